"""`zm.approximation_error`: its eigenvalue errors measured against the spectrum's scale."""

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest

import zodmem as zm


@pytest.mark.parametrize("x64", [False, True])
def test_eigenvalue_errors_are_relative_to_the_largest_eigenvalue(x64, request):
    if x64:
        request.getfixturevalue("float64")
    dtype = jnp.float64 if x64 else jnp.float32
    # Rank 2 of size 6: the third largest eigenvalue is zero, found as a rounding error.
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(6, 6)))
    matrix = jnp.asarray(q[:, :2] @ np.diag([3.0, 1.0]) @ q[:, :2].T, dtype)
    A = lx.MatrixLinearOperator(matrix, lx.symmetric_tag)
    error = zm.approximation_error(A, A, key=jax.random.key(0), k=3)
    eps = float(jnp.finfo(dtype).eps)
    assert error.eigenvalues.dtype == dtype
    assert np.all(np.asarray(error.eigenvalues) < 100 * eps), error.eigenvalues
    # Against another operator: each eigenvalue's error over the largest, 3.
    other = lx.MatrixLinearOperator(matrix * 0.5, lx.symmetric_tag)
    error = zm.approximation_error(other, A, key=jax.random.key(0), k=2)
    np.testing.assert_allclose(error.eigenvalues, [1.5 / 3, 0.5 / 3], rtol=1e-4)
