"""Stochastic Lanczos quadrature: `lanczos_quadrature`'s Gauss rules against
`jnp.linalg.eigh`, and `spectral_density` on operators of known spectrum."""

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest

import zodmem as zm
from zodmem._estimators._spectral import lanczos_quadrature, spectral_density

pytestmark = pytest.mark.usefixtures("float64")


def symmetric(spectrum, seed=0):
    n = len(spectrum)
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return jnp.asarray(q @ np.diag(spectrum) @ q.T)


@jax.jit
def rule_of(matrix, probe):
    """The 4-node rule of a matrix from a probe, compiled once for every test here."""
    return lanczos_quadrature(lambda v: matrix @ v, probe, 4)


def moments(matrix, u, degrees):
    """`u^T A^j u` for each degree `j`, from the eigendecomposition (NumPy's)."""
    values, vectors = np.linalg.eigh(np.asarray(matrix))
    components = (vectors.T @ np.asarray(u)) ** 2
    return np.array([np.sum(components * values**j) for j in degrees])


def test_quadrature_is_exact_for_polynomials_below_twice_the_steps():
    matrix = symmetric(np.linspace(-1, 2, 12))
    probe = jnp.asarray(np.random.default_rng(1).normal(size=12))
    u = np.asarray(probe) / np.linalg.norm(probe)
    nodes, weights = map(np.asarray, rule_of(matrix, probe))
    assert nodes.shape == weights.shape == (4,)
    np.testing.assert_allclose(np.sum(weights), 1, rtol=1e-12)
    degrees = range(8)  # below 2 * 4
    rule = np.array([np.sum(weights * nodes**j) for j in degrees])
    np.testing.assert_allclose(rule, moments(matrix, u, degrees), rtol=1e-9, atol=1e-12)
    # Degree 2 * 4 is beyond the rule: it must differ (the test can tell).
    assert abs(np.sum(weights * nodes**8) - moments(matrix, u, [8])[0]) > 1e-6


def test_quadrature_after_a_breakdown_is_exact():
    # The probe's Krylov space has dimension 3 (3 distinct eigenvalues): the rule of 3
    # nodes is exact for every function, and the fourth node gets no weight.
    spectrum = np.asarray([1.0] * 6 + [2.0] * 4 + [5.0] * 2)
    probe = np.random.default_rng(2).normal(size=12)
    nodes, weights = map(np.asarray, rule_of(jnp.asarray(np.diag(spectrum)), jnp.asarray(probe)))
    assert np.sum(np.isclose(nodes, 5.0) | np.isclose(nodes, 2.0) | np.isclose(nodes, 1.0)) >= 3
    # The step after the breakdown goes on in a new direction of the space, so its
    # node is a Ritz value of A too (not the 0 of a zero vector).
    assert np.all((nodes > 1 - 1e-9) & (nodes < 5 + 1e-9))
    u = probe / np.linalg.norm(probe)
    np.testing.assert_allclose(np.sum(weights * np.exp(nodes)), np.sum(u**2 * np.exp(spectrum)))
    np.testing.assert_allclose(np.sum(weights), 1, rtol=1e-12)


