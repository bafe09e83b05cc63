"""`LowRankDiagonal` and `low_rank`: a low-rank plus diagonal operator's products, Woodbury
solves, log-determinants, marginal variances and samples, against the dense matrix's."""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import close, make_mlp

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")


def parts(n, r, *, seed=0, zero_d=False, orthonormal=True, dtype=np.float64):
    """`(U, s, d)` of a random low-rank plus diagonal operator of size `n` and rank `r`,
    with one eigenvalue of the low-rank part at zero where `r >= 3`."""
    rng = np.random.default_rng(seed)
    U = rng.normal(size=(n, r))
    if orthonormal and r:
        U = np.linalg.qr(U)[0]
    s = rng.uniform(0.5, 20.0, size=r)
    if r >= 3:
        s[1] = 0.0
    d = np.zeros(n) if zero_d else rng.uniform(0.1, 2.0, size=n)
    return tuple(jnp.asarray(a, dtype) for a in (U, s, d))


def dense(U, s, d):
    return np.asarray(U) * np.asarray(s) @ np.asarray(U).T + np.diag(np.asarray(d))


# (n, r, damping, zero d, orthonormal U): a rank of 0, a diagonal of 0 with damping > 0,
# a diagonal alone with no damping, and columns that are not orthonormal.
CASES = [
    (7, 0, 0.5, False, True),
    (7, 0, 0.0, False, True),
    (8, 3, 0.0, False, True),
    (8, 3, 0.25, True, True),
    (12, 5, 1.5, False, True),
    (12, 5, 1e-3, True, True),
    (10, 4, 0.3, False, False),
    (6, 6, 0.7, True, False),
]


@pytest.mark.parametrize("n, r, damping, zero_d, orthonormal", CASES)
def test_products_and_inverse_equal_the_dense_matrix(n, r, damping, zero_d, orthonormal):
    U, s, d = parts(n, r, seed=n + r, zero_d=zero_d, orthonormal=orthonormal)
    A = zm.LowRankDiagonal(U, s, d)
    M = dense(U, s, d)
    v = jnp.asarray(np.random.default_rng(1).normal(size=n))
    close(A.as_matrix(), jnp.asarray(M))
    close(A.mv(v), jnp.asarray(M @ np.asarray(v)))
    close(A.diagonal(), jnp.asarray(np.diag(M)))
    assert A.transpose() is A
    assert A.in_structure() == A.out_structure() == jax.ShapeDtypeStruct((n,), jnp.float64)

    damped = M + damping * np.eye(n)
    B = np.random.default_rng(2).normal(size=(n, 3))
    close(A.solve(v, damping=damping), jnp.asarray(np.linalg.solve(damped, v)), rtol=1e-9)
    close(A.solve(jnp.asarray(B), damping=damping), jnp.asarray(np.linalg.solve(damped, B)), 1e-9)
    sign, logdet = np.linalg.slogdet(damped)
    assert sign == 1
    close(A.logdet(damping=damping), jnp.asarray(logdet), rtol=1e-11)
    variances = np.diag(np.linalg.inv(damped))
    close(A.marginal_variances(damping=damping), jnp.asarray(variances), rtol=1e-9)


def test_lineax_takes_it_as_a_symmetric_positive_semidefinite_operator():
    U, s, d = parts(9, 3)
    A = zm.LowRankDiagonal(U, s, d)
    M = dense(U, s, d)
    assert lx.is_symmetric(A) and lx.is_positive_semidefinite(A)
    assert not lx.is_negative_semidefinite(A) and not lx.is_diagonal(A)
    assert lx.is_diagonal(zm.LowRankDiagonal(jnp.zeros((9, 0)), jnp.zeros(0), d))
    close(lx.diagonal(A), jnp.asarray(np.diag(M)))
    main, lower, upper = lx.tridiagonal(A)
    close((main, lower, upper), tuple(jnp.asarray(np.diag(M, k)) for k in (0, -1, 1)))
    assert lx.linearise(A) is A and lx.conj(A) is A
    close(lx.materialise(A).as_matrix(), jnp.asarray(M))
    b = jnp.arange(9.0)
    expected = jnp.asarray(np.linalg.solve(M, np.arange(9.0)))
    close(lx.linear_solve(A, b, lx.CG(rtol=1e-12, atol=1e-12)).value, expected, rtol=1e-8)
    close(lx.linear_solve(A, b).value, expected, rtol=1e-9)  # lineax's own choice
    # zodmem's estimators and solvers take it too.
    close(zm.solve(A, b, damping=0.5, rtol=1e-12, atol=1e-12), A.solve(b, damping=0.5), 1e-8)
    values, _ = zm.eigsh(A, 2)
    close(values, jnp.asarray(np.linalg.eigvalsh(M)[-2:]), rtol=1e-8)


