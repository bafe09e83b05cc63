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

This module holds the public functions and the planning of their streamed call; each
part of a result file has its own module:

- `_npy`: the `.npy` files, written block by block with a checksum of each block;
- `_journal`: the journal of checksummed records beside them;
- `_fingerprint`: the call's fingerprint, which the journal compares to resume it;
- `_syncer`: the thread that makes written blocks durable and records them;
- `_lock`: the lock of the path, which keeps a second writer out;
- `_files`: the file-safety helpers (whole writes, atomic replace, fsyncs).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._blocks import BlockPlan, OutputSink
from ._fingerprint import call_fingerprint
from ._journal import Journal, RowJournal
from ._lock import exclusive
from ._npy import AFRESH, ResultFiles
from ._progress import closing_bars
from ._serialise import SerialisationError
from ._sharding import Share, Split, run_sharded, to_mesh
from ._syncer import Syncer
from ._traceback import public
from ._transform import AbstractStreamable

__all__ = ["to_host", "to_file"]


@public
def to_host(transform: Any, *args: Any, **kwargs: Any) -> Any:
    """The result of `transform(*args, **kwargs)`, assembled in host memory as NumPy
    arrays, block by block.

    Use it when the result fits in the host's memory but not on the device (a Hessian
    that fits in RAM but not in GPU memory): each block is computed on the device and
    copied to the host as soon as it is made, so the device holds one block (and the
    work of one block) at a time, never the whole result.

    **Arguments:**

    - `transform`: a `zm.BatchedJacobian`, `zm.BatchedHessian` or `zm.ChunkedVmap`.
      Its block options (`nbatches`, `batch_size`, `chunk_size`) cut the result into
      blocks; with `max_memory`, the blocks are planned for this streamed call, whose
      result is not on the device. A `BatchedJacobian` or `BatchedHessian` with
      `sharding=` over rows (`PartitionSpec("d", None)`, over every device of the mesh)
      runs each device's rows on that device, a block at a time, as they arrive here.
    - `*args`, `**kwargs`: the arguments of the call, as for `transform(...)`.

    **Returns:**

    What `transform(*args, **kwargs)` returns, with its arrays as `numpy.ndarray`s of
    the same values and dtypes (a pytree of them when the transform returns one). With
    `has_aux=True`, `(result, aux)`, with `aux` as the transform returns it.

    With a sharded transform, each process gets **its own rows**: those of its devices'
    shares, in order, as one array per result leaf (`n / P` rows of an `n`-row Hessian
    on each of `P` processes of a `jax.distributed` job; on one process, every row).
    A column split and `has_aux=True` are refused.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def loss(w):
            return jnp.sum(jnp.sin(w) ** 2)

        H = zm.to_host(zm.BatchedHessian(loss, nbatches=4), jnp.arange(10.0))
        assert H.shape == (10, 10)  # a numpy.ndarray, built 3 rows at a time
        ```
    """
    _check_transform(transform, "to_host")
    _check_concrete(args, kwargs, "to_host")
    if getattr(transform, "sharding", None) is not None:
        return _to_host_sharded(transform, args, kwargs)
    layout = _layout(transform, args, kwargs)
    planned = _planned(transform, args, kwargs)
    arrays = {
        i: np.empty(leaf.shape, leaf.dtype)
        for i, leaf in enumerate(layout.leaves)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    }

    def write(index, leaves, start, pieces, axes):
        for leaf, piece, axis in zip(leaves, pieces, axes, strict=True):
            _block_view(arrays[leaf], piece.shape, axis, start)[...] = piece

    returned, streamed = _run_streamed(planned, args, kwargs, write, 0)
    out = returned[0] if layout.has_aux else returned
    values = _values(layout, out)
    leaves = [
        arrays[i] if i in streamed else (np.asarray(v) if eqx.is_array(v) else v)
        for i, v in enumerate(values)
    ]
    result = jax.tree_util.tree_unflatten(layout.treedef, leaves)
    return (result, returned[1]) if layout.has_aux else result


