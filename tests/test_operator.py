"""`transform.operator(x, *args, **kwargs)`: products with the Hessian, the Jacobian and a
dataset's curvature as lineax operators, against JAX's dense matrices."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import as_tree, close, make_mlp, raveled

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


def loss(params, data):
    z = data @ params["w"] + jnp.sum(params["m"]) * params["b"]
    return jnp.sum(jnp.cosh(z)) + jnp.sum(params["m"] ** 3) * params["b"] ** 2


def outputs(params, t):
    return {"y": params["w"] * jnp.sin(params["b"] * t), "z": jnp.outer(params["m"], params["w"])}


def point():
    # Built by NumPy (float64, as the tests run): no programs to compile.
    params = {
        "b": jnp.asarray(0.7),
        "m": jax.device_put(np.arange(6.0).reshape(2, 3) / 7),
        "n": 3,  # not a variable: held fixed
        "w": jax.device_put(np.linspace(-0.5, 0.5, 3)),
    }
    data = jax.device_put(np.arange(12.0).reshape(4, 3) / 10)
    return params, data


# References and vectors are NumPy arrays, so that checking costs no compiles of JAX's.


def vectors(n, k, seed=0):
    return np.random.default_rng(seed).normal(size=(n, k))


@functools.cache
def dense_hessian():
    """JAX's Hessian of `loss` at `point()`, and the raveled variables."""
    fn, flat = raveled(loss, *point())
    return np.asarray(jax.jit(jax.hessian(fn))(flat)), flat


def dense_jacobian(params, t):
    fn, flat = raveled(outputs, params, t)
    jacobians = jax.jit(jax.jacfwd(fn))(flat)
    pieces = [np.reshape(j, (-1, flat.size)) for j in jax.tree_util.tree_leaves(jacobians)]
    return np.concatenate(pieces)


# 5 vectors: 2 blocks of 3 (the second overlaps the first), or 5 blocks of 1 (nbatches
# counts blocks of the Hessian's 10 columns, at most the 5 vectors here).
BLOCKS = [{"batch_size": 3}, {"nbatches": 10}]


@pytest.mark.parametrize("options", BLOCKS)
def test_hessian_products(options):
    params, data = point()
    H, flat = dense_hessian()
    op = zm.BatchedHessian(loss, **options).operator(params, data)
    V = vectors(flat.size, 5)
    close(op.mm(V), H @ V)
    close(op.mv(V[:, 0]), H @ V[:, 0])
    # A vector shaped like the variables comes back in that shape.
    close(op.mv(as_tree(V[:, 1], params)), as_tree(H @ V[:, 1], params))
    assert op.in_structure() == op.out_structure()
    assert op.in_structure()["n"] is None


def test_hessian_strategies():
    params, data = point()
    H, flat = dense_hessian()
    V = vectors(flat.size, 4)
    recompute = zm.BatchedHessian(loss, batch_size=3, strategy="recompute")
    op = recompute.operator(params, data)
    assert lx.linearise(op) is op  # nothing kept: each product evaluates `fn` again
    close(op.mm(V), H @ V)
    linear = lx.linearise(zm.BatchedHessian(loss).operator(params, data))
    assert linear.linear is not None  # the linearisation is kept, its residuals leaves
    close(linear.mm(V), H @ V)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_iterations_form_the_products_afresh_where_fn_checkpoints(monkeypatch, checkpointed):
    # JAX's linearisation puts a `jax.checkpoint`'s forward pass on its linear side: a
    # kept linearisation would run it in every product anyway. With strategy="auto" an
    # iteration's products are then formed afresh.
    from zodmem._transforms import _derivative

    kept = []
    original = _derivative.product_function

    def recording(*args, recompute, **kwargs):
        kept.append(not recompute)
        return original(*args, recompute=recompute, **kwargs)

    monkeypatch.setattr(_derivative, "product_function", recording)

    fn = jax.checkpoint(loss) if checkpointed else loss
    params, data = point()
    H, _ = dense_hessian()
    op = zm.BatchedHessian(fn, mode="fwd").operator(params, data)
    kept.clear()
    values, _ = zm.eigsh(op, 2, max_steps=10)
    assert kept == [not checkpointed]
    close(values, np.linalg.eigvalsh(H)[-2:])


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
@pytest.mark.parametrize("strategy", ["linearize", "recompute"])
def test_hessian_products_in_every_mode(mode, strategy):
    # By default (and with "rev") a product is the VJP of the gradient, per leaf; with
    # "fwd" the JVP of the gradient. The same products either way, with aux and a
    # checkpoint too.
    def with_aux(params, data):
        return loss(params, data), params["b"]

    params, data = point()
    H, flat = dense_hessian()
    V = vectors(flat.size, 4)
    for transform in (
        zm.BatchedHessian(loss, mode=mode, strategy=strategy, batch_size=3),
        zm.BatchedHessian(with_aux, has_aux=True, checkpoint=True, mode=mode, strategy=strategy),
    ):
        op = transform.operator(params, data)
        close(op.mm(V), H @ V)
        close(op.mv(V[:, 0]), H @ V[:, 0])


