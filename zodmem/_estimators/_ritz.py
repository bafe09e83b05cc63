"""The Ritz pairs of `eigsh`'s Lanczos basis: the wanted eigenpairs of its tridiagonal
matrix, computed on the host, with bounds on their residuals.

A call back from the compiled loop at each convergence check: the tridiagonal
eigensolvers there take only the wanted pairs and use no threaded BLAS, where a dense
`eigh` in the program (LAPACK's syevd on CPU) wakes BLAS threads that contend with
XLA's own once the basis grows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

__all__ = ["ritz_pairs"]


def ritz_pairs(
    alphas: jax.Array,
    betas: jax.Array,
    couplings: jax.Array,
    locked_residuals: jax.Array,
    m: Any,
    start: Any,
    k: int,
) -> tuple:
    """The `k` largest Ritz values of the `m` rows in use (ascending), their eigenvectors
    of the Rayleigh-Ritz matrix (as `(max_steps, k)`) and bounds on their residual
    norms; the largest Ritz value of the latest run (rows `start` on, decoupled from the
    rows before), and its residual norm; and the smallest Ritz value. The arrays are
    those of `eigsh`'s loop: the tridiagonal matrix's `alphas` and `betas`, each row's
    `couplings` to the locked rows, and the locked rows' residual norms.

    The Rayleigh-Ritz matrix is the tridiagonal one: the locked rows are Ritz vectors
    (their values on the diagonal, uncoupled), and their products with the rows after,
    about their residuals in size, count in the residual bounds instead.
    """
    dtype = alphas.dtype
    scalar = jax.ShapeDtypeStruct((), dtype)
    shapes = (
        jax.ShapeDtypeStruct((k,), dtype),
        jax.ShapeDtypeStruct((alphas.shape[0], k), dtype),
        jax.ShapeDtypeStruct((k,), dtype),
        scalar,
        scalar,
        scalar,
    )
    # Under `jax.vmap` (the pairs of a batch of operators), one call per operator.
    return jax.pure_callback(
        functools.partial(_host_ritz, k=k),
        shapes,
        alphas,
        betas,
        couplings,
        locked_residuals,
        m,
        start,
        vmap_method="sequential",
    )


def _host_ritz(
    alphas: Any,
    betas: Any,
    couplings: Any,
    locked_residuals: Any,
    m: Any,
    start: Any,
    k: int,
) -> tuple:
    """`ritz_pairs` on the host, with NumPy arrays."""
    alphas, betas = np.asarray(alphas), np.asarray(betas)
    couplings, locked_residuals = np.asarray(couplings), np.asarray(locked_residuals)
    m, start, dtype = int(m), int(start), alphas.dtype
    values = np.full(k, -np.inf, dtype)
    vectors = np.zeros((alphas.shape[0], k), dtype)
    residuals = np.full(k, np.inf, dtype)
    if start >= m:
        # No step since the last restart: only a finished run of a batch gets here (under
        # `jax.vmap`, the loop steps every run until the last is done, and keeps the
        # finished runs' states), and what it is given back is discarded.
        nothing = (-np.inf, np.inf, np.inf)
        return (values, vectors, residuals, *(np.asarray(x, dtype) for x in nothing))
    found = min(k, m)
    pairs = _largest_pairs(alphas[:m], betas[: m - 1], found)
    values[k - found :], vectors[:m, k - found :] = pairs
    # A pair's residual has a part along the next Lanczos vector, one along the locked
    # Ritz vectors (the products with them that the tridiagonal matrix leaves out),
    # orthogonal to it, and the locked vectors' own residuals in the pair's shares of them.
    shares = pairs[1]
    along_next = betas[m - 1] * shares[m - 1]
    along_locked = np.linalg.norm(couplings[:m].T @ shares, axis=0)
    locked = min(k, m)
    inherited = locked_residuals[:locked] @ np.abs(shares[:locked])
    residuals[k - found :] = np.hypot(along_next, along_locked) + inherited
    top, top_vector = _largest_pairs(alphas[start:m], betas[start : m - 1], 1)
    top_residual = np.abs(betas[m - 1] * top_vector[-1, 0])
    low = _smallest_value(alphas[:m], betas[: m - 1])
    scalars = (top[0], top_residual, low)
    return (values, vectors, residuals, *(np.asarray(x, dtype) for x in scalars))


def _largest_pairs(diagonal: np.ndarray, couplings: np.ndarray, count: int) -> tuple:
    """The `count` largest eigenpairs of a symmetric tridiagonal matrix (ascending)."""
    size = diagonal.shape[0]
    if size == 1:
        return diagonal.copy(), np.ones((1, 1), diagonal.dtype)
    try:
        # Bisection and inverse iteration (LAPACK's stebz and stein): no BLAS threads,
        # and only the wanted pairs.
        values, vectors = _scipy_linalg().eigh_tridiagonal(
            diagonal,
            couplings,
            select="i",
            select_range=(size - count, size - 1),
            check_finite=False,
        )
    except np.linalg.LinAlgError:  # inverse iteration failed: the dense solver
        dense = np.diag(diagonal) + np.diag(couplings, 1) + np.diag(couplings, -1)
        values, vectors = np.linalg.eigh(dense)
        values, vectors = values[size - count :], vectors[:, size - count :]
    return values.astype(diagonal.dtype), vectors.astype(diagonal.dtype)


def _smallest_value(diagonal: np.ndarray, couplings: np.ndarray) -> Any:
    """The smallest eigenvalue of a symmetric tridiagonal matrix (by bisection)."""
    if diagonal.shape[0] == 1:
        return diagonal[0]
    return _scipy_linalg().eigvalsh_tridiagonal(
        diagonal, couplings, select="i", select_range=(0, 0), check_finite=False
    )[0]


def _scipy_linalg() -> Any:
    """`scipy.linalg`, imported at its first use rather than with zodmem: a program that
    finds no eigenvalues does not pay for scipy's import."""
    import scipy.linalg

    return scipy.linalg
