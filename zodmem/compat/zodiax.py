"""`zodiax.diffops` 0.5, on zodmem's block engine.

`jacobian`, `hessian` and `hessian_to_pytree` take the same arguments and return
the same results as `zodiax.diffops` for pytrees of floating-point arrays, so a
zodiax user changes only the import::

    from zodmem.compat.zodiax import hessian   # was: from zodiax.diffops import hessian

What differs, deliberately: only the inexact-array leaves of `x` are variables
(zodiax ravels every leaf, so it fails on an `eqx.nn.MLP` and differentiates ints);
the blocks are written into one preallocated result instead of being stacked,
transposed and sliced, so peak memory is about one Hessian smaller; and a bad
`nbatches` (zero, negative, not an int) is a `ValueError`/`TypeError` here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._hessian import BatchedHessian, hessian_to_pytree
from .._jacobian import BatchedJacobian
from .._pytree import split_variables

__all__ = ["jacobian", "hessian", "hessian_to_pytree"]


def _check_nbatches(nbatches: Any, n: int) -> None:
    if isinstance(nbatches, bool) or not isinstance(nbatches, int):
        raise TypeError(f"nbatches must be a positive int, got {nbatches!r}.")
    if nbatches <= 0:
        raise ValueError(f"nbatches must be a positive int, got nbatches={nbatches}.")
    if nbatches > n:
        raise ValueError(
            f"nbatches={nbatches} is too large for n={n} parameters. "
            f"Choose nbatches <= n, or set nbatches=1 for no batching."
        )


def jacobian(
    f: Callable[[Any], Any],
    x: Any,
    nbatches: int = 1,
    jit: bool = True,
    checkpoint: bool = False,
) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """The Jacobian of `f` at `x` in `nbatches` blocks of columns, and `unflatten`.

    Returns `(J, unflatten)`: `J` has shape `(*f(x).shape, n)` and `unflatten` maps
    a flat vector of the `n` variables back to the structure of `x`.
    """
    _, variables = split_variables(x)
    _check_nbatches(nbatches, variables.size)
    transform = BatchedJacobian(
        f, nbatches=nbatches, mode="fwd", jit=jit, checkpoint=checkpoint
    )
    return transform(x), variables.unravel


def hessian(
    f: Callable[[Any], Any],
    x: Any,
    nbatches: int = 1,
    jit: bool = True,
    checkpoint: bool = False,
) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """The `(n, n)` Hessian of the scalar `f` at `x` in `nbatches` blocks, and `unflatten`."""
    _, variables = split_variables(x)
    _check_nbatches(nbatches, variables.size)
    transform = BatchedHessian(f, nbatches=nbatches, jit=jit, checkpoint=checkpoint)
    return transform(x), variables.unravel