@public
def to_file(path: str | os.PathLike, transform: Any, *args: Any, **kwargs: Any) -> Any:
    """The result of `transform(*args, **kwargs)` written to a `.npy` file block by block,
    returned as a read-only `numpy.memmap`; a killed job resumes where it stopped.

    Use it when the result does not fit in memory at all, or when the job is long
    enough that losing it to a crash would hurt. Each block is computed on the device
    and written into the file at its offset; neither the device nor this process ever
    holds the whole result (written pages are flushed and dropped from the cache).

    Beside the file, `<path>.journal` records the call that made it and the blocks on
    disk. Calling `to_file` again with the same path, transform and arguments after a
    crash (a `SIGKILL`, a power cut) continues at the first block not yet on disk; on a
    finished file it returns the file at once, computing nothing.

    A call is known by its transform and configuration, the shapes, dtypes and values
    of its inputs (the transform's arrays included), and what it computes: the program
    JAX traces from it, with the values of the arrays its functions close over. A
    function whose body or closed-over arrays changed is another call, whatever its
    name, so a file never mixes blocks of two computations.

    What is verified: the journal records a checksum (sha256) of the bytes each block
    wrote, and reopening a file, finished or not, reads back every block the journal
    counts and checks it, so a file changed or damaged on disk is refused rather than
    returned or resumed. While a call runs, it holds a lock on the path (`<path>.lock`,
    or `blocks.lock` in a pytree result's directory, removed when the call ends): a
    second call on the same path, from another process or thread, is refused at once.

    **Arguments:**

    - `path`: where to write. An array result goes to this `.npy` file (`np.load(path,
      mmap_mode="r")` reads it too); a pytree result goes to this directory, one `.npy`
      file per leaf named by its key path (`jax.tree_util.keystr`), with the journal
      `blocks.journal` inside.
    - `transform`: a `zm.BatchedJacobian`, `zm.BatchedHessian` or `zm.ChunkedVmap`, as
      for `zm.to_host`; `has_aux=True` is refused (use `zm.to_host`, or return the
      auxiliary value from a separate call).
    - `*args`, `**kwargs`: the arguments of the call.

    **A sharded transform** (`sharding=` over rows, `PartitionSpec("d", None)`, over
    every device of the mesh): each device computes the blocks of its own rows, and each
    process writes its devices' rows into the one file at their offsets (rows are
    contiguous in a C-ordered `.npy`, so no process writes another's bytes). Under
    `jax.distributed` every process makes the same call on a filesystem they all share:
    process 0 makes the file, and each process keeps its own journal,
    `<path>.journal.p<process index>`, and lock, `<path>.lock.p<process index>`. Every
    process gets the whole file back once all have written their rows. A rerun, on the
    same mesh or another, computes only the blocks whose rows are not on disk. A column
    split is refused with a `ValueError` (split the rows instead).

    **Returns:**

    The result as a read-only `numpy.memmap` (or a pytree of them, shaped like the
    result), equal in values and dtypes to `transform(*args, **kwargs)`.

    **Raises:**

    `zm.SerialisationError` when the file was made by another call (another transform
    or configuration, another computation, other shapes or dtypes, other input values:
    the message names what differs), when its journal or files are damaged (a block
    whose bytes are not those written: the message names the file and the block), or
    when another call is writing the same path. To start afresh, delete the file and
    its journal.

    !!! warning

        A Python function called from inside the computation (`jax.pure_callback`,
        `jax.debug.callback`) is known by its name only: after changing what such a
        function returns, delete the file. The program is JAX's, so after upgrading
        JAX an unfinished file is refused rather than resumed.

    !!! example

        ```python
        import os, tempfile
        import jax.numpy as jnp
        import zodmem as zm

        def loss(w):
            return jnp.sum(jnp.sin(w) ** 2)

        path = os.path.join(tempfile.mkdtemp(), "hessian.npy")
        H = zm.to_file(path, zm.BatchedHessian(loss, nbatches=4), jnp.arange(10.0))
        assert H.shape == (10, 10) and not H.flags.writeable
        H = zm.to_file(path, zm.BatchedHessian(loss, nbatches=4), jnp.arange(10.0))  # done
        ```
    """
    _check_transform(transform, "to_file")
    if transform.config.get("has_aux", False):
        raise TypeError(
            "zm.to_file: the transform has has_aux=True, but a file holds only the result. "
            "Use zm.to_host for (result, aux), or compute the auxiliary value separately."
        )
    _check_concrete(args, kwargs, "to_file")
    path = os.fspath(path)
    if getattr(transform, "sharding", None) is not None:
        return _to_file_sharded(path, transform, args, kwargs)
    layout = _layout(transform, args, kwargs)
    for key, leaf in zip(layout.paths, layout.leaves, strict=True):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"zm.to_file: the result{key} is {leaf!r}, not an array; a file holds arrays "
                "only. Use zm.to_host, or leave that output out of the result."
            )
    files = ResultFiles(path, layout)
    if RowJournal.paths(files):
        raise SerialisationError(
            f"zm.to_file: {files.where} was written by the rows of a sharded call (its "
            f"journals are {files.journal}.p0, ...): resume it with that sharded transform. "
            f"{AFRESH}"
        )
    fingerprint = call_fingerprint(transform, args, kwargs, layout)
    with exclusive(files.lock, files.where):
        return _write_or_resume(files, fingerprint, transform, args, kwargs)


