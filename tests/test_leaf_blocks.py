"""The diagonal blocks of Hessians and Gauss-Newton matrices per variable leaf
(`blocks="leaf"`) and their operator, `zm.BlockDiagonal`: each block equals the same
block of `jax.hessian` (or of the whole GGN), values and dtypes, for any block option,
under jit, vmap and grad; the operator's products, solves, log-determinants and
eigenpairs equal dense NumPy's."""

import re

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import make_mlp
from hypothesis import given, settings

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


def loss(params, data):
    hidden = jnp.tanh(data @ params["w"] + params["b"][0])
    return jnp.sum(hidden**2) + jnp.sum(params["b"] ** 2 * jnp.sum(params["w"] ** 3))


def problem(dtype=jnp.float64, n=5):
    # Built by NumPy (float64, as the tests run), then cast: no programs to compile.
    params = {
        "b": jax.device_put(np.array([0.3, -0.2]).astype(dtype)),
        "w": jax.device_put(np.linspace(-1, 1, n).astype(dtype)),
        "name": "a non-array leaf",
        "count": 3,
    }
    data = jax.device_put(np.linspace(0, 1, 3 * n).astype(dtype).reshape(3, n))
    return params, data


def block_diag(*blocks):
    """NumPy's block-diagonal matrix of square `blocks`."""
    sizes = [len(block) for block in blocks]
    out = np.zeros((sum(sizes), sum(sizes)), np.result_type(*blocks))
    start = 0
    for block, size in zip(blocks, sizes, strict=True):
        out[start : start + size, start : start + size] = block
        start += size
    return out


@eqx.filter_jit  # one program per shape rather than one per operation of the Hessian
def dense_blocks(params, data):
    full = jax.hessian(lambda p: loss(eqx.combine(p, static), data))
    arrays, static = eqx.partition(params, eqx.is_inexact_array)
    H = full(arrays)
    return [H["b"]["b"], H["w"]["w"]]