def test_hessian_with_aux_and_mixed_precisions():
    def with_aux(params, data):
        return loss(params, data), {"note": "kept", "value": params["b"]}

    params, data = point()
    mixed = {**params, "w": params["w"].astype(jnp.float32)}
    op = zm.BatchedHessian(with_aux, has_aux=True).operator(mixed, data)
    v = jax.tree_util.tree_map(jnp.ones_like, eqx.filter(mixed, eqx.is_inexact_array))
    variables, fixed = eqx.partition(mixed, eqx.is_inexact_array)
    gradient = jax.grad(lambda p: loss(eqx.combine(p, fixed), data))
    expected = jax.jit(lambda p, v: jax.jvp(gradient, (p,), (v,))[1])(variables, v)
    result = op.mv(v)
    assert result["w"].dtype == jnp.float32 and result["m"].dtype == jnp.float64
    close(result, expected, rtol=1e-5, atol=1e-5)
    close(op.as_matrix(), zm.BatchedHessian(with_aux, has_aux=True)(mixed, data)[0])


def test_jacobian_products_and_transpose():
    params, _ = point()
    J = dense_jacobian(params, 0.5)
    # 2 blocks of 4 of the 7 vectors; the mode of the transform's own call does not matter.
    op = zm.BatchedJacobian(outputs, nbatches=2, mode="rev").operator(params, 0.5)
    V, W = vectors(J.shape[1], 7), vectors(J.shape[0], 3, seed=1)
    close(op.mm(V), J @ V)
    close(op.mv(V[:, 0]), J @ V[:, 0])
    shaped = op.mv(as_tree(V[:, 0], params))
    close(shaped, jax.tree_util.tree_map(lambda o: o, outputs_of(J @ V[:, 0])))
    close(op.T.mv(W[:, 0]), J.T @ W[:, 0])
    close(op.T.mv(outputs_of(W[:, 0])), as_tree(J.T @ W[:, 0], params))
    close(op.as_matrix(), J)
    close(op.T.as_matrix(), J.T)
    # Least squares through the transpose: lineax's normal equations take it as it is.
    b = W[:, 0]
    solution = lx.linear_solve(op, outputs_of(b), lx.Normal(lx.CG(rtol=1e-12, atol=1e-12)))
    close(solution.value, as_tree(np.linalg.lstsq(J, b)[0], params), rtol=1e-8, atol=1e-8)
    assert not lx.is_symmetric(op) and op.T.T.mv(V[:, 0]).shape == (J.shape[0],)


def outputs_of(flat):
    return {"y": flat[:3], "z": flat[3:].reshape(6, 3)}


def test_as_matrix_is_the_transforms_result():
    params, data = point()
    transform = zm.BatchedHessian(loss, nbatches=2)
    close(transform.operator(params, data).as_matrix(), transform(params, data), exact=True)
    v = np.linspace(-1, 1, 10)
    H = np.asarray(transform(params, data))
    close(
        lx.materialise(transform.operator(params, data)).mv(as_tree(v, params)),
        as_tree(H @ v, params),
    )
    close(lx.diagonal(transform.operator(params, data)), np.diag(H))


