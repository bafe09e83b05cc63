"""One operator base: every operator declares mv/mm, diagonal, solve, logdet and eigh, on
flat vectors and on vectors shaped like the variables."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import zodmem as zm


def predict(model, inputs, labels):
    return jax.vmap(model)(inputs)


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        request.getfixturevalue("float64")
    return jnp.dtype(request.param)


def tolerance(dtype):
    return {"rtol": 1e-10, "atol": 1e-10} if dtype == jnp.float64 else {"rtol": 2e-4, "atol": 2e-5}


def problem(dtype):
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jnp.tanh, key=jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda leaf: leaf.astype(dtype) if eqx.is_inexact_array(leaf) else leaf, model
    )
    inputs = jax.random.normal(jax.random.key(1), (10, 3), dtype)
    labels = jnp.arange(10) % 2
    return model, inputs, labels


def variables_like(model, seed):
    """A vector shaped like the model's variables, `None` at its other leaves."""
    rng = np.random.default_rng(seed)
    tree = eqx.filter(model, eqx.is_inexact_array)
    return jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), tree)


@functools.cache
def operators(dtype):
    """The model and its four operators in `dtype`, built once: the tests only read them."""
    model, inputs, labels = problem(dtype)
    loss = zm.losses.SoftmaxCrossEntropy()
    return model, {
        "kfac": zm.KFAC(predict, loss)(model, inputs, labels),
        "ekfac": zm.EKFAC(predict, loss)(model, inputs, labels),
        "leaf blocks": zm.BatchedGGN(predict, loss, blocks="leaf").operator(model, inputs, labels),
        "ggn": zm.BatchedGGN(predict, loss).operator(model, inputs, labels),
    }


@pytest.mark.parametrize("name", ["kfac", "ekfac", "leaf blocks", "ggn"])
def test_products_and_solves_take_the_variables_structure(dtype, name):
    model, ops = operators(dtype)
    op = ops[name]
    assert isinstance(op, zm.AbstractOperator)
    vector = variables_like(model, 2)
    flat = ravel_pytree(vector)[0]
    dense = np.asarray(op.as_matrix())
    product = op.mv(vector)
    assert jax.tree_util.tree_structure(product) == jax.tree_util.tree_structure(vector)
    assert all(
        p.shape == v.shape
        for p, v in zip(*map(jax.tree_util.tree_leaves, (product, vector)), strict=True)
    )
    np.testing.assert_allclose(ravel_pytree(product)[0], dense @ flat, **tolerance(dtype))
    np.testing.assert_allclose(op.mv(flat), dense @ flat, **tolerance(dtype))
    solution = op.solve(vector, damping=0.5)
    assert jax.tree_util.tree_structure(solution) == jax.tree_util.tree_structure(vector)
    expected = np.linalg.solve(dense + 0.5 * np.eye(len(flat)), flat)
    np.testing.assert_allclose(ravel_pytree(solution)[0], expected, **tolerance(dtype))
    np.testing.assert_allclose(op.solve(flat, damping=0.5), expected, **tolerance(dtype))
    assert op.solve(flat, damping=0.5).dtype == dtype


@pytest.mark.parametrize("name", ["kfac", "ekfac", "leaf blocks", "ggn"])
def test_diagonal_logdet_and_mm_are_the_dense_matrix_s(dtype, name):
    _, ops = operators(dtype)
    op = ops[name]
    dense = np.asarray(op.as_matrix())
    n = dense.shape[0]
    np.testing.assert_allclose(op.diagonal(), np.diag(dense), **tolerance(dtype))
    _, expected = np.linalg.slogdet(dense + 0.5 * np.eye(n))
    np.testing.assert_allclose(op.logdet(damping=0.5), expected, **tolerance(dtype))
    columns = np.random.default_rng(4).normal(size=(n, 3)).astype(dtype)
    np.testing.assert_allclose(op.mm(columns), dense @ columns, **tolerance(dtype))


