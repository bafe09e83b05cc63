"""`to_host` and `to_file` of a transform sharded by rows: each device streams the blocks
of its own rows, and each process writes its devices' rows into the one `.npy` at their
offsets (a journal per process, `<journal>.p<k>`, records them as runs of rows with their
checksums, so a rerun over any mesh takes the rows on disk as they are); `to_host` gives
each process its own rows."""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._engine._block_plans import BlockPlan, OutputSink
from .._engine._progress import closing_bars
from .._engine._sharding import Share, Split, run_sharded, split_of, to_mesh
from .._serialise import SerialisationError
from ._call import Layout, check_arrays, keep_nothing, result_layout, streamed_call
from ._fingerprint import call_fingerprint
from ._journal import RowJournal
from ._lock import exclusive
from ._npy import AFRESH, ResultFiles
from ._syncer import Syncer

__all__ = ["rows_split", "to_file_sharded", "to_host_sharded"]


def rows_split(transform: Any, name: str) -> Split:
    """The split of a sharded transform whose result is streamed: its rows (the first
    axis) over every device of its mesh, so each device writes contiguous rows."""
    spec = transform.sharding.spec
    split = split_of(transform.sharding, owner=transform._owner)
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
    split = rows_split(transform, name)
    sink = OutputSink(keep_nothing, 0)

    def one_share(args, kwargs):
        share = Share(jnp.asarray(0, jnp.int32), split.count)
        return transform.compute_share(sink, share, split, *args, **kwargs)

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
            transform.compute_share(sink, share, split, *args, **kwargs)
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
    return transform.planned(*placed, call=streamed_call).transform


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
    layout = result_layout(whole, args, kwargs)
    check_arrays(
        layout,
        name,
        "a sharded result is streamed as arrays only. Leave that output out of the result.",
    )
    return whole, layout


def to_host_sharded(transform: Any, args: tuple, kwargs: dict) -> Any:
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


def to_file_sharded(path: str, transform: Any, args: tuple, kwargs: dict) -> Any:
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
