"""The covariance of a dense Fisher or Hessian matrix, inverted through its Cholesky
factor (or its pseudo-inverse), and the standard errors on its diagonal."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from .._checks import RealScalar, check_bool, described, typechecked
from .._operators._arguments import check_real
from .._pytree import is_traced, split_variables
from .._traceback import public

__all__ = ["covariance"]

# Failures of the dense inverse, as codes: 0 none.
_ASYMMETRIC, _NOT_DEFINITE, _SINGULAR = 1, 2, 3


def _asymmetry(F: jax.Array, s: jax.Array) -> jax.Array:
    """`max |A v - A^T v| / max |A| |v|` of `A = S F S`, `S = diag(s)`, for one fixed
    vector `v`: a symmetry check that costs two products and no second matrix."""
    # Entries spread without pattern (an irrational step), so that no structured
    # asymmetry of F maps `v` to zero.
    v = s * jnp.sin(jnp.arange(1, F.shape[0] + 1, dtype=F.dtype) * 0.7548776662466927)
    difference = jnp.max(jnp.abs(s * (F @ v - v @ F)))
    scale = jnp.max(s * (jnp.abs(F) @ jnp.abs(v)))
    return difference / jnp.where(scale > 0, scale, 1)


def _unit_diagonal(F: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(S F S, s)` with `S = diag(s)`, `s = 1 / sqrt|diag F|`: `F` in units in which each
    variable's own curvature is one (1 where a diagonal entry is zero)."""
    diagonal = jnp.abs(jnp.diagonal(F))
    # A zero diagonal entry of a semi-definite F has a zero row: any unit leaves it so.
    s = jnp.where(diagonal > 0, 1 / jnp.sqrt(jnp.where(diagonal > 0, diagonal, 1)), 1)
    return s[:, None] * F * s[None, :], s


@jax.jit
def _cholesky_inverse(F):
    """`(inverse, code, details)`: `F^{-1}` from the Cholesky factor of `F` scaled to a
    unit diagonal; the failure code; the first bad row of that factor and its pivot, the
    asymmetry ratio and, where the factor broke down, the ends of the scaled spectrum."""
    n = F.shape[0]
    eps = jnp.finfo(F.dtype).eps
    scaled, s = _unit_diagonal(F)
    factor = jax.scipy.linalg.cho_factor(scaled, lower=True)
    pivots = jnp.diagonal(factor[0])
    inverse = jax.scipy.linalg.cho_solve(factor, jnp.eye(n, dtype=F.dtype))
    inverse = s[:, None] * inverse * s[None, :]
    # A pivot whose square is below n eps of the (unit) diagonal leaves no correct digit
    # in the inverse: F is singular to working precision, whatever its variables' units.
    tiny = pivots**2 <= n * eps * jnp.max(jnp.abs(jnp.diagonal(scaled)))
    broken = ~jnp.isfinite(pivots) | (pivots <= 0)
    bad = broken | tiny
    row = jnp.argmax(bad)
    ratio = _asymmetry(F, s)

    def spectrum_ends(F, s):
        eigenvalues = jnp.linalg.eigvalsh(_unit_diagonal(F)[0], symmetrize_input=False)
        return eigenvalues[0], eigenvalues[-1]

    # A factor that breaks down says neither where nor by how much; the eigenvalues tell
    # a singular F (rounding made a pivot negative) from an indefinite one. `cond` pays for
    # them only then (but for every F under vmap), in jitted and eager calls alike, so
    # both give one answer.
    nan = jnp.asarray(jnp.nan, F.dtype)
    smallest, largest = jax.lax.cond(jnp.any(broken), spectrum_ends, lambda F, s: (nan, nan), F, s)
    # NaN eigenvalues (of a NaN F) are no evidence of a singular F.
    semi_definite = smallest >= -n * eps * jnp.maximum(jnp.abs(smallest), jnp.abs(largest))
    code = jnp.select(
        [ratio > jnp.sqrt(eps), jnp.any(broken) & ~semi_definite, jnp.any(bad)],
        [_ASYMMETRIC, _NOT_DEFINITE, _SINGULAR],
        0,
    )
    details = {"row": row, "pivot": pivots[row], "ratio": ratio}
    return inverse, code, {**details, "smallest": smallest, "largest": largest}


