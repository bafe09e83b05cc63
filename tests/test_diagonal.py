"""`zm.diagonal` and `zm.trace`: exact from blocks of unit vectors, against the diagonal of
JAX's dense matrices, and stochastic, checked statistically."""

import functools
import re

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import as_tree, close, mixed_hessian, mixed_loss as loss, mixed_point as point, raveled
from hypothesis import given, strategies as st

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")


def spd(n, spectrum, seed=0):
    """A symmetric matrix with eigenvalues `spectrum` in a random basis, as NumPy."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return (q * np.asarray(spectrum)) @ q.T


# -- exact --------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"nbatches": 3}, {"batch_size": 4}])
def test_exact_diagonal_and_trace_of_a_hessian(options):
    params, data = point()
    H = mixed_hessian()
    op = zm.BatchedHessian(loss, **options).operator(params, data)
    close(zm.diagonal(op), np.diag(H))
    close(zm.trace(op), np.trace(H))
    close(zm.diagonal(op, pytree=True), as_tree(np.diag(H), params))


@pytest.mark.parametrize("batch_size", [1, 3, 4, 10])
def test_exact_diagonal_in_blocks_given_to_it(batch_size):
    params, data = point()
    op = zm.BatchedHessian(loss).operator(params, data)
    close(zm.diagonal(op, batch_size=batch_size), np.diag(mixed_hessian()))


def test_exact_diagonal_of_a_ggn_and_of_a_dataset():
    params, data = point()

    def predict(params, targets):
        return jnp.concatenate([jnp.tanh(data @ params["w"]) * params["b"], params["m"][0]])

    fn, flat = raveled(predict, params, None)
    J = np.asarray(jax.jit(jax.jacfwd(fn))(flat))
    G = J.T @ J
    ggn = zm.BatchedGGN(predict, zm.losses.SquaredError(), batch_size=4)
    targets = jnp.zeros(7)
    close(zm.diagonal(ggn.operator(params, targets)), np.diag(G))
    close(zm.trace(ggn.operator(params, targets)), np.trace(G))

    def rows_loss(params, rows):  # a sum over rows: the dataset's is the microbatches' sum
        return jnp.sum(jnp.cosh(rows @ params["w"] * params["b"] + jnp.sum(params["m"])))

    summed = zm.Microbatcher(
        zm.BatchedHessian(rows_loss), microbatch_size=3, argnums=(1,), accumulator="sum"
    )
    fn, flat = raveled(rows_loss, params, data)
    close(zm.diagonal(summed.operator(params, data)), np.diag(jax.jit(jax.hessian(fn))(flat)))


def test_exact_diagonal_of_lineax_operators_real_and_complex():
    A = spd(6, np.arange(1.0, 7.0))
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.symmetric_tag)
    close(zm.diagonal(op), np.diag(A))
    C = A + 1j * np.random.default_rng(1).normal(size=(6, 6))
    close(zm.diagonal(lx.MatrixLinearOperator(jnp.asarray(C))), np.diag(C))
    close(zm.trace(lx.MatrixLinearOperator(jnp.asarray(C)), batch_size=4), np.trace(C))


def test_exact_diagonal_keeps_float32_and_runs_under_jit():
    params, data = point(jnp.float32)

    @jax.jit
    def diagonal(params, data):
        return zm.diagonal(zm.BatchedHessian(loss, batch_size=4).operator(params, data))

    result = diagonal(params, data)
    assert result.dtype == jnp.float32
    close(result, np.diag(mixed_hessian()).astype(np.float32), rtol=1e-4, atol=1e-4)


def test_exact_diagonal_with_a_budget():
    params, data = point()
    op = zm.BatchedHessian(loss, max_memory="2kB").operator(params, data)
    close(zm.diagonal(op), np.diag(mixed_hessian()))
    close(zm.diagonal(op, max_memory="3kB"), np.diag(mixed_hessian()))


def test_exact_diagonal_draws_a_progress_bar(capfd):
    params, data = point()
    op = zm.BatchedHessian(loss).operator(params, data)
    close(zm.diagonal(op, batch_size=4, progress=True), np.diag(mixed_hessian()))
    assert "zm.diagonal unit vectors" in capfd.readouterr().err


# -- stochastic ---------------------------------------------------------------------------


def test_stochastic_estimates_are_unbiased_within_their_errors():
    """Over 100 seeds: the mean estimate lies within 4 pooled standard errors of the
    truth (a false alarm about once in 16,000 runs for a normal mean), and each seed's
    interval of 2 standard errors holds the truth at least 80% of the time (about 94.5%
    expected with 30 probes: 80% or less has a probability below 1e-9)."""
    A = spd(12, np.linspace(-1.0, 5.0, 12), seed=3)
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.symmetric_tag)
    keys = [jax.random.key(seed) for seed in range(100)]
    for method, estimator, truth in [
        ("hutchinson", zm.trace, np.trace(A)),
        ("hutchinson", zm.diagonal, np.diag(A)),
    ]:
        estimates, errors = zip(
            *[estimator(op, method=method, num_probes=30, key=key) for key in keys],
            strict=True,
        )
        estimates, errors = np.asarray(estimates), np.asarray(errors)
        pooled = np.sqrt(np.sum(errors**2, axis=0)) / len(keys)
        assert np.all(np.abs(estimates.mean(axis=0) - truth) <= 4 * pooled)
        covered = np.mean(np.abs(estimates - truth) <= 2 * errors, axis=0)
        assert np.all(covered >= 0.8), covered


def near_identity(dtype, n=40, seed=0):
    """`100 I + 0.01 S`, `S` symmetric random signs off the diagonal: a large trace and
    diagonal beside a small spread of Hutchinson's samples, as NumPy in `dtype`."""
    signs = np.triu(np.random.default_rng(seed).choice([-1.0, 1.0], size=(n, n)), 1)
    return (100 * np.eye(n) + 0.01 * (signs + signs.T)).astype(dtype)