def _write_or_resume(
    files: ResultFiles, fingerprint: dict[str, str], transform: Any, args: tuple, kwargs: dict
) -> Any:
    """The body of `to_file`, with the files' lock held."""
    journal = Journal(files.journal)
    header = journal.open(fingerprint, files)
    if header is not None and journal.complete:
        return files.load()
    if header is None:
        planned = _planned(transform, args, kwargs)
        block_size, strategy = _block_size(planned, args, kwargs)
        header = {"block_size": block_size, "strategy": strategy}
        journal.create(fingerprint, files, header)
    elif transform.max_memory is not None and header.get("block_size"):
        # The blocks the journal counts: the size planned when the file was made.
        planned = transform._with_block_size(header["block_size"], header.get("strategy"))
    else:
        planned = transform
    files.open()
    syncer = Syncer(files, journal)
    try:

        def write(index, leaves, start, pieces, axes):
            regions = [
                files.write_block(leaf, piece, axis, start)
                for leaf, piece, axis in zip(leaves, pieces, axes, strict=True)
            ]
            syncer.written(index + 1, [index, [r for r in regions if r is not None]])

        returned, streamed = _run_streamed(planned, args, kwargs, write, journal.done)
        syncer.close()
        whole = [
            [i, files.write_whole(i, np.asarray(value))]
            for i, value in enumerate(_values(files.layout, returned))
            if i not in streamed
        ]
        files.sync()
        journal.append({"complete": True, "whole": whole})
    finally:
        syncer.close()
        files.close()
    return files.load()


def _check_transform(transform: Any, name: str) -> None:
    if not isinstance(transform, AbstractStreamable):
        raise TypeError(
            f"zm.{name}: the transform must be a zm.BatchedJacobian, zm.BatchedHessian or "
            f"zm.ChunkedVmap, whose results are cut into blocks, but got {transform!r} of "
            f"type {type(transform).__name__}."
        )
    if getattr(transform, "sharding", None) is not None:
        _rows_split(transform, name)


def _rows_split(transform: Any, name: str) -> Split:
    """The split of a sharded transform whose result is streamed: its rows (the first
    axis) over every device of its mesh, so each device writes contiguous rows."""
    split = transform._split
    spec = transform.sharding.spec
    if split.dim != 0:
        what = "splits nothing" if split.dim is None else "splits the columns of the result"
        raise ValueError(
            f"zm.{name}: the transform's sharding {spec} {what}, but a streamed sharded "
            "result is written by rows: each device writes its own contiguous rows of the "
            "C-ordered result. Split the rows instead, e.g. sharding=NamedSharding(mesh, "
            "PartitionSpec('d', None)), or stream the transform without `sharding`."
        )
    if split.count != split.mesh.size:
        raise ValueError(
            f"zm.{name}: the transform's sharding {spec} splits the rows over "
            f"{split.count} of the mesh's {split.mesh.size} devices, so the others would "
            "compute the same rows again. Name every mesh axis on the rows, e.g. "
            "PartitionSpec(('x', 'y'), None), or use a mesh of the split axes only."
        )
    return split


def _check_concrete(args: tuple, kwargs: dict, name: str) -> None:
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
        raise TypeError(
            f"zm.{name}: the arguments hold traced values; zm.{name} moves the result off "
            "the device as it is made, so call it outside jax.jit, jax.vmap and jax.grad."
        )


