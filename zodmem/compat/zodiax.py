"""`zodiax.diffops` 0.5, on zodmem's block engine.

`jacobian`, `hessian` and `hessian_to_pytree` take the same arguments and return
the same results as `zodiax.diffops` for pytrees of floating-point arrays and Python
floats, so a zodiax user changes only the import::

    from zodmem.compat.zodiax import hessian   # was: from zodiax.diffops import hessian

What differs, deliberately: only the inexact leaves of `x` (floating-point arrays and
Python floats) are variables (zodiax ravels every leaf, so it fails on an
`eqx.nn.MLP` and differentiates ints); the blocks are written into one preallocated
result instead of being stacked, transposed and sliced, so peak memory is about one
Hessian smaller; and a bad `nbatches` (zero, negative, a bool, not an int) is a
`ValueError`/`TypeError` here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, PyTree

from .. import BatchedHessian, BatchedJacobian, hessian_to_pytree as _hessian_to_pytree
from .._checks import check_int
from .._pytree import split_variables

__all__ = ["jacobian", "hessian", "hessian_to_pytree"]


def _is_python_scalar(leaf: Any) -> bool:
    # zodiax ravels every leaf, so a Python float is a variable there, as for jax.grad.
    return isinstance(leaf, (float, complex)) and not eqx.is_array(leaf)


def _scalars_as_arrays(x: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda leaf: jnp.asarray(leaf) if _is_python_scalar(leaf) else leaf, x
    )


def _variables(x: Any, nbatches: Any, owner: str) -> tuple[Any, Any, int]:
    """`x` with its Python float and complex scalars as arrays, its variables, and
    `nbatches` checked against their number."""
    nbatches = check_int(nbatches, "nbatches", owner=owner, minimum=1)
    x = _scalars_as_arrays(x)
    _, variables = split_variables(x)
    if nbatches > variables.size:
        # zodiax's own wording, which its tests match.
        raise ValueError(
            f"{owner}: nbatches={nbatches} is too large for n={variables.size} parameters. "
            "Choose nbatches <= n, or set nbatches=1 for no batching."
        )
    return x, variables, nbatches


def jacobian(
    f: Callable[[Any], Any],
    x: PyTree,
    nbatches: int = 1,
    jit: bool = True,
    checkpoint: bool = False,
) -> tuple[Any, Callable[[jax.Array], Any]]:
    """The Jacobian of `f` at `x` in `nbatches` blocks of columns, and `unflatten`.

    Returns `(J, unflatten)`: `J` has shape `(*f(x).shape, n)` (a pytree of these
    when `f` returns a pytree) and `unflatten` maps a flat vector of the `n`
    variables back to the structure of `x`.
    """
    x, variables, nbatches = _variables(x, nbatches, "jacobian")
    # One block is `jax.jacobian` (reverse mode) in zodiax, blocks of columns are JVPs.
    mode = "rev" if nbatches == 1 else "fwd"
    transform = BatchedJacobian(f, mode=mode, nbatches=nbatches, jit=jit, checkpoint=checkpoint)
    return transform(x), variables.unravel


def hessian(
    f: Callable[[Any], Any],
    x: PyTree,
    nbatches: int = 1,
    jit: bool = True,
    checkpoint: bool = False,
) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """The `(n, n)` Hessian of the scalar `f` at `x` in `nbatches` blocks, and `unflatten`."""
    x, variables, nbatches = _variables(x, nbatches, "hessian")
    transform = BatchedHessian(f, nbatches=nbatches, jit=jit, checkpoint=checkpoint)
    return transform(x), variables.unravel


def hessian_to_pytree(H: ArrayLike, x: PyTree) -> PyTree:
    """The flat `(n, n)` Hessian `H` as blocks: `x`'s structure twice, block `[i][j]` of
    shape `leaf_i.shape + leaf_j.shape` and, as in zodiax, of `H`'s dtype."""
    H = jnp.asarray(H)
    x = _scalars_as_arrays(x)
    # zodiax slices H, so every block keeps H's dtype even where x mixes precisions.
    like_H = jax.tree_util.tree_map(
        lambda leaf: leaf.astype(H.dtype) if eqx.is_inexact_array(leaf) else leaf, x
    )
    return _hessian_to_pytree(H, like_H)