def coverage(estimator, operator, truth, num_keys=200, **options):
    """How often `estimator`'s interval of 2 standard errors holds `truth`, over keys
    `0, ..., num_keys - 1` (entry by entry), and the standard errors."""
    estimates, errors = zip(
        *[
            estimator(operator, num_probes=30, key=jax.random.key(seed), **options)
            for seed in range(num_keys)
        ],
        strict=True,
    )
    estimates, errors = np.asarray(estimates), np.asarray(errors)
    return np.mean(np.abs(estimates - truth) <= 2 * errors, axis=0), errors


# With 30 probes an interval of 2 standard errors holds the truth with probability
# about 0.945 (Student's t, 29 degrees of freedom); over 200 keys a coverage below 88%
# has a probability of about 1e-4, and below 85% in any of 40 entries, below 1e-5.


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_standard_errors_of_a_large_trace_beside_a_small_spread(dtype, jit):
    A = near_identity(dtype)
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.symmetric_tag)
    trace = functools.partial(zm.trace, method="hutchinson")
    if jit:  # the statistics traced, not finished on the host
        trace = jax.jit(trace, static_argnames="num_probes")
    covered, errors = coverage(trace, op, np.trace(A.astype(np.float64)))
    assert errors.dtype == dtype and np.all(errors > 0), np.sum(errors == 0)
    assert covered >= 0.88, covered


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_standard_errors_of_a_large_diagonal_beside_a_small_spread(dtype):
    A = near_identity(dtype)
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.symmetric_tag)
    covered, errors = coverage(zm.diagonal, op, np.diag(A.astype(np.float64)), method="hutchinson")
    assert errors.dtype == dtype and np.all(errors > 0), np.sum(errors == 0)
    assert np.mean(covered) >= 0.88 and np.all(covered >= 0.85), covered


def test_standard_errors_of_a_float32_hessian_near_a_multiple_of_the_identity():
    couplings = jnp.asarray(near_identity(np.float32, n=20) - 100 * np.eye(20, dtype=np.float32))

    def loss(w):  # its Hessian is 100 I plus the couplings
        return 50 * jnp.sum(w**2) + 0.5 * w @ couplings @ w

    op = zm.BatchedHessian(loss).operator(jnp.ones(20, jnp.float32))
    covered, errors = coverage(zm.trace, op, 2000.0, method="hutchinson")
    assert errors.dtype == np.float32 and np.all(errors > 0), np.sum(errors == 0)
    assert covered >= 0.88, covered
    _, errors = coverage(zm.diagonal, op, 100.0, num_keys=20, method="diag++")
    assert np.all(errors > 0), np.sum(errors == 0)


def test_sketched_estimates_are_exact_when_the_sketch_spans_the_matrix():
    # 3 * 10 probes sketch 10 directions of a rank-10 matrix: what is left is zero.
    params, data = point()
    op = zm.BatchedHessian(loss, batch_size=4).operator(params, data)
    H = mixed_hessian()
    estimate, error = zm.trace(op, method="hutch++", num_probes=30, key=jax.random.key(0))
    close(estimate, np.trace(H), rtol=1e-9)
    assert error < 1e-8
    estimate, error = zm.diagonal(
        op, method="diag++", num_probes=31, key=jax.random.key(0), pytree=True
    )
    close(estimate, as_tree(np.diag(H), params), rtol=1e-9, atol=1e-9)