class Layout(NamedTuple):
    """The result's leaves (shapes and dtypes, or non-array values) and structure,
    without the auxiliary value, and the traced program of the call."""

    treedef: Any
    leaves: list
    paths: list[str]
    has_aux: bool
    program: Any


def _layout(transform: Any, args: tuple, kwargs: dict) -> Layout:
    if transform.max_memory is not None:
        # Any block size gives the same result; the one the count options would give.
        size = max(transform._work(*args, **kwargs).block_size, 1)
        transform = transform._with_block_size(size, transform._strategies[0])
    program, dynamic, static = eqx.filter_make_jaxpr(lambda t, a, k: t._run(*a, **k))(
        transform, args, kwargs
    )
    shapes = eqx.combine(dynamic, static)
    has_aux = bool(transform.config.get("has_aux", False))
    out = shapes[0] if has_aux else shapes
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(out)
    paths = [jax.tree_util.keystr(path) for path, _ in paths_leaves]
    return Layout(treedef, [leaf for _, leaf in paths_leaves], paths, has_aux, program)


def _streamed_call(transform: Any, args: tuple, kwargs: dict) -> Any:
    """The streamed call with a sink that keeps nothing: what the planner compiles."""
    return transform._streamed(OutputSink(_keep_nothing, 0), *args, **kwargs)


def _keep_nothing(*_: Any) -> None:
    pass


def _planned(transform: Any, args: tuple, kwargs: dict) -> Any:
    """The transform with the block size its budget allows for the streamed call."""
    return transform._planned(args, kwargs, run=_streamed_call)


def _block_size(planned: Any, args: tuple, kwargs: dict) -> tuple[int, Any]:
    work = planned._work(*args, **kwargs)
    return work.block_size, planned.config.get("strategy")


def _run_streamed(
    transform: Any, args: tuple, kwargs: dict, write: Any, first_block: int
) -> tuple[Any, set[int]]:
    """Run the streamed call from `first_block`: returns what it returned (`None` at the
    leaves handed to `write`) and the indices of those leaves."""

    @eqx.filter_jit
    def call(transform, args, kwargs, first):
        sink = OutputSink(write, first)
        out = transform._streamed(sink, *args, **kwargs)
        return out, tuple(sink.leaves)  # not arrays: returned as they are

    with closing_bars():
        first = jnp.asarray(first_block, jnp.int32)
        returned, streamed = call(transform, args, kwargs, first)
        jax.effects_barrier()  # every block handed over before the caller reads them
    return returned, set(streamed)


def _values(layout: Layout, returned: Any) -> list:
    """The leaves of what the streamed call returned (`None` at the streamed ones)."""
    if returned is None:
        return [None] * layout.treedef.num_leaves  # every leaf was streamed
    return layout.treedef.flatten_up_to(returned)


def _block_view(array: np.ndarray, piece_shape: tuple, axis: int, start: int) -> Any:
    """The part of a C-ordered `array` that a block of `piece_shape`, starting at `start`
    along `axis` of the engine's view of it, fills."""
    others = math.prod(piece_shape) // piece_shape[axis] if piece_shape[axis] else 1
    total = array.size // others
    view = array.reshape(piece_shape[:axis] + (total,) + piece_shape[axis + 1 :])
    return view[(slice(None),) * axis + (slice(start, start + piece_shape[axis]),)]


# ---------------------------------------------------------------------------------------
# Sharded transforms: each device streams its own rows, each process writes its devices'.


class _Shares(NamedTuple):
    """How a sharded call's rows are streamed: `split`, over every device of its mesh;
    `parts`, the `(leaves, plan)` of each `map_blocks` call of one device's share (the
    same for every share); `here`, the shares of this process's devices, in order;
    `rows`, for each result leaf, the rows of one share (of the engine's view of it)."""

    split: Split
    parts: list[tuple[tuple[int, ...], BlockPlan]]
    here: list[int]
    rows: dict[int, int]

    def first_block(self, share: int, finished: dict[int, list]) -> int:
        """The first block of `share` (counted over its parts) whose rows are not all in
        `finished`; the loop starts there."""
        count = 0
        for leaves, plan in self.parts:
            base = share * plan.total
            for index in range(plan.num_blocks):
                start = base + min(index * plan.block_size, plan.total - plan.block_size)
                stop = start + plan.block_size
                if any(_missing(finished[leaf], start, stop) for leaf in leaves):
                    return count
                count += 1
        return count

    def spans(self, leaf: int) -> list[tuple[int, int]]:
        """The rows of `leaf` that this process's devices make."""
        rows = self.rows[leaf]
        return [(k * rows, (k + 1) * rows) for k in self.here]


