"""The exact operations of an operator with no structure to use but its dense matrix: a
transform's `BlockedOperator` (whose products are all it has) and the eigenvectors of a
low rank plus a diagonal. Each forms the `(n, n)` matrix (a transform's in its own planned
blocks), so each costs `n^2` numbers and `O(n^3)` work: for `n` up to some thousands. For
larger `n` the estimators do the same from products (`zm.diagonal`, `zm.solve`,
`zm.logdet`, `zm.eigsh`).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx

from .._pytree import is_traced
from ._arguments import check_real

__all__ = [
    "check_square",
    "dense_diagonal",
    "dense_eigh",
    "dense_logdet",
    "dense_solve",
    "square_matrix",
]


def square_matrix(operator: Any, owner: str) -> jax.Array:
    """`operator.as_matrix()`, refused in words naming the caller `owner` unless the
    operator is square (its input and output structures alike)."""
    check_square(operator, owner)
    return operator.as_matrix()


def check_square(operator: Any, owner: str) -> None:
    """Refuse, naming the caller `owner`, an operator whose input and output differ."""
    structure = jax.tree_util.tree_structure
    if structure(operator.in_structure()) != structure(operator.out_structure()) or [
        (leaf.shape, leaf.dtype) for leaf in jax.tree_util.tree_leaves(operator.in_structure())
    ] != [(leaf.shape, leaf.dtype) for leaf in jax.tree_util.tree_leaves(operator.out_structure())]:
        raise ValueError(
            f"{owner}: the operator is not square (it maps the variables to another space, "
            "as a Jacobian does); its diagonal, solves, log-determinant and eigenvectors "
            "are those of a square operator, such as a Hessian's or a Gauss-Newton matrix's."
        )


def _damped(operator: Any, damping: Any, owner: str) -> jax.Array:
    """`A + damping I`, dense, `damping` checked to be a finite real number."""
    damping = check_real(damping, "damping", owner=owner, minimum=None)
    matrix = square_matrix(operator, owner)
    return matrix + jnp.asarray(damping, matrix.dtype) * jnp.eye(
        matrix.shape[0], dtype=matrix.dtype
    )


def _refuse_singular(value: Any, singular: jax.Array, damping: Any, owner: str) -> Any:
    message = (
        f"{owner}: the operator plus `damping` is singular (damping={damping!r}): it has no "
        "inverse and no finite log-determinant. Give damping > 0 (for a positive "
        "semi-definite curvature), or another damping."
    )
    if is_traced(singular):
        return eqx.error_if(value, singular, message)
    if bool(singular):
        raise ValueError(message)
    return value


def dense_diagonal(operator: Any, owner: str) -> jax.Array:
    """The diagonal, flat `(n,)`."""
    return jnp.diagonal(square_matrix(operator, owner))


def dense_solve(operator: Any, b: Any, damping: Any, owner: str) -> jax.Array:
    """`(A + damping I)^{-1} b` for a flat `(n,)` or `(n, k)` `b`, from one LU
    factorisation, which also says whether the damped matrix is singular (a zero pivot)."""
    damped = _damped(operator, damping, owner)
    lu, pivots = jax.scipy.linalg.lu_factor(damped)
    solution = jax.scipy.linalg.lu_solve((lu, pivots), jnp.asarray(b, damped.dtype))
    singular = jnp.any(jnp.diagonal(lu) == 0) | jnp.logical_not(jnp.all(jnp.isfinite(solution)))
    return _refuse_singular(solution, singular, damping, owner)


def dense_logdet(operator: Any, damping: Any, owner: str) -> jax.Array:
    """`log det(A + damping I)`: `jnp.linalg.slogdet`'s where the determinant is positive,
    `nan` where it is negative (as `zm.BlockDiagonal.logdet` gives); a singular damped
    operator is refused."""
    sign, value = jnp.linalg.slogdet(_damped(operator, damping, owner))
    return _refuse_singular(jnp.where(sign < 0, jnp.nan, value), sign == 0, damping, owner)


def dense_eigh(operator: Any, owner: str) -> tuple[jax.Array, jax.Array]:
    """`(eigenvalues, eigenvectors)` of a symmetric operator: ascending `(n,)` and the
    `(n, n)` matrix of flat eigenvectors as columns, `jnp.linalg.eigh`'s."""
    check_square(operator, owner)
    if not lx.is_symmetric(operator):
        raise ValueError(
            f"{owner}: the operator is not declared symmetric (a Hessian's or a Gauss-Newton "
            "matrix's is); `eigh` is the eigendecomposition of a symmetric operator."
        )
    matrix = square_matrix(operator, owner)
    return jnp.linalg.eigh((matrix + matrix.T.conj()) / 2)
