"""Products of the blocked operators on models whose variables are sharded over the
devices: pytree vectors in, pytree products out, each leaf laid out like its variable;
the values those of the same model on one device.

Layouts: FSDP (each leaf's first axis that the device count divides, sharded), data
parallel (weights replicated, the batch sharded) and tensor parallel (a weight's last
axis sharded), on Auto meshes, and on Explicit meshes where the model's own operations
are well typed. Run in a process of its own with
`--xla_force_host_platform_device_count=4` (or 8): the device count is read here.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zodmem as zm

D = len(jax.devices())


def mlp():
    # Hidden layers as wide as the devices' count allows: XLA lays their products out
    # over the other axis of the weight unless told.
    return eqx.nn.MLP(16, D, 8 * D, 2, key=jax.random.key(0))


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.head = eqx.nn.Linear(8 * 4 * 4, D, key=k2)

    def __call__(self, x):
        z = jnp.tanh(self.conv(x.reshape(1, 4, 4)))
        return self.head(z.ravel())


class Dense(eqx.Module):
    """A layer whose products are well typed on Explicit axes with its weight sharded
    over its outputs and the batch replicated."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, key):
        self.weight = jax.random.normal(key, (4 * D, 16)) / 3
        self.bias = jnp.linspace(-1.0, 1.0, 4 * D)

    def __call__(self, x):
        z = jnp.tanh(self.weight @ x + self.bias)
        return jnp.stack([jnp.sum(z**2), jnp.sum(z * self.bias)] * (D // 2))


def outputs(model, x, y):
    return jax.vmap(model)(x)


def squared_error(out, x, y):
    return jnp.mean((out - y) ** 2)


def loss(model, x, y):
    return squared_error(outputs(model, x, y), x, y)


def spec_of(leaf, layout):
    """The layout's PartitionSpec for one variable."""
    spec = [None] * leaf.ndim
    axes = range(leaf.ndim) if layout == "fsdp" else reversed(range(leaf.ndim))
    if layout in ("fsdp", "tensor") and leaf.ndim >= (1 if layout == "fsdp" else 2):
        for axis in axes:
            if leaf.shape[axis] % D == 0:
                spec[axis] = "d"
                break
    return P(*spec)


def laid_out(mesh, model, x, y, layout, batch):
    def put(leaf):
        if not eqx.is_inexact_array(leaf):
            return leaf
        return jax.device_put(leaf, NamedSharding(mesh, spec_of(leaf, layout)))

    batch = NamedSharding(mesh, P("d") if batch else P())
    return jax.tree.map(put, model), jax.device_put(x, batch), jax.device_put(y, batch)


def check_laid_out(vectors, variables, block=False):
    """Each leaf of `vectors` (a block of them with `block`) laid out like its variable,
    and no device holding more than 2/D of a sharded leaf's entries."""
    leaves = [v for v in jax.tree.leaves(variables) if eqx.is_inexact_array(v)]
    for vector, variable in zip(jax.tree.leaves(vectors), leaves, strict=True):
        spec = variable.sharding.spec
        expected = P(None, *spec) if block else spec
        assert vector.sharding.is_equivalent_to(
            NamedSharding(variable.sharding.mesh, expected), vector.ndim
        ), (vector.shape, vector.sharding, expected)
        if any(axis is not None for axis in spec):
            for shard in vector.addressable_shards:
                assert shard.data.size <= 2 * vector.size / D


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
CASES = [
    pytest.param(model_fn, features, layout, AxisType.Auto, id=f"{name}-{layout}-auto")
    for name, model_fn, features in [("mlp", mlp, 16), ("cnn", lambda: CNN(jax.random.key(0)), 16)]
    for layout in ("fsdp", "data", "tensor")
] + [
    pytest.param(
        lambda: Dense(jax.random.key(0)),
        16,
        layout,
        AxisType.Explicit,
        id=f"dense-{layout}-explicit",
    )
    for layout in ("fsdp", "data")
]


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
def test_products_laid_out(name, model_fn, features, layout, kind, request):
    if name == "microbatched" and kind == AxisType.Explicit:
        # The microbatches' shard_map closes over the flat vector sharded on Explicit axes.
        reason = "Microbatcher's products on Explicit axes"
        request.applymarker(
            pytest.mark.xfail(raises=NotImplementedError, strict=True, reason=reason)
        )
    (model, x, y), (sharded, xs, ys), mesh = setting(model_fn, features, layout, kind)
    params = eqx.filter(model, eqx.is_inexact_array)
    variables = eqx.filter(sharded, eqx.is_inexact_array)
    v, block = vectors_like(params), vectors_like(params, 3)
    single = TRANSFORMS[name]().operator(model, x, y)
    with jax.sharding.set_mesh(mesh):
        op = TRANSFORMS[name]().operator(sharded, xs, ys)
        product = op.mv(placed(v, variables))
    check_close(product, single.mv(v))
    check_laid_out(product, variables)
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
