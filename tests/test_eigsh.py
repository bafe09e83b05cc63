"""`eigsh`: the extreme eigenpairs of symmetric operators by Lanczos, against the
eigendecomposition of the dense matrix (`numpy.linalg.eigh`)."""

import functools

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import raveled
from hypothesis import given, strategies as st

import zodmem as zm
from zodmem._estimators._eigsh import EigshInfo, eigsh

pytestmark = pytest.mark.usefixtures("float64")

TOL = 1e-6


def symmetric(spectrum, seed=0):
    """`Q diag(spectrum) Q^T` for a random orthogonal `Q`, and `Q`."""
    n = len(spectrum)
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return q @ np.diag(spectrum) @ q.T, q


def operator_of(matrix):
    return lx.MatrixLinearOperator(jnp.asarray(matrix), lx.symmetric_tag)


def reference(matrix, k, which):
    values, vectors = np.linalg.eigh(matrix)
    picked = slice(-k, None) if which == "LA" else slice(0, k)
    return values[picked], vectors[:, picked]


def check_pairs(values, vectors, matrix, k, which, *, rtol=TOL, subspace=False):
    """Eigenvalues to `rtol` (relative to the largest), and eigenvectors up to sign (or
    the subspace they span, for a cluster) against the dense decomposition."""
    expected_values, expected_vectors = reference(np.asarray(matrix), k, which)
    values, vectors = np.asarray(values), np.asarray(vectors)
    assert values.shape == (k,) and vectors.shape == (len(matrix), k)
    scale = np.max(np.abs(np.linalg.eigvalsh(matrix)))
    np.testing.assert_allclose(values, expected_values, rtol=0, atol=rtol * scale)
    np.testing.assert_allclose(vectors.T @ vectors, np.eye(k), atol=1e-8)
    overlaps = expected_vectors.T @ vectors
    if subspace:
        # The cosines of the principal angles between the two subspaces are all ~1.
        np.testing.assert_allclose(np.linalg.svd(overlaps, compute_uv=False), 1, atol=1e-5)
    else:
        np.testing.assert_allclose(np.abs(np.diag(overlaps)), 1, atol=1e-5)


SEPARATED = np.concatenate([np.linspace(-1, 1, 34), [-9.0, -6.0, -4.0, 3.0, 5.0, 8.0]])


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_separated_spectrum(which):
    matrix, _ = symmetric(SEPARATED)
    values, vectors = eigsh(operator_of(matrix), 3, which=which)
    check_pairs(values, vectors, matrix, 3, which)


def test_clustered_spectrum():
    # The top 3 within 1e-4 of each other, well apart from the rest (the size and `k`
    # of the tests above: the same compiled program).
    spectrum = np.concatenate([np.linspace(0, 1, 37), [10.0, 10.0001, 10.0002]])
    matrix, _ = symmetric(spectrum, seed=1)
    values, vectors = eigsh(operator_of(matrix), 3)
    check_pairs(values, vectors, matrix, 3, "LA", subspace=True)


def test_repeated_eigenvalues_are_found_after_the_krylov_space_is_exhausted():
    # From one start vector, the Krylov space holds one vector per distinct eigenvalue
    # (3 here) and then breaks down; the run from a fresh direction finds the second
    # copy of the top one, and breaks down too, its largest Ritz value exact: a check
    # that finds nothing above the second copy.
    spectrum = jnp.asarray([1.0] * 10 + [2.0] * 5 + [5.0] * 5)
    values, vectors, info = eigsh(lx.DiagonalLinearOperator(spectrum), 2, return_info=True)
    np.testing.assert_allclose(values, [5.0, 5.0], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(vectors)[:15], 0, atol=1e-10)
    assert bool(info.converged) and int(info.num_products) <= 8


def cluster_at_the_top(gap, multiplicity, n=48):
    """A spectrum whose `multiplicity` largest eigenvalues are `gap` apart, at 10, with
    the rest in [0, 9.5]."""
    top = 10.0 + gap * np.arange(multiplicity)
    return np.concatenate([np.linspace(0.0, 9.5, n - multiplicity), top])


