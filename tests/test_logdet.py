"""Traces of matrix functions by stochastic Lanczos quadrature: `zm.trace_function` and
`zm.logdet` against dense eigendecompositions and `numpy.linalg.slogdet`."""

import functools

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import zodmem as zm
from zodmem._estimators._random import sign_probes

pytestmark = pytest.mark.usefixtures("float64")

FUNCTIONS = {"log": np.log, "inv": np.reciprocal, "sqrt": np.sqrt}
# The options of most tests, on matrices of size 16: one compiled program each.
EXACT = dict(num_probes=10, num_steps=16)  # as many steps as the size
PARTIAL = dict(num_probes=10, num_steps=8)


def spd(n, condition, seed=0, dtype=np.float64):
    """A random symmetric positive definite matrix with eigenvalues spread
    geometrically from 1 to `condition`."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    eigenvalues = np.geomspace(1.0, condition, n)
    return jnp.asarray((q * eigenvalues) @ q.T, dtype)


def operator(matrix):
    return lx.MatrixLinearOperator(matrix, lx.symmetric_tag)


def dense(matrix, function):
    """`f(A)` from the eigendecomposition, in double precision."""
    eigenvalues, vectors = np.linalg.eigh(np.asarray(matrix, np.float64))
    return (vectors * function(eigenvalues)) @ vectors.T


# The estimator's own sign probes, one compiled program per size and number of probes.
_probes = jax.jit(sign_probes, static_argnums=(2, 3))


def hutchinson(matrix, function, key, num_probes):
    """The samples `g^T f(A) g` of the estimator's own sign probes, computed densely."""
    n = matrix.shape[0]
    probes = np.asarray(_probes(key, np.arange(num_probes), n, jnp.float64))
    return np.einsum("pi,ij,pj->p", probes, dense(matrix, function), probes)


@pytest.mark.parametrize("name", ["log", "inv", "sqrt", "callable"])
def test_as_many_steps_as_the_size_give_hutchinson_exactly(name):
    # With n steps each probe's rule is exact: its sample is g^T f(A) g itself, so the
    # estimate and its error are the mean and standard error of those samples.
    matrix, key = spd(16, 50.0, seed=1), jax.random.key(3)
    function, reference = (jnp.expm1, np.expm1) if name == "callable" else (name, FUNCTIONS[name])
    estimate, error = zm.trace_function(operator(matrix), function, **EXACT, key=key)
    samples = hutchinson(matrix, reference, key, 10)
    assert estimate.dtype == error.dtype == jnp.float64
    np.testing.assert_allclose(estimate, samples.mean(), rtol=1e-8)
    np.testing.assert_allclose(error, samples.std(ddof=1) / np.sqrt(10), rtol=1e-7)


def test_logdet_is_trace_function_of_log():
    op, key = operator(spd(16, 50.0, seed=1)), jax.random.key(3)
    np.testing.assert_array_equal(
        zm.logdet(op, **PARTIAL, key=key), zm.trace_function(op, "log", **PARTIAL, key=key)
    )


def coverage(matrix, exact, steps, *, damping=0.0, function="log", width=3.0, seeds=100):
    """Of `seeds` seeds, how many estimates of 10 probes lie within `width` reported
    errors of `exact`."""

    @jax.jit
    def estimate(key):
        return zm.trace_function(
            operator(matrix), function, num_probes=10, num_steps=steps, key=key, damping=damping
        )

    estimates, errors = np.array([estimate(jax.random.key(seed)) for seed in range(seeds)]).T
    assert np.all(errors > 0)
    return np.sum(np.abs(estimates - exact) <= width * errors)


# (n, condition, steps): a rule of `steps` nodes for log on eigenvalues in
# [1, condition] is far more accurate than the probes' spread, so the estimate's error
# is the probes' alone.
@pytest.mark.parametrize(
    ("n", "condition", "steps"), [(20, 10.0, 10), (40, 100.0, 20), (60, 1e3, 40)]
)
def test_logdet_is_within_three_standard_errors_for_most_seeds(n, condition, steps):
    # With 10 probes the standardised error is about Student's t with 9 degrees of
    # freedom, outside 3 with chance 0.015: 8 misses or more in 100 has chance below
    # 1e-3 (the false-alarm rate of each case).
    matrix = spd(n, condition, seed=n)
    assert coverage(matrix, np.linalg.slogdet(np.asarray(matrix))[1], steps) >= 93


