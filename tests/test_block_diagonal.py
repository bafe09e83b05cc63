"""`zm.BlockDiagonal` at the edges of its solves and log-determinants: singular blocks
refused in words (at once, or under jit when the program runs), the rounding-level
negative eigenvalues of a positive semi-definite Gauss-Newton block taken as zeros,
`jnp.linalg.slogdet`'s answer where a block's determinant is positive with negative
eigenvalues, and the damping checked as `zm.logdet` checks it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

DTYPES = [jnp.float32, jnp.float64]


def predict(model, inputs, targets):
    return jax.vmap(model)(inputs)


def singular_ggn(dtype):
    """The GGN blocks of an MLP of 50 variables at 2 examples of 2 outputs: rank 4 at
    most in every block, so every block larger than that is singular."""
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0), dtype=jnp.float64)
    model = jax.tree_util.tree_map(lambda a: a.astype(dtype) if eqx.is_array(a) else a, model)
    inputs = jax.random.normal(jax.random.key(1), (2, 3), jnp.float64).astype(dtype)
    targets = jnp.zeros((2, 2), dtype)
    ggn = zm.BatchedGGN(predict, zm.losses.SquaredError(), blocks="leaf")
    return ggn.operator(model, inputs, targets)


def psd_logdet(blocks, damping):
    """log det(A + damping I) in float64, each block's eigenvalues within rounding of
    zero (or below it) taken as 0."""
    total = 0.0
    for block in blocks:
        block = np.asarray(block, np.float64)
        values = np.linalg.eigvalsh((block + block.T) / 2)
        tolerance = len(values) * np.finfo(np.float64).eps * np.abs(values).max()
        total += np.sum(np.log(np.where(values <= tolerance, 0.0, values) + damping))
    return total


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_singular_ggn_solve_is_refused_in_words(dtype):
    A = singular_ggn(dtype)
    b = jnp.ones(A.in_structure().shape, dtype)
    message = r"every eigenvalue plus `damping` must be > 0"
    with pytest.raises(ValueError, match=r"BlockDiagonal\.solve: " + message):
        A.solve(b)
    with pytest.raises(ValueError, match=r"BlockDiagonal\.logdet: " + message):
        A.logdet()
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(jax.jit(lambda A, d: A.solve(b, damping=d))(A, 0.0))
    # A damping that lifts the zero eigenvalues solves, as exactly as the dtype allows.
    x = A.solve(b, damping=1e-3)
    assert x.dtype == dtype
    residual = A.mv(x) + 1e-3 * x - b
    assert float(jnp.linalg.norm(residual)) < 1e-3 * float(jnp.linalg.norm(b))
    assert A.blocks[0].dtype == dtype and lx.is_positive_semidefinite(A)


@pytest.mark.parametrize("damping", [1e-9, 1e-8, 1e-4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_ggn_logdet_takes_rounding_negative_eigenvalues_as_zeros(dtype, damping):
    A = singular_ggn(dtype)
    expected = psd_logdet(singular_ggn(jnp.float64).blocks, damping)
    value = A.logdet(damping=damping)
    assert value.dtype == dtype and jnp.isfinite(value)
    np.testing.assert_allclose(value, expected, rtol=1e-4 if dtype == jnp.float32 else 1e-10)
    # The eigenvalues `eigh` returns are those the solves use: none below zero.
    assert all(float(values.min()) >= 0 for values in A.eigh()[0])


def test_a_singular_hessian_block_is_refused_and_an_indefinite_one_solves():
    A = zm.BlockDiagonal([jnp.array([[1.0, 1.0], [1.0, 1.0]]), jnp.array([[-2.0]])])
    assert not lx.is_positive_semidefinite(A)
    message = r"BlockDiagonal\.solve: every eigenvalue plus `damping` must be nonzero"
    with pytest.raises(ValueError, match=message):
        A.solve(jnp.ones(3))
    with pytest.raises(ValueError, match=message):
        A.solve(jnp.ones(3), damping=2.0)  # the block [[-2]] plus 2
    with pytest.raises(ValueError, match=r"BlockDiagonal\.logdet: every eigenvalue"):
        A.logdet()
    damped = A.as_matrix() + 0.5 * jnp.eye(3)  # eigenvalues 0.5, 2.5, -1.5
    np.testing.assert_allclose(
        A.solve(jnp.arange(3.0), damping=0.5), np.linalg.solve(damped, np.arange(3.0))
    )
    assert jnp.isnan(A.logdet(damping=0.5))  # its determinant is negative


@pytest.mark.parametrize("dtype", DTYPES)
def test_logdet_of_a_positive_determinant_with_negative_eigenvalues_is_slogdets(dtype):
    rotation = np.linalg.qr(np.arange(9.0).reshape(3, 3) ** 2 + np.eye(3))[0]
    block = rotation @ np.diag([-1.0, -2.0, 3.0]) @ rotation.T
    A = zm.BlockDiagonal([jnp.asarray(block, dtype), jnp.array([[4.0]], dtype)])
    sign, expected = np.linalg.slogdet(block)
    expected += np.log(4.0)
    assert sign == 1
    np.testing.assert_allclose(A.logdet(), expected, rtol=1e-5 if dtype == jnp.float32 else 1e-12)
    np.testing.assert_allclose(A.logdet(damping=-0.5), np.log(1.5 * 2.5 * 2.5 * 3.5), rtol=1e-5)
    assert jnp.isnan(A.logdet(damping=1.5))  # eigenvalues 0.5, -0.5, 4.5 and 5.5


@pytest.mark.parametrize(
    "damping, error, match",
    [
        (np.nan, ValueError, r"`damping` must be a finite real number, got damping=nan"),
        (jnp.inf, ValueError, r"`damping` must be a finite real number, got damping=inf"),
        ("x", TypeError, r"`damping` must be a real number, got"),
        (jnp.ones(2), TypeError, r"`damping` must be a real number, got an array"),
    ],
)
def test_damping_is_checked_as_zm_logdet_checks_it(damping, error, match):
    A = zm.BlockDiagonal([jnp.eye(2)])
    with pytest.raises(error, match=r"BlockDiagonal\.solve: " + match):
        A.solve(jnp.ones(2), damping=damping)
    with pytest.raises(error, match=r"BlockDiagonal\.logdet: " + match):
        A.logdet(damping=damping)


def test_positive_semidefinite_is_a_checked_declaration():
    A = zm.BlockDiagonal([jnp.eye(2)], positive_semidefinite=True)
    assert lx.is_positive_semidefinite(A)
    assert not lx.is_positive_semidefinite(zm.BlockDiagonal([jnp.eye(2)]))
    with pytest.raises(TypeError, match="`positive_semidefinite` must be True or False"):
        zm.BlockDiagonal([jnp.eye(2)], positive_semidefinite=1)


def diagonal_blocks(matrix, sizes):
    starts = np.cumsum([0, *sizes])
    return [matrix[a:b, a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def mean_loss(params, inputs, targets):
    return jnp.mean((jnp.tanh(inputs @ params["w"] + params["b"]) - targets) ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_microbatchers_leaf_operator_is_the_whole_batchs_blocks(dtype):
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0), dtype=dtype)
    inputs = jax.random.normal(jax.random.key(1), (10, 3), dtype)
    targets = jax.random.normal(jax.random.key(2), (10, 2), dtype)
    ggn = zm.BatchedGGN(predict, zm.losses.SquaredError(), blocks="leaf")
    batched = zm.Microbatcher(ggn, microbatch_size=4, argnums=(1, 2), accumulator="sum")
    A = batched.operator(model, inputs, targets)
    whole = zm.BatchedGGN(predict, zm.losses.SquaredError())(model, inputs, targets)
    assert isinstance(A, zm.BlockDiagonal) and lx.is_positive_semidefinite(A)
    assert A.blocks[0].dtype == dtype
    rtol = 1e-5 if dtype == jnp.float32 else 1e-12
    for block, expected in zip(A.blocks, diagonal_blocks(whole, A.sizes), strict=True):
        np.testing.assert_allclose(block, expected, rtol=rtol, atol=rtol * 1e-2)
    # A Hessian of the mean loss, averaged over the microbatches of 4, 4 and 2.
    params = {"b": jnp.array([0.1, -0.2], dtype), "w": jnp.linspace(-1, 1, 6, dtype=dtype)}
    params["w"] = params["w"].reshape(3, 2)
    hessian = zm.BatchedHessian(mean_loss, blocks="leaf")
    mean = zm.Microbatcher(hessian, microbatch_size=4, argnums=(1, 2), accumulator="mean")
    A = mean.operator(params, inputs, targets)
    whole = zm.BatchedHessian(mean_loss)(params, inputs, targets)
    assert isinstance(A, zm.BlockDiagonal) and not lx.is_positive_semidefinite(A)
    for block, expected in zip(A.blocks, diagonal_blocks(whole, A.sizes), strict=True):
        np.testing.assert_allclose(block, expected, rtol=rtol, atol=rtol * 1e-2)
    v = jnp.linspace(-1, 1, sum(A.sizes), dtype=dtype)
    np.testing.assert_allclose(A.mv(v), A.as_matrix() @ v, rtol=rtol)