def check_right_or_flagged(matrix, k, which, key):
    """The pairs of a converged run are right: the eigenvalues to the tolerance against
    `eigh` (so none of a cluster is missing), orthonormal eigenvectors with residuals
    within the tolerance. Not converged is allowed, right or not; these are all expected
    to converge, so a run flagged here fails as well."""
    values, vectors, info = eigsh(operator_of(matrix), k, which=which, key=key, return_info=True)
    values, vectors = np.asarray(values), np.asarray(vectors)
    expected, _ = reference(matrix, k, which)
    scale = np.max(np.abs(np.linalg.eigvalsh(matrix)))
    assert bool(info.converged), (values, expected)
    np.testing.assert_allclose(values, expected, rtol=0, atol=TOL * scale)
    np.testing.assert_allclose(vectors.T @ vectors, np.eye(k), atol=1e-8)
    residuals = np.linalg.norm(matrix @ vectors - vectors * values, axis=0)
    assert np.all(residuals <= 1.01 * TOL * np.abs(values)), residuals / np.abs(values)
    return int(info.num_products)


@pytest.mark.parametrize("gap", [1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3])
@pytest.mark.parametrize("which", ["LA", "SA"])
def test_a_cluster_of_wanted_eigenvalues_is_found_whole(gap, which):
    # From one start vector, Lanczos resolves a cluster this tight slowly (and never an
    # exactly repeated eigenvalue): the residuals of the copies it found converge first.
    # For "SA" the spectrum is negated, the cluster at the bottom.
    sign = 1 if which == "LA" else -1
    for multiplicity, k in [(2, 2), (2, 3), (3, 3)]:
        matrix, _ = symmetric(sign * cluster_at_the_top(gap, multiplicity), seed=multiplicity)
        for seed in range(4):
            check_right_or_flagged(matrix, k, which, jax.random.key(seed))


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_under_vmap_over_keys_each_run_is_its_own(which):
    # Runs of a batch stop after different numbers of steps (a tight cluster is found
    # whole after a restart by some starts only), and the batch steps every run until
    # the last is done: the finished runs' steps must change nothing of theirs. Within
    # the cluster the eigenvectors are any basis of its space: they are checked by
    # their residuals, the eigenvalues against the same run alone.
    sign = 1 if which == "LA" else -1
    matrix, _ = symmetric(sign * cluster_at_the_top(1e-8, 3), seed=3)
    keys = jnp.stack([jax.random.key(seed) for seed in range(4)])
    run = jax.vmap(lambda key: zm.eigsh(operator_of(matrix), 3, which=which, key=key))
    values, vectors = map(np.asarray, jax.jit(run)(keys))
    for key, batch_values, batch_vectors in zip(keys, values, vectors, strict=True):
        alone = zm.eigsh(operator_of(matrix), 3, which=which, key=key)[0]
        np.testing.assert_allclose(batch_values, alone, rtol=0, atol=1e-12)
        np.testing.assert_allclose(batch_vectors.T @ batch_vectors, np.eye(3), atol=1e-8)
        residuals = np.linalg.norm(matrix @ batch_vectors - batch_vectors * batch_values, axis=0)
        assert np.all(residuals <= 1.01 * TOL * np.abs(batch_values)), residuals


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_exactly_repeated_eigenvalues_in_a_random_basis(which):
    # Unlike a diagonal operator, the Krylov space never breaks down here: every copy
    # past the first comes from the check's fresh start.
    sign = 1 if which == "LA" else -1
    spectrum = np.concatenate([np.linspace(-2.0, 2.0, 40), [5.0, 7.0, 7.0, 7.0]])
    matrix, _ = symmetric(sign * spectrum, seed=4)
    for k in (2, 3, 4):
        check_right_or_flagged(matrix, k, which, jax.random.key(k))


def loss(params, data):
    z = data @ params["w"] + jnp.sum(params["m"]) * params["b"]
    return jnp.sum(jnp.cosh(z)) + jnp.sum(params["m"] ** 3) * params["b"] ** 2


def point():
    params = {
        "b": jnp.asarray(0.7),
        "m": jnp.asarray(np.arange(6.0).reshape(2, 3) / 7),
        "n": 3,  # not a variable: held fixed
        "w": jnp.asarray(np.linspace(-0.5, 0.5, 3)),
    }
    return params, jnp.asarray(np.arange(12.0).reshape(4, 3) / 10)


@functools.cache
def dense_hessian():
    """JAX's dense Hessian at `point()`, as NumPy (compiled and computed once)."""
    fn, flat = raveled(loss, *point())
    return np.asarray(jax.jit(jax.hessian(fn))(flat))


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_hessian_operator_of_a_pytree(which):
    op = zm.BatchedHessian(loss).operator(*point())
    values, vectors = eigsh(op, 2, which=which)
    check_pairs(values, vectors, dense_hessian(), 2, which)