@settings(max_examples=6, deadline=None)
@given(
    n=st.integers(1, 7),
    option=st.sampled_from(["none", "nbatches", "batch_size", "max_memory"]),
    size=st.integers(1, 4),
    mode=st.sampled_from(["auto", "fwd", "rev"]),
)
def test_blocks_equal_jax_hessians_blocks(n, option, size, mode):
    params, data = problem(n=n)
    kwargs = {
        "none": {},
        "nbatches": {"nbatches": size},
        "batch_size": {"batch_size": size},
        "max_memory": {"max_memory": "20MB"},
    }[option]
    blocks = zm.BatchedHessian(loss, blocks="leaf", mode=mode, **kwargs)(params, data)
    assert isinstance(blocks, tuple) and len(blocks) == 2
    for block, expected in zip(blocks, dense_blocks(params, data), strict=True):
        assert block.dtype == expected.dtype
        np.testing.assert_allclose(block, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dtypes_are_the_whole_matrixs(dtype):
    params, data = problem(dtype)
    blocks = zm.BatchedHessian(loss, blocks="leaf")(params, data)
    full = zm.BatchedHessian(loss)(params, data)
    assert all(block.dtype == full.dtype == dtype for block in blocks)
    np.testing.assert_allclose(blocks[1], full[2:, 2:], rtol=1e-5)


def test_mixed_precision_blocks_take_the_common_dtype():
    params = {
        "a": jax.device_put(np.asarray([0.5, 1.0], np.float32)),
        "b": jax.device_put(np.asarray([0.2, 0.1, 0.4])),
    }

    def f(p):
        return jnp.sum(p["a"] ** 3) * jnp.sum(jnp.sin(p["b"]))

    full = zm.BatchedHessian(f)(params)
    blocks = zm.BatchedHessian(f, blocks="leaf")(params)
    assert [b.dtype for b in blocks] == [full.dtype, full.dtype] == [jnp.float64] * 2
    np.testing.assert_allclose(blocks[0], full[:2, :2], rtol=1e-6)
    np.testing.assert_allclose(blocks[1], full[2:, 2:], rtol=1e-12)


def test_under_jit_vmap_and_grad():
    params, data = problem()
    hessian = zm.BatchedHessian(loss, blocks="leaf", batch_size=2)
    expected = dense_blocks(params, data)
    for block, want in zip(eqx.filter_jit(hessian)(params, data), expected, strict=True):
        np.testing.assert_allclose(block, want, rtol=1e-10)
    twice = jax.device_put(2 * np.asarray(data))
    mapped = jax.vmap(lambda d: hessian(params, d))(jnp.stack([data, twice]))
    np.testing.assert_allclose(mapped[1][1], dense_blocks(params, twice)[1], rtol=1e-10)

    def trace_of_blocks(d):
        return sum(jnp.trace(block) for block in hessian(params, d))

    def plain(d):
        return sum(jnp.trace(block) for block in dense_blocks(params, d))

    # The reference's gradient compiled: one program rather than one per operation.
    np.testing.assert_allclose(
        jax.grad(trace_of_blocks)(data), jax.jit(jax.grad(plain))(data), rtol=1e-9
    )


def test_has_aux_returns_the_blocks_and_aux():
    params, data = problem()
    hessian = zm.BatchedHessian(
        lambda p, d: (loss(p, d), {"tag": "x"}), blocks="leaf", has_aux=True
    )
    blocks, aux = hessian(params, data)
    assert aux == {"tag": "x"}
    np.testing.assert_allclose(blocks[0], dense_blocks(params, data)[0], rtol=1e-10)


def predict(model, inputs, targets):
    return jax.vmap(model)(inputs)


@pytest.mark.parametrize("loss_", [zm.losses.SquaredError(), zm.losses.SoftmaxCrossEntropy()])
def test_ggn_blocks_are_the_whole_ggns_blocks(loss_):
    # Drawn by NumPy: no initialiser or random programs to compile.
    model = make_mlp(3, 4, 5, 1)
    rng = np.random.default_rng(1)
    inputs = jax.device_put(rng.normal(size=(7, 3)))
    targets = jax.device_put(
        np.arange(7) % 4
        if isinstance(loss_, zm.losses.SoftmaxCrossEntropy)
        else rng.normal(size=(7, 4))
    )
    whole = np.asarray(zm.BatchedGGN(predict, loss_)(model, inputs, targets))
    blocks = zm.BatchedGGN(predict, loss_, blocks="leaf", batch_size=3)(model, inputs, targets)
    start = 0
    for block in blocks:
        stop = start + block.shape[0]
        np.testing.assert_allclose(block, whole[start:stop, start:stop], rtol=1e-10, atol=1e-14)
        start = stop
    assert start == whole.shape[0]


def test_operator_is_the_dense_block_diagonal():
    params, data = problem()
    op = zm.BatchedHessian(loss, blocks="leaf").operator(params, data)
    assert isinstance(op, zm.BlockDiagonal) and lx.is_symmetric(op)
    # The checks in NumPy: no programs to compile for them.
    expected = block_diag(*[np.asarray(block) for block in dense_blocks(params, data)])
    np.testing.assert_allclose(op.as_matrix(), expected, rtol=1e-10)
    v = np.linspace(-1, 2, expected.shape[0])
    np.testing.assert_allclose(op.mv(jax.device_put(v)), expected @ v, rtol=1e-10)
    np.testing.assert_allclose(op.diagonal(), np.diagonal(expected), rtol=1e-10)
    damping = 3.0 + np.abs(np.linalg.eigvalsh(expected)).max()
    damped = expected + damping * np.eye(len(v))
    np.testing.assert_allclose(
        op.solve(jax.device_put(v), damping=damping), np.linalg.solve(damped, v), rtol=1e-9
    )
    np.testing.assert_allclose(op.logdet(damping=damping), np.linalg.slogdet(damped)[1], rtol=1e-10)
    values, vectors = op.eigh()
    for block, w, q in zip(dense_blocks(params, data), values, vectors, strict=True):
        w, q = np.asarray(w), np.asarray(q)
        np.testing.assert_allclose(q @ np.diag(w) @ q.T, block, rtol=1e-9, atol=1e-12)
    solution = np.asarray(lx.linear_solve(op, jax.device_put(expected @ v), lx.SVD()).value)
    np.testing.assert_allclose(expected @ solution, expected @ v, rtol=1e-6, atol=1e-9)


def test_an_indefinite_blocks_logdet_is_nan():
    op = zm.BlockDiagonal([jax.device_put(np.eye(2)), jax.device_put(-np.eye(1))])
    assert np.isnan(op.logdet())
    np.testing.assert_allclose(op.logdet(damping=2.0), 2 * np.log(3.0), rtol=1e-6)


def test_budget_holds_every_block_made_so_far():
    params, data = problem(n=40)
    hessian = zm.BatchedHessian(loss, blocks="leaf", max_memory="200kB")
    blocks = hessian(params, data)
    np.testing.assert_allclose(blocks[1], dense_blocks(params, data)[1], rtol=1e-10)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: zm.BatchedJacobian(jnp.sin, blocks="leaf"), "a Jacobian has none"),
        (lambda: zm.BatchedHessian(loss, blocks="rows"), "blocks"),
        (lambda: zm.BatchedHessian(loss, blocks="leaf", holomorphic=True), "holomorphic"),
        (lambda: zm.BlockDiagonal([jnp.ones((2, 3))]), "square"),
        (lambda: zm.BlockDiagonal([]), "empty"),
        (lambda: zm.BlockDiagonal([jnp.eye(2, dtype=jnp.int32)]), "floating"),
        (lambda: zm.BlockDiagonal([jnp.eye(2), jnp.eye(2, dtype=jnp.float32)]), "one dtype"),
    ],
)
def test_refusals_name_the_argument(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_plan_and_streaming_are_refused_in_words(tmp_path):
    params, data = problem()
    hessian = zm.BatchedHessian(loss, blocks="leaf")
    with pytest.raises(ValueError, match="blocks='leaf'"):
        hessian.plan(params, data)
    with pytest.raises(ValueError, match="blocks='leaf'"):
        zm.to_host(hessian, params, data)
    with pytest.raises(ValueError, match=r"`vector` must be an array of shape \(7,\)"):
        hessian.operator(params, data).mv(jnp.ones(3))


def suggested_budget(error):
    """The least budget a refusal suggests, read from its message: "at least 84.0 kB"."""
    number, unit = re.search(r"budget of at least ([\d.]+) (\w+)", str(error)).groups()
    assert unit == "kB"
    return f"{number}{unit}"


@pytest.mark.parametrize("budget, shown", [(5000, "5 kB"), ("30kB", "30 kB")])
def test_a_refused_budget_quotes_the_budget_and_a_least_that_plans(budget, shown):
    # The first leaf's block is refused at 5 kB, the second's after the first at 30 kB.
    params = {
        "b": jax.device_put(np.linspace(0.1, 0.3, 30)),
        "w": jax.device_put(np.linspace(-1, 1, 60)),
    }
    data = jax.device_put(np.linspace(0, 1, 180).reshape(3, 60))
    hessian = zm.BatchedHessian(loss, blocks="leaf", max_memory=budget)
    with pytest.raises(zm.MemoryBudgetError) as refused:
        hessian(params, data)
    assert f"max_memory={shown} cannot hold" in str(refused.value)
    suggestion = suggested_budget(refused.value)
    blocks = zm.BatchedHessian(loss, blocks="leaf", max_memory=suggestion)(params, data)
    np.testing.assert_allclose(blocks[1], dense_blocks(params, data)[1], rtol=1e-10)
    assert refused.value.budget_bytes == 1000 * int(shown[:-3])
    assert refused.value.suggested_bytes <= 1000 * float(suggestion[:-2])
