"""The compiled operations of `KroneckerFactored`: each is one program of the whole
operator (its blocks' matrix products), not many small ones."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._memo import memo_of

__all__ = [
    "decompose",
    "decomposed",
    "decomposition",
    "dense",
    "diagonal",
    "least",
    "logdet",
    "products",
    "solve",
]


def _eigh(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eigenvalues (clipped at 0: the factors are sums of squares) and eigenvectors."""
    values, vectors = jnp.linalg.eigh((matrix + matrix.T) / 2)
    return jnp.maximum(values, 0), vectors


@eqx.filter_jit
def decompose(input_factors: tuple, gradient_factors: tuple) -> tuple:
    """The factors' eigendecompositions: `(input bases, gradient bases, eigenvalues)`,
    a block's eigenvalues `outer(b, a)` of its factors' `b` and `a`."""
    inputs = [_eigh(factor) for factor in input_factors]
    gradients = [_eigh(factor) for factor in gradient_factors]
    eigenvalues = [jnp.outer(b, a) for (b, _), (a, _) in zip(gradients, inputs, strict=True)]
    return (
        tuple(vectors for _, vectors in inputs),
        tuple(vectors for _, vectors in gradients),
        tuple(jnp.maximum(values, 0) for values in eigenvalues),
    )


def decomposition(operator: Any) -> tuple:
    """`(input bases, gradient bases, eigenvalues)` of `operator`: given (EKFAC's), or
    its factors' eigendecompositions, taken once and kept beside the operator where they
    are concrete (under a trace, they are taken in the program traced)."""
    if operator.eigen is not None:
        return operator.eigen
    memo = memo_of(operator)
    if "eigen" in memo:
        return memo["eigen"]
    eigen = decompose(operator.input_factors, operator.gradient_factors)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(eigen)):
        memo["eigen"] = eigen
    return eigen


def decomposed(operator: Any) -> Any:
    """`operator` holding its eigendecompositions: what its solves and spectra take."""
    if operator.eigen is not None:
        return operator
    eigen = decomposition(operator)
    return eqx.tree_at(lambda op: op.eigen, operator, eigen, is_leaf=lambda node: node is None)


def _rotated(operator: Any, pieces: list, spectrum: Any) -> list:
    """`Q spectrum(E) Q^T v` block by block, `E` the eigenvalues in the basis `Q`, for
    `v` given and returned as the variables' leaves."""
    out = []
    for k, matrix in enumerate(operator._leaf_matrices(pieces)):
        q_b, q_a = operator.gradient_bases[k], operator.input_bases[k]
        out.append(q_b @ (spectrum(k) * (q_b.T @ matrix @ q_a)) @ q_a.T)
    return operator._leaf_pieces(out)


@eqx.filter_jit
def products(operator: Any, pieces: list) -> list:
    """The product with a vector given and returned as the variables' leaves."""
    if operator.corrected:
        return _rotated(operator, pieces, lambda k: operator.eigenvalues[k])
    matrices = operator._leaf_matrices(pieces)
    factors = zip(matrices, operator.input_factors, operator.gradient_factors, strict=True)
    return operator._leaf_pieces([b @ matrix @ a for matrix, a, b in factors])


def _flat(operation: Any, operator: Any, vector: jax.Array) -> jax.Array:
    """`operation` of the leaves, on a flat vector."""
    layout = operator.layout
    return layout.join(operation(layout.split(vector)), operator.dtype)


@eqx.filter_jit
def dense(operator: Any) -> jax.Array:
    identity = jnp.eye(operator._size, dtype=operator.dtype)
    one = lambda vector: _flat(lambda p: products(operator, p), operator, vector)  # noqa: E731
    return jax.vmap(one)(identity).T


@eqx.filter_jit
def diagonal(operator: Any) -> jax.Array:
    out = []
    for q_b, q_a, values in zip(
        operator.gradient_bases, operator.input_bases, operator.eigenvalues, strict=True
    ):
        out.append((q_b * q_b) @ values @ (q_a * q_a).T)
    return operator.layout.join(operator._leaf_pieces(out), operator.dtype)


@eqx.filter_jit
def least(operator: Any) -> jax.Array:
    smallest = [jnp.min(values) for values in operator.eigenvalues if values.size]
    return jnp.min(jnp.stack(smallest)) if smallest else jnp.asarray(jnp.inf, operator.dtype)


@eqx.filter_jit
def solve(operator: Any, b: Any, damping: jax.Array) -> Any:
    """The damped solve of `b`: the variables' leaves (a list), or a flat `(n,)` or
    `(n, k)` array."""

    def leaves(pieces: list) -> list:
        return _rotated(operator, pieces, lambda k: 1 / (operator.eigenvalues[k] + damping))

    if isinstance(b, list):
        return leaves(b)
    one = lambda vector: _flat(leaves, operator, vector)  # noqa: E731
    return one(b) if b.ndim == 1 else jax.vmap(one, in_axes=1, out_axes=1)(b)


@eqx.filter_jit
def logdet(operator: Any, damping: jax.Array) -> jax.Array:
    logs = [jnp.sum(jnp.log(values + damping)) for values in operator.eigenvalues]
    return sum(logs, jnp.zeros((), operator.dtype))
