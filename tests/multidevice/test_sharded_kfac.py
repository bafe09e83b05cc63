"""KFAC and EKFAC of a model whose weights are laid out over the devices: the same
factors as the whole model's, held whole on every device (they are small), and the
products and solves of vectors shaped like the weights laid out like the weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import zodmem as zm
from tests.multidevice.models import CNN, Block, D, Dense, check_laid_out, laid_out, layouts, mlp
from zodmem._plan import _lean


def predict(model, inputs, targets):
    return jax.vmap(model)(inputs)


LOSS = zm.losses.SquaredError()
CASES = layouts(
    [
        ("mlp", mlp, 8),
        ("cnn", lambda: CNN(jax.random.key(0), D), 16),
        ("block", lambda: Block(jax.random.key(0)), 16),
    ],
    (lambda: Dense(jax.random.key(0), 16, D), 16),
)


def vector_like(params, seed):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )


@pytest.mark.parametrize("cls", [zm.KFAC, zm.EKFAC])
@pytest.mark.parametrize("model_fn, features, layout, kind", CASES)
def test_kfac_of_a_sharded_model_is_the_whole_model_s_laid_out_like_it(
    cls, model_fn, features, layout, kind
):
    model = model_fn()
    x = jax.random.normal(jax.random.key(1), (2 * D, features))
    out = jax.eval_shape(lambda: predict(model, x, None)).shape[-1]
    y = jax.random.normal(jax.random.key(2), (2 * D, out))
    whole = cls(predict, LOSS)(model, x, y)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(kind,))
    with jax.sharding.set_mesh(mesh):
        sharded, xs, ys = laid_out(mesh, model, x, y, layout, batch=kind == AxisType.Auto)
        F = cls(predict, LOSS)(sharded, xs, ys)
        variables = eqx.filter(sharded, eqx.is_inexact_array)
        v = vector_like(eqx.filter(model, eqx.is_inexact_array), 3)
        vs = jax.tree.map(lambda a, w: jax.device_put(a, w.sharding), v, variables)
        product, solution = F.mv(vs), F.solve(vs, damping=0.5)
    check_laid_out(product, sharded, block=False)
    check_laid_out(solution, sharded, block=False)
    scale = float(jnp.max(jnp.abs(whole.as_matrix())))
    np.testing.assert_allclose(F.as_matrix() / scale, whole.as_matrix() / scale, atol=1e-5)
    for got, expected in [(product, whole.mv(v)), (solution, whole.solve(v, damping=0.5))]:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            top = float(jnp.max(jnp.abs(b))) or 1.0
            np.testing.assert_allclose(np.asarray(a) / top, np.asarray(b) / top, atol=1e-5)


@pytest.mark.parametrize("layout", ["data", "fsdp", "tensor"])
def test_the_build_holds_each_device_s_share_of_the_examples(layout, monkeypatch):
    """By XLA's count, the build's program holds on each of D devices about a D-th of
    what it holds on one, whatever the weights' layout: each layer's rows stay split
    as the data split their examples (with FSDP- or tensor-parallel weights, XLA's
    propagation alone split the rows' features and held every device's rows whole)."""
    model = eqx.nn.MLP(64, 10, 256, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2048, 64))
    y = jnp.arange(2048) % 10
    seen = []
    jitted = _lean._jitted

    def counted(platform):
        program = jitted(platform)

        def call(dynamic, static):
            memory = program.lower(dynamic, static).compile().memory_analysis()
            seen.append(memory.temp_size_in_bytes + memory.output_size_in_bytes)
            return program(dynamic, static)

        return call

    monkeypatch.setattr(_lean, "_jitted", counted)

    def per_device(devices, layout):
        mesh = jax.make_mesh(
            (devices,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
        )
        sharded, xs, ys = laid_out(mesh, model, x, y, layout)
        zm.KFAC(predict, zm.losses.SoftmaxCrossEntropy())(sharded, xs, ys)
        return seen[-1]

    one, many = per_device(1, "data"), per_device(D, layout)
    assert many <= 1.5 * one / D, (one, many)
