"""Products of an operator with many probe vectors, in planned blocks: the engine of the
estimators.

An estimator says what one block of probes does (`ProbeJob.block`): it makes its probe
vectors (unit vectors, random signs from a key, the columns of a given matrix), takes
their products with the operator and keeps what it needs of them, the entries on the
diagonal, say, or the probes' quadratic forms. `Probes` runs the blocks: as a blocked
transform, its block size is planned from `max_memory` like any other's, the blocks run
in one compiled loop with an optional progress bar, and a `sharding` spreads the probes
over devices. A job's results are either one per probe (`reduce = False`, assembled along
`axis`) or merged over the probes (`reduce = True`): each block's, then each device's,
by the job's `combine`, a sum unless the job says otherwise.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .._checks import check_int, described
from .._engine._block_plans import plan_blocks
from .._engine._blocks import map_blocks, reduce_blocks
from .._engine._sharding import dispatch, explicit_mesh, is_explicit, replicate
from .._operators._flat import FlatView
from .._operators._operator import BlockedOperator
from .._operators._vector_blocks import AbstractVectorBlocks, vector_options
from .._plan._memory import check_memory
from .._plan._plans import Work

__all__ = [
    "AbstractColumns",
    "ProbeJob",
    "ProbeOptions",
    "Probes",
    "check_probe_blocks",
    "run_probes",
]


class ProbeOptions(NamedTuple):
    """How an estimator runs its probes, as its caller gave them: `owner`, the estimator
    its messages name; `batch_size` probes a block, or as many as `max_memory` allows (at
    most one of the two); spread over the devices that `sharding` splits its first axis
    over; a bar where `progress`. Options left `None` are those of a zodmem operator's
    transform."""

    owner: str
    max_memory: Any = None
    batch_size: Any = None
    sharding: Any = None
    progress: Any = None


def check_probe_blocks(options: ProbeOptions) -> None:
    """Refuse a `max_memory` or a `batch_size` that says no block size, or both of them."""
    owner, max_memory, batch_size = options.owner, options.max_memory, options.batch_size
    check_memory(max_memory, owner=owner)
    check_int(batch_size, "batch_size", owner=owner, minimum=1, optional=True)
    if max_memory is not None and batch_size is not None:
        raise ValueError(
            f"{owner}: give at most one of `batch_size` (probes per block) and "
            f"`max_memory` (a budget the blocks are planned to fit), got "
            f"batch_size={batch_size!r} and max_memory={max_memory!r}."
        )


class ProbeJob(eqx.Module):
    """What a block of probes computes. Its array fields (a key, a matrix) are leaves."""

    reduce: eqx.AbstractClassVar[bool]
    what: eqx.AbstractClassVar[str]  # the probes, for plans and messages
    axis: ClassVar[int] = 0  # where a mapped job's results hold their probes

    @abc.abstractmethod
    def count(self, view: FlatView) -> int:
        """How many probes the job has."""

    def sums_like(self, view: FlatView) -> Any:
        """A reduced job's results as `jax.ShapeDtypeStruct`s, where the job knows them
        (`None`: they are found by tracing a block, once more per program)."""
        return None

    @abc.abstractmethod
    def block(self, view: FlatView, product: Callable, start: Any, size: int) -> Any:
        """The results of probes `start, ..., start + size - 1` (`start` traced), with
        `product` one product with a flat vector: `size` results along `axis` for a
        mapped job, what `combine` merges for a reduced one. Spread over devices that do
        not divide the probes, a block may run past the last probe: a mapped job's
        results there are cut, and a reduced job must count them as zero."""

    def combine(self, total: Any, part: Any) -> Any:
        """A reduced job's results of two sets of probes merged into those of both: the
        blocks done so far and the next one, or two devices' shares. By default their
        sum, whose zero (as `sums_like` shapes it) starts the merge."""
        return jax.tree_util.tree_map(jnp.add, total, part)

    def product(self, view: FlatView, strategy: Any) -> Callable:
        """The product `block` is given, built once for all the blocks: by default with
        flat vectors (`view.linear`)."""
        return view.linear(strategy)

    def spread(self) -> ProbeJob:
        """The job as it runs where each device takes a share of the probes inside a
        `shard_map` (the variables whole there): by default as it is."""
        return self


class AbstractColumns(ProbeJob):
    """A job whose probes are the columns of a given matrix, one result a column."""

    matrix: eqx.AbstractVar[jax.Array]
    reduce: ClassVar[bool] = False
    axis: ClassVar[int] = 1

    def count(self, view: FlatView) -> int:
        return self.matrix.shape[1]

    def columns(self, start: Any, size: int) -> jax.Array:
        """Columns `start, ..., start + size - 1` of the matrix, each read at its own
        index, clamped: a block that runs past the last column (on the last of devices
        that do not divide the columns) keeps its other columns in place."""
        last = self.matrix.shape[1] - 1
        indices = jnp.minimum(start + jnp.arange(size, dtype=jnp.int32), last)
        return jnp.take(self.matrix, indices, axis=1)


class Probes(AbstractVectorBlocks):
    """The probes of a job, in blocks: spread over the devices of the mesh axes that
    `sharding` splits (any axis of a transform's result, or the first of the probes')."""

    fn: FlatView
    job: ProbeJob = eqx.field(kw_only=True)
    owner: str = eqx.field(static=True, kw_only=True)
    _vector_axis: ClassVar[int] = 0
    # Probes of a loop's program keep the platform's cap on a block: one block of all
    # of them holds every probe's loop state at once, and runs no faster.
    loop_in_one_block: ClassVar[bool] = False

    @property
    def _owner(self) -> str:
        return self.owner

    def work(self) -> Work:
        total = self.job.count(self.fn)
        size = self._block_size(total)
        return Work(total, self.job.what, "result", size).per_device(self.vector_split)

    def run(self) -> Any:
        return (_probes_jit if self.jit else _probes)(self)


def _probes(engine: Probes) -> Any:
    total = engine.job.count(engine.fn)
    split = engine.vector_split
    padded = total
    if split is not None:
        # Probes that the devices do not divide: the last device's share runs past the
        # end; a mapped job's extra results are cut, a reduced job's count for nothing.
        padded = -(-total // split.count) * split.count

    def compute(share, split, engine):
        if share is None or split.dim is None:
            return _local(engine, 0, total)
        count = padded // split.count
        result = _local(engine, share.index * count, count)
        if engine.job.reduce:  # each device's results, stacked, then merged
            result = jax.tree_util.tree_map(lambda leaf: leaf[None], result)
        return result

    if split is None:
        # A lineax operator's products run in the caller's layout, not on each device.
        return dispatch(compute, engine, here=engine.fn.is_lineax)

    def specs(shapes):
        dim = 0 if engine.job.reduce else engine.job.axis
        return jax.tree_util.tree_map(lambda leaf: split.spec(leaf.ndim, dim % leaf.ndim), shapes)

    result = dispatch(compute, engine, split, out_specs=specs)
    if engine.job.reduce:
        # Whole on every device first: a share is read by its index along the split axis.
        result = replicate(result, split.mesh)
        shares = [
            jax.tree_util.tree_map(lambda leaf, index=index: leaf[index], result)
            for index in range(split.count)
        ]
        return functools.reduce(engine.job.combine, shares)
    if padded != total:
        result = replicate(result, split.mesh)
        axis = engine.job.axis
        result = jax.tree_util.tree_map(
            lambda leaf: jax.lax.slice_in_dim(leaf, 0, total, axis=axis % leaf.ndim), result
        )
    return result


_probes_jit = eqx.filter_jit(_probes)


def _local(engine: Probes, offset: Any, count: int) -> Any:
    """This device's probes, `offset` to `offset + count - 1`, block by block."""
    view, job = engine.fn, engine.job
    plan = plan_blocks(count, batch_size=engine._block_size(count))
    product = job.product(view, engine.strategy)  # built once: serves every block
    label = f"{engine.owner} {job.what}" if engine.progress else None
    if not job.reduce:

        def mapped(start):
            return job.block(view, product, offset + start, plan.block_size)

        return map_blocks(mapped, plan, axis=job.axis, progress=label)

    def block(start, size):
        return job.block(view, product, offset + start, size)

    shapes = job.sums_like(view)
    if shapes is None:
        shapes = jax.eval_shape(
            lambda start: block(start, plan.block_size), jnp.asarray(0, jnp.int32)
        )
    # Zeros typed as the results are where those lie over Explicit mesh axes (a loop's
    # carry keeps its type).
    init = jax.tree_util.tree_map(
        lambda leaf: jnp.zeros(leaf.shape, leaf.dtype, out_sharding=_explicit(leaf)), shapes
    )

    def update(acc, result, index, size):
        return job.combine(acc, result)

    return reduce_blocks(block, plan, init, update, progress=label)