def test_a_transform_s_operator_is_exact_from_its_dense_matrix(dtype):
    def loss(params):
        return jnp.sum(jnp.sin(params["w"]) * params["w"] ** 2) + params["b"] @ params["w"][:2]

    params = {"b": jnp.array([1.0, -2.0], dtype), "w": jnp.array([0.3, 1.2, -0.7], dtype)}
    flat, unravel = ravel_pytree(params)
    H = np.asarray(jax.jit(jax.hessian(lambda v: loss(unravel(v))))(flat))
    op = zm.BatchedHessian(loss).operator(params)
    values, vectors = op.eigh()
    np.testing.assert_allclose(values, np.linalg.eigvalsh(H), **tolerance(dtype))
    np.testing.assert_allclose(vectors @ np.diag(values) @ vectors.T, H, **tolerance(dtype))
    sign, expected = np.linalg.slogdet(H + 30.0 * np.eye(5))
    assert sign > 0
    np.testing.assert_allclose(op.logdet(damping=30.0), expected, **tolerance(dtype))
    b = np.arange(10.0).reshape(5, 2).astype(dtype)
    np.testing.assert_allclose(
        op.solve(b, damping=3.0), np.linalg.solve(H + 3 * np.eye(5), b), **tolerance(dtype)
    )
    under_jit = eqx.filter_jit(lambda op, v: op.solve(v, damping=3.0))(op, params)
    np.testing.assert_allclose(
        ravel_pytree(under_jit)[0],
        np.linalg.solve(H + 3 * np.eye(5), ravel_pytree(params)[0]),
        **tolerance(dtype),
    )


def test_an_indefinite_determinant_is_nan_and_a_singular_one_refused():
    op = zm.BatchedHessian(lambda w: w[0] ** 2 - w[1] ** 2).operator(jnp.ones(2))
    assert jnp.isnan(op.logdet())
    with pytest.raises(ValueError, match="singular"):
        op.logdet(damping=2.0)  # eigenvalues 2 - 2 and -2 + 2... one of them zero
    with pytest.raises(ValueError, match="singular"):
        op.solve(jnp.ones(2), damping=-2.0)
    with pytest.raises(Exception, match="singular"):  # under jit, when the call runs
        eqx.filter_jit(lambda op: op.logdet(damping=2.0))(op).block_until_ready()
    with pytest.raises(TypeError, match="`damping` must be a real number"):
        op.solve(jnp.ones(2), damping="a")


def test_a_jacobian_s_operator_refuses_what_only_a_square_one_has():
    op = zm.BatchedJacobian(lambda w: jnp.stack([w.sum(), (w**2).sum(), w[0]])).operator(
        jnp.ones(2)
    )
    for call in (op.diagonal, op.logdet, op.eigh, lambda: op.solve(jnp.ones(2))):
        with pytest.raises(ValueError, match="not square"):
            call()


def test_a_vector_of_another_structure_is_refused_in_words():
    model, ops = operators(jnp.float32)
    for name in ("kfac", "leaf blocks"):
        with pytest.raises(
            ValueError, match=r"`vector` must be an array of shape \(\d+,\) or a pytree"
        ):
            ops[name].mv({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"`b` must be an array of shape \(\d+,\) or \(\d+, k\)"):
        ops["kfac"].solve(jnp.ones(3), damping=1.0)


def test_the_structure_must_match_the_blocks_or_shapes():
    with pytest.raises(ValueError, match="one leaf per block"):
        zm.BlockDiagonal([jnp.eye(2)], structure={"a": jnp.ones(3)})
    tree = {"a": jnp.ones((1, 2)), "b": jnp.ones(1)}
    A = zm.BlockDiagonal([jnp.eye(2) * 2, jnp.eye(1) * 3], structure=tree)
    out = A.mv(tree)
    np.testing.assert_allclose(out["a"], 2 * np.ones((1, 2)))
    np.testing.assert_allclose(out["b"], [3.0])
    assert A.variable_shardings() == (None,)  # its input structure is flat: one leaf


def test_zm_solve_takes_a_structured_operator_s_own_exact_solve(dtype):
    import lineax as lx

    model, ops = operators(dtype)
    vector = variables_like(model, 5)
    flat = ravel_pytree(vector)[0]
    for name in ("kfac", "ekfac", "leaf blocks"):
        op = ops[name]
        assert op.solves_exactly
        np.testing.assert_array_equal(zm.solve(op, flat, damping=0.5), op.solve(flat, damping=0.5))
        got = zm.solve(op, vector, damping=0.5)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(vector)
        columns = jnp.stack([flat, 2 * flat], axis=1)
        np.testing.assert_allclose(
            zm.solve(op, columns, damping=0.5)[:, 1],
            2 * op.solve(flat, damping=0.5),
            **tolerance(dtype),
        )
        tol = 1e-10 if dtype == jnp.float64 else 1e-5
        iterated = zm.solve(op, flat, damping=0.5, solver=lx.CG(rtol=tol, atol=tol))
        np.testing.assert_allclose(iterated, op.solve(flat, damping=0.5), rtol=1e-3, atol=1e-4)
    assert not ops["ggn"].solves_exactly  # a transform's: CG from products