def geometric_diagonal(dtype):
    """`diag(geomspace(1e-3, 1e3, 500))`: every sign probe gives the same Lanczos run,
    so the probes' spread is nil and the quadrature's error is the whole error."""
    return jnp.asarray(np.diag(np.geomspace(1e-3, 1e3, 500)), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", ["log", "inv", "sqrt"])
def test_the_error_bounds_the_quadrature_where_it_is_the_whole_error(dtype, name):
    # Deterministic: the Gauss and Gauss-Radau rules bracket each probe's quadratic form,
    # and the probes agree, so the truth lies within one reported error (no false alarm).
    matrix = geometric_diagonal(dtype)
    eigenvalues = np.geomspace(1e-3, 1e3, 500)
    for damping in (1e-3, 1.0):
        exact = np.sum(FUNCTIONS[name](eigenvalues + damping))
        estimate, error = zm.trace_function(
            operator(matrix), name, num_probes=4, key=jax.random.key(0), damping=damping
        )
        assert estimate.dtype == error.dtype == dtype
        assert abs(float(estimate) - exact) <= float(error), (damping, estimate, error, exact)
    # With more steps the bracket narrows, and the estimate with it.
    wide = zm.trace_function(
        operator(matrix), name, num_probes=4, key=jax.random.key(0), damping=1.0, num_steps=10
    )[1]
    assert float(error) < float(wide)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_an_unbounded_quadrature_is_refused(dtype):
    # The undamped diagonal: 30 steps leave its smallest Ritz value far from converged
    # (its residual is larger than it), so nothing bounds the spectrum away from zero,
    # and the Gauss rule alone is far above the log-determinant, 0.
    op = operator(geometric_diagonal(dtype))
    message = r"zm\.logdet: for the operator plus damping .*no positive lower bound of its spectrum"
    with pytest.raises(ValueError, match=message):
        zm.logdet(op, num_probes=4, key=jax.random.key(0))
    with pytest.raises(RuntimeError, match=message.replace(" .*", ".*")):
        jax.block_until_ready(
            jax.jit(lambda m: zm.logdet(operator(m), num_probes=4, key=jax.random.key(0)))(
                op.matrix
            )
        )
    # sqrt is bounded at zero: a positive semi-definite spectrum needs no more.
    estimate, error = zm.trace_function(op, "sqrt", num_probes=4, key=jax.random.key(0))
    exact = np.sum(np.sqrt(np.geomspace(1e-3, 1e3, 500)))
    assert abs(float(estimate) - exact) <= float(error)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_an_unfound_negative_eigenvalue_is_refused(dtype):
    # -0.05 below a spectrum reaching down to 1e-3: 8 steps find no Ritz value below
    # zero, and every probe gives the same rule (no spread), but the smallest Ritz value
    # is within its residual of zero, so nothing bounds the spectrum above zero.
    spectrum = np.concatenate([[-0.05], np.geomspace(1e-3, 1e3, 499)])
    matrix = jnp.asarray(np.diag(spectrum), dtype)
    for run in (
        lambda m: zm.logdet(operator(m), num_probes=4, num_steps=8, key=jax.random.key(0)),
        lambda m: zm.trace_function(
            operator(m), "inv", num_probes=4, num_steps=8, key=jax.random.key(0)
        ),
    ):
        with pytest.raises(ValueError, match=r"no positive lower bound of its spectrum"):
            run(matrix)
        with pytest.raises(RuntimeError, match=r"no positive lower bound of its spectrum"):
            jax.block_until_ready(jax.jit(run)(matrix))


def rotated(eigenvalues, seed, dtype):
    """`Q diag(eigenvalues) Q^T` for a random orthogonal `Q`: a dense matrix."""
    n = len(eigenvalues)
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return jnp.asarray((q * eigenvalues) @ q.T, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize(
    ("name", "damping", "steps"), [("log", 1e-3, 20), ("inv", 1e-2, 20), ("sqrt", 0.0, 12)]
)
def test_a_wide_spectrum_is_covered_at_the_stated_rate(name, damping, steps, dtype):
    # Eigenvalues over six decades: for log and inv these steps leave a quadrature error
    # larger than the probes' spread. The reported error adds the bound on it to the
    # standard error, so a miss of 3 errors needs the probes' mean to miss by 3 standard
    # errors (Student's t with 9 degrees of freedom: chance 0.015): 8 misses or more in
    # 100 seeds has chance below 1e-3, the test's false-alarm rate.
    eigenvalues = np.geomspace(1e-4, 1e2, 80)
    matrix = rotated(eigenvalues, 3, dtype)
    exact = np.sum(FUNCTIONS[name](eigenvalues + damping))
    assert coverage(matrix, exact, steps, damping=damping, function=name) >= 93


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_a_near_indefinite_operator_is_refused_or_covered(dtype):
    # One eigenvalue of 1e-6 below a bulk in [0.5, 5]: undamped, its Ritz value converges
    # but not within its residual of zero, so the run is refused; damped by 1e-4, the
    # estimate is covered as above (false-alarm rate below 1e-3).
    eigenvalues = np.concatenate([[1e-6], np.linspace(0.5, 5.0, 59)])
    matrix = rotated(eigenvalues, 4, dtype)
    with pytest.raises(ValueError, match=r"no positive lower bound of its spectrum"):
        zm.logdet(operator(matrix), num_probes=10, num_steps=12, key=jax.random.key(0))
    exact = np.sum(np.log(eigenvalues + 1e-4))
    assert coverage(matrix, exact, 12, damping=1e-4) >= 93


@pytest.mark.parametrize("name", ["inv", "sqrt"])
def test_traces_of_the_inverse_and_square_root_against_eigh(name):
    matrix = spd(30, 20.0, seed=4)
    exact = np.trace(dense(matrix, FUNCTIONS[name]))
    estimate, error = map(
        float,
        zm.trace_function(
            operator(matrix), name, num_probes=40, num_steps=15, key=jax.random.key(5)
        ),
    )
    # One seed, 3 standard errors: a false alarm has chance about 0.005.
    assert abs(estimate - exact) <= 3 * error
    assert error < 0.05 * abs(exact)


def test_damping_adds_a_multiple_of_the_identity():
    # A singular positive semi-definite matrix: its log-determinant is -inf, that of
    # A + 0.5 I finite.
    rows = np.random.default_rng(6).normal(size=(5, 16))
    matrix = jnp.asarray(rows.T @ rows)
    op, key = operator(matrix), jax.random.key(7)
    estimate, error = zm.logdet(op, **EXACT, key=key, damping=0.5)
    damped = rows.T @ rows + 0.5 * np.eye(16)
    samples = hutchinson(damped, np.log, key, 10)
    np.testing.assert_allclose(estimate, samples.mean(), rtol=1e-8)
    np.testing.assert_allclose(error, samples.std(ddof=1) / np.sqrt(10), rtol=1e-7)
    exact = np.linalg.slogdet(damped)[1]
    assert abs(float(estimate) - exact) <= 3 * float(error)
    # Traced, as a hyperparameter under jit.
    traced = jax.jit(lambda damping: zm.logdet(op, **EXACT, key=key, damping=damping))(
        jnp.asarray(0.5)
    )
    np.testing.assert_allclose(traced, (estimate, error), rtol=1e-10)


def test_logdet_of_a_convex_loss_hessian():
    data = np.random.default_rng(8).normal(size=(30, 10))
    labels = np.sign(np.random.default_rng(9).normal(size=30))

    def loss(w, data, labels):
        # Logistic regression with a Gaussian prior: strictly convex.
        return jnp.sum(jax.nn.softplus(-labels * (data @ w))) + 0.5 * jnp.sum(w**2)

    w = jnp.asarray(np.linspace(-0.5, 0.5, 10))
    data, labels = jnp.asarray(data), jnp.asarray(labels)
    op = zm.BatchedHessian(loss).operator(w, data, labels)
    hessian = jax.jit(jax.hessian(loss))(w, data, labels)
    key = jax.random.key(10)
    estimate, error = zm.logdet(op, num_probes=20, num_steps=10, key=key)
    samples = hutchinson(hessian, np.log, key, 20)
    np.testing.assert_allclose(estimate, samples.mean(), rtol=1e-8)
    exact = np.linalg.slogdet(np.asarray(hessian))[1]
    assert abs(float(estimate) - exact) <= 3 * float(error)


def test_under_jit_equals_eager():
    matrix, key = spd(16, 30.0, seed=11), jax.random.key(12)

    @jax.jit
    def traced(matrix, key):
        return zm.logdet(operator(matrix), **PARTIAL, key=key)

    eager = zm.logdet(operator(matrix), **PARTIAL, key=key)
    np.testing.assert_allclose(traced(matrix, key), eager, rtol=1e-10)


@pytest.mark.parametrize("batch_size", [2, 4])  # one divides the 10 probes, one does not
def test_blocks_do_not_change_the_estimate(batch_size):
    op, key = operator(spd(16, 30.0, seed=13)), jax.random.key(14)
    whole = zm.logdet(op, **PARTIAL, key=key)
    blocked = zm.logdet(op, **PARTIAL, key=key, batch_size=batch_size)
    np.testing.assert_allclose(blocked, whole, rtol=1e-10)


def test_a_budget_a_bar_and_a_sharding(capfd):
    op, key = operator(spd(16, 30.0, seed=13)), jax.random.key(14)
    options = dict(PARTIAL, key=key)
    whole = zm.logdet(op, **options)
    planned = zm.logdet(op, **options, max_memory="8kB", progress=True)
    np.testing.assert_allclose(planned, whole, rtol=1e-10)
    # The budget holds a few probes' bases at a time: several blocks.
    bar = capfd.readouterr().err
    assert "zm.logdet probes" in bar and "1/1" not in bar
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("d",)), PartitionSpec("d"))
    np.testing.assert_allclose(zm.logdet(op, **options, sharding=sharding), whole, rtol=1e-10)