def _shares(transform: Any, args: tuple, kwargs: dict, name: str) -> _Shares:
    """The shares of a transform sharded by rows, and the blocks of each (traced, not
    run, for one share: every share has the same blocks)."""
    split = _rows_split(transform, name)
    sink = OutputSink(_keep_nothing, 0)

    def one_share(args, kwargs):
        share = Share(jnp.asarray(0, jnp.int32), split.count)
        return transform._share(sink, share, split, *args, **kwargs)

    eqx.filter_eval_shape(one_share, args, kwargs)  # traced for its parts only
    rows = {leaf: plan.total for leaves, plan in sink.parts for leaf in leaves}
    mesh = split.mesh
    sizes = [mesh.shape[axis] for axis in split.axes]
    where = [mesh.axis_names.index(axis) for axis in split.axes]
    here = sorted(
        int(np.ravel_multi_index([position[i] for i in where], sizes))
        for position in np.ndindex(mesh.devices.shape)
        if mesh.devices[position].process_index == jax.process_index()
    )
    return _Shares(split, sink.parts, here, rows)


def _missing(intervals: list, start: int, stop: int) -> list[tuple[int, int]]:
    """The runs of `start, ..., stop - 1` not in the sorted, disjoint `intervals`."""
    gaps = []
    for a, b in intervals:
        if b <= start:
            continue
        if a >= stop:
            break
        if a > start:
            gaps.append((start, a))
        start = max(start, b)
        if start >= stop:
            return gaps
    if start < stop:
        gaps.append((start, stop))
    return gaps


def _merged(intervals: Any) -> list[list[int]]:
    """Runs `[a, b)` as sorted, disjoint runs covering the same rows."""
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _run_shares(
    transform: Any, shares: _Shares, args: tuple, kwargs: dict, firsts: dict[int, int], write: Any
) -> None:
    """Run the sharded call, each device from its share's first block in `firsts`,
    handing every block to `write(index, leaves, start, pieces, axes, share=k)`."""
    split = shares.split
    (args, kwargs) = to_mesh((args, kwargs), split.mesh)
    spec = split.spec(1, 0)
    values = np.zeros(split.count, np.int32)
    for share, first in firsts.items():
        values[share] = first
    starts = jax.make_array_from_callback(
        (split.count,), NamedSharding(split.mesh, spec), lambda index: values[index]
    )

    @eqx.filter_jit
    def call(transform, inputs):
        def compute(share, inputs):
            (args, kwargs), starts = inputs
            sink = OutputSink(write, starts[0], share=share.index)
            transform._share(sink, share, split, *args, **kwargs)
            return None

        def specs(arrays):
            return jax.tree_util.tree_map(lambda _: PartitionSpec(), arrays[0]), spec

        run_sharded(compute, split, inputs, in_specs=specs)

    with closing_bars():
        call(transform, ((args, kwargs), starts))
        jax.effects_barrier()  # every block handed over before the caller reads them


def _planned_sharded(transform: Any, args: tuple, kwargs: dict) -> Any:
    """The sharded transform with the block size its budget allows for the streamed call
    (a budget is per device)."""
    if transform.max_memory is None:
        return transform
    placed = to_mesh((args, kwargs), transform.sharding.mesh)
    return transform._planned(*placed, run=_streamed_call)


def _sharded_layout(transform: Any, args: tuple, kwargs: dict, name: str) -> tuple[Any, Layout]:
    """The same transform without `sharding`, which computes the same result and whose
    call is what a file's fingerprint names, and the layout of its result."""
    if transform.config.get("has_aux", False):
        raise TypeError(
            f"zm.{name}: the transform has sharding= and has_aux=True; a sharded result is "
            "streamed by rows only. Call the transform itself for (result, aux), or compute "
            "the auxiliary value separately."
        )
    whole = dataclasses.replace(transform, sharding=None)
    layout = _layout(whole, args, kwargs)
    for key, leaf in zip(layout.paths, layout.leaves, strict=True):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"zm.{name}: the result{key} is {leaf!r}, not an array; a sharded result "
                "is streamed as arrays only. Leave that output out of the result."
            )
    return whole, layout


