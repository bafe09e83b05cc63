"""The diagonal blocks of a Hessian or Gauss-Newton matrix, one per variable leaf
(`blocks="leaf"`): each is the whole curvature of a function of that leaf alone, the
others held where they are, so it is computed by the same transform, planned and
blocked as any call, and nothing of the cross-terms is ever formed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._plan._memory import budget_bytes
from .._pytree import split_variables

__all__ = ["leaf_blocks"]


class _OneLeaf(eqx.Module):
    """`fn` as a function of the variable leaf `index` of `x`, the rest of `x` fixed.
    A module, so that `x`'s arrays are leaves of the transform that differentiates it."""

    fn: Callable[..., Any]
    x: Any
    index: int = eqx.field(static=True)

    def __call__(self, leaf: Any, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(self.x)
        positions = [k for k, value in enumerate(leaves) if eqx.is_inexact_array(value)]
        leaves[positions[self.index]] = leaf
        return self.fn(jax.tree_util.tree_unflatten(treedef, leaves), *args, **kwargs)


def leaf_blocks(transform: Any, args: tuple, kwargs: dict) -> Any:
    """The blocks of `transform`'s matrix at `(x, *args, **kwargs)`, one `(n_i, n_i)`
    array per variable leaf of `x` in leaf order, in the dtype the whole matrix has (with
    `has_aux`, `(blocks, aux)`, the aux of the first leaf's call).

    Each block is the call of `transform` itself with `fn` restricted to one leaf. With a
    budget in bytes, each call is planned within what the blocks already made leave of
    it, so that all of them together stay within `max_memory`."""
    x, *rest = args
    leaves = [value for value in jax.tree_util.tree_leaves(x) if eqx.is_inexact_array(value)]
    if not leaves:
        split_variables(x, owner=type(transform).__name__)  # refused there, in its words
    # The whole matrix's dtype, read from the leaves: raveling them all is not needed.
    dtype = jnp.result_type(*(leaf.dtype for leaf in leaves))
    budget = transform.max_memory
    held = 0
    blocks, aux = [], None
    for index, leaf in enumerate(leaves):
        memory = budget
        if budget not in (None, "auto"):
            memory = max(budget_bytes(budget) - held, 1)
        # A count of blocks is one per leaf; a leaf smaller than it is one block a variable.
        count = None if transform.nbatches is None else min(transform.nbatches, leaf.size)
        one = dataclasses.replace(
            transform,
            fn=_OneLeaf(transform.fn, x, index),
            blocks="full",
            nbatches=count,
            max_memory=memory,
        )
        result = one(leaf, *rest, **kwargs)
        block, leaf_aux = result if transform.has_aux else (result, None)
        aux = leaf_aux if index == 0 else aux
        blocks.append(block.astype(dtype))
        held += block.size * jnp.dtype(dtype).itemsize
    return (tuple(blocks), aux) if transform.has_aux else tuple(blocks)
