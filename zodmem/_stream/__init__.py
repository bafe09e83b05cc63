"""Results that leave the device block by block: `to_host` and `to_file`.

The block engine's `map_blocks` hands each finished block to the host (`OutputSink`),
where it is copied into a NumPy array (`to_host`) or written into a `.npy` file at its
offset (`to_file`); the device holds one block at a time, and `to_file`'s process holds
no more than a block or two.

A file is resumable. Beside it, a journal of checksummed one-line records says what
call made it (a fingerprint of the transform, the shapes and dtypes, a hash of the
input values and one of the traced program) and how many blocks are on disk, with the
checksum of each block's bytes: a block is counted only once its bytes are flushed and
fsynced, and its record is fsynced in turn, so a job killed at any instant restarts at
the first block not on disk, and never reads a block that is not. Reopening a file
checks every counted block against its checksum, and a lock on the path keeps a second
writer out.

A transform sharded by rows streams too: each device hands over the blocks of its own
rows, and each process writes its devices' rows into the one file (a journal per
process, `<journal>.p<k>`, records them as runs of rows with their checksums, so a
rerun over any mesh takes the rows on disk as they are); `to_host` gives each process
its own rows.

`_api` holds the public functions and the writing of a file by one process; `_call`
the streamed call (its result's layout, its planning, its run) and `_rows` the
streaming of a transform sharded by rows. Each part of a result file
has its own module:

- `_npy`: the `.npy` files, written block by block with a checksum of each block;
- `_journal`: the journal of checksummed records beside them;
- `_fingerprint`: the call's fingerprint, which the journal compares to resume it;
- `_syncer`: the thread that makes written blocks durable and records them;
- `_lock`: the lock of the path, which keeps a second writer out;
- `zodmem._files`: the file-safety helpers (whole writes, atomic replace, fsyncs),
  shared with saving and loading.
"""
