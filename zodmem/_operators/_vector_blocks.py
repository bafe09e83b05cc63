"""Work on many vectors of an operator in blocks of vectors (`AbstractVectorBlocks`):
planned work (`zodmem._plan._planned.AbstractPlanned`, the part of a blocked transform
that the planner needs), whose block size is planned from a budget like a transform's,
and whose vectors may be spread over devices. `ProductBlocks` is an operator's `mm`, the
products with the columns of a matrix; the probes of the estimators are the other kind
(`_probes.py`)."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .._engine._block_plans import plan_blocks
from .._engine._blocks import map_blocks
from .._engine._sharding import Split, check_divides, dispatch, split_of
from .._plan._planned import AbstractPlanned
from .._plan._plans import Work
from ._options import options_of

if TYPE_CHECKING:
    from ._operator import BlockedOperator

__all__ = ["AbstractVectorBlocks", "ProductBlocks", "vector_options"]


class AbstractVectorBlocks(AbstractPlanned):
    """Work on many vectors of an operator (products, probes) in blocks of vectors:
    planned work, so a budget is planned as for a transform. The options are those
    of the operator's transform; `sharding` spreads the vectors over the devices of the
    mesh axes it splits (whichever axis of the transform's result it splits)."""

    nbatches: int | None = eqx.field(default=None, static=True, kw_only=True)
    batch_size: int | None = eqx.field(default=None, static=True, kw_only=True)
    max_memory: int | str | None = eqx.field(default=None, static=True, kw_only=True)
    strategy: Any = eqx.field(default=None, static=True, kw_only=True)
    sharding: NamedSharding | None = eqx.field(default=None, static=True, kw_only=True)
    jit: bool = eqx.field(default=True, static=True, kw_only=True)
    progress: bool = eqx.field(default=False, static=True, kw_only=True)
    # The axis of the result that holds the vectors, split over the devices.
    _vector_axis: ClassVar[int]

    @property
    @abc.abstractmethod
    def _owner(self) -> str:
        """The name messages give the work: the user's call that runs it."""

    @property
    def strategies(self) -> tuple[Any, ...]:
        if self.strategy in (None, "linearize", "recompute"):
            return (self.strategy,)
        # As the transform's own call: one linearisation kept, or `fn` again per block.
        return ("linearize", "recompute") if self.max_memory is not None else ("linearize",)

    @property
    def vector_split(self) -> Split | None:
        """The vectors spread over the devices of the mesh axes that `sharding` splits;
        `None` without a split."""
        if self.sharding is None:
            return None
        whole = split_of(self.sharding, owner=self._owner)
        if whole.dim is None:
            return None
        return Split(whole.mesh, self._vector_axis, whole.axes, whole.count)

    def _block_size(self, k: int) -> int:
        nbatches = None if self.nbatches is None else min(self.nbatches, k)
        return plan_blocks(k, nbatches=nbatches, batch_size=self.batch_size).block_size

    def with_block_size(self, size: int, strategy: Any) -> AbstractVectorBlocks:
        return dataclasses.replace(
            self, nbatches=None, batch_size=size, max_memory=None, strategy=strategy
        )


def vector_options(transform: Any) -> dict[str, Any]:
    """The options of `AbstractVectorBlocks` that a transform's own give: its blocks
    (for a `Microbatcher`, whose options cut the batch, those of the derivative it
    wraps), strategy, sharding, `jit` and bar; the defaults for `None`."""
    options = options_of(transform)._asdict()
    del options["has_aux"]  # what the transform's call returns, not how products are cut
    return options


class ProductBlocks(AbstractVectorBlocks):
    """The products of an operator with the columns of a matrix, in blocks of columns."""

    fn: BlockedOperator
    _vector_axis: ClassVar[int] = 1

    @classmethod
    def of(cls, operator: BlockedOperator) -> ProductBlocks:
        """The blocks that `operator`'s transform's options give."""
        return cls(operator, **vector_options(operator.transform))

    @property
    def _owner(self) -> str:
        # The user called the operator's `mm`, not this class.
        return f"{self.fn._owner}(...).mm"

    def work(self, matrix: Any) -> Work:
        k = matrix.shape[1]
        return Work(k, "vectors", "result", self._block_size(k)).per_device(self.vector_split)

    def run(self, matrix: Any) -> Any:
        return (_blocked_jit if self.jit else _blocked)(self, matrix)


def _blocked(blocks: ProductBlocks, matrix: jax.Array) -> jax.Array:
    split = blocks.vector_split
    if split is not None:
        check_divides(
            matrix.shape[1], split, owner=blocks.fn._owner, what="vectors (columns of `matrix`)"
        )

    def compute(share, split, inputs):
        blocks, matrix = inputs
        if share is not None and split.dim is not None:
            # Every device is handed the whole matrix and takes its own columns.
            width = matrix.shape[1] // split.count
            offset = share.offset(matrix.shape[1])
            matrix = jax.lax.dynamic_slice_in_dim(matrix, offset, width, axis=1)
        return _local_products(blocks, matrix)

    if split is None:
        return dispatch(compute, (blocks, matrix))
    return dispatch(compute, (blocks, matrix), split, out_specs=split.spec(2, 1))


_blocked_jit = eqx.filter_jit(_blocked)


def _local_products(blocks: ProductBlocks, matrix: jax.Array) -> jax.Array:
    """The products with the columns of `matrix` (this device's), block by block."""
    operator = blocks.fn.with_strategy(blocks.strategy)
    k = matrix.shape[1]
    out_size = operator.out_size()
    dtype = jnp.result_type(*jax.tree_util.tree_leaves(operator.out_structure()))
    if k == 0:
        return jnp.zeros((out_size, 0), dtype)
    plan = plan_blocks(k, batch_size=blocks._block_size(k))
    # Built once: with one linearisation kept, its residuals serve every block; with
    # `strategy="recompute"` each product evaluates `fn` again inside its block.
    product = operator._map()

    def block(start):
        columns = jax.lax.dynamic_slice_in_dim(matrix, start, plan.block_size, axis=1)
        return jax.vmap(product, in_axes=1, out_axes=1)(columns).astype(dtype)

    label = f"{operator._owner} products" if blocks.progress else None
    return map_blocks(block, plan, axis=1, progress=label)
