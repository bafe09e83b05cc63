"""The Lanczos step on a symmetric operator, shared by `eigsh` (its extreme eigenpairs,
`_eigsh.py`) and the stochastic Lanczos quadrature of the spectral density and of traces
of matrix functions (`_spectral.py`, `_logdet.py`).

Both keep the whole Krylov basis, one preallocated `(steps, n)` buffer, and orthogonalise
every new vector against all of it (two passes of classical Gram-Schmidt), so the
tridiagonal matrix stays faithful in floating point: no spurious copies of converged
eigenvalues, at the price of `steps * n` numbers of memory and `4 * steps * n` flops a
step beside the product.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._random import hashed_bits, key_seed

__all__ = [
    "lanczos_step",
    "normal_direction",
    "normal_start",
    "normalised",
    "projection",
    "tridiagonal",
]

# A step whose new direction is this many rounding errors of the operator's norm (or
# less) has found an invariant subspace.
_BREAKDOWN = 10.0
# Rows of the Krylov basis a pass of Gram-Schmidt reads at a time.
_CHUNK = 16
# A pass of Gram-Schmidt that leaves less than this fraction of a vector's norm is
# repeated once ("twice is enough").
_TWICE = 2**-0.5


def _orthogonalise(basis: jax.Array, vector: jax.Array) -> jax.Array:
    """`vector` less its components along the rows of `basis` (rows not yet used are
    zero): classical Gram-Schmidt twice, which leaves it orthogonal to working precision."""
    vector = vector - basis.T @ (basis @ vector)
    return vector - basis.T @ (basis @ vector)


def projection(basis: jax.Array, j: Any, vector: jax.Array) -> jax.Array:
    """`basis.T @ (basis @ vector)` over rows `0..j` only (the rows after are zero), in
    chunks of `_CHUNK` rows: a step reads the part of the basis it has filled, not all
    of it, and each pass costs as much as a product here."""
    rows, n = basis.shape
    size = min(_CHUNK, rows)

    def chunk(c, total):
        start = jnp.minimum(c * size, rows - size)  # the last chunk may overlap the one before
        block = jax.lax.dynamic_slice_in_dim(basis, start, size, axis=0)
        index = start + jnp.arange(size)
        coefficients = jnp.where((index >= c * size) & (index <= j), block @ vector, 0)
        return total + block.T @ coefficients

    return jax.lax.fori_loop(0, j // size + 1, chunk, jnp.zeros_like(vector))


def normalised(vector: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(vector)
    return vector / jnp.where(norm > 0, norm, 1)


def _direction(j: Any, n: int, dtype: Any) -> jax.Array:
    """A pseudo-random vector of `n` entries in [-1, 1), different for each `j`: the
    new direction after a breakdown (a branch that seldom runs)."""
    return hashed_bits(n, j).astype(dtype) * 2.0**-31 - 1


def normal_start(key: jax.Array, n: int, dtype: Any) -> jax.Array:
    """A unit vector of standard normal entries, drawn from the words of `key`."""
    return normal_direction(key_seed(key), 0, n, dtype)


def normal_direction(seed: Any, draw: Any, n: int, dtype: Any) -> jax.Array:
    """Unit vector number `draw` of standard normal entries (Box-Muller over hashed
    words) for the 32-bit `seed`: uniform on the sphere, as a random start must be."""
    # In (0, 1], so that the logarithm is finite.
    u1 = (hashed_bits(n, 2 * draw, seed).astype(dtype) + 1) * 2.0**-32
    u2 = hashed_bits(n, 2 * draw + 1, seed).astype(dtype) * 2.0**-32
    return normalised(jnp.sqrt(-2 * jnp.log(u1)) * jnp.cos(2 * math.pi * u2))


def lanczos_step(
    product: Callable,
    basis: jax.Array,
    j: Any,
    vector: jax.Array,
    fresh: Any,
    norm: Any,
) -> tuple:
    """Lanczos step `j` from the unit `vector`, orthogonal to rows `0..j-1` of `basis`;
    with `fresh` true, from a new pseudo-random direction (`_direction(j)`) orthogonal
    to them instead, the way to go on once the Krylov space is exhausted.

    Returns `(basis, alpha, beta, next_vector, broke, norm, image)`: the step's unit
    vector stored as row `j`, the diagonal entry `alpha`, the coupling `beta` to
    `next_vector`, whether the Krylov space broke down here (then `beta` is 0 and the
    next step must be `fresh`), the running estimate of the operator's norm (the
    largest norm of a product seen), and the product of the step's vector (its image).
    """

    def draw(vector):
        drawn = _direction(j, vector.shape[0], basis.dtype)
        return normalised(_orthogonalise(basis, drawn))

    vector = jax.lax.cond(fresh, draw, lambda vector: vector, vector)
    basis = jax.lax.dynamic_update_index_in_dim(basis, vector, j, axis=0)
    image = product(vector).astype(basis.dtype)
    norm = jnp.maximum(norm, jnp.linalg.norm(image))
    # The three-term recurrence first (its two projections read two rows, not the
    # basis), then one pass of classical Gram-Schmidt against the whole basis, and a
    # second only where that pass removed much (Daniel, Gragg, Kaufman and Stewart's
    # test): each pass reads all of the basis, which costs as much as a product here.
    alpha = jnp.vdot(vector, image)
    previous = basis[jnp.maximum(j - 1, 0)]
    coupling = jnp.where(j > 0, jnp.vdot(previous, image), 0)
    residual = image - alpha * vector - coupling * previous
    before = jnp.linalg.norm(residual)
    residual = residual - projection(basis, j, residual)
    again = jnp.linalg.norm(residual) < _TWICE * before
    residual = jax.lax.cond(again, lambda r: r - projection(basis, j, r), lambda r: r, residual)
    beta = jnp.linalg.norm(residual)
    broke = beta <= _BREAKDOWN * jnp.finfo(basis.dtype).eps * norm
    beta = jnp.where(broke, 0, beta)
    return basis, alpha, beta, residual / jnp.where(broke, 1, beta), broke, norm, image


def tridiagonal(alphas: jax.Array, betas: jax.Array) -> jax.Array:
    return jnp.diag(alphas) + jnp.diag(betas, 1) + jnp.diag(betas, -1)