def _explicit(shape: Any) -> Any:
    """The sharding of `shape` (a `ShapeDtypeStruct`) where it lies over Explicit mesh
    axes, else `None`."""
    sharding = getattr(shape, "sharding", None)
    return sharding if is_explicit(sharding) else None


def _transform_of(view: FlatView) -> Any:
    operator = view.operator
    return operator.transform if isinstance(operator, BlockedOperator) else None


def run_probes(view: FlatView, job: ProbeJob, options: ProbeOptions, *, spread: bool = True) -> Any:
    """Run `job`'s probes of `view` in blocks, as `options` say, spread over devices by
    their `sharding` (never, with `spread=False`). Options left `None` are those of a
    zodmem operator's transform (its budget, block count or size, sharding and bar; for a
    `Microbatcher`, those of the transform it wraps)."""
    owner = options.owner
    transform = _transform_of(view)
    settings = vector_options(transform)
    if options.max_memory is not None or options.batch_size is not None:
        check_probe_blocks(options)
        settings.update(nbatches=None, batch_size=options.batch_size, max_memory=options.max_memory)
    if not spread:
        settings["sharding"] = None
    elif options.sharding is not None:
        if not isinstance(options.sharding, NamedSharding):
            raise TypeError(
                f"{owner}: `sharding` must be a jax.sharding.NamedSharding whose first "
                "entry names the mesh axes that split the probes, e.g. NamedSharding(mesh, "
                f"PartitionSpec('d')), or None; got {described(options.sharding)}."
            )
        if view.lineax_on_explicit_axes:
            raise ValueError(
                f"{owner}: `sharding` spreads the {job.what} over the devices, each taking "
                "its products inside a `shard_map`, but the operator is a lineax operator "
                "whose input structure lies over Explicit mesh axes: its function runs only "
                "on whole vectors in that layout. Pass sharding=None; its products are then "
                "spread over the devices as its structure's layout says."
            )
        settings["sharding"] = options.sharding
    if settings.get("sharding") is not None or (
        explicit_mesh(view) is not None and not view.is_lineax
    ):
        # Each device's probes run inside a `shard_map`, the variables whole there.
        job = job.spread()
    if options.progress is not None:
        if not isinstance(options.progress, bool):
            raise TypeError(
                f"{owner}: `progress` must be a bool or None, got {described(options.progress)}."
            )
        settings["progress"] = options.progress
    return Probes(view, job=job, owner=owner, **settings)()
