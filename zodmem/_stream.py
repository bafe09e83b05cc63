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

import math
import os
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._blocks import OutputSink
from ._fingerprint import call_fingerprint
from ._journal import Journal
from ._lock import exclusive
from ._npy import ResultFiles
from ._progress import closing_bars
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
    files = ResultFiles(path, layout)
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