@jax.jit
def _pseudo_inverse(F, rcond):
    """`(pseudo-inverse, code, smallest eigenvalue, ratio)`: `S pinv(S F S) S`, from the
    eigendecomposition of `F` scaled to a unit diagonal, and its smallest eigenvalue."""
    scaled, s = _unit_diagonal(F)
    eigenvalues, vectors = jnp.linalg.eigh(scaled, symmetrize_input=False)
    cutoff = rcond * jnp.max(jnp.abs(eigenvalues))
    kept = jnp.abs(eigenvalues) > cutoff
    root = jnp.sqrt(jnp.where(kept & (eigenvalues > 0), 1 / jnp.where(kept, eigenvalues, 1), 0))
    weighted = s[:, None] * vectors * root
    inverse = weighted @ weighted.T
    ratio = _asymmetry(F, s)
    smallest = eigenvalues[0]
    code = jnp.select(
        [ratio > jnp.sqrt(jnp.finfo(F.dtype).eps), smallest < -cutoff],
        [_ASYMMETRIC, _NOT_DEFINITE],
        0,
    )
    return inverse, code, smallest, ratio


def _refusal(owner: str, code: int, pseudo_inverse: bool, values: Any = None) -> str:
    """Why `F` is refused; with `values` (eagerly) the numbers that show it."""
    shown = values is not None
    way_out = (
        ""
        if pseudo_inverse
        else " Pass pseudo_inverse=True for the pseudo-inverse, or add a small multiple of "
        "the identity to F."
    )
    if code == _ASYMMETRIC:
        size = f" (|F v - F^T v| is {values['ratio']:.2g} of its scale)" if shown else ""
        return f"{owner}: `F` is not symmetric{size}; pass a symmetric matrix."
    if code == _NOT_DEFINITE:
        kind = "semi-definite" if pseudo_inverse else "definite"
        smallest = (
            f": scaled to a unit diagonal, its smallest eigenvalue is {values['smallest']:.3g}"
            if shown
            else ""
        )
        return (
            f"{owner}: `F` is not positive {kind}{smallest}, so it is no covariance's "
            f"inverse (a Hessian away from a minimum?).{way_out}"
        )
    if not shown:
        why = "a pivot of its Cholesky factor vanishes"
    elif values["pivot"] > 0:
        why = f"pivot {values['row']} of its Cholesky factor is {values['pivot']:.3g}"
    else:
        # The factor broke down at this pivot: the spectrum says by how much.
        why = (
            f"its smallest eigenvalue is {values['smallest']:.3g}, its largest "
            f"{values['largest']:.3g}"
        )
    why = f": scaled to a unit diagonal, {why}"
    return f"{owner}: `F` is singular to working precision{why}.{way_out}"


def _check_matrix(F: Any, *, owner: str) -> jax.Array:
    if not eqx.is_array(F):
        raise TypeError(
            f"{owner}: `F` must be an (n, n) array (a Fisher or Hessian matrix), got "
            f"{described(F)}."
        )
    if jnp.ndim(F) != 2 or F.shape[0] != F.shape[1]:
        raise ValueError(f"{owner}: `F` must be a square (n, n) array, got shape {F.shape}.")
    if not jnp.issubdtype(F.dtype, jnp.floating):
        raise TypeError(
            f"{owner}: `F` must have a real floating dtype, got {F.dtype}; cast it, e.g. "
            f"F.astype(float)."
        )
    return jnp.asarray(F)