def test_low_rank_recovers_a_known_low_rank_plus_diagonal_matrix():
    # The first 10 coordinates hold a rank-3 block whose eigenvalues stand above every
    # entry of the diagonal on the other 20: the top 3 eigenpairs are the block's, and the
    # remainder of the diagonal is the diagonal, exactly.
    rng = np.random.default_rng(3)
    basis = np.zeros((30, 3))
    basis[:10] = np.linalg.qr(rng.normal(size=(10, 3)))[0]
    s = np.array([5.0, 8.0, 13.0])
    d = np.concatenate([np.zeros(10), rng.uniform(0.1, 2.0, 20)])
    M = dense(basis, s, d)
    operator = lx.MatrixLinearOperator(jnp.asarray(M), lx.symmetric_tag)
    options = dict(tol=1e-12, key=jax.random.key(4))
    for diagonal in ("exact", "estimate"):
        # A diagonal remainder is one that Hutchinson's sign probes estimate exactly.
        A = zm.low_rank(operator, 3, diagonal=diagonal, num_probes=6, **options)
        assert isinstance(A, zm.LowRankDiagonal)
        close(A.s, jnp.asarray(s), rtol=1e-10)
        close(A.d, jnp.asarray(d), atol=1e-10)
        close(A.as_matrix(), jnp.asarray(M), atol=1e-10)
    bare = zm.low_rank(operator, 3, **options)
    close(bare.d, jnp.zeros(30))
    close(bare.as_matrix(), jnp.asarray(dense(basis, s, np.zeros(30))), atol=1e-10)
    # The whole diagonal, computed before, gives the same remainder.
    given = zm.low_rank(operator, 3, diagonal=jnp.asarray(np.diag(M)), **options)
    close(given.d, jnp.asarray(d), atol=1e-10)
    # Rank 0: the diagonal alone.
    alone = zm.low_rank(operator, 0, diagonal="exact")
    assert alone.U.shape == (30, 0)
    close(alone.d, jnp.asarray(np.diag(M)))


def test_low_rank_of_a_network_keeps_the_diagonal_and_stays_flat():
    model = make_mlp(2, 1, 4, 1)  # 17 parameters in four leaves

    def predict(model, xs, ys):
        return jax.vmap(model)(xs)

    xs = jnp.linspace(-1, 1, 12).reshape(6, 2)
    ys = jnp.sin(xs[:, :1])
    op = zm.BatchedGGN(predict, zm.losses.SquaredError()).operator(model, xs, ys)
    G = np.asarray(op.as_matrix())
    posterior = zm.low_rank(op, 3, diagonal="exact")
    # The structure is flat even though the variables are a model's leaves.
    assert posterior.in_structure() == jax.ShapeDtypeStruct((17,), jnp.float64)
    close(posterior.diagonal(), jnp.asarray(np.diag(G)), atol=1e-10)
    close(posterior.s, jnp.asarray(np.linalg.eigvalsh(G)[-3:]), rtol=1e-6)
    # The remainder of a positive semi-definite G's diagonal is never below zero.
    assert bool(jnp.all(posterior.d >= 0))