def test_sketched_estimates_beat_hutchinson_on_a_dominated_spectrum():
    # A few large eigenvalues dominate, as in a network's curvature.
    spectrum = np.concatenate([[100.0, 50.0, 20.0], np.full(37, 0.1)])
    A = spd(40, spectrum, seed=5)
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.symmetric_tag)
    key = jax.random.key(7)
    plain_trace = zm.trace(op, method="hutchinson", num_probes=24, key=key)
    sketched_trace = zm.trace(op, method="hutch++", num_probes=24, key=key)
    assert sketched_trace[1] < plain_trace[1] / 10
    assert abs(sketched_trace[0] - np.trace(A)) < 4 * sketched_trace[1]
    plain = zm.diagonal(op, method="hutchinson", num_probes=24, key=key)
    sketched = zm.diagonal(op, method="diag++", num_probes=24, key=key)
    assert np.linalg.norm(sketched[0] - np.diag(A)) < np.linalg.norm(plain[0] - np.diag(A)) / 5


@pytest.mark.parametrize("batch_size", [1, 7, 30])
def test_a_probe_does_not_depend_on_the_blocks(batch_size):
    params, data = point()
    op = zm.BatchedHessian(loss).operator(params, data)
    key = jax.random.key(2)
    reference = zm.trace(op, method="hutchinson", num_probes=30, key=key, batch_size=30)
    close(
        zm.trace(op, method="hutchinson", num_probes=30, key=key, batch_size=batch_size),
        reference,
        rtol=1e-12,
    )


def test_stochastic_estimates_keep_float32_and_run_under_jit():
    params, data = point(jnp.float32)

    @jax.jit
    def estimate(params, data, key):
        op = zm.BatchedHessian(loss).operator(params, data)
        return zm.trace(op, method="hutch++", num_probes=12, key=key), zm.diagonal(
            op, method="hutchinson", num_probes=8, key=key, pytree=True
        )

    (trace, error), (diagonal, _) = estimate(params, data, jax.random.key(0))
    assert trace.dtype == error.dtype == jnp.float32
    assert diagonal["w"].dtype == jnp.float32 and diagonal["n"] is None
    assert abs(float(trace) - np.trace(mixed_hessian())) < 5 * float(error) + 1e-3


# -- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda op: zm.diagonal(op, method="xdiag"), ValueError, "`method` must be one of"),
        (lambda op: zm.trace(op, method="hutchinson", num_probes=4), TypeError, "needs a key"),
        (
            lambda op: zm.trace(op, method="hutchinson", key=jax.random.key(0)),
            TypeError,
            "needs `num_probes`",
        ),
        (
            lambda op: zm.trace(op, method="hutch++", num_probes=3, key=jax.random.key(0)),
            ValueError,
            "`num_probes` must be an int >= 4",
        ),
        (
            lambda op: zm.diagonal(op, method="hutchinson", num_probes=4, key=0),
            TypeError,
            "`key` must be a JAX random key",
        ),
        (
            lambda op: zm.diagonal(op, batch_size=2, max_memory="1MB"),
            ValueError,
            "at most one of `batch_size`",
        ),
        (lambda op: zm.diagonal(op, batch_size=0), ValueError, "`batch_size` must be"),
        (lambda op: zm.diagonal(op, max_memory="lots"), ValueError, "`max_memory` must be"),
        (
            lambda op: zm.diagonal(op, sharding="devices"),
            TypeError,
            "`sharding` must be a jax.sharding.NamedSharding",
        ),
        (lambda op: zm.trace(np.eye(3)), TypeError, "must be a linear operator"),
    ],
)
def test_refusals(call, error, message):
    params, data = point()
    op = zm.BatchedHessian(loss).operator(params, data)
    with pytest.raises(error, match=re.escape(message)):
        call(op)


def test_refusals_of_operators():
    params, _ = point()
    jacobian = zm.BatchedJacobian(lambda p: p["w"][:2] * p["b"]).operator(params)
    with pytest.raises(ValueError, match="must be square"):
        zm.diagonal(jacobian)
    complex_op = lx.MatrixLinearOperator(jnp.eye(3, dtype=jnp.complex128))
    with pytest.raises(TypeError, match="real operator"):
        zm.trace(complex_op, method="hutchinson", num_probes=4, key=jax.random.key(0))
    skew = lx.MatrixLinearOperator(jnp.asarray(np.triu(np.ones((4, 4)))))
    with pytest.raises(ValueError, match="needs a symmetric operator"):
        zm.diagonal(skew, method="diag++", num_probes=6, key=jax.random.key(0))


@given(n=st.integers(2, 9), batch_size=st.integers(1, 11), seed=st.integers(0, 3))
def test_exact_diagonal_sweep(n, batch_size, seed):
    A = np.random.default_rng(seed).normal(size=(n, n))
    op = lx.MatrixLinearOperator(jnp.asarray(A))
    close(zm.diagonal(op, batch_size=batch_size), np.diag(A))
    close(zm.trace(op, batch_size=batch_size), np.trace(A))
