"""Products of the blocked operators on models whose variables are sharded over the
devices: pytree vectors in, pytree products out, each leaf laid out like its variable;
the values those of the same model on one device.

The models and layouts (FSDP, data and tensor parallel, on Auto meshes, and on Explicit
meshes where the model's own operations are well typed) are those of
`tests/multidevice/models.py`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zodmem as zm
from tests.multidevice import models
from tests.multidevice.models import CNN, D, Dense, check_laid_out, laid_out, layouts


def mlp():
    # Hidden layers as wide as the devices' count allows: XLA lays their products out
    # over the other axis of the weight unless told.
    return models.mlp(16, D, 8 * D)


def outputs(model, x, y):
    return jax.vmap(model)(x)


def squared_error(out, x, y):
    return jnp.mean((out - y) ** 2)


def loss(model, x, y):
    return squared_error(outputs(model, x, y), x, y)


def check_close(actual, expected):
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=1e-5)


TRANSFORMS = {
    "hessian": lambda: zm.BatchedHessian(loss),
    "ggn": lambda: zm.BatchedGGN(outputs, squared_error),
    "microbatched": lambda: zm.Microbatcher(
        zm.BatchedHessian(loss), microbatch_size=D, argnums=(1, 2), accumulator="mean"
    ),
}
CASES = layouts(
    [("mlp", mlp, 16), ("cnn", lambda: CNN(jax.random.key(0), D), 16)],
    (lambda: Dense(jax.random.key(0), 16, D), 16),
)


def setting(model_fn, features, layout, kind):
    model = model_fn()
    x = jax.random.normal(jax.random.key(1), (2 * D, features))
    y = jax.random.normal(jax.random.key(2), (2 * D, D))
    mesh = jax.make_mesh((D,), ("d",), axis_types=(kind,))
    # On Explicit axes the batch is replicated, as the model's operations are typed so.
    sharded = laid_out(mesh, model, x, y, layout, batch=kind == AxisType.Auto)
    return (model, x, y), sharded, mesh


def vectors_like(params, k=None):
    def vector(i, leaf):
        shape = leaf.shape if k is None else (k, *leaf.shape)
        return jax.random.normal(jax.random.key(10 + i), shape, leaf.dtype)

    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [vector(i, leaf) for i, leaf in enumerate(leaves)])


def placed(vectors, variables, block=False):
    def put(v, leaf):
        spec = leaf.sharding.spec
        return jax.device_put(
            v, NamedSharding(leaf.sharding.mesh, P(None, *spec) if block else spec)
        )

    return jax.tree.map(put, vectors, variables)


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("model_fn, features, layout, kind", CASES)
def test_products_laid_out(name, model_fn, features, layout, kind):
    (model, x, y), (sharded, xs, ys), mesh = setting(model_fn, features, layout, kind)
    params = eqx.filter(model, eqx.is_inexact_array)
    variables = eqx.filter(sharded, eqx.is_inexact_array)
    v, block = vectors_like(params), vectors_like(params, 3)
    single = TRANSFORMS[name]().operator(model, x, y)
    with jax.sharding.set_mesh(mesh):
        op = TRANSFORMS[name]().operator(sharded, xs, ys)
        product = op.mv(placed(v, variables))
    check_close(product, single.mv(v))
    check_laid_out(product, variables, block=False)
    with jax.sharding.set_mesh(mesh):
        products = op.mm(placed(block, variables, block=True))
    expected = jax.vmap(single.mv)(block)
    check_close(products, expected)
    check_laid_out(products, variables, block=True)


def test_flat_products_on_one_device():
    model = mlp()
    x = jax.random.normal(jax.random.key(1), (2 * D, 16))
    y = jax.random.normal(jax.random.key(2), (2 * D, D))
    op = zm.BatchedHessian(loss).operator(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    v = vectors_like(params)
    flat = jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(v)])
    expected = jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(op.mv(v))])
    np.testing.assert_allclose(op.mv(flat), expected, rtol=1e-6)
    block = vectors_like(params, 2)
    columns = jnp.concatenate([leaf.reshape(2, -1) for leaf in jax.tree.leaves(block)], 1).T
    rows = jnp.concatenate([leaf.reshape(2, -1) for leaf in jax.tree.leaves(op.mm(block))], 1)
    np.testing.assert_allclose(op.mm(columns).T, rows, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("approximation", [zm.KFAC, zm.EKFAC], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_kfac_data_parallel(approximation, kind, float64):
    """Weights replicated and the batch sharded, under the mesh: the factors summed over
    the devices' shares of the batch equal those of one device."""
    # In float64: the factors' eigendecompositions magnify float32's rounding of sums
    # taken in another order over the devices' shares.
    model = eqx.nn.MLP(16, 4, 32, 2, key=jax.random.key(0))
    model = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, model)
    x = jax.random.normal(jax.random.key(1), (4 * D, 16), jnp.float64)
    y = jax.random.normal(jax.random.key(2), (4 * D, 4), jnp.float64)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(kind,))
    sharded, xs, ys = laid_out(mesh, model, x, y, "data", batch=True)
    approximate = approximation(outputs, zm.losses.SquaredError())
    single = approximate(model, x, y)
    size = sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    v = jax.random.normal(jax.random.key(3), (size,), jnp.float64)
    with jax.sharding.set_mesh(mesh):
        F = approximate(sharded, xs, ys)
        product, solved = F.mv(v), F.solve(v, damping=0.1)
    check_close(product, single.mv(v))
    check_close(solved, single.solve(v, damping=0.1))


@pytest.mark.parametrize("model_fn, features, layout, kind", CASES[-2:] + CASES[:2])
def test_transposed_jacobian_products(model_fn, features, layout, kind):
    # A Jacobian's transpose maps outputs to the variables' space: its products, as
    # computed and as lineax keeps them linearised, are laid out like the variables.
    (model, x, y), (sharded, xs, ys), mesh = setting(model_fn, features, layout, kind)
    variables = eqx.filter(sharded, eqx.is_inexact_array)
    single = zm.BatchedJacobian(outputs).operator(model, x, y).T
    u = jax.random.normal(jax.random.key(3), (2 * D, D))
    with jax.sharding.set_mesh(mesh):
        op = zm.BatchedJacobian(outputs).operator(sharded, xs, ys).T
        kept = lx.linearise(op)
        products = [op.mv(u), kept.mv(u)]
    for product in products:
        check_close(product, single.mv(u))
        check_laid_out(product, variables, block=False)
    columns = jax.random.normal(jax.random.key(4), (u.size, 3))
    with jax.sharding.set_mesh(mesh):
        block = op.mm(columns)
    np.testing.assert_allclose(block, single.mm(columns), rtol=1e-5, atol=1e-6)
