"""Operators of sharded transforms over 4 CPU devices: `mm` spreads its vectors over the
devices of the axes the transform's sharding splits, and equals the one-device answer.

Run in a process of its own with `--xla_force_host_platform_device_count=4`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zodmem as zm
from tests.helpers import close

pytestmark = pytest.mark.usefixtures("float64")


def loss(params, data):
    z = jnp.tanh(data @ params["w"] + params["b"])
    return jnp.sum(z**2) + jnp.sum(params["w"] ** 3) * params["b"]


def outputs(params, data):
    return jnp.sin(data @ params["w"]) * params["b"]


PARAMS = {"b": np.float64(0.3), "w": np.linspace(0.1, 0.9, 5)}
DATA = np.linspace(-1.0, 1.0, 15).reshape(3, 5)
VECTORS = np.random.default_rng(0).normal(size=(6, 8))  # 8 vectors, 2 per device


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("spec", [P("d", None), P(None, "d")])
def test_sharded_hessian_products(kind, spec):
    mesh = jax.make_mesh((4,), ("d",), axis_types=(kind,))
    sharding = NamedSharding(mesh, spec)
    expected = zm.BatchedHessian(loss).operator(PARAMS, DATA).mm(VECTORS)
    sharded = zm.BatchedHessian(loss, batch_size=1, sharding=sharding)
    result = sharded.operator(PARAMS, DATA).mm(VECTORS)
    close(result, expected)
    # Each device made its own 2 of the 8 columns, and holds only them.
    assert result.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "d")), 2)
    assert {shard.data.shape for shard in result.addressable_shards} == {(6, 2)}


def test_sharded_jacobian_products_and_budget():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, P(None, "d"))
    op = zm.BatchedJacobian(outputs).operator(PARAMS, DATA)
    expected = op.mm(VECTORS)
    sharded = zm.BatchedJacobian(outputs, max_memory="400MB", sharding=sharding)
    close(sharded.operator(PARAMS, DATA).mm(VECTORS), expected)
    close(sharded.operator(PARAMS, DATA).T.mm(expected), op.T.mm(expected))


def test_vectors_the_devices_do_not_divide_are_refused():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    sharded = zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P("d", None)))
    with pytest.raises(ValueError, match="splits the 6 vectors .* over 4 devices"):
        sharded.operator(PARAMS, DATA).mm(VECTORS[:, :6])


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_microbatcher_operator_of_a_sharded_batch(kind):
    def mean_loss(w, x, y):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

    mesh = jax.make_mesh((4,), ("d",), axis_types=(kind,))
    w = np.linspace(-0.3, 0.3, 3)
    x, y = np.random.default_rng(1).normal(size=(16, 3)), np.arange(16.0) / 16
    H = np.asarray(jax.jit(jax.hessian(mean_loss))(w, x, y))
    xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    ys = jax.device_put(y, NamedSharding(mesh, P("d")))
    hessian = zm.Microbatcher(
        zm.BatchedHessian(mean_loss), microbatch_size=2, argnums=(1, 2), accumulator="mean"
    )
    op = hessian.operator(w, xs, ys)  # each device reduces its own microbatches
    close(op.mm(VECTORS[:3, :4]), H @ VECTORS[:3, :4])
    close(op.mv(VECTORS[:3, 0]), H @ VECTORS[:3, 0])
