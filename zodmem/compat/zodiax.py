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

import numbers
from collections.abc import Callable
from typing import Any

import jax

from .._hessian import BatchedHessian, hessian_to_pytree
from .._jacobian import BatchedJacobian
from .._pytree import split_variables

__all__ = ["jacobian", "hessian", "hessian_to_pytree"]


def _check_nbatches(nbatches: Any, n: int) -> int:
    """`nbatches` as a Python int, refused unless it is a whole number from 1 to `n`."""
    if isinstance(nbatches, bool) or not isinstance(nbatches, numbers.Integral):
        raise TypeError(f"nbatches must be a positive int, got {nbatches!r}.")
    nbatches = int(nbatches)
    if nbatches <= 0:
        raise ValueError(f"nbatches must be a positive int, got nbatches={nbatches}.")
    if nbatches > n:
        raise ValueError(
            f"nbatches={nbatches} is too large for n={n} parameters. "
            f"Choose nbatches <= n, or set nbatches=1 for no batching."
        )
    return nbatches


def jacobian(
    f: Callable[[Any], Any],
    x: Any,
    nbatches: int = 1,
    jit: bool = True,
    checkpoint: bool = False,
) -> tuple[Any, Callable[[jax.Array], Any]]:
    """The Jacobian of `f` at `x` in `nbatches` blocks of columns, and `unflatten`.

    Returns `(J, unflatten)`: `J` has shape `(*f(x).shape, n)` (a pytree of these
    when `f` returns a pytree) and `unflatten` maps a flat vector of the `n`
    variables back to the structure of `x`.
    """
    _, variables = split_variables(x)
    nbatches = _check_nbatches(nbatches, variables.size)
    # One block is `jax.jacobian` (reverse mode) in zodiax, blocks of columns are JVPs.
    mode = "rev" if nbatches == 1 else "fwd"
    transform = BatchedJacobian(f, mode=mode, nbatches=nbatches, jit=jit, checkpoint=checkpoint)
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
    nbatches = _check_nbatches(nbatches, variables.size)
    transform = BatchedHessian(f, nbatches=nbatches, jit=jit, checkpoint=checkpoint)
    return transform(x), variables.unravel