def test_pytree_eigenvectors_are_shaped_like_the_variables():
    params, data = point()
    op = zm.BatchedHessian(loss).operator(params, data)
    values, flat = eigsh(op, 2)
    _, tree = eigsh(op, 2, pytree=True)
    assert tree["n"] is None
    assert {name: tree[name].shape for name in "bmw"} == {"b": (2,), "m": (2, 2, 3), "w": (2, 3)}
    for j in range(2):
        pieces = [np.ravel(np.asarray(tree[name])[j]) for name in "bmw"]
        np.testing.assert_array_equal(np.concatenate(pieces), np.asarray(flat)[:, j])


def test_gauss_newton_and_microbatched_operators():
    def model(w, inputs, targets):
        return jnp.tanh(inputs @ w["a"]) * w["c"]

    def mean_loss(w, inputs, targets):
        return jnp.mean((model(w, inputs, targets) - targets) ** 2)

    rng = np.random.default_rng(0)
    w = {"a": jnp.asarray(rng.normal(size=6)) / 3, "c": jnp.asarray(1.5)}
    data = (jnp.asarray(rng.normal(size=(10, 6))), jnp.asarray(np.linspace(0, 1, 10)))
    fn, flat = raveled(model, w, *data)
    jacobian = np.asarray(jax.jit(jax.jacfwd(fn))(flat))
    ggn = zm.BatchedGGN(model, zm.losses.SquaredError()).operator(w, *data)
    check_pairs(*eigsh(ggn, 2), jacobian.T @ jacobian, 2, "LA")

    fn, flat = raveled(mean_loss, w, *data)
    hessian = np.asarray(jax.jit(jax.hessian(fn))(flat))
    batched = zm.Microbatcher(
        zm.BatchedHessian(mean_loss), microbatch_size=4, argnums=(1, 2), accumulator="mean"
    )
    check_pairs(*eigsh(batched.operator(w, *data), 2, which="SA"), hessian, 2, "SA")


def test_an_operator_with_a_budget():
    # Its pairs are those of the same operator without one, eagerly and under jit.
    budgeted = zm.BatchedHessian(loss, max_memory="50MB").operator(*point())
    values, vectors = eigsh(budgeted, 2, which="SA")
    check_pairs(values, vectors, dense_hessian(), 2, "SA")
    plain, _ = eigsh(zm.BatchedHessian(loss).operator(*point()), 2, which="SA")
    np.testing.assert_allclose(values, plain, rtol=1e-10)
    traced = jax.jit(
        lambda p, d: eigsh(
            zm.BatchedHessian(loss, max_memory="50MB").operator(p, d), 2, which="SA"
        )[0]
    )
    np.testing.assert_allclose(traced(*point()), values, rtol=1e-10)


def test_info_counts_the_products():
    matrix, _ = symmetric(SEPARATED)
    calls = []

    def product(v):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.asarray(matrix) @ v

    structure = jax.ShapeDtypeStruct((len(matrix),), jnp.float64)
    op = lx.FunctionLinearOperator(product, structure, lx.symmetric_tag)
    values, vectors, info = eigsh(op, 3, return_info=True)
    assert isinstance(info, EigshInfo)
    assert bool(info.converged)
    assert int(info.num_products) == len(calls) <= len(matrix)
    # The residual norms are those of the returned pairs, and within the tolerance.
    residuals = np.linalg.norm(matrix @ vectors - vectors * values, axis=0)
    np.testing.assert_allclose(info.residual_norms, residuals, rtol=1e-3, atol=1e-12)
    assert np.all(residuals <= TOL * np.abs(values))
    check_pairs(values, vectors, matrix, 3, "LA")


def test_under_jit():
    @jax.jit
    def top(params, data):
        return eigsh(zm.BatchedHessian(loss).operator(params, data), 2, which="SA", pytree=True)

    values, tree = top(*point())
    flat = np.concatenate([np.reshape(tree[name], (2, -1)) for name in "bmw"], axis=1)
    check_pairs(values, flat.T, dense_hessian(), 2, "SA")


def test_under_vmap_over_operators():
    matrices = np.stack([symmetric(SEPARATED[:12] + shift, seed=2)[0] for shift in (0.0, 3.0)])
    values, vectors = jax.vmap(lambda m: eigsh(operator_of(m), 2))(jnp.asarray(matrices))
    for matrix, value, vector in zip(matrices, values, vectors, strict=True):
        check_pairs(value, vector, matrix, 2, "LA")