def test_dtypes_follow_the_operator():
    matrix, key = spd(16, 30.0, seed=15), jax.random.key(16)
    matrix32 = jnp.asarray(matrix, jnp.float32)
    wide = zm.logdet(operator(matrix), **PARTIAL, key=key)
    narrow = zm.logdet(operator(matrix32), **PARTIAL, key=key)
    assert [x.dtype for x in wide] == [jnp.float64] * 2
    assert [x.dtype for x in narrow] == [jnp.float32] * 2
    np.testing.assert_allclose(narrow, wide, rtol=1e-4)
    # A callable's values in another dtype come back in the operator's.
    cast = zm.trace_function(
        operator(matrix32),
        lambda x: x.astype(jnp.float64),
        **PARTIAL,
        key=key,
    )
    assert [x.dtype for x in cast] == [jnp.float32] * 2


def test_an_indefinite_operator_is_refused():
    matrix = jnp.asarray(np.diag(np.linspace(-1.0, 2.0, 16)))
    options = dict(EXACT, key=jax.random.key(0))
    for name in ("log", "inv", "sqrt"):
        with pytest.raises(ValueError, match=rf"zm.trace_function: .*{name}.* positive definite"):
            zm.trace_function(operator(matrix), name, **options)
    with pytest.raises(
        ValueError, match=r"zm.logdet: .* Ritz value is -1\. log det needs .*`damping`"
    ):
        zm.logdet(operator(matrix), **options)
    # Enough damping makes it definite; a callable takes any operator.
    assert np.isfinite(zm.logdet(operator(matrix), damping=1.5, **options)[0])
    estimate, _ = zm.trace_function(operator(matrix), lambda x: x**2, **options)
    np.testing.assert_allclose(estimate, np.sum(np.linspace(-1.0, 2.0, 16) ** 2), rtol=1e-10)
    # Under jit the same message is raised when the program runs.
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"zm.logdet: .* positive definite"):
        jax.jit(lambda m: zm.logdet(operator(m), **options))(matrix)


