"""The arithmetic of a low-rank plus diagonal operator held as flat arrays,
`A = U diag(s) U^T + diag(d)` (see `_low_rank_diagonal` for the identities): each
function is one compiled program where it is called eagerly, rather than a program per
operation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._eager import one_program
from ._low_rank_leaves import Damped

__all__ = [
    "damped",
    "dense",
    "diagonal",
    "logdet",
    "marginal_variances",
    "product",
    "sample",
    "solve",
]


@one_program()
def product(U: Any, s: Any, d: Any, vector: Any) -> Any:
    """`A v = U (s * (U^T v)) + d * v`."""
    return U @ (s * (U.T @ vector)) + d * vector


@one_program()
def dense(U: Any, s: Any, d: Any) -> Any:
    """The `(n, n)` matrix."""
    return (U * s) @ U.T + jnp.diag(d)


@one_program()
def diagonal(U: Any, s: Any, d: Any) -> Any:
    """`d + sum(U**2 * s, axis=1)`."""
    return d + jnp.sum(U * U * s, axis=1)


@one_program()
def damped(U: Any, s: Any, shifted: Any) -> Damped:
    """`A + damping I = R (I + Q diag(t) Q^T) R` from `shifted = d + damping > 0`."""
    root = jnp.sqrt(shifted)
    scaled = U * jnp.sqrt(s) / root[:, None]
    basis, singular, _ = jnp.linalg.svd(scaled, full_matrices=False)
    return Damped(root, basis, singular * singular)


@one_program()
def solve(damped: Damped, b: Any) -> Any:
    """`(A + damping I)^{-1} b` for `b` of shape `(n,)` or `(n, k)` (Woodbury)."""
    root, basis, spectrum = damped
    rows = root if b.ndim == 1 else root[:, None]
    whitened = b / rows
    shrink = spectrum / (1 + spectrum)
    inner = basis.T @ whitened
    inner = shrink * inner if b.ndim == 1 else shrink[:, None] * inner
    return (whitened - basis @ inner) / rows


@one_program()
def logdet(damped: Damped) -> Any:
    """`log det(A + damping I)` (the determinant lemma)."""
    root, _, spectrum = damped
    return 2 * jnp.sum(jnp.log(root)) + jnp.sum(jnp.log1p(spectrum))


@one_program()
def marginal_variances(damped: Damped) -> Any:
    """The diagonal of `(A + damping I)^{-1}`."""
    root, basis, spectrum = damped
    squares = basis * basis
    # Clipped: rounding can leave a row of Q with a norm a little above 1.
    outside = jnp.maximum(1 - jnp.sum(squares, axis=1), 0)
    inside = squares @ (1 / (1 + spectrum))
    return (outside + inside) / (root * root)


@one_program(static=("shape",))
def sample(damped: Damped, key: Any, shape: tuple[int, ...]) -> Any:
    """Draws `L z` from `N(0, (A + damping I)^{-1})`, `z` normal of shape `(*shape, n)`."""
    root, basis, spectrum = damped
    normals = jax.random.normal(key, (*shape, root.shape[0]), root.dtype)
    grown = jnp.sqrt(1 + spectrum)
    # 1 - 1 / sqrt(1 + t), written so that a small t loses nothing to cancellation.
    pull = spectrum / (grown * (1 + grown))
    return (normals - ((normals @ basis) * pull) @ basis.T) / root
