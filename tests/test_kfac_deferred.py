"""KFAC's operator holds its factors only: the factors' eigendecompositions, which its
products with the factors do not need, are taken when a solve, a log-determinant, a
diagonal or a spectrum first asks for them, once for a concrete operator, and under a
trace in the traced program."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from kfac_functions import predict

import zodmem as zm


def operator():
    model = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    inputs = jax.random.normal(jax.random.key(1), (12, 4))
    return zm.KFAC(predict, zm.losses.SoftmaxCrossEntropy())(model, inputs, jnp.arange(12) % 3)


def test_the_eigendecompositions_are_taken_on_first_use_and_kept():
    F = operator()
    assert F.eigen is None  # built without them
    v = jnp.ones(F.in_structure().shape)
    traced = jax.jit(lambda damping: F.solve(v, damping=damping))(0.1)  # none kept from it
    first = F.eigenvalues
    assert all(a is b for a, b in zip(first, F.eigenvalues, strict=True))  # taken once
    np.testing.assert_allclose(F.solve(v, damping=0.1), traced, rtol=1e-5)
    np.testing.assert_allclose(
        F.mv(F.solve(v, damping=0.1)) + 0.1 * F.solve(v, damping=0.1), v, rtol=1e-3
    )
    dense = F.as_matrix() + 0.1 * jnp.eye(v.size)
    np.testing.assert_allclose(F.logdet(damping=0.1), jnp.linalg.slogdet(dense)[1], rtol=1e-4)
    np.testing.assert_allclose(F.diagonal(), jnp.diag(F.as_matrix()), atol=1e-5)


def test_an_operator_built_under_jit_takes_them_in_the_traced_program():
    @jax.jit
    def logdet_of_built():
        return operator().logdet(damping=0.1)

    np.testing.assert_allclose(logdet_of_built(), operator().logdet(damping=0.1), rtol=1e-5)