def test_samples_have_the_inverse_as_their_covariance():
    n, damping = 6, 0.4
    U, s, d = parts(n, 2, seed=5)
    A = zm.LowRankDiagonal(U, s, d)
    covariance = np.linalg.inv(dense(U, s, d) + damping * np.eye(n))
    key = jax.random.key(6)

    # Exactly: the draws are L z for z = jax.random.normal(key, (*shape, n)), and
    # the map L has L L^T = (A + damping I)^{-1}.
    draws = np.asarray(A.sample(key, (n,), damping=damping))
    normals = np.asarray(jax.random.normal(key, (n, n), jnp.float64))
    factor = np.linalg.solve(normals, draws).T  # draws = normals @ L^T
    np.testing.assert_allclose(factor @ factor.T, covariance, rtol=1e-9, atol=1e-12)

    # Statistically: the empirical covariance of 200,000 draws, entry by entry, within 5
    # standard errors of a sample covariance (Var[x_i x_j] = C_ii C_jj + C_ij^2 for a
    # zero-mean Gaussian); the chance of a false alarm over the 21 entries is ~1e-5.
    count = 200_000
    draws = np.asarray(A.sample(jax.random.key(7), (count,), damping=damping))
    assert draws.shape == (count, n)
    empirical = draws.T @ draws / count
    spread = np.sqrt((np.outer(np.diag(covariance), np.diag(covariance)) + covariance**2) / count)
    assert np.all(np.abs(empirical - covariance) < 5 * spread), np.max(
        np.abs(empirical - covariance) / spread
    )
    assert np.all(np.abs(draws.mean(0)) < 5 * np.sqrt(np.diag(covariance) / count))

    assert A.sample(key).shape == (n,)
    assert A.sample(key, 3).shape == (3, n)
    assert A.sample(key, (2, 4), damping=damping).shape == (2, 4, n)


