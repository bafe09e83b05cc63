"""The models, layouts and checks that the tests of variables sharded over the devices
share: small models (an MLP, a CNN, a transformer block, a dense layer well typed on
Explicit axes), each laid out FSDP-style, data parallel or tensor parallel, and the check
that a vector is laid out like the variables.

Layouts: FSDP (each leaf's first axis that the device count divides, sharded), data
parallel (weights replicated, the batch sharded) and tensor parallel (a weight's last
axis sharded). The device count is read here, in a process started with
`--xla_force_host_platform_device_count=4` (or 8).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

D = len(jax.devices())


def mlp(in_size=8, out_size=2, width=32):
    return eqx.nn.MLP(in_size, out_size, width, 2, key=jax.random.key(0))


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key, out_size=2):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.head = eqx.nn.Linear(8 * 4 * 4, out_size, key=k2)

    def __call__(self, x):
        z = jnp.tanh(self.conv(x.reshape(1, 4, 4)))
        return self.head(z.ravel())


class Block(eqx.Module):
    """A transformer block: attention and an MLP, each with a residual and a norm."""

    attention: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=k1)
        self.norm = eqx.nn.LayerNorm(8)
        self.mlp = eqx.nn.MLP(8, 8, 16, 1, key=k2)
        self.head = eqx.nn.Linear(8, 2, key=k3)

    def __call__(self, x):
        tokens = x.reshape(2, 8)
        tokens = tokens + self.attention(tokens, tokens, tokens)
        tokens = jax.vmap(self.norm)(tokens)
        tokens = tokens + jax.vmap(self.mlp)(tokens)
        return self.head(jnp.mean(tokens, axis=0))


class Dense(eqx.Module):
    """A layer whose products are well typed on Explicit axes with its weight sharded
    over its outputs and the batch replicated; `out_size` outputs, an even number."""

    weight: jax.Array
    bias: jax.Array
    out_size: int = eqx.field(static=True)

    def __init__(self, key, in_size=8, out_size=2):
        self.weight = jax.random.normal(key, (4 * D, in_size)) / 3
        self.bias = jnp.linspace(-1.0, 1.0, 4 * D)
        self.out_size = out_size

    def __call__(self, x):
        z = jnp.tanh(self.weight @ x + self.bias)
        return jnp.stack([jnp.sum(z**2), jnp.sum(z * self.bias)] * (self.out_size // 2))


def layouts(auto, explicit):
    """pytest parameters `(model_fn, features, layout, kind)`: each `(name, model_fn,
    features)` of `auto` in every layout on an Auto mesh, and the `(model_fn, features)`
    of `explicit` FSDP-style and data parallel on an Explicit mesh, where the model's own
    operations must be well typed (its batch replicated)."""
    model_fn, features = explicit
    return [
        pytest.param(model_fn, features, layout, AxisType.Auto, id=f"{name}-{layout}-auto")
        for name, model_fn, features in auto
        for layout in ("fsdp", "data", "tensor")
    ] + [
        pytest.param(model_fn, features, layout, AxisType.Explicit, id=f"dense-{layout}-explicit")
        for layout in ("fsdp", "data")
    ]


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


def laid_out(mesh, model, x, y, layout, batch=True):
    """The model on `mesh` in `layout`, and the data split along the batch over the mesh
    (with `batch`) or whole on every device."""

    def put(leaf):
        if not eqx.is_inexact_array(leaf):
            return leaf
        return jax.device_put(leaf, NamedSharding(mesh, spec_of(leaf, layout)))

    batch = NamedSharding(mesh, P("d") if batch else P())
    return jax.tree.map(put, model), jax.device_put(x, batch), jax.device_put(y, batch)


def check_laid_out(vectors, variables, *, block):
    """Each leaf of `vectors` (a block of them, on a leading axis, with `block`) laid out
    like its variable, and no device holding more than 2/D of a sharded leaf's entries."""
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