def test_budget_plans_the_blocks_of_vectors():
    params, data = point()
    H, flat = dense_hessian()
    V = vectors(flat.size, 6)
    close(zm.BatchedHessian(loss, max_memory="400MB").operator(params, data).mm(V), H @ V)
    tiny = zm.BatchedHessian(loss, max_memory="50B").operator(params, data)
    with pytest.raises(zm.MemoryBudgetError, match=r"BatchedHessian.operator\(...\).mm: max_m"):
        tiny.mm(V[:, :2])
    assert zm.BatchedHessian(loss).operator(params, data).mm(V[:, :0]).shape == (10, 0)


def test_inside_jit_and_grad():
    params, data = point()
    H, flat = dense_hessian()
    V = vectors(flat.size, 3)
    transform = zm.BatchedHessian(loss, batch_size=2)

    @jax.jit
    def products(data, V):
        op = transform.operator(params, data)
        return op.mv(V[:, 0]), op.mm(V)

    one, block = products(data, V)
    close(one, H @ V[:, 0])
    close(block, H @ V)
    op = transform.operator(params, data)
    close(eqx.filter_jit(lambda op, v: op.mv(v))(op, V[:, 1]), H @ V[:, 1])

    def objective(v, data):
        return jnp.sum(jnp.sin(transform.operator(params, data).mv(v)))

    def reference(v, data):
        fn, flat = raveled(loss, params, data)
        return jnp.sum(jnp.sin(jax.hessian(fn)(flat) @ v))

    # With respect to the vector (H is symmetric), and to the point (third derivatives).
    close(jax.jit(jax.grad(objective))(V[:, 0], data), H @ np.cos(H @ V[:, 0]))
    close(
        jax.jit(jax.grad(objective, 1))(V[:, 0], data),
        jax.jit(jax.grad(reference, 1))(V[:, 0], data),
    )