def _to_host_sharded(transform: Any, args: tuple, kwargs: dict) -> Any:
    """`to_host` of a sharded transform: this process's rows, in order."""
    _, layout = _sharded_layout(transform, args, kwargs, "to_host")
    planned = _planned_sharded(transform, args, kwargs)
    shares = _shares(planned, args, kwargs, "to_host")
    count = shares.split.count
    arrays = {}
    for i, leaf in enumerate(layout.leaves):
        rows = leaf.shape[0] * len(shares.here) // count if leaf.shape else 0
        arrays[i] = np.empty((rows, *leaf.shape[1:]), leaf.dtype)
    position = {share: p for p, share in enumerate(shares.here)}

    def write(index, leaves, start, pieces, axes, share):
        for leaf, piece in zip(leaves, pieces, strict=True):
            first = position[share] * shares.rows[leaf] + start
            view = arrays[leaf].reshape(len(shares.here) * shares.rows[leaf], -1)
            view[first : first + piece.shape[0]] = piece.reshape(piece.shape[0], -1)

    _run_shares(planned, shares, args, kwargs, dict.fromkeys(shares.here, 0), write)
    return jax.tree_util.tree_unflatten(layout.treedef, [arrays[i] for i in range(len(arrays))])


def _to_file_sharded(path: str, transform: Any, args: tuple, kwargs: dict) -> Any:
    """`to_file` of a sharded transform: every process writes its devices' rows."""
    whole, layout = _sharded_layout(transform, args, kwargs, "to_file")
    files = ResultFiles(path, layout)
    fingerprint = call_fingerprint(whole, args, kwargs, layout)
    process = jax.process_index()
    with exclusive(f"{files.lock}.p{process}", files.where):
        return _write_or_resume_rows(files, fingerprint, transform, args, kwargs, process)


def _write_or_resume_rows(
    files: ResultFiles,
    fingerprint: dict[str, str],
    transform: Any,
    args: tuple,
    kwargs: dict,
    process: int,
) -> Any:
    """The body of a sharded `to_file`, with this process's lock held.

    Every process reads every journal (they lie on the filesystem all share) while none
    writes, so all agree on the rows on disk; each verifies its own; process 0 makes the
    file before any process writes to it; all wait for all before reading the file."""
    planned = _planned_sharded(transform, args, kwargs)
    shares = _shares(planned, args, kwargs, "to_file")
    job = _Job(files.where)
    job.barrier("started")
    regions: list = []
    error = None
    try:
        if os.path.exists(files.journal):
            raise SerialisationError(
                f"zm.to_file: {files.where} was written by a call on one device (its journal "
                f"is {files.journal}), not by the rows of a sharded call, which keeps one "
                f"journal per process. {AFRESH}"
            )
        journals = RowJournal.paths(files)
        for path in journals:
            regions.extend(RowJournal.read(path, fingerprint, files))
        if not journals and files.exists():
            raise SerialisationError(
                f"zm.to_file: {files.where} exists but has no journal ({files.journal}.p0, "
                "...): it was not written by zm.to_file, or its journals were removed, so "
                "its rows cannot be trusted. Delete it, or choose another path, to start "
                "afresh."
            )
        if regions:
            files.check()
            files.verify({i: [r] for i, r in enumerate(_own(regions, shares))}, [])
    except SerialisationError as refused:
        error = refused
    job.agree(error)
    finished = {
        leaf: _merged((r[3], r[4]) for r in regions if r[0] == leaf) for leaf in shares.rows
    }
    complete = all(
        not _missing(finished[leaf], 0, shares.rows[leaf] * shares.split.count)
        for leaf in shares.rows
    )
    layout = {
        "processes": jax.process_count(),
        "process": process,
        "mesh": dict(shares.split.mesh.shape),
        "spec": str(planned.sharding.spec),
        "shares": shares.here,
        "block_size": [plan.block_size for _, plan in shares.parts],
    }
    journal = RowJournal(files, process)
    if not complete:
        journal.start(fingerprint, files, layout)
        if not regions and process == 0:
            files.create()  # nothing on disk counts yet: the file may not have been made
    job.barrier("ready")
    if not complete:
        files.open()
        syncer = Syncer(files, journal, record=_rows_record)
        try:
            writer = _RowWriter(files, shares, finished, syncer)
            firsts = {k: shares.first_block(k, finished) for k in shares.here}
            _run_shares(planned, shares, args, kwargs, firsts, writer)
            syncer.close()
            files.sync()
        finally:
            syncer.close()
            files.close()
    job.barrier("written")
    return files.load()


