"""Stacks of zodmem transforms, and zodmem transforms under JAX and Equinox transforms,
each against the plain JAX answer in float64."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mlp
from hypothesis import given, settings, strategies as st
from jax.flatten_util import ravel_pytree

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


def close(actual, expected, rtol=1e-12, atol=1e-12):
    """Same structure, shapes and dtypes; values equal up to float64 rounding."""
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def normal(seed, shape):
    # NumPy's generator: jax.random's would compile a program for every shape drawn.
    return jax.device_put(np.random.default_rng(seed).standard_normal(shape))  # float64


def flat_reference(fn, x):
    """`x` raveled in leaf order, and `fn` as a function of that flat vector."""
    flat, unravel = ravel_pytree(x)
    return flat, lambda flat_x, *args: fn(unravel(flat_x), *args)


# ----------------------------------------------------------------------------------
# Per-example Jacobians and Hessians: ChunkedVmap over BatchedJacobian / BatchedHessian


def features(params, a):
    """A vector-valued function of a pytree of variables and a per-example scalar."""
    u = jnp.tanh(a * params["w"][:3] + params["b"])
    return u * jnp.sum(params["w"] ** 2)


def energy(params, a):
    """A scalar function of a pytree of variables and a per-example scalar."""
    return jnp.sum(jnp.sin(a * params["w"]) ** 2) * (1 + params["b"] ** 2) + jnp.prod(params["w"])


def batch_of_params(batch, seed=0):
    return {"b": normal(seed, (batch,)), "w": normal(seed + 1, (batch, 4))}


# The references, compiled once per shape and shared by the tests (a function made
# inside a test would compile again in every parametrisation).
@jax.jit
@jax.vmap
def feature_jacobians(one_params, one_a):
    flat, fn = flat_reference(features, one_params)
    return jax.jacrev(fn)(flat, one_a)


@jax.jit
@jax.vmap
def energy_hessians(one_params, one_a):
    flat, fn = flat_reference(energy, one_params)
    return jax.hessian(fn)(flat, one_a)


@pytest.mark.parametrize(
    "mode, chunk_size", [("fwd", 1), ("rev", 3), ("auto", 7), ("fwd", 10), ("rev", 10)]
)
def test_per_example_jacobians(mode, chunk_size):
    params, a = batch_of_params(7), normal(2, (7,))
    jacobian = zm.BatchedJacobian(features, mode=mode, batch_size=2)
    actual = zm.ChunkedVmap(jacobian, chunk_size=chunk_size)(params, a)
    close(actual, feature_jacobians(params, a))
    assert actual.shape == (7, 3, 5)


@pytest.mark.parametrize("chunk_size", [1, 3, 10])
def test_per_example_hessians(chunk_size):
    params, a = batch_of_params(7), normal(2, (7,))
    actual = zm.ChunkedVmap(zm.BatchedHessian(energy, nbatches=2), chunk_size=chunk_size)(params, a)
    close(actual, energy_hessians(params, a))
    assert actual.shape == (7, 5, 5)


def test_per_example_hessians_at_shared_parameters():
    """Per-example Hessians of a loss w.r.t. parameters shared by every example."""

    def loss(params, x, y):
        return (jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2

    params = {"b": jnp.asarray(0.2), "w": normal(0, (3,))}
    xs, ys = normal(1, (9, 3)), normal(2, (9,))
    stack = zm.ChunkedVmap(zm.BatchedHessian(loss), chunk_size=4, in_axes=(None, 0, 0))
    flat, fn = flat_reference(loss, params)
    expected = eqx.filter_jit(jax.vmap(jax.hessian(fn), in_axes=(None, 0, 0)))(flat, xs, ys)
    close(stack(params, xs, ys), expected)
    # The per-example Hessians average to the Hessian of the mean loss.
    mean_hessian = jax.jit(jax.hessian(lambda f: jnp.mean(jax.vmap(fn, (None, 0, 0))(f, xs, ys))))(
        flat
    )
    close(np.mean(np.asarray(stack(params, xs, ys)), axis=0), mean_hessian)


def test_per_example_jacobians_with_aux():
    def critic(x, scale):
        value = jnp.stack([jnp.sum(jnp.sin(scale * x)), jnp.sum(x**2)])
        return value, {"norm": jnp.linalg.norm(x)}

    xs, scales = normal(0, (5, 3)), normal(1, (5,))
    jacobian, aux = zm.ChunkedVmap(zm.BatchedJacobian(critic, has_aux=True), chunk_size=2)(
        xs, scales
    )
    expected_jacobian, expected_aux = eqx.filter_jit(jax.vmap(jax.jacrev(critic, has_aux=True)))(
        xs, scales
    )
    close(jacobian, expected_jacobian)
    close(aux, expected_aux)


def test_hessian_as_jacobian_of_jacobian():
    params = {"b": jnp.asarray(0.4), "w": normal(0, (4,))}
    flat, fn = flat_reference(energy, params)
    expected = eqx.filter_jit(jax.hessian(fn))(flat, 0.7)
    gradient = zm.BatchedJacobian(energy, mode="rev")
    close(zm.BatchedJacobian(gradient, mode="fwd", nbatches=2)(params, 0.7), expected)

    # The other two in one compiled function: one program rather than one each.
    @eqx.filter_jit
    def others(params):
        return (
            zm.BatchedJacobian(gradient, mode="rev", nbatches=2)(params, 0.7),
            zm.BatchedHessian(energy, batch_size=3)(params, 0.7),
        )

    for result in others(params):
        close(result, expected)


# ----------------------------------------------------------------------------------
# Dataset Hessians: Microbatcher over BatchedHessian


def regression_loss(params, x, y):
    prediction = jnp.tanh(x @ params["w"] + params["b"]) * params["scale"]
    return jnp.mean((prediction - y) ** 2)


def regression_problem(batch):
    params = {"b": jnp.asarray(0.1), "scale": jnp.asarray(1.3), "w": normal(0, (3,))}
    return params, normal(1, (batch, 3)), normal(2, (batch,))


@jax.jit
def regression_hessian(params, x, y):
    """The reference: `jax.hessian` of `regression_loss` on the raveled parameters."""
    flat, fn = flat_reference(regression_loss, params)
    return jax.hessian(fn)(flat, x, y)


@pytest.mark.parametrize("microbatch_size", [3, 16])
def test_dataset_hessian(microbatch_size):
    params, x, y = regression_problem(10)
    dataset_hessian = zm.Microbatcher(
        zm.BatchedHessian(regression_loss, nbatches=2),
        microbatch_size=microbatch_size,
        argnums=(1, 2),
        accumulator="mean",
    )
    close(dataset_hessian(params, x, y), regression_hessian(params, x, y))


def test_dataset_hessian_with_aux_and_summed_loss():
    def summed_loss(params, x, y):
        residual = x @ params["w"] + params["b"] - y
        return jnp.sum(jnp.cosh(residual)), jnp.max(jnp.abs(residual))

    params, x, y = regression_problem(11)
    dataset_hessian = zm.Microbatcher(
        zm.BatchedHessian(summed_loss, has_aux=True),
        microbatch_size=4,
        argnums=(1, 2),
        accumulator=("sum", zm.AccumulationType.CONCAT),
    )
    hessian, largest = dataset_hessian(params, x, y)
    flat, fn = flat_reference(lambda p, x, y: summed_loss(p, x, y)[0], params)
    close(hessian, eqx.filter_jit(jax.hessian(fn))(flat, x, y))
    assert largest.shape == (3,)  # one scalar per microbatch: 4, 4 and 3 examples
    full = jax.jit(lambda params, x, y: summed_loss(params, x, y)[1])(params, x, y)
    np.testing.assert_allclose(np.max(largest), full)


# ----------------------------------------------------------------------------------
# Equinox models: as the argument, as `fn`, under eqx.filter_grad


@functools.cache
def mlp():
    """One MLP for the tests (its weights drawn by NumPy, no initialiser to compile)."""
    return make_mlp(3, 2, 4, 2)


def mlp_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


mlp_loss_grad = eqx.filter_jit(eqx.filter_grad(mlp_loss))  # one program for both sizes below


@pytest.mark.parametrize("microbatch_size", [5, 12])
def test_microbatched_filter_grad_of_an_mlp(microbatch_size):
    model = mlp()
    x, y = normal(1, (12, 3)), normal(2, (12, 2))
    grads = zm.Microbatcher(
        eqx.filter_grad(mlp_loss),
        microbatch_size=microbatch_size,
        argnums=(1, 2),
        accumulator="mean",
    )(model, x, y)
    expected = mlp_loss_grad(model, x, y)
    close(eqx.filter(grads, eqx.is_array), eqx.filter(expected, eqx.is_array))
    assert grads.activation is None  # not a variable: no gradient, as filter_grad gives


def test_dataset_hessian_of_an_mlp():
    model = mlp()
    x, y = normal(1, (10, 3)), normal(2, (10, 2))
    hessian = zm.Microbatcher(
        zm.BatchedHessian(mlp_loss, batch_size=16),
        microbatch_size=5,
        argnums=(1, 2),
        accumulator="mean",
    )(model, x, y)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    expected = eqx.filter_jit(
        jax.hessian(lambda f: mlp_loss(eqx.combine(unravel(f), static), x, y))
    )(flat)
    close(hessian, expected)


def test_transforms_whose_fn_is_an_mlp():
    model = mlp()
    xs = normal(1, (7, 3))
    # The references compiled: one program each rather than one per operation.
    close(zm.ChunkedVmap(model, chunk_size=3)(xs), jax.jit(jax.vmap(model))(xs))
    close(zm.BatchedJacobian(model, nbatches=2)(xs[0]), jax.jit(jax.jacrev(model))(xs[0]))
    per_example = zm.ChunkedVmap(zm.BatchedJacobian(model, mode="fwd"), chunk_size=2)
    close(per_example(xs), jax.jit(jax.vmap(jax.jacfwd(model)))(xs))

    # The model's weights are leaves of the stack, so gradients reach them through it.
    def total(stack, xs):
        return jnp.sum(stack(xs) ** 2)

    grads = eqx.filter_grad(total)(per_example, xs)
    expected = eqx.filter_jit(
        eqx.filter_grad(lambda m, xs: jnp.sum(jax.vmap(jax.jacfwd(m))(xs) ** 2))
    )(model, xs)
    close(eqx.filter(grads.fn.fn, eqx.is_array), eqx.filter(expected, eqx.is_array))


# ----------------------------------------------------------------------------------
# Scans inside other transforms


def decay(carry, x):
    carry = 0.9 * carry + jnp.sin(carry * x)
    return carry, {"state": carry, "square": carry**2}


def decay_without_input(carry, _):
    carry = carry + 0.1 * jnp.cos(carry)
    return carry, carry * 2


@jax.jit
def sliced_decays(inits, xs):
    """The references of the test below, the outputs sliced as the transforms slice them."""
    carry, ys = jax.vmap(lambda c, x: jax.lax.scan(decay, c, x))(inits, xs)
    free_carry, free_ys = jax.vmap(lambda c: jax.lax.scan(decay_without_input, c, None, length=11))(
        inits
    )
    return (carry, jax.tree_util.tree_map(lambda y: y[:, 1::3], ys)), (
        free_carry,
        free_ys[:, -4::-2],
    )


@pytest.mark.parametrize("chunk_size", [2, 5])
def test_chunked_vmap_of_sliced_scan(chunk_size):
    inits, xs = normal(0, (5, 2)), normal(1, (5, 9, 2))
    with_xs, without_xs = sliced_decays(inits, xs)
    sliced = zm.SlicedScan(decay, start=1, step=3)
    close(zm.ChunkedVmap(sliced, chunk_size=chunk_size)(inits, xs), with_xs)

    # Without inputs: a shared `xs` of None and a fixed length.
    sliced = zm.SlicedScan(decay_without_input, start=-4, step=-2, length=11)
    close(zm.ChunkedVmap(sliced, chunk_size=chunk_size)(inits), without_xs)


def tanh_step(carry, w):
    carry = jnp.tanh(w * carry + 0.1)
    return carry, jnp.sum(carry)


def tanh_loss_with(scan):
    def loss(x0, ws):
        carry, ys = scan(x0, ws)
        return jnp.sum(carry**2) + jnp.sum(ys)

    return loss


# The reference of every chunk size below: one program.
plain_tanh_grads = jax.jit(
    jax.vmap(
        jax.grad(
            tanh_loss_with(lambda init, xs: jax.lax.scan(tanh_step, init, xs)), argnums=(0, 1)
        ),
        in_axes=(0, None),
    )
)


@pytest.mark.parametrize("chunk_size", [1, 3, 4])
def test_checkpointed_scan_in_grad_in_chunked_vmap(chunk_size):
    ws = normal(0, (10,))
    checkpointed = tanh_loss_with(zm.CheckpointedScan(tanh_step, chunk_size=chunk_size))
    x0s = normal(1, (5, 3))
    per_example = zm.ChunkedVmap(jax.grad(checkpointed, argnums=(0, 1)), chunk_size=2)
    actual = per_example(x0s, jax.device_put(np.broadcast_to(np.asarray(ws), (5, 10))))
    close(actual, plain_tanh_grads(x0s, ws))


# ----------------------------------------------------------------------------------
# JAX and Equinox transforms around a stack


def test_grad_with_respect_to_data_of_a_hessian_stack():
    params, a = batch_of_params(6), normal(2, (6,))
    stack = zm.ChunkedVmap(zm.BatchedHessian(energy, batch_size=2), chunk_size=4)

    def total(stack, params, a):
        return jnp.sum(jnp.sin(stack(params, a)))

    def reference(params, a):
        def one(p, s):
            flat, fn = flat_reference(energy, p)
            return jax.hessian(fn)(flat, s)

        return jnp.sum(jnp.sin(jax.vmap(one)(params, a)))

    grad = eqx.filter_jit(jax.grad(total, argnums=(1, 2)))
    expected = jax.jit(jax.grad(reference, argnums=(0, 1)))(params, a)
    close(grad(stack, params, a), expected, rtol=1e-10)


def test_grad_of_a_dataset_hessian_with_respect_to_the_data():
    params, x, y = regression_problem(7)
    dataset_hessian = zm.Microbatcher(
        zm.BatchedHessian(regression_loss), microbatch_size=3, argnums=(1, 2), accumulator="mean"
    )
    flat, fn = flat_reference(regression_loss, params)

    def trace(hessian_of_data):
        return lambda x, y: jnp.trace(hessian_of_data(x, y))

    actual = jax.grad(trace(lambda x, y: dataset_hessian(params, x, y)), argnums=(0, 1))(x, y)
    expected = jax.jit(jax.grad(trace(lambda x, y: jax.hessian(fn)(flat, x, y)), argnums=(0, 1)))(
        x, y
    )
    close(actual, expected, rtol=1e-10)


def test_stacks_under_jit_vmap_and_filter_jit():
    params, a = batch_of_params(4), normal(2, (4,))
    hessian = zm.BatchedHessian(energy, nbatches=3)

    expected = energy_hessians(params, a)
    close(jax.vmap(hessian)(params, a), expected)
    close(jax.jit(jax.vmap(hessian))(params, a), expected)
    close(
        eqx.filter_jit(lambda t, p, s: t(p, s))(zm.ChunkedVmap(hessian, chunk_size=3), params, a),
        expected,
    )
    # Chunks of a jax.vmap of a BatchedHessian, over two batch axes.
    nested = zm.ChunkedVmap(jax.vmap(hessian), chunk_size=1)

    # (Reshaped by NumPy: no program to compile per leaf.)
    def in_two(v):
        return jax.device_put(np.reshape(v, (2, 2, *v.shape[1:])))

    close(
        nested(jax.tree_util.tree_map(in_two, params), in_two(a)),
        in_two(expected),
    )


def test_microbatched_per_example_jacobians_concatenate():
    model = mlp()
    xs = normal(1, (11, 3))
    per_example = zm.ChunkedVmap(zm.BatchedJacobian(model), chunk_size=3)
    stacked = zm.Microbatcher(per_example, microbatch_size=4, accumulator="concat")(xs)
    close(stacked, eqx.filter_jit(lambda m, xs: jax.vmap(jax.jacrev(m))(xs))(model, xs))


# ----------------------------------------------------------------------------------
# Errors surface through a stack


def test_errors_surface_through_a_stack():
    def not_scalar(x, a):
        return a * x

    stack = zm.ChunkedVmap(zm.BatchedHessian(not_scalar), chunk_size=2)
    with pytest.raises(TypeError, match=r"must return a scalar \(shape \(\)\).*shape \(3,\)"):
        stack(normal(0, (4, 3)), normal(1, (4,)))

    stack = zm.ChunkedVmap(zm.BatchedJacobian(features), chunk_size=2)
    with pytest.raises(ValueError, match=r"same size along their mapped axes.*5.*4"):
        stack(batch_of_params(5), normal(2, (4,)))

    params, x, y = regression_problem(10)
    per_example_sum = zm.Microbatcher(
        zm.ChunkedVmap(zm.BatchedHessian(regression_loss), chunk_size=2, in_axes=(None, 0, 0)),
        microbatch_size=4,
        argnums=(1, 2),
    )
    with pytest.raises(ValueError, match=r"'sum' needs results of one shape.*'concat'"):
        per_example_sum(params, x[:, None], y[:, None])


# ----------------------------------------------------------------------------------
# Sweeps over block sizes at every level of a stack


@settings(max_examples=4)
@given(
    batch=st.integers(1, 9),
    chunk_size=st.integers(1, 10),
    hessian_batch_size=st.integers(1, 6),
)
def test_per_example_hessian_sweep(batch, chunk_size, hessian_batch_size):
    params, a = batch_of_params(batch, seed=batch), normal(3, (batch,))
    stack = zm.ChunkedVmap(
        zm.BatchedHessian(energy, batch_size=hessian_batch_size), chunk_size=chunk_size
    )
    close(stack(params, a), energy_hessians(params, a))


@settings(max_examples=6)
@given(
    batch=st.integers(1, 12),
    microbatch_size=st.integers(1, 13),
    nbatches=st.integers(1, 5),
)
def test_dataset_hessian_sweep(batch, microbatch_size, nbatches):
    params, x, y = regression_problem(batch)
    dataset_hessian = zm.Microbatcher(
        zm.BatchedHessian(regression_loss, nbatches=nbatches),
        microbatch_size=microbatch_size,
        argnums=(1, 2),
        accumulator="mean",
    )
    close(dataset_hessian(params, x, y), regression_hessian(params, x, y))


def sine_step(carry, w):
    return jnp.sin(w * carry) + carry, carry


def sine_loss(x0, ws, scan):
    carry, ys = scan(sine_step, x0, ws)
    return jnp.sum(carry) + jnp.sum(ys**2)


# The reference of the sweep below, one function for every example (a program per shape).
plain_sine_grads = jax.jit(
    jax.vmap(jax.grad(lambda x0, ws: sine_loss(x0, ws, jax.lax.scan)), in_axes=(0, None))
)


@settings(max_examples=4)
@given(
    batch=st.integers(1, 6),
    chunk_size=st.integers(1, 7),
    scan_chunk_size=st.integers(1, 9),
    length=st.integers(1, 8),
)
def test_per_example_scan_gradient_sweep(batch, chunk_size, scan_chunk_size, length):
    def checkpointed(step, init, xs):
        return zm.CheckpointedScan(step, chunk_size=scan_chunk_size)(init, xs)

    x0s, ws = normal(0, (batch, 2)), normal(1, (length,))
    stack = zm.ChunkedVmap(
        jax.grad(lambda x0, ws: sine_loss(x0, ws, checkpointed)),
        chunk_size=chunk_size,
        in_axes=(0, None),
    )
    close(stack(x0s, ws), plain_sine_grads(x0s, ws))