def test_float32_is_kept():
    matrix, _ = symmetric(SEPARATED)
    op = lx.MatrixLinearOperator(jnp.asarray(matrix, jnp.float32), lx.symmetric_tag)
    values, vectors, info = eigsh(op, 2, tol=1e-5, return_info=True)
    assert values.dtype == vectors.dtype == info.residual_norms.dtype == jnp.float32
    np.testing.assert_allclose(values, [5.0, 8.0], rtol=1e-5)


def test_not_converging_raises_or_reports():
    matrix, _ = symmetric(SEPARATED)
    op = operator_of(matrix)
    message = (
        r"the 3 eigenpairs did not converge to tol=1e-06 within max_steps=4 .*larger "
        r"`max_steps`.*return_info=True"
    )
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(eigsh(op, 3, max_steps=4))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda m: eigsh(operator_of(m), 3, max_steps=4))(matrix))
    values, vectors, info = eigsh(op, 3, max_steps=4, return_info=True)
    assert not bool(info.converged) and int(info.num_products) == 4
    assert values.shape == (3,) and vectors.shape == (40, 3)


def test_refusals():
    matrix, _ = symmetric(SEPARATED[:10])
    op = operator_of(matrix)
    with pytest.raises(TypeError, match=r"zm.eigsh: `operator` must be a linear operator"):
        eigsh(jnp.asarray(matrix), 2)
    with pytest.raises(ValueError, match=r"must be symmetric.*lx.TaggedLinearOperator"):
        eigsh(lx.MatrixLinearOperator(jnp.asarray(matrix)), 2)
    with pytest.raises(TypeError, match=r"complex dtype complex128"):
        eigsh(lx.MatrixLinearOperator(jnp.asarray(matrix, complex), lx.symmetric_tag), 2)
    jacobian = zm.BatchedJacobian(jnp.sin).operator(jnp.ones(3))
    with pytest.raises(ValueError, match=r"must be symmetric"):
        eigsh(jacobian, 1)
    with pytest.raises(ValueError, match=r"must be square"):
        eigsh(zm.BatchedJacobian(jnp.outer).operator(jnp.ones(3), jnp.ones(2)), 1)
    with pytest.raises(ValueError, match=r"1 <= k < n = 10 .*got k=10"):
        eigsh(op, 10)
    with pytest.raises(ValueError, match=r"`k` must be a positive int, got k=0"):
        eigsh(op, 0)
    with pytest.raises(TypeError, match=r"`k` must be a positive int, got 2.0 of type float"):
        eigsh(op, 2.0)
    with pytest.raises(ValueError, match=r"`which` must be one of 'LA', 'SA'; got 'LM'"):
        eigsh(op, 2, which="LM")
    with pytest.raises(ValueError, match=r"`tol` must be a positive finite number, got 0"):
        eigsh(op, 2, tol=0)
    with pytest.raises(TypeError, match=r"`tol` must be a positive number, got '1e-3'"):
        eigsh(op, 2, tol="1e-3")
    with pytest.raises(ValueError, match=r"k \+ 1 = 3 <= max_steps <= n = 10, got max_steps=2"):
        eigsh(op, 2, max_steps=2)
    with pytest.raises(ValueError, match=r"max_steps=11"):
        eigsh(op, 2, max_steps=11)
    with pytest.raises(TypeError, match=r"`key` must be None or a single JAX random key"):
        eigsh(op, 2, key=0)
    with pytest.raises(TypeError, match=r"`pytree` must be True or False"):
        eigsh(op, 2, pytree=1)
    with pytest.raises(TypeError, match=r"`return_info` must be True or False"):
        eigsh(op, 2, return_info="yes")


@given(
    n=st.sampled_from([8, 16]),
    k=st.integers(1, 2),
    which=st.sampled_from(["LA", "SA"]),
    seed=st.integers(0, 2**16),
)
def test_sweep(n, k, which, seed):
    rng = np.random.default_rng(seed)
    # Gaps of at least 0.05 between neighbours in [-3, 3], in random order.
    spectrum = np.sort(rng.permutation(np.linspace(-3, 3, 2 * n))[:n])
    matrix, _ = symmetric(spectrum, seed=seed)
    values, vectors = eigsh(operator_of(matrix), k, which=which, key=jax.random.key(seed))
    check_pairs(values, vectors, matrix, k, which)


