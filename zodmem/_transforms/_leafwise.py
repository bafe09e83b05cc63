"""Blocks of basis vectors leaf by leaf: where a block of rows lies in one variable leaf,
its products are taken with that leaf's piece alone.

A dense curvature matrix (`BatchedHessian`, `BatchedGGN`) is built from products with
blocks of unit vectors `e_i` (`curvature_matrix`). Such a block made from the loop index
holds a piece for every leaf, most of them zeros that XLA cannot see: every product then
multiplies them out. A block whose rows lie in one leaf can instead be given to a product
function of that leaf alone (the VJP of that leaf's part of the gradient, the JVP along
that leaf), where the other leaves' pieces are JAX's symbolic zeros and cost nothing.
Each such leaf is one more branch of the loop's body to compile, so only the leaves that
hold many blocks whole get one; the others' blocks run the product of every leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine._block_plans import BlockPlan, OutputSink, plan_blocks
from .._engine._blocks import map_blocks
from .._engine._progress import label
from .._engine._sharding import Share, Split, share_of
from .._pytree import Variables, basis_block
from ._derivative import AbstractDerivative, Prepared

__all__ = ["LEAF_SHARE", "by_leaf", "curvature_matrix", "leaves_of_their_own"]

# A leaf gets a branch of its own where at least 1 / LEAF_SHARE of the blocks lie wholly
# in it: at most this many loop bodies more to compile. Each branch is one more body's
# compile (time, and host memory), which pays only where the branch saves products over
# many blocks, as for a dense `(n, n)` result.
LEAF_SHARE = 10


def leaves_of_their_own(variables: Variables, plan: BlockPlan, offset: int) -> list[int]:
    """The variable leaves that get a branch of their own in `by_leaf`: those that wholly
    hold at least a tenth of the blocks (and two), largest share first. `offset` is where
    the blocks' items start among the variables (a device's share)."""
    if len(variables.sizes) < 2 or plan.num_blocks < 2:
        return []
    starts = offset + np.minimum(
        np.arange(plan.num_blocks, dtype=np.int64) * plan.block_size,
        plan.total - plan.block_size,
    )
    least = max(2, -(-plan.num_blocks // LEAF_SHARE))
    counts = {}
    for i, (first, size) in enumerate(zip(variables.offsets, variables.sizes, strict=True)):
        inside = (starts >= first) & (starts + plan.block_size <= first + size)
        counts[i] = int(np.count_nonzero(inside))
    return sorted((i for i, c in counts.items() if c >= least), key=lambda i: -counts[i])


def by_leaf(
    variables: Variables,
    plan: BlockPlan,
    offset: Any,
    every_leaf: Callable[[Any], Any],
    in_leaf: Callable[[int], Callable[[Any], Any]],
) -> Callable[[Any], Any]:
    """The block function `start -> rows` of the blocks of `plan` (items from `offset` on,
    an int or, under `shard_map`, traced), with a branch of its own for each leaf that
    holds many blocks whole.

    - `every_leaf(start)`: the rows of any block, from unit vectors over every leaf.
    - `in_leaf(i)`: a function of the block's unit vectors in leaf `i` alone, an array of
      `(block_size, *leaf_shape)` in the leaf's dtype, that gives the same rows.

    The blocks pick their branch with `lax.switch` on where they start.
    """
    if isinstance(offset, int | np.integer):
        own = leaves_of_their_own(variables, plan, int(offset))
    else:
        # A share whose place is known only when the program runs (the device's index
        # under `shard_map`): the leaves are chosen from the blocks of every share.
        whole = BlockPlan(variables.size, plan.block_size)
        own = leaves_of_their_own(variables, whole, 0)
    if not own:
        return every_leaf
    size = plan.block_size

    def branch(i):
        products = in_leaf(i)
        first, shape, dtype = variables.offsets[i], variables.shapes[i], variables.dtypes[i]

        def rows(start):
            local = start + offset - first + jnp.arange(size)
            units = jax.nn.one_hot(local, variables.sizes[i], dtype=dtype)
            return products(units.reshape((size, *shape)))

        return rows

    branches = [every_leaf] + [branch(i) for i in own]

    def block(start):
        at = start + offset
        index = jnp.zeros((), jnp.int32)
        for k, i in enumerate(own, start=1):
            first, leaf_size = variables.offsets[i], variables.sizes[i]
            inside = (at >= first) & (at + size <= first + leaf_size)
            index = jnp.where(inside, jnp.int32(k), index)
        return jax.lax.switch(index, branches, start)

    return block


def curvature_matrix(
    transform: AbstractDerivative,
    prepared: Prepared,
    rows: Callable[[jax.Array], jax.Array],
    in_leaf: Callable[[int], Callable[[Any], jax.Array]] | None,
    sink: OutputSink | None,
    share: Share | None,
    split: Split | None,
    *,
    columns: bool,
) -> jax.Array | None:
    """The symmetric `(n, n)` matrix of `transform` at the call `prepared`, in the blocks
    its options give (with `share`, one device's share of its rows or columns; with `sink`,
    each block handed to it, and `None` returned).

    - `rows(V)`: the products with the rows of a `(k, n)` block of unit vectors, a `(k, n)`
      block of the matrix's rows (its columns, transposed).
    - `in_leaf`: `None`, or as for `by_leaf`, the same of unit vectors of one leaf alone.
    - `columns`: write each block as columns rather than rows.
    """
    owner = transform._owner
    flat, n = prepared.flat, prepared.n
    plan = plan_blocks(
        n,
        nbatches=transform.nbatches,
        batch_size=transform.batch_size,
        what="variables",
        owner=owner,
    )
    what = "columns" if columns else "rows"
    plan, offset = share_of(n, plan, share, split, owner=owner, what=what)

    def every_leaf(start):
        return rows(basis_block(start + offset, plan.block_size, n, flat.dtype))

    rows_of = every_leaf
    if in_leaf is not None:
        rows_of = by_leaf(prepared.variables, plan, offset, every_leaf, in_leaf)

    def block(start):
        block_rows = rows_of(start)
        return block_rows.T if columns else block_rows

    if n == 0:  # only empty variables: nothing to run, the matrix is empty
        return jnp.zeros((0, 0), flat.dtype)
    return map_blocks(
        block,
        plan,
        axis=1 if columns else 0,
        sink=None if sink is None else sink.part([0], plan),
        progress=label(transform),
    )