@public
@typechecked
def covariance(
    F: Float[Array | np.ndarray, "n n"],
    *,
    pseudo_inverse: bool = False,
    rcond: RealScalar | None = None,
    like: PyTree | None = None,
) -> tuple[Float[Array, "n n"], Float[Array, " n"] | PyTree[Float[Array, "..."]]]:
    """The covariance `F^{-1}` of a dense symmetric positive-definite matrix and the
    standard errors `sqrt(diag(F^{-1}))`.

    `F` is a Fisher information matrix (`zm.BatchedGGN` of a negative log-likelihood)
    or the Hessian of one at its minimum (`zm.BatchedHessian`): its inverse is the
    asymptotic covariance of the fitted parameters (the Laplace approximation), and the
    square roots of its diagonal their standard errors. For a few parameters of a model
    too large for the dense matrix, `zm.marginal_variances` takes solves instead.

    `F` is first scaled to a unit diagonal, `A = S F S` with `S = diag(F)^{-1/2}` (1
    where the diagonal is zero, as is then a semi-definite `F`'s whole row): each
    variable measured in units of its own curvature, so that variables in different
    units (`F = diag(1e6, 1)`) are no sign of trouble. The inverse comes from a Cholesky
    factorisation of `A`, `S cho_solve(cho_factor(A), I) S`. A matrix that is not
    positive definite, or singular to working precision (a pivot of `A`'s factor whose
    square is below `n * eps`), is refused, never answered with NaNs: eagerly by a
    `ValueError`; under `jax.jit` by the same message through `eqx.error_if` when the
    call runs. With `pseudo_inverse=True` the pseudo-inverse is taken instead,
    `S pinv(A) S`, from an eigendecomposition of `A` with the eigenvalues below
    `rcond * max|eigenvalue|` dropped: the covariance of the directions the data
    determine. It is the Moore-Penrose inverse of `F` where `F`'s diagonal is constant
    (and `F^{-1}` where `F` is invertible); unlike that one, it follows the variables'
    units: measuring a variable in other units scales its row and column of the
    covariance, and no other entry.

    Only the lower triangle of `A` is factored; `A` is checked to be symmetric to within
    `sqrt(eps)` of its scale by comparing `A v` with `A^T v` for one vector `v`.

    **Arguments:**

    - `F`: a real `(n, n)` floating-point array, symmetric positive definite
      (semi-definite with `pseudo_inverse=True`).
    - `pseudo_inverse`: `True` for the pseudo-inverse of a singular `F`. Default `False`.
    - `rcond`: with `pseudo_inverse=True`, the relative cutoff for small eigenvalues of
      `A`; `None` (the default) is `n * eps` of `F`'s dtype, as `jnp.linalg.pinv`.
    - `like`: `None`, or the pytree `x` that `F` was taken at: the standard errors are
      then returned shaped like its variables (its inexact-array leaves; `None` at the
      other leaves). `zm.hessian_to_pytree(covariance, x)` cuts the matrix alike.

    **Returns:**

    `(covariance, standard_errors)`: the `(n, n)` inverse and the `(n,)` standard errors
    (a pytree with `like=`), in `F`'s dtype.

    **Cost:** `O(n^3)` time; memory beside `F`: the output and the Cholesky factor, about
    twice `F` (with `pseudo_inverse=True`, the eigenvectors in place of the factor).

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def nll(params, t, y):
            return 0.5 * jnp.sum((params["a"] * t + params["b"] - y) ** 2)

        params = {"a": jnp.asarray(1.0), "b": jnp.asarray(0.0)}
        t = jnp.linspace(0, 1, 20)
        F = zm.BatchedHessian(nll)(params, t, 2 * t)
        cov, errors = zm.covariance(F, like=params)   # errors["a"], errors["b"]
        ```
    """
    owner = "zm.covariance"
    F = _check_matrix(F, owner=owner)
    check_bool(pseudo_inverse, "pseudo_inverse", owner=owner)
    n = F.shape[0]
    variables = None
    if like is not None:
        variables = split_variables(like, argname="like", owner=owner)[1]
        if variables.size != n:
            raise ValueError(
                f"{owner}: `like` has {variables.size} scalar variables, but `F` is "
                f"{n} x {n}; pass the pytree that `F` was taken at."
            )
    if pseudo_inverse:
        if rcond is None:
            rcond = n * float(jnp.finfo(F.dtype).eps)
        rcond = check_real(rcond, "rcond", owner=owner)
        inverse, code, smallest, ratio = _pseudo_inverse(F, jnp.asarray(rcond, F.dtype))
        details = {"smallest": smallest, "ratio": ratio}
    else:
        if rcond is not None:
            raise ValueError(
                f"{owner}: `rcond` applies only with pseudo_inverse=True, got rcond={rcond!r}."
            )
        inverse, code, details = _cholesky_inverse(F)
    if is_traced(code):
        messages = tuple(_refusal(owner, c, pseudo_inverse) for c in range(1, 4))
        inverse = eqx.branched_error_if(inverse, code > 0, jnp.maximum(code - 1, 0), messages)
    elif int(code) > 0:
        values = {name: np.asarray(value).item() for name, value in details.items()}
        raise ValueError(_refusal(owner, int(code), pseudo_inverse, values))
    errors = jnp.sqrt(jnp.diagonal(inverse))
    if variables is not None:
        errors = variables.fill(variables.split_per_leaf(errors), keep_fixed=False)
    return inverse, errors
