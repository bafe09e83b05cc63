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

from .._plan._memory import budget_bytes, format_bytes, format_bytes_up
from .._plan._plans import MemoryBudgetError
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
    it, so that all of them together stay within `max_memory`; a budget too small for
    one of them is refused with the least that holds every block and every call."""
    x, *rest = args
    leaves = [value for value in jax.tree_util.tree_leaves(x) if eqx.is_inexact_array(value)]
    if not leaves:
        split_variables(x, owner=transform._owner)  # refused there, in its words
    # The whole matrix's dtype, read from the leaves: raveling them all is not needed.
    dtype = jnp.result_type(*(leaf.dtype for leaf in leaves))
    budget = transform.max_memory
    held = _held_before(leaves, dtype)
    blocks, aux = [], None
    for index, leaf in enumerate(leaves):
        memory = budget
        if budget not in (None, "auto"):
            memory = max(budget_bytes(budget) - held[index], 1)
        one = _one_leaf(transform, x, index, leaf, memory)
        try:
            result = one(leaf, *rest, **kwargs)
        except MemoryBudgetError as error:
            if budget in (None, "auto") or error.suggested_bytes is None:
                raise
            raise _refusal(transform, x, leaves, held, index, error, rest, kwargs) from error
        block, leaf_aux = result if transform.has_aux else (result, None)
        aux = leaf_aux if index == 0 else aux
        blocks.append(block.astype(dtype))
    return (tuple(blocks), aux) if transform.has_aux else tuple(blocks)


def _held_before(leaves: list, dtype: Any) -> list[int]:
    """The bytes of the blocks made before each leaf's, in the whole matrix's dtype."""
    sizes = [leaf.size**2 * jnp.dtype(dtype).itemsize for leaf in leaves]
    return [sum(sizes[:index]) for index in range(len(leaves))]


def _one_leaf(transform: Any, x: Any, index: int, leaf: Any, memory: Any) -> Any:
    """`transform` as the whole-matrix call of `leaf`'s block (variable leaf `index` of
    `x`), within `memory`."""
    # A count of blocks is one per leaf; a leaf smaller than it is one block a variable.
    count = None if transform.nbatches is None else min(transform.nbatches, leaf.size)
    return dataclasses.replace(
        transform,
        fn=_OneLeaf(transform.fn, x, index),
        blocks="full",
        nbatches=count,
        max_memory=memory,
    )


def _refusal(
    transform: Any,
    x: Any,
    leaves: list,
    held: list[int],
    index: int,
    error: MemoryBudgetError,
    rest: list[Any],
    kwargs: dict,
) -> MemoryBudgetError:
    """The refusal of a budget that leaf `index`'s call does not fit beside the blocks
    made before it: the whole budget named, and the least that holds every leaf's block
    and call from it on (the leaves before it fit a smaller one)."""
    owner = transform._owner
    budget = budget_bytes(transform.max_memory)
    least = held[index] + error.suggested_bytes
    binding, need = index, error.suggested_bytes  # the leaf whose call sets `least`
    for later in range(index + 1, len(leaves)):
        # Each later call planned within what `least` leaves it, raised where it must be.
        one = _one_leaf(transform, x, later, leaves[later], max(least - held[later], 1))
        try:
            one.plan(leaves[later], *rest, **kwargs)
        except MemoryBudgetError as larger:
            if larger.suggested_bytes is None:
                raise
            if held[later] + larger.suggested_bytes > least:
                least = held[later] + larger.suggested_bytes
                binding, need = later, larger.suggested_bytes
    path = [
        jax.tree_util.keystr(path)
        for path, value in jax.tree_util.tree_flatten_with_path(x)[0]
        if eqx.is_inexact_array(value)
    ][binding]
    held_before = held[binding]
    beside = (
        f", beside the {format_bytes(held_before)} of the blocks before it" if held_before else ""
    )
    refused = MemoryBudgetError(
        f"{owner}: max_memory={format_bytes(budget)} cannot hold the blocks per leaf "
        "(blocks='leaf'), each leaf's call planned within what the blocks made before it "
        f"leave: the call that makes x{path}'s block needs {format_bytes(need)}{beside}. "
        f"The way out is a budget of at least {format_bytes_up(least)}, which holds every "
        "leaf's block and the call that makes it."
    )
    refused.budget_bytes, refused.suggested_bytes = budget, least
    return refused