def test_quadrature_is_vmappable():
    matrix = symmetric(np.linspace(0, 1, 12), seed=3)
    probes = jnp.asarray(np.random.default_rng(4).normal(size=(3, 12)))
    batched = jax.jit(jax.vmap(rule_of, in_axes=(None, 0)))(matrix, probes)
    for i in range(3):
        one = rule_of(matrix, probes[i])
        np.testing.assert_allclose(batched[0][i], one[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(batched[1][i], one[1], rtol=1e-10, atol=1e-12)


# Two clusters: 30 eigenvalues in [0.9, 1.1] and 10 in [4.9, 5.1].
CLUSTERS = np.concatenate([np.linspace(0.9, 1.1, 30), np.linspace(4.9, 5.1, 10)])


def mass(grid, density, lower, upper):
    inside = (grid >= lower) & (grid <= upper)
    return float(jnp.sum(jnp.where(inside, density, 0)) * (grid[1] - grid[0]))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_density_of_two_clusters(dtype):
    op = lx.MatrixLinearOperator(symmetric(CLUSTERS).astype(dtype), lx.symmetric_tag)
    grid, density = spectral_density(op, num_probes=20, num_steps=8, sigma=0.1)
    assert grid.dtype == density.dtype == dtype and grid.shape == density.shape == (512,)
    # A Rademacher probe's rule puts |u_i|^2-weighted mass on each cluster; over 20
    # probes the mean fraction is within a few percent of the clusters' shares.
    assert mass(grid, density, 0, 3) == pytest.approx(0.75, abs=0.05)
    assert mass(grid, density, 3, 7) == pytest.approx(0.25, abs=0.05)
    assert mass(grid, density, -np.inf, np.inf) == pytest.approx(1, abs=1e-2)


def integral(grid, density):
    """The density's trapezoid integral over its grid, in double precision."""
    return np.trapezoid(np.asarray(density, np.float64), np.asarray(grid, np.float64))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_density_of_equal_eigenvalues_integrates_to_one(dtype):
    # The Hessian of sum(w**2) is 2 I: every node is 2, up to rounding.
    w = jnp.linspace(-1.0, 1.0, 30, dtype=dtype)
    op = zm.BatchedHessian(lambda w: jnp.sum(w**2)).operator(w)
    grid, density = spectral_density(op, num_probes=4, num_steps=10)
    assert grid.dtype == density.dtype == dtype
    assert len(np.unique(np.asarray(grid))) == len(grid)  # distinct points, around 2
    assert grid[0] < 2 < grid[-1]
    # The grid spans 3 kernel widths either side: it holds 99.7% of a Gaussian's mass.
    assert integral(grid, density) == pytest.approx(1, abs=0.02)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_density_of_the_zero_operator_integrates_to_one(dtype):
    op = lx.MatrixLinearOperator(jnp.zeros((12, 12), dtype), lx.symmetric_tag)
    grid, density = spectral_density(op, num_probes=2, num_steps=4)
    assert grid.dtype == density.dtype == dtype and grid[0] < 0 < grid[-1]
    assert integral(grid, density) == pytest.approx(1, abs=0.02)


def test_default_width_is_a_hundredth_of_the_nodes_spread():
    # As many steps as the size: the nodes are the eigenvalues, 1 to 2, and the grid
    # spans 3 widths of 0.01 either side of them.
    op = lx.DiagonalLinearOperator(jnp.linspace(1.0, 2.0, 8))
    grid, density = spectral_density(op, num_probes=2, num_steps=8)
    np.testing.assert_allclose([grid[0], grid[-1]], [0.97, 2.03], rtol=1e-9)
    assert integral(grid, density) == pytest.approx(1, abs=0.02)


def test_density_under_jit_with_a_grid_and_more_steps_than_the_size():
    @jax.jit
    def density(matrix):
        op = lx.MatrixLinearOperator(matrix, lx.symmetric_tag)
        return spectral_density(op, num_probes=4, num_steps=100, grid=jnp.linspace(-1, 7, 801))

    grid, values = density(symmetric(CLUSTERS))
    # 40 steps are all there are: each rule is exact, its nodes the eigenvalues.
    assert mass(grid, values, 0, 3) == pytest.approx(0.75, abs=0.1)
    assert mass(grid, values, -1, 7) == pytest.approx(1, abs=1e-2)


def test_probes_do_not_depend_on_the_batches():
    op = lx.MatrixLinearOperator(symmetric(CLUSTERS), lx.symmetric_tag)
    # The first call is the one of `test_density_of_two_clusters[float64]` (compiled once).
    one_at_a_time = spectral_density(op, num_probes=20, num_steps=8, sigma=0.1)
    in_batches = spectral_density(op, num_probes=20, num_steps=8, sigma=0.1, batch_size=6)
    np.testing.assert_allclose(one_at_a_time[1], in_batches[1], rtol=1e-9, atol=1e-12)


def test_refusals():
    op = lx.MatrixLinearOperator(symmetric(CLUSTERS[:10]), lx.symmetric_tag)
    owner = "zm.spectral_density"
    with pytest.raises(ValueError, match=rf"{owner}: `operator` must be symmetric"):
        spectral_density(lx.MatrixLinearOperator(jnp.eye(3)))
    with pytest.raises(ValueError, match=r"`num_probes` must be a positive int, got num_probes=0"):
        spectral_density(op, num_probes=0)
    with pytest.raises(TypeError, match=r"`num_steps` must be a positive int, got 2.5"):
        spectral_density(op, num_steps=2.5)
    with pytest.raises(ValueError, match=r"`grid` must be an int >= 2, got grid=1"):
        spectral_density(op, grid=1)
    with pytest.raises(ValueError, match=r"`grid` must be a 1-D array .* shape \(2, 2\)"):
        spectral_density(op, grid=jnp.ones((2, 2)))
    with pytest.raises(TypeError, match=r"`grid` must be None, a number of points"):
        spectral_density(op, grid="auto")
    with pytest.raises(ValueError, match=r"`sigma` must be a positive finite number, got -1"):
        spectral_density(op, sigma=-1)
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive int"):
        spectral_density(op, batch_size=0)
    with pytest.raises(ValueError, match=r"`num_steps` must be at most the probe's size 3"):
        lanczos_quadrature(lambda v: v, jnp.ones(3), 4)


def test_density_of_a_hessian_in_planned_blocks_with_a_bar(capfd):
    import zodmem as zm

    def loss(w):
        return jnp.sum(jnp.cosh(w) * jnp.arange(1.0, 13.0)) + jnp.sum(w) ** 2

    w = jnp.linspace(-1.0, 1.0, 12)
    key = jax.random.key(1)
    reference = spectral_density(zm.BatchedHessian(loss).operator(w), key=key, batch_size=1)
    planned = zm.BatchedHessian(loss, max_memory="15kB", progress=True).operator(w)
    grid, density = spectral_density(planned, key=key)
    np.testing.assert_allclose(grid, reference[0], rtol=1e-10)
    np.testing.assert_allclose(density, reference[1], rtol=1e-8, atol=1e-10)
    # The budget holds a few of the 10 probes' bases at a time: several blocks.
    bar = capfd.readouterr().err
    assert "zm.spectral_density probes" in bar and "1/1" not in bar
