"""Split a pytree into its differentiable variables and everything else.

The variables of a pytree are its inexact-array leaves (floating or complex
arrays), taken in `jax.tree_util` leaf order. Every other leaf -- functions,
Python and integer-array scalars, bools, strings, activation callables held by an
Equinox model -- is held fixed and put back unchanged when a flat vector is
turned back into a pytree.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Variables", "split_variables"]


class Variables(eqx.Module):
    """The inexact leaves of a pytree, described well enough to ravel and unravel them.

    - `shapes`, `dtypes`: shape and dtype of each variable leaf, in leaf order.
    - `dtype`: the common dtype of the flat vector (`jnp.result_type` of the leaves).
    - `treedef`, `is_variable`: the structure of the whole pytree and which of its
      leaves are variables.
    - `fixed`: the leaves that are not variables (`None` in the place of each variable).
    """

    shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    dtypes: tuple[Any, ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    treedef: Any = eqx.field(static=True)
    is_variable: tuple[bool, ...] = eqx.field(static=True)
    fixed: list[Any]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def size(self) -> int:
        """`n`: the number of scalar variables."""
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each leaf starts in the flat vector."""
        return tuple(int(o) for o in np.cumsum((0,) + self.sizes[:-1]))

    def ravel(self, tree: Any) -> jax.Array:
        """Concatenate the variable leaves of `tree` into one vector of dtype `self.dtype`."""
        leaves = [
            leaf
            for leaf, is_var in zip(jax.tree_util.tree_leaves(tree), self.is_variable, strict=True)
            if is_var
        ]
        if not leaves:
            return jnp.zeros((0,), self.dtype)
        return jnp.concatenate([jnp.ravel(leaf).astype(self.dtype) for leaf in leaves])

    def unravel(self, flat: jax.Array) -> Any:
        """The pytree with its variables read from `flat` and every other leaf restored."""
        leaves = [
            jax.lax.slice_in_dim(flat, offset, offset + size).reshape(shape).astype(dtype)
            for offset, size, shape, dtype in zip(
                self.offsets, self.sizes, self.shapes, self.dtypes, strict=True
            )
        ]
        return self.fill(leaves)

    def fill(self, leaves: list[Any], *, keep_fixed: bool = True) -> Any:
        """Put `leaves` (one per variable, in leaf order) back into the pytree's structure.

        The other leaves are restored (`keep_fixed=True`) or set to `None`.
        """
        it = iter(leaves)
        out = [
            next(it) if is_var else (leaf if keep_fixed else None)
            for is_var, leaf in zip(self.is_variable, self.fixed, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def split_rows(self, flat_axis_array: jax.Array, axis: int = -1) -> list[jax.Array]:
        """Cut `flat_axis_array` along `axis` into one piece per variable leaf, shaped like it."""
        axis = axis % flat_axis_array.ndim
        pieces = []
        for offset, size, shape in zip(self.offsets, self.sizes, self.shapes, strict=True):
            piece = jax.lax.slice_in_dim(flat_axis_array, offset, offset + size, axis=axis)
            new_shape = piece.shape[:axis] + shape + piece.shape[axis + 1 :]
            pieces.append(piece.reshape(new_shape))
        return pieces


def split_variables(tree: Any, *, argname: str = "x") -> tuple[jax.Array, Variables]:
    """Return `(flat, variables)` for `tree`: its inexact leaves raveled, and how to undo it.

    Raises `ValueError` when `tree` has no inexact-array leaf, since there is then
    nothing to differentiate.
    """
    all_leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_variable = tuple(bool(eqx.is_inexact_array(leaf)) for leaf in all_leaves)
    leaves = [leaf for leaf, is_var in zip(all_leaves, is_variable, strict=True) if is_var]
    if not leaves:
        kinds = sorted({type(leaf).__name__ for leaf in all_leaves})
        raise ValueError(
            f"`{argname}` has no inexact-array leaves, so there is nothing to differentiate: "
            f"its leaves are of type {kinds or ['(none)']}. The variables of `{argname}` are "
            "its floating-point or complex JAX/NumPy arrays; pass them as arrays, e.g. "
            "`jnp.asarray(value, dtype=float)`."
        )
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    dtypes = tuple(jnp.dtype(leaf.dtype) for leaf in leaves)
    dtype = jnp.result_type(*dtypes)
    fixed = [None if is_var else leaf for leaf, is_var in zip(all_leaves, is_variable, strict=True)]
    info = Variables(
        shapes=shapes,
        dtypes=dtypes,
        dtype=dtype,
        treedef=treedef,
        is_variable=is_variable,
        fixed=fixed,
    )
    return info.ravel(tree), info


def tree_size(tree: Any) -> int:
    """Total number of elements over the array leaves of `tree`."""
    return sum(math.prod(jnp.shape(leaf)) for leaf in jax.tree_util.tree_leaves(tree))


def flat_function(
    fn: Any, variables: Variables, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`z -> fn(unravel(z), *args, **kwargs)`: `fn` as a function of the flat variables."""

    def fn_of_flat(flat: jax.Array) -> Any:
        return fn(variables.unravel(flat), *args, **kwargs)

    return fn_of_flat


def basis_block(start: jax.Array, block_size: int, n: int, dtype: Any) -> jax.Array:
    """Rows `start, ..., start + block_size - 1` of the `n x n` identity: `(block_size, n)`."""
    return jax.nn.one_hot(start + jnp.arange(block_size), n, dtype=dtype)