def test_inside_jit():
    U, s, d = parts(8, 3, seed=8)
    A = zm.LowRankDiagonal(U, s, d)
    b = jnp.arange(8.0)
    key = jax.random.key(9)

    @jax.jit
    def everything(U, s, d, b, damping):
        A = zm.LowRankDiagonal(U, s, d)  # built from traced arrays
        return (
            A.mv(b),
            A.solve(b, damping=damping),
            A.logdet(damping=damping),
            A.marginal_variances(damping=damping),
            A.sample(key, (2,), damping=damping),
        )

    eager = (
        A.mv(b),
        A.solve(b, damping=0.5),
        A.logdet(damping=0.5),
        A.marginal_variances(damping=0.5),
        A.sample(key, (2,), damping=0.5),
    )
    close(everything(U, s, d, b, jnp.asarray(0.5)), eager, rtol=1e-10)
    # The operator as an argument of a compiled function.
    solved = eqx.filter_jit(lambda A, b: A.solve(b, damping=0.5))(A, b)
    close(solved, eager[1], rtol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dtypes(dtype):
    U, s, d = parts(10, 3, seed=10, dtype=dtype)
    A = zm.LowRankDiagonal(U, s, d)
    M = dense(U, s, d).astype(np.float64) + 0.5 * np.eye(10)
    b = jnp.arange(10.0, dtype=dtype)
    tolerance = 1e-4 if dtype == jnp.float32 else 1e-10
    results = {
        "mv": (A.mv(b), (M - 0.5 * np.eye(10)) @ np.arange(10.0)),
        "solve": (A.solve(b, damping=0.5), np.linalg.solve(M, np.arange(10.0))),
        "logdet": (A.logdet(damping=0.5), np.linalg.slogdet(M)[1]),
        "variances": (A.marginal_variances(damping=0.5), np.diag(np.linalg.inv(M))),
    }
    for name, (actual, expected) in results.items():
        assert actual.dtype == dtype, name
        np.testing.assert_allclose(actual, expected, rtol=tolerance, err_msg=name)
    assert A.sample(jax.random.key(0), (2,), damping=0.5).dtype == dtype
    assert A.in_structure().dtype == dtype


def test_bad_parts_are_refused_by_name():
    U, s, d = parts(5, 2)
    with pytest.raises(ValueError, match=r"`U` must be a 2-d array .* shape \(5,\)"):
        zm.LowRankDiagonal(d, s, d)
    with pytest.raises(ValueError, match=r"`s` must have shape \(2,\).* \(3,\)"):
        zm.LowRankDiagonal(U, jnp.ones(3), d)
    with pytest.raises(ValueError, match=r"`d` must have shape \(5,\).* \(4,\)"):
        zm.LowRankDiagonal(U, s, jnp.ones(4))
    with pytest.raises(TypeError, match=r"`s` has dtype float32.* float64"):
        zm.LowRankDiagonal(U, s.astype(jnp.float32), d)
    with pytest.raises(TypeError, match=r"`U` must be a real floating array.* int"):
        zm.LowRankDiagonal(jnp.ones((5, 2), int), s, d)
    with pytest.raises(TypeError, match=r"`d` must be an array"):
        zm.LowRankDiagonal(U, s, "diagonal")
    with pytest.raises(ValueError, match=r"`s` must be >= 0.* s\[1\] = -0.5"):
        zm.LowRankDiagonal(U, jnp.array([1.0, -0.5]), d)
    with pytest.raises(ValueError, match=r"`d` must be >= 0.* d\[3\] = -1"):
        zm.LowRankDiagonal(U, s, d.at[3].set(-1.0))
    with pytest.raises(ValueError, match=r"`d` must be .*finite.* d\[0\] = nan"):
        zm.LowRankDiagonal(U, s, d.at[0].set(jnp.nan))


def test_bad_calls_are_refused_by_name():
    U, s, d = parts(5, 2)
    A = zm.LowRankDiagonal(U, s, d.at[2].set(0.0))
    with pytest.raises(ValueError, match=r"d\[2\] \+ damping = 0.0.* damping=0.0.*damping > 0"):
        A.solve(jnp.ones(5))
    shallow = zm.LowRankDiagonal(U, s, jnp.ones(5).at[2].set(0.25))
    with pytest.raises(ValueError, match=r"logdet.* d\[2\] \+ damping = -0.25 \(d\[2\] = 0.25"):
        shallow.logdet(damping=-0.5)
    for method in (
        A.marginal_variances,
        lambda damping: A.sample(jax.random.key(0), damping=damping),
    ):
        with pytest.raises(ValueError, match=r"d\[2\] \+ damping"):
            method(damping=0.0)
    with pytest.raises(TypeError, match=r"`damping` must be a real number"):
        A.solve(jnp.ones(5), damping="1")
    with pytest.raises(ValueError, match=r"`b` must be .*\(5,\) or \(5, k\).* \(4,\)"):
        A.solve(jnp.ones(4), damping=1.0)
    with pytest.raises(TypeError, match=r"`b` has dtype float32"):
        A.solve(jnp.ones(5, jnp.float32), damping=1.0)
    with pytest.raises(ValueError, match=r"`vector` must be .*\(5,\).* \(5, 2\)"):
        A.mv(jnp.ones((5, 2)))
    with pytest.raises(TypeError, match=r"`key` must be"):
        A.sample(0, damping=1.0)
    with pytest.raises(ValueError, match=r"`shape` must be .* got shape=\(2, -1\)"):
        A.sample(jax.random.key(0), (2, -1), damping=1.0)
    # Traced, the diagonal part is checked when the compiled call runs.
    with pytest.raises(Exception, match=r"d \+ damping must be > 0"):
        jax.jit(lambda damping: A.solve(jnp.ones(5), damping=damping))(0.0).block_until_ready()


def test_low_rank_refuses_bad_options_by_name():
    M = dense(*parts(6, 2))
    op = lx.MatrixLinearOperator(jnp.asarray(M), lx.symmetric_tag)
    with pytest.raises(ValueError, match=r"`rank` must be an int with 0 <= rank < n = 6.* rank=6"):
        zm.low_rank(op, 6)
    with pytest.raises(ValueError, match=r"`rank` must be a non-negative int.* rank=-1"):
        zm.low_rank(op, -1)
    with pytest.raises(ValueError, match=r"`diagonal` must be None, 'exact', 'estimate'.*'full'"):
        zm.low_rank(op, 2, diagonal="full")
    with pytest.raises(TypeError, match=r"diagonal='estimate' .* `key`"):
        zm.low_rank(op, 2, diagonal="estimate", num_probes=10)
    with pytest.raises(TypeError, match=r"diagonal='estimate' .* `num_probes`"):
        zm.low_rank(op, 2, diagonal="estimate", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`diagonal` .* shape \(6,\).* \(5,\)"):
        zm.low_rank(op, 2, diagonal=jnp.ones(5))
    with pytest.raises(ValueError, match=r"`operator` must be symmetric"):
        zm.low_rank(lx.MatrixLinearOperator(jnp.asarray(M)), 2)
