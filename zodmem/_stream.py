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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import operator
import os
import re
import threading
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from ._blocks import OutputSink
from ._files import (
    append_durably,
    drop_cached,
    fsync_directory,
    pread_all,
    pwrite_all,
    write_atomically,
)
from ._progress import closing_bars
from ._serialise import SerialisationError
from ._traceback import public
from ._transform import AbstractStreamable

__all__ = ["to_host", "to_file"]

_JOURNAL_FORMAT = "zodmem.to_file"
_JOURNAL_VERSION = 2
_LOCK_NAME = "blocks.lock"  # in a pytree result's directory; `<path>.lock` beside a file
_DIGEST_LENGTH = 32  # hex digits of sha256 kept per block: 128 bits
_READ_SIZE = 8 << 20  # bytes read at a time when a file is verified


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
      result is not on the device.
    - `*args`, `**kwargs`: the arguments of the call, as for `transform(...)`.

    **Returns:**

    What `transform(*args, **kwargs)` returns, with its arrays as `numpy.ndarray`s of
    the same values and dtypes (a pytree of them when the transform returns one). With
    `has_aux=True`, `(result, aux)`, with `aux` as the transform returns it.

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
    layout = _layout(transform, args, kwargs)
    for key, leaf in zip(layout.paths, layout.leaves, strict=True):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"zm.to_file: the result{key} is {leaf!r}, not an array; a file holds arrays "
                "only. Use zm.to_host, or leave that output out of the result."
            )
    files = _Files(path, layout)
    fingerprint = _fingerprint(transform, args, kwargs, layout)
    with _exclusive(files):
        return _write_or_resume(files, fingerprint, transform, args, kwargs)


def _write_or_resume(
    files: _Files, fingerprint: dict[str, str], transform: Any, args: tuple, kwargs: dict
) -> Any:
    """The body of `to_file`, with the files' lock held."""
    journal = _Journal(files.journal)
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
    syncer = _Syncer(files, journal)
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
        raise ValueError(
            f"zm.{name}: the transform has sharding={transform.sharding}, which leaves each "
            "device's share of the result on that device; a streamed result leaves the "
            "devices block by block in one order instead. Stream the transform without "
            "`sharding`, or keep the sharded result and read each device's share from "
            "its `addressable_shards`."
        )


def _check_concrete(args: tuple, kwargs: dict, name: str) -> None:
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
        raise TypeError(
            f"zm.{name}: the arguments hold traced values; zm.{name} moves the result off "
            "the device as it is made, so call it outside jax.jit, jax.vmap and jax.grad."
        )


class _Layout(NamedTuple):
    """The result's leaves (shapes and dtypes, or non-array values) and structure,
    without the auxiliary value, and the traced program of the call."""

    treedef: Any
    leaves: list
    paths: list[str]
    has_aux: bool
    program: Any


def _layout(transform: Any, args: tuple, kwargs: dict) -> _Layout:
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
    return _Layout(treedef, [leaf for _, leaf in paths_leaves], paths, has_aux, program)


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
    streamed: list[int] = []

    @eqx.filter_jit
    def call(transform, args, kwargs, first):
        sink = OutputSink(write, first)
        out = transform._streamed(sink, *args, **kwargs)
        streamed[:] = sink.leaves
        return out

    with closing_bars():
        returned = call(transform, args, kwargs, jnp.asarray(first_block, jnp.int32))
        jax.effects_barrier()  # every block handed over before the caller reads them
    return returned, set(streamed)


def _values(layout: _Layout, returned: Any) -> list:
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


def _safe_name(key: str, taken: set[str]) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_.") or "result"
    unique, k = name, 1
    while unique in taken:
        unique, k = f"{name}_{k}", k + 1
    taken.add(unique)
    return unique + ".npy"


def _npy_header(shape: tuple, dtype: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    description = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": tuple(shape),
    }
    np.lib.format.write_array_header_1_0(buffer, description)
    return buffer.getvalue()