def test_lineax_solves_take_it():
    def convex(w, data):
        return jnp.sum(jnp.logaddexp(0.0, data @ w)) + 0.5 * jnp.sum(w**2)

    w, data = (
        jax.device_put(np.linspace(-1, 1, 4)),
        jax.device_put(np.arange(20.0).reshape(5, 4) / 20),
    )
    H = np.asarray(jax.jit(jax.hessian(convex))(w, data))
    b = jax.device_put(np.arange(1.0, 5.0))
    op = zm.BatchedHessian(convex, batch_size=3).operator(w, data)
    assert lx.is_symmetric(op) and not lx.is_positive_semidefinite(op) and op.T is op
    positive = lx.TaggedLinearOperator(op, lx.positive_semidefinite_tag)
    solution = lx.linear_solve(positive, b, lx.CG(rtol=1e-12, atol=1e-12)).value
    close(solution, np.linalg.solve(H, b), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("accumulator, size", [("sum", 3), ("mean", 4)])
def test_microbatcher_operator(accumulator, size):
    def example_loss(w, x, y):
        return jnp.mean((jnp.tanh(x @ w["a"]) * w["c"] - y) ** 2)

    w = {"a": jax.device_put(np.linspace(-0.3, 0.3, 3)), "c": jnp.asarray(1.2)}
    x = jax.device_put(np.random.default_rng(2).normal(size=(6, 3)))
    y = jax.device_put(np.arange(6.0) / 6)
    fn, flat = raveled(example_loss, w, x, y)
    # (Sliced by NumPy: no program to compile per slice.)
    microbatches = [
        (jax.device_put(np.asarray(x)[i : i + size]), jax.device_put(np.asarray(y)[i : i + size]))
        for i in range(0, 6, size)
    ]
    weight = (lambda xs: 1.0) if accumulator == "sum" else (lambda xs: xs.shape[0] / 6)

    def hessian_of(xs, ys):
        return jax.hessian(raveled(example_loss, w, xs, ys)[0])(flat)

    hessian_of = jax.jit(hessian_of)
    H = sum(np.asarray(hessian_of(xs, ys)) * weight(xs) for xs, ys in microbatches)
    transform = zm.Microbatcher(
        zm.BatchedHessian(example_loss, batch_size=2),
        microbatch_size=size,
        argnums=(1, 2),
        accumulator=accumulator,
    )
    op = transform.operator(w, x, y)
    V = vectors(flat.size, 3)
    close(op.mm(V), H @ V)  # 2 blocks of 2 vectors (the inner batch_size), each a scan
    if accumulator == "mean":  # the rest is the same code for either accumulator
        close(op.mv(as_tree(V[:, 0], w)), as_tree(H @ V[:, 0], w))
        close(op.as_matrix(), transform(w, x, y), exact=True)
    assert lx.is_symmetric(op)


def test_microbatcher_jacobian_operator():
    def model(w, x):
        return jnp.sum(jnp.tanh(x @ w), axis=0)  # a sum over the examples: additive

    w = jax.device_put(np.linspace(-0.3, 0.3, 6).reshape(3, 2))
    x = jax.device_put(np.arange(15.0).reshape(5, 3) / 10)
    J = np.asarray(jax.jit(jax.jacfwd(model))(w, x)).reshape(2, 6)
    op = zm.Microbatcher(zm.BatchedJacobian(model), microbatch_size=2, argnums=1).operator(w, x)
    V, W = vectors(6, 2), vectors(2, 1)
    close(op.mm(V), J @ V)
    close(op.T.mv(W[:, 0]), J.T @ W[:, 0])


def test_products_follow_their_transforms_options():
    # What an operator reads of its transform: a derivative's own options, and for a
    # Microbatcher its bar with the blocks of products of the derivative it wraps.
    from zodmem._operators._vector_blocks import ProductBlocks

    def with_aux(params, data):
        return loss(params, data), data

    params, data = point()
    hessian = zm.BatchedHessian(
        with_aux, has_aux=True, batch_size=3, strategy="recompute", jit=False
    )
    op = hessian.operator(params, data)
    blocks = ProductBlocks.of(op)
    assert (blocks.batch_size, blocks.strategy, blocks.jit, blocks.progress) == (
        3,
        "recompute",
        False,
        False,
    )
    close(op.as_matrix(), dense_hessian()[0])  # the matrix, without aux
    wrapped = zm.Microbatcher(hessian, microbatch_size=2, argnums=1, progress=True)
    op = wrapped.operator(params, data)
    blocks = ProductBlocks.of(op)
    options = (blocks.batch_size, blocks.strategy, blocks.sharding, blocks.jit, blocks.progress)
    assert options == (3, None, None, True, True)
    close(op.as_matrix(), wrapped(params, data)[0], exact=True)


def test_bad_input_is_refused_before_computing():
    params, data = point()
    op = zm.BatchedHessian(loss).operator(params, data)
    with pytest.raises(ValueError, match=r"`vector` must be a flat vector of shape \(10,\)"):
        op.mv(jnp.ones(9))
    with pytest.raises(TypeError, match="dtype float32.*float64"):
        op.mv(jnp.ones(10, jnp.float32))
    with pytest.raises(TypeError, match=r"`vector`\['w'\] has dtype int"):
        op.mv({"b": jnp.ones(()), "m": jnp.ones((2, 3)), "n": None, "w": jnp.ones(3, int)})
    with pytest.raises(ValueError, match=r"`vector`\['m'\] must be an array of shape \(2, 3\)"):
        op.mv({"b": jnp.ones(()), "m": jnp.ones(6), "n": None, "w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"`matrix` must be an \(10, k\) array.*\(10,\)"):
        op.mm(jnp.ones(10))
    with pytest.raises(TypeError, match="`matrix` has dtype int"):
        op.mm(jnp.ones((10, 2), int))
    with pytest.raises(TypeError, match=r"must return a scalar.*shape \(4,\)"):
        zm.BatchedHessian(lambda p, d: d @ p["w"]).operator(params, data)
    with pytest.raises(TypeError, match="no `operator` method"):
        zm.Microbatcher(jnp.sum, microbatch_size=2, argnums=1).operator(params, data)
    hessian = zm.BatchedHessian(loss)
    with pytest.raises(ValueError, match="the point `x`"):
        zm.Microbatcher(hessian, microbatch_size=2, argnums=(0, 1)).operator(params, data)
    with pytest.raises(ValueError, match="accumulator='concat'"):
        zm.Microbatcher(hessian, microbatch_size=2, argnums=1, accumulator="concat").operator(
            params, data
        )


def test_a_whole_model_is_a_vector_too():
    model = make_mlp(2, "scalar", 3, 1)
    x = jnp.ones(2)

    def model_loss(model, x):
        return jnp.tanh(model(x)) ** 2

    op = zm.BatchedHessian(model_loss).operator(model, x)
    fn, flat = raveled(model_loss, model, x)
    H = np.asarray(jax.jit(jax.hessian(fn))(flat))
    product = op.mv(model)  # its activation functions are not variables: ignored
    close(jax.flatten_util.ravel_pytree(eqx.filter(product, eqx.is_array))[0], H @ flat)


def test_ggn_operator_is_positive_semidefinite():
    def model(w, inputs):
        return jnp.tanh(inputs @ w["a"]) * w["c"]

    def squared(outputs, inputs):
        return 0.5 * jnp.sum(outputs**2)

    w = {"a": jax.device_put(np.linspace(-0.2, 0.4, 3)), "c": jnp.asarray(1.5)}
    # 5 outputs, 4 variables: G is regular.
    inputs = jax.device_put(np.linspace(-1, 1, 15).reshape(5, 3) ** 3)
    fn, flat = raveled(model, w, inputs)
    J = np.asarray(jax.jit(jax.jacfwd(fn))(flat))
    op = zm.BatchedGGN(model, squared, batch_size=3).operator(w, inputs)
    assert lx.is_symmetric(op) and lx.is_positive_semidefinite(op) and op.T is op
    V = vectors(4, 2)
    close(op.mm(V), J.T @ J @ V)
    b = jax.device_put(np.arange(1.0, 5.0))
    # Taken by CG as it is (the Gauss-Newton matrix is positive semi-definite), with the
    # right-hand side shaped like the variables, as lineax asks (its `out_structure`).
    cg = lx.CG(rtol=1e-12, atol=1e-12, max_steps=100)
    solution = lx.linear_solve(op, as_tree(b, w), cg).value
    close(solution, as_tree(np.linalg.solve(J.T @ J, b), w), rtol=1e-7, atol=1e-7)


def test_a_progress_bar_counts_the_blocks_of_vectors(capsys):
    params, data = point()
    H, _ = dense_hessian()
    op = zm.BatchedHessian(loss, batch_size=2, progress=True).operator(params, data)
    V = vectors(10, 5)
    capsys.readouterr()
    result = jax.block_until_ready(op.mm(V))  # 5 vectors in 3 blocks of 2
    jax.effects_barrier()
    err = capsys.readouterr().err
    assert re.search(r"BatchedHessian.operator products: 100%\|[^|]*\| 3/3 ", err), err
    close(result, H @ V)
    jax.block_until_ready(op.mv(V[:, 0]))  # a single product draws no bar
    jax.effects_barrier()
    assert "operator" not in capsys.readouterr().err


def test_complex_hessians_and_per_example_operators():
    def energy(z):
        return jnp.sum(jnp.sin(z) ** 2) + z[0] * z[1]

    z = jax.device_put(np.asarray([0.5 + 1j, -1 + 0.25j]))
    H = np.asarray(jax.jit(jax.hessian(energy, holomorphic=True))(z))
    op = zm.BatchedHessian(energy, holomorphic=True).operator(z)
    v = np.asarray([1.0 + 0j, 2j])
    # Complex symmetric, not Hermitian: no tag, and the transpose is JAX's own.
    assert not lx.is_symmetric(op)
    close(op.mv(v), H @ v)
    close(op.T.mv(v), H.T @ v)

    def cubes(x):
        return jnp.sum(jnp.sin(x) ** 3)

    points = np.linspace(-1, 1, 6).reshape(2, 3)
    per_example = jax.vmap(lambda x: zm.BatchedHessian(cubes).operator(x).mv(jnp.ones(3)))
    expected = jax.jit(jax.vmap(lambda x: jax.hessian(cubes)(x) @ jnp.ones(3)))(points)
    close(per_example(points), expected)