def test_a_progress_bar_of_the_steps(capfd):
    A = np.diag(np.arange(1.0, 41.0))
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.symmetric_tag)
    values, _ = eigsh(op, 2, progress=True)
    np.testing.assert_allclose(values, [39.0, 40.0], rtol=1e-6)
    bar = capfd.readouterr().err
    assert "zm.eigsh steps" in bar and "40/40" in bar


# Compiled once for both bad values of a dtype (a lambda jitted inside the test would be
# compiled again for each).
_eigsh_of_matrix = jax.jit(lambda m: eigsh(operator_of(m), 2))
_low_rank_of_matrix = jax.jit(lambda m: zm.low_rank(operator_of(m), 2).as_matrix())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_an_operator_of_nan_or_inf_products_is_refused_in_words(bad, dtype):
    matrix = np.asarray(symmetric(SEPARATED[:12])[0])
    matrix[3, 3] = bad
    matrix = jnp.asarray(matrix, dtype)
    message = r"zm\.eigsh: the operator's products with vectors are not finite \(NaN or inf\)"
    with pytest.raises(ValueError, match=message):
        eigsh(operator_of(matrix), 2)
    with pytest.raises(ValueError, match=message):
        eigsh(operator_of(matrix), 2, return_info=True)
    with pytest.raises(ValueError, match=r"zm\.low_rank: .*not finite \(NaN or inf\)"):
        zm.low_rank(operator_of(matrix), 2)
    # Under jit, when the program runs, through `eqx.error_if`.
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(_eigsh_of_matrix(matrix))
    with pytest.raises(RuntimeError, match=r"not finite \(NaN or inf\)"):
        jax.block_until_ready(_low_rank_of_matrix(matrix))


def test_a_hessian_at_a_nan_parameter_is_refused_in_words():
    def loss(w):
        return jnp.sum(jnp.arange(1.0, 9.0) * jnp.cosh(w))  # its Hessian depends on w

    op = zm.BatchedHessian(loss).operator(jnp.zeros(8).at[2].set(jnp.nan))
    with pytest.raises(ValueError, match=r"zm\.eigsh: the operator's products .* not finite"):
        eigsh(op, 2)
    with pytest.raises(ValueError, match=r"zm\.low_rank: the operator's products .* not finite"):
        zm.low_rank(op, 2)


def _spread_loss(w):
    return jnp.sum(jnp.arange(1.0, w.size + 1) ** 2 * w**2) + jnp.sum(w) ** 2


def test_a_basis_over_the_operators_budget_is_refused_before_it_runs():
    # 100 vectors of 400 numbers: a basis of 160 kB (float32) or 320 kB, over 100 kB.
    x = jnp.asarray(np.linspace(0.1, 1.0, 400))
    basis = 100 * 400 * x.dtype.itemsize
    op = zm.BatchedHessian(_spread_loss, max_memory="100kB").operator(x)
    with pytest.raises(zm.MemoryBudgetError, match=r"max_steps=100 vectors of n=400") as error:
        zm.eigsh(op, 3, max_steps=100)
    message = str(error.value)
    assert "by XLA's count" in message and "per device" in message
    suggested = error.value.suggested_bytes
    assert error.value.budget_bytes == 100_000 and suggested > basis
    # The budget it names holds the iteration, which returns what it does without one.
    fits = zm.BatchedHessian(_spread_loss, max_memory=suggested).operator(x)
    values, vectors = zm.eigsh(fits, 3, max_steps=100)
    expected, _ = zm.eigsh(zm.BatchedHessian(_spread_loss).operator(x), 3, max_steps=100)
    np.testing.assert_allclose(values, expected, rtol=1e-5)
    assert vectors.shape == (400, 3) and vectors.dtype == x.dtype
    # A second call of the same shapes runs the executable compiled for the check.
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name) if "backend_compile" in name else None
    )
    again, _ = zm.eigsh(fits, 3, max_steps=100)
    assert compiles == [] and np.array_equal(again, values)
    # The same refusal under jax.jit, at trace time.
    with pytest.raises(zm.MemoryBudgetError):
        jax.jit(
            lambda x: zm.eigsh(
                zm.BatchedHessian(_spread_loss, max_memory="100kB").operator(x), 3, max_steps=100
            )[0]
        )(x)
