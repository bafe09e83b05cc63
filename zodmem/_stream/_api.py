"""`to_host` and `to_file`, and the writing of a result file by one process."""

from __future__ import annotations

import os
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._serialise import SerialisationError
from .._traceback import public
from .._transforms._base import AbstractBlocked
from ._call import (
    block_view,
    check_arrays,
    check_concrete,
    planned_block_size,
    planned_for_streaming,
    result_layout,
    returned_leaves,
    run_streamed,
)
from ._fingerprint import call_fingerprint
from ._journal import Journal, RowJournal
from ._lock import exclusive
from ._npy import AFRESH, ResultFiles
from ._rows import rows_split, to_file_sharded, to_host_sharded
from ._syncer import Syncer

__all__ = ["to_host", "to_file"]


@public
def to_host(transform: AbstractBlocked, *args: Any, **kwargs: Any) -> Any:
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
    check_concrete(args, kwargs, "to_host")
    if _is_sharded(transform):
        return to_host_sharded(transform, args, kwargs)
    layout = result_layout(transform, args, kwargs)
    planned = planned_for_streaming(transform, args, kwargs)
    arrays = {
        i: np.empty(leaf.shape, leaf.dtype)
        for i, leaf in enumerate(layout.leaves)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    }

    def write(index, leaves, start, pieces, axes):
        for leaf, piece, axis in zip(leaves, pieces, axes, strict=True):
            block_view(arrays[leaf], piece.shape, axis, start)[...] = piece

    returned, streamed = run_streamed(planned, args, kwargs, write, 0)
    out = returned[0] if layout.has_aux else returned
    values = returned_leaves(layout, out)
    leaves = [
        arrays[i] if i in streamed else (np.asarray(v) if eqx.is_array(v) else v)
        for i, v in enumerate(values)
    ]
    result = jax.tree_util.tree_unflatten(layout.treedef, leaves)
    return (result, returned[1]) if layout.has_aux else result


@public
def to_file(path: str | os.PathLike, transform: AbstractBlocked, *args: Any, **kwargs: Any) -> Any:
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
    check_concrete(args, kwargs, "to_file")
    path = os.fspath(path)
    if _is_sharded(transform):
        return to_file_sharded(path, transform, args, kwargs)
    layout = result_layout(transform, args, kwargs)
    check_arrays(
        layout,
        "to_file",
        "a file holds arrays only. Use zm.to_host, or leave that output out of the result.",
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
        planned = planned_for_streaming(transform, args, kwargs)
        block_size, strategy = planned_block_size(planned, args, kwargs)
        header = {"block_size": block_size, "strategy": strategy}
        journal.create(fingerprint, files, header)
    elif transform.max_memory is not None and header.get("block_size"):
        # The blocks the journal counts: the size planned when the file was made.
        planned = transform.with_block_size(header["block_size"], header.get("strategy"))
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

        returned, streamed = run_streamed(planned, args, kwargs, write, journal.done)
        syncer.close()
        whole = [
            [i, files.write_whole(i, np.asarray(value))]
            for i, value in enumerate(returned_leaves(files.layout, returned))
            if i not in streamed
        ]
        files.sync()
        journal.append({"complete": True, "whole": whole})
    finally:
        syncer.close()
        files.close()
    return files.load()


def _is_sharded(transform: Any) -> bool:
    """Whether `transform` spreads its result over devices (it was given a `sharding`)."""
    sharding = getattr(transform, "sharding", None)  # a transform may have no such option
    return isinstance(transform, AbstractBlocked) and sharding is not None


def _check_transform(transform: Any, name: str) -> None:
    if not isinstance(transform, AbstractBlocked) or not transform.result_in_blocks:
        raise TypeError(
            f"zm.{name}: the transform must be a zm.BatchedJacobian, zm.BatchedHessian or "
            f"zm.ChunkedVmap, whose results are cut into blocks, but got {transform!r} of "
            f"type {type(transform).__name__}."
        )
    if _is_sharded(transform):
        rows_split(transform, name)
