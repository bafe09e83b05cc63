"""The compiled operations of `KroneckerFactored`: each is one program of the whole
operator (its blocks' matrix products), not many small ones."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

__all__ = ["dense", "diagonal", "least", "logdet", "products", "solve"]


def _rotated(operator: Any, vector: jax.Array, spectrum: Any) -> jax.Array:
    """`Q spectrum(E) Q^T vector` block by block, `E` the eigenvalues in the basis `Q`."""
    out = []
    for k, matrix in enumerate(operator._matrices(vector)):
        q_b, q_a = operator.gradient_bases[k], operator.input_bases[k]
        out.append(q_b @ (spectrum(k) * (q_b.T @ matrix @ q_a)) @ q_a.T)
    return operator._vector(out)


@eqx.filter_jit
def products(operator: Any, vector: jax.Array) -> jax.Array:
    if operator.corrected:
        return _rotated(operator, vector, lambda k: operator.eigenvalues[k])
    matrices = operator._matrices(vector)
    factors = zip(matrices, operator.input_factors, operator.gradient_factors, strict=True)
    return operator._vector([b @ matrix @ a for matrix, a, b in factors])


@eqx.filter_jit
def dense(operator: Any) -> jax.Array:
    identity = jnp.eye(operator._size, dtype=operator.dtype)
    return jax.vmap(lambda vector: products(operator, vector))(identity).T


@eqx.filter_jit
def diagonal(operator: Any) -> jax.Array:
    out = []
    for q_b, q_a, values in zip(
        operator.gradient_bases, operator.input_bases, operator.eigenvalues, strict=True
    ):
        out.append((q_b * q_b) @ values @ (q_a * q_a).T)
    return operator._vector(out)


@eqx.filter_jit
def least(operator: Any) -> jax.Array:
    smallest = [jnp.min(values) for values in operator.eigenvalues if values.size]
    return jnp.min(jnp.stack(smallest)) if smallest else jnp.asarray(jnp.inf, operator.dtype)


@eqx.filter_jit
def solve(operator: Any, b: jax.Array, damping: jax.Array) -> jax.Array:
    def one(vector: jax.Array) -> jax.Array:
        return _rotated(operator, vector, lambda k: 1 / (operator.eigenvalues[k] + damping))

    return one(b) if b.ndim == 1 else jax.vmap(one, in_axes=1, out_axes=1)(b)


@eqx.filter_jit
def logdet(operator: Any, damping: jax.Array) -> jax.Array:
    logs = [jnp.sum(jnp.log(values + damping)) for values in operator.eigenvalues]
    return sum(logs, jnp.zeros((), operator.dtype))