def _pread_exactly(fd: int, length: int, offset: int) -> bytes:
    data = pread_all(fd, length, offset)
    if len(data) < length:
        raise SerialisationError(
            f"zm.to_file: a file ended {length - len(data)} bytes before its journal's "
            f"blocks did, though its size was checked: it is being truncated. {_AFRESH}"
        )
    return data


def _digest(array: np.ndarray) -> str:
    """The checksum of a C-contiguous array's bytes, as the journal records it."""
    data = array.view(np.uint8).reshape(-1).data if array.size else b""
    return hashlib.sha256(data).hexdigest()[:_DIGEST_LENGTH]


class _Files:
    """The `.npy` files of a result: one file for an array, a directory for a pytree."""

    def __init__(self, path: str, layout: _Layout):
        self.layout = layout
        self.single = layout.treedef.num_leaves == 1 and layout.paths == [""]
        if self.single:
            self.directory = os.path.dirname(os.path.abspath(path))
            self.paths = [path]
            self.journal = path + ".journal"
            self.lock = path + ".lock"
        else:
            self.directory = path
            taken: set[str] = set()
            self.paths = [os.path.join(path, _safe_name(key, taken)) for key in layout.paths]
            self.journal = os.path.join(path, "blocks.journal")
            self.lock = os.path.join(path, _LOCK_NAME)
        self.headers = [_npy_header(leaf.shape, leaf.dtype) for leaf in layout.leaves]
        self.fds: list[int] = []

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"file": os.path.basename(p), "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
            for p, leaf in zip(self.paths, self.layout.leaves, strict=True)
        ]

    def create(self) -> None:
        """Every file, with its header and its full (sparse) size, on disk."""
        for path, header, leaf in zip(self.paths, self.headers, self.layout.leaves, strict=True):
            with open(path, "wb") as file:
                file.write(header)
                file.truncate(len(header) + leaf.size * np.dtype(leaf.dtype).itemsize)
                file.flush()
                os.fsync(file.fileno())
        fsync_directory(self.directory)

    def check(self) -> None:
        """Refuse files that are missing, or whose header or size is not the journal's."""
        for path, header, leaf in zip(self.paths, self.headers, self.layout.leaves, strict=True):
            size = len(header) + leaf.size * np.dtype(leaf.dtype).itemsize
            try:
                with open(path, "rb") as file:
                    found = file.read(len(header))
                    actual = os.fstat(file.fileno()).st_size
            except OSError as error:
                raise SerialisationError(
                    f"zm.to_file: {path} is missing or cannot be read ({error}), though its "
                    f"journal records blocks written to it. {_AFRESH}"
                ) from error
            if found != header or actual != size:
                raise SerialisationError(
                    f"zm.to_file: {path} does not hold the header and size its journal "
                    f"expects (a {leaf.dtype} array of shape {leaf.shape}, {size} bytes; "
                    f"found {actual} bytes). {_AFRESH}"
                )

    def open(self) -> None:
        self.fds = [os.open(path, os.O_RDWR) for path in self.paths]

    def write_block(self, leaf: int, piece: Any, axis: int, start: int) -> list | None:
        """Write a block's new items at their offsets: one run of bytes per index of the
        axes before `axis` (a single run when the block axis leads). Returns the region
        written and its checksum, `[leaf, before, after, first, stop, digest]` (items
        `first, ..., stop - 1` along the axis), or `None` when it is empty.

        The engine's last block ends at the total, moved back over the one before it:
        its items before the next multiple of the block size are that block's, on disk
        already, so each item is written, and checksummed, by one block only."""
        dtype = np.dtype(self.layout.leaves[leaf].dtype)
        piece = np.ascontiguousarray(piece, dtype)
        size = self.layout.leaves[leaf].size
        count = piece.shape[axis]
        before = math.prod(piece.shape[:axis])
        after = math.prod(piece.shape[axis + 1 :])
        if not count or not before or not after:
            return None
        first = -(-start // count) * count
        total = size // (before * after)
        runs = piece.reshape(before, count * after)[:, (first - start) * after :]
        base = len(self.headers[leaf])
        for p in range(before):
            offset = base + (p * total + first) * after * dtype.itemsize
            pwrite_all(self.fds[leaf], runs[p], offset)
        digest = _digest(np.ascontiguousarray(runs))
        return [leaf, before, after, first, start + count, digest]

    def write_whole(self, leaf: int, value: Any) -> str:
        """Write a leaf that was returned whole; returns its checksum."""
        dtype = np.dtype(self.layout.leaves[leaf].dtype)
        value = np.ascontiguousarray(value, dtype)
        if value.size:
            pwrite_all(self.fds[leaf], value.reshape(-1), len(self.headers[leaf]))
        return _digest(value)

    def region(self, entry: Any) -> list:
        """A block's region as a journal records it, checked to lie inside its file."""
        leaf, before, after, first, stop, digest = entry
        leaf, before, after, first, stop = map(operator.index, entry[:5])
        size = self.layout.leaves[leaf].size if 0 <= leaf < len(self.paths) else 0
        inside = before > 0 and after > 0 and not size % (before * after)
        if not (inside and 0 <= first < stop <= size // (before * after)):
            raise ValueError(f"a block's region {entry} lies outside its file")
        if not isinstance(digest, str):
            raise TypeError(f"a block's checksum {digest!r} is not a string")
        return [leaf, before, after, first, stop, digest]

    def whole_leaf(self, entry: Any) -> list:
        """A leaf written whole and its checksum, as a journal records them, checked."""
        leaf, digest = entry
        if not 0 <= operator.index(leaf) < len(self.paths) or not isinstance(digest, str):
            raise ValueError(f"a whole leaf {entry} is not one of the files")
        return [leaf, digest]

    def verify(self, blocks: dict[int, list], whole: list) -> None:
        """Refuse files whose blocks (`{index: regions}`, as `write_block` returns them)
        or whole leaves (`[leaf, digest]`) no longer hold the bytes written there."""
        regions: dict[tuple[int, int, int], list] = {}
        for index, entries in sorted(blocks.items()):
            for leaf, before, after, first, stop, digest in entries:
                regions.setdefault((leaf, before, after), []).append((index, first, stop, digest))
        for leaf, digest in whole:
            if not self.layout.leaves[leaf].size:
                continue  # no bytes to check
            regions.setdefault((leaf, 1, self.layout.leaves[leaf].size), []).append(
                (None, 0, 1, digest)
            )
        for (leaf, before, after), spans in regions.items():
            found = self._digests(leaf, before, after, [(a, b) for _, a, b, _ in spans])
            for (index, first, stop, digest), actual in zip(spans, found, strict=True):
                if actual == digest:
                    continue
                what = (
                    f"block {index} of {self.paths[leaf]} (items {first} to {stop - 1} "
                    "along its block axis)"
                    if index is not None
                    else self.paths[leaf]
                )
                raise SerialisationError(
                    f"zm.to_file: {what} does not hold the bytes that were written there "
                    f"(its checksum is not the one in the journal {self.journal}): the "
                    f"file was changed or damaged after it was written. {_AFRESH}"
                )

    def _digests(self, leaf: int, before: int, after: int, spans: list) -> list[str]:
        """The checksums of the items `a, ..., b - 1` of leaf `leaf` (seen as `before`
        runs of `total * after` elements) for each `(a, b)` in `spans`, as written.

        The file is read once in pieces of at most `_READ_SIZE` bytes: whole runs at a
        time when a run is short (blocks of columns), else each span of each run."""
        itemsize = np.dtype(self.layout.leaves[leaf].dtype).itemsize
        total = self.layout.leaves[leaf].size // (before * after)
        step, row, base = after * itemsize, total * after * itemsize, len(self.headers[leaf])
        hashers = [hashlib.sha256() for _ in spans]
        fd = os.open(self.paths[leaf], os.O_RDONLY)
        try:
            if row <= _READ_SIZE:
                rows = _READ_SIZE // row
                for p in range(0, before, rows):
                    count = min(rows, before - p)
                    data = np.frombuffer(_pread_exactly(fd, count * row, base + p * row), np.uint8)
                    data = data.reshape(count, row)
                    for hasher, (a, b) in zip(hashers, spans, strict=True):
                        hasher.update(np.ascontiguousarray(data[:, a * step : b * step]).data)
            else:
                for hasher, (a, b) in zip(hashers, spans, strict=True):
                    for p in range(before):
                        offset, end = base + p * row + a * step, base + p * row + b * step
                        while offset < end:
                            length = min(_READ_SIZE, end - offset)
                            hasher.update(_pread_exactly(fd, length, offset))
                            offset += length
            drop_cached(fd)  # read once, not kept
        finally:
            os.close(fd)
        return [hasher.hexdigest()[:_DIGEST_LENGTH] for hasher in hashers]

    def sync(self) -> None:
        """Flush what was written, and drop it from the page cache: it counts as memory."""
        for fd in self.fds:
            os.fsync(fd)
            drop_cached(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def load(self) -> Any:
        arrays = [np.load(path, mmap_mode="r") for path in self.paths]
        return jax.tree_util.tree_unflatten(self.layout.treedef, arrays)

    def exists(self) -> bool:
        if self.single:
            return os.path.exists(self.paths[0])
        return os.path.isdir(self.directory) and bool(
            set(os.listdir(self.directory)) - {_LOCK_NAME}
        )


_AFRESH = "To start afresh, delete the file (and its journal) and call zm.to_file again."


@contextlib.contextmanager
def _exclusive(files: _Files) -> Any:
    """Hold the lock of a result's files while the call reads and writes them: a second
    call on the same path, in another process or in another thread, is refused."""
    os.makedirs(os.path.dirname(os.path.abspath(files.lock)), exist_ok=True)
    while True:
        fd = os.open(files.lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            where = files.paths[0] if files.single else files.directory
            raise SerialisationError(
                f"zm.to_file: {where} is being written by another call (another process, "
                f"or another thread of this one, holds its lock {files.lock}). Wait for "
                "that call to end, then call zm.to_file again to resume or read the "
                "result; or write to another path."
            ) from None
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(files.lock))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # removed by the call that held it as it ended: lock the new file
    try:
        yield
    finally:
        try:
            os.unlink(files.lock)  # before the lock is let go, so no one locks it again
        except FileNotFoundError:
            pass
        os.close(fd)


def _record(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True)
    return f"{hashlib.sha256(body.encode()).hexdigest()[:16]} {body}\n".encode()


class _Journal:
    """The records beside a file: a header record (the call's fingerprint, the files,
    the block size), then `{"done": k, "blocks": [[index, regions], ...]}` once blocks
    `0, ..., k - 1` are on disk, listing the blocks new since the last such record with
    the checksum of each region they wrote, then `{"complete": true, "whole": [[leaf,
    checksum], ...]}` with the leaves written whole. Each record is one line with a
    checksum; a torn last line (a write cut short) is ignored, a damaged one before it
    is refused. Opening a journal verifies the blocks it counts against the files."""

    def __init__(self, path: str):
        self.path = path
        self.done = 0
        self.complete = False
        self.blocks: dict[int, list] = {}
        self.whole: list = []

    def open(self, fingerprint: dict[str, str], files: _Files) -> dict[str, Any] | None:
        """The header of an existing journal, checked against this call, or `None`
        when there is none (and no file in the way)."""
        if not os.path.exists(self.path):
            if files.exists():
                where = files.paths[0] if files.single else files.directory
                raise SerialisationError(
                    f"zm.to_file: {where} exists but has no journal ({self.path}): it was "
                    "not written by zm.to_file, or its journal was removed, so its blocks "
                    "cannot be trusted. Delete it, or choose another path, to start afresh."
                )
            return None
        with open(self.path, "rb") as file:
            data = file.read()
        records, valid = [], 0
        lines = data.split(b"\n")
        for number, line in enumerate(lines[:-1], start=1):
            record = _parse(line)
            if record is None:
                last = number == len(lines) - 1 and not lines[-1]
                if last and records:
                    break  # a record cut short by a crash: its block is not counted
                raise SerialisationError(
                    f"zm.to_file: record {number} of the journal {self.path} is damaged "
                    f"(its checksum does not match). {_AFRESH}"
                )
            records.append(record)
            valid += len(line) + 1
        if not records:
            raise SerialisationError(
                f"zm.to_file: the journal {self.path} holds no readable header record. {_AFRESH}"
            )
        header = records[0]
        if header.get("format") != _JOURNAL_FORMAT:
            raise SerialisationError(
                f"zm.to_file: {self.path} is not a journal of zm.to_file (format "
                f"{header.get('format')!r}). {_AFRESH}"
            )
        if header.get("version") != _JOURNAL_VERSION:
            raise SerialisationError(
                f"zm.to_file: the journal {self.path} was written by another version of "
                f"zodmem (journal version {header.get('version')!r}; this one reads version "
                f"{_JOURNAL_VERSION}), so its blocks cannot be checked. {_AFRESH}"
            )
        differs = [
            f"its {name} (the file: {header['fingerprint'].get(name)}; this call: {value})"
            for name, value in fingerprint.items()
            if header["fingerprint"].get(name) != value
        ]
        if differs:
            raise SerialisationError(
                f"zm.to_file: {files.paths[0] if files.single else files.directory} was made "
                f"by another call: {'; '.join(differs)} differ. A file resumes only the call "
                f"that made it. {_AFRESH}"
            )
        try:
            for record in records[1:]:
                if "done" in record:
                    if not isinstance(record["done"], int) or record["done"] < self.done:
                        raise ValueError("blocks out of order")
                    self.done = record["done"]
                    for index, regions in record["blocks"]:
                        self.blocks[operator.index(index)] = [files.region(r) for r in regions]
                elif record.get("complete") is True:
                    self.complete = True
                    self.whole = [files.whole_leaf(entry) for entry in record["whole"]]
            if sorted(self.blocks) != list(range(self.done)):
                raise ValueError(f"checksums of blocks {sorted(self.blocks)} for {self.done}")
        except (KeyError, TypeError, ValueError) as error:
            raise SerialisationError(
                f"zm.to_file: the journal {self.path} does not record the blocks on disk "
                f"in order with their checksums ({error}). {_AFRESH}"
            ) from error
        if valid < len(data):
            with open(self.path, "r+b") as file:
                file.truncate(valid)  # later records go after the last whole one
                os.fsync(file.fileno())
        if self.done == 0 and not self.complete:
            files.create()  # nothing counted yet: the files may not have been made
        else:
            files.check()
            files.verify(self.blocks, self.whole)
        return header

    def create(self, fingerprint: dict[str, str], files: _Files, header: dict[str, Any]) -> None:
        """A new journal (written whole, then renamed into place), then the files."""
        os.makedirs(files.directory, exist_ok=True)
        record = {
            "format": _JOURNAL_FORMAT,
            "version": _JOURNAL_VERSION,
            "fingerprint": fingerprint,
            "files": files.describe(),
            **header,
        }
        write_atomically(self.path, [_record(record)])
        files.create()

    def append(self, record: dict[str, Any]) -> None:
        append_durably(self.path, _record(record))


def _parse(line: bytes) -> dict[str, Any] | None:
    checksum, _, body = line.partition(b" ")
    if hashlib.sha256(body).hexdigest()[:16].encode() != checksum:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class _Syncer:
    """Makes written blocks durable off the loop's thread: fsyncs the files, drops their
    pages from the cache, then records (and fsyncs) how many blocks are on disk."""

    def __init__(self, files: _Files, journal: _Journal):
        self._files, self._journal = files, journal
        self._pending: int | None = None
        self._blocks: list = []
        self._closed = False
        self._error: BaseException | None = None
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def written(self, count: int, block: list) -> None:
        """Blocks `0, ..., count - 1` are written (not yet flushed); the last of them is
        `block`, `[index, regions]`."""
        with self._condition:
            self._pending = count
            self._blocks.append(block)
            self._condition.notify()

    def _loop(self) -> None:
        while True:
            with self._condition:
                while self._pending is None and not self._closed:
                    self._condition.wait()
                if self._pending is None:
                    return
                count, self._pending = self._pending, None
                blocks, self._blocks = self._blocks, []
            try:
                self._files.sync()
                self._journal.append({"done": count, "blocks": blocks})
            except BaseException as error:  # raised again on the caller's thread
                self._error = error
                return

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _describe(value: Any) -> str:
    """A value as text that is the same in every process (no memory addresses)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def _fingerprint(transform: Any, args: tuple, kwargs: dict, layout: _Layout) -> dict[str, str]:
    """What a file's journal compares to resume it: the transform and its configuration,
    the result's and the inputs' shapes and dtypes, the other leaves (functions, numbers,
    static fields), a hash of every input value (the transform's arrays included) and a
    hash of what the call computes (its program and the constants it closes over)."""
    config = ", ".join(f"{k}={_describe(v)}" for k, v in transform.config.items())
    leaves, treedef = jax.tree_util.tree_flatten((transform, args, kwargs))
    digest = hashlib.sha256()
    shapes, constants = [], []
    for leaf in leaves:
        if eqx.is_array(leaf):
            array = np.ascontiguousarray(np.asarray(leaf))
            shapes.append(f"{array.dtype}{list(array.shape)}")
            digest.update(array.view(np.uint8).reshape(-1).data if array.size else b"")
        else:
            constants.append(_describe(leaf))
    output = ", ".join(
        f"{key or 'result'}: {leaf.dtype}{list(leaf.shape)}"
        for key, leaf in zip(layout.paths, layout.leaves, strict=True)
    )
    return {
        "transform": f"{type(transform).__name__}({config})",
        "output shapes and dtypes": output,
        "input shapes and dtypes": ", ".join(shapes),
        "input structure and constants": _ADDRESS.sub("", str(treedef))
        + " | "
        + ", ".join(constants),
        "input values (sha256)": digest.hexdigest(),
        "computation (sha256 of its program and constants)": _program_digest(layout.program),
    }


def _program_digest(program: Any) -> str:
    """A hash of a traced call: the text of its program, at every level of nesting, and
    the values of the constants it holds (the arrays a function closes over). Two
    functions of the same name that compute different things differ here; the text
    names nothing by its address, so the same script gives the same hash in every
    process."""
    digest = hashlib.sha256(_ADDRESS.sub("", str(program)).encode())
    for constant in _constants(program):
        array = np.ascontiguousarray(np.asarray(constant))
        digest.update(f"{array.dtype}{list(array.shape)}".encode())
        digest.update(array.view(np.uint8).reshape(-1).data if array.size else b"")
    return digest.hexdigest()


def _constants(program: Any) -> Any:
    """The constants of a `ClosedJaxpr` or `Jaxpr` and of the programs in its equations'
    parameters (loop bodies, branches, inner `jit`s), literals included, in order."""
    if isinstance(program, jax.extend.core.ClosedJaxpr):
        yield from program.consts
        program = program.jaxpr
    for eqn in program.eqns:
        yield from (v.val for v in eqn.invars if isinstance(v, jax.extend.core.Literal))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    yield from _constants(item)
    yield from (v.val for v in program.outvars if isinstance(v, jax.extend.core.Literal))