def test_refusals():
    op, key = operator(spd(16, 3.0)), jax.random.key(0)
    run = functools.partial(zm.trace_function, op, "log", **PARTIAL, key=key)
    with pytest.raises(
        ValueError, match=r"zm.trace_function: `num_probes` must be an int >= 2, got num_probes=1"
    ):
        run(num_probes=1)
    with pytest.raises(TypeError, match=r"`num_probes` must be an int >= 2, got 2.5"):
        run(num_probes=2.5)
    with pytest.raises(ValueError, match=r"`num_steps` must be a positive int, got num_steps=0"):
        run(num_steps=0)
    with pytest.raises(
        ValueError, match=r"`num_steps` must be at most the operator's size 16, got num_steps=17"
    ):
        run(num_steps=17)
    with pytest.raises(TypeError, match=r"`key` must be a JAX random key.*got None"):
        run(key=None)
    with pytest.raises(TypeError, match=r"`key` must be a JAX random key.*got 0 of type int"):
        run(key=0)
    with pytest.raises(
        ValueError, match=r"`function` must be one of 'log', 'inv', 'sqrt' or a callable; got 'exp'"
    ):
        zm.trace_function(op, "exp", **PARTIAL, key=key)
    with pytest.raises(
        TypeError,
        match=r"`function` must be one of 'log', 'inv', 'sqrt' or a callable; got 3 of type int",
    ):
        zm.trace_function(op, 3, **PARTIAL, key=key)
    with pytest.raises(
        ValueError,
        match=r"`function` must map the Ritz values elementwise.*shape \(10, 8\).*shape \(\)",
    ):
        zm.trace_function(op, jnp.sum, **PARTIAL, key=key)
    with pytest.raises(TypeError, match=r"zm.logdet: `damping` must be a real number, got 'a'"):
        zm.logdet(op, num_probes=4, key=key, damping="a")
    with pytest.raises(ValueError, match=r"`batch_size` \(probes per block\) and `max_memory`"):
        run(batch_size=2, max_memory="1GB")
    with pytest.raises(TypeError, match=r"zm.logdet: `operator` has the complex dtype complex128"):
        zm.logdet(operator(jnp.asarray(np.eye(4, dtype=np.complex128))), num_probes=4, key=key)
    with pytest.raises(ValueError, match=r"zm.logdet: `operator` must be symmetric"):
        zm.logdet(lx.MatrixLinearOperator(jnp.asarray(np.eye(4))), num_probes=4, key=key)