def _own(regions: list, shares: _Shares) -> list:
    """The regions that lie in this process's rows (those it verifies)."""
    return [
        r
        for r in regions
        if any(r[3] < stop and start < r[4] for start, stop in shares.spans(r[0]))
    ]


def _rows_record(count: int, blocks: list) -> dict[str, Any]:
    return {"rows": [region for regions in blocks for region in regions]}


class _RowWriter:
    """The host side of a sharded `to_file` in one process: writes each block's rows
    that are not on disk yet (a block that ends a share overlaps the one before it, and
    a run over another mesh may find some of its rows written) and hands their regions
    to the syncer. Blocks come from every local device's thread at once."""

    def __init__(self, files: ResultFiles, shares: _Shares, finished: dict, syncer: Syncer):
        self._files, self._shares, self._syncer = files, shares, syncer
        self._taken = {leaf: [tuple(run) for run in runs] for leaf, runs in finished.items()}
        self._count = 0
        self._lock = threading.Lock()

    def __call__(self, index, leaves, start, pieces, axes, share):
        regions = []
        for leaf, piece in zip(leaves, pieces, strict=True):
            first = share * self._shares.rows[leaf] + start
            stop = first + piece.shape[0]
            with self._lock:
                gaps = _missing(self._taken[leaf], first, stop)
                self._taken[leaf] = [tuple(r) for r in _merged([*self._taken[leaf], (first, stop)])]
            for a, b in gaps:
                regions.append(self._files.write_rows(leaf, piece[a - first : b - first], a))
        with self._lock:
            self._count += 1
            self._syncer.written(self._count, regions)


# Calls of the sharded `to_file` so far in this process: every process of a job makes the
# same calls in the same order, so the count names a call's meeting points alike in all.
_SHARDED_CALLS = itertools.count()
# How long a process waits for the others: as long as their share of the work takes.
_WAIT_MS = 2**31 - 1


class _Job:
    """The processes of a `jax.distributed` job, as a sharded `to_file` meets them: at
    barriers, and to learn which refused the file. The job's coordination service does
    both (no program is compiled for them); without it, collectives over the devices."""

    def __init__(self, where: str):
        self.count, self.index = jax.process_count(), jax.process_index()
        self.name = f"zodmem.to_file/{next(_SHARDED_CALLS)}"
        self.where = where
        self.client = None
        if self.count > 1:
            try:
                from jax._src import distributed

                self.client = distributed.global_state.client
            except (ImportError, AttributeError):
                self.client = None

    def barrier(self, stage: str) -> None:
        """Wait here for every process of the job."""
        if self.count == 1:
            return
        if self.client is not None:
            self.client.wait_at_barrier(f"{self.name}/{stage}", _WAIT_MS)
        else:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"{self.name}/{stage}")

    def agree(self, error: BaseException | None) -> None:
        """Raise `error` here, and in every other process that of a process that refused
        the file, so that no process goes on to wait for one that stopped."""
        failed = [error is not None]
        if self.count > 1 and self.client is not None:
            key = f"{self.name}/refused"
            self.client.key_value_set(f"{key}/{self.index}", "1" if error else "0")
            failed = [
                self.client.blocking_key_value_get(f"{key}/{k}", _WAIT_MS) == "1"
                for k in range(self.count)
            ]
        elif self.count > 1:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.int32(error is not None))
            failed = [bool(flag) for flag in np.asarray(flags)]
        if error is not None:
            raise error
        if any(failed):
            which = [k for k, refused in enumerate(failed) if refused]
            raise SerialisationError(
                f"zm.to_file: process {which} refused {self.where}, so this one stops too; "
                "that process's error says why."
            )
