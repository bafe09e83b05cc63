"""`BatchedGGN(sharding=)` over 4 CPU devices, against `J^T H J` from plain JAX.

Run in a process of its own with `--xla_force_host_platform_device_count=4`; collected
only where JAX has at least 4 devices.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zodmem as zm
from tests.helpers import close

pytestmark = pytest.mark.usefixtures("float64")


def mesh_of(shape=(4,), names=("d",)):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def model(params, inputs, targets):
    return {"y": jnp.tanh(inputs @ params["w"] + params["b"]), "s": jnp.sum(params["w"] ** 2)}


def loss(outputs, inputs, targets):
    return jnp.sum(jnp.cos(outputs["y"] - targets) ** 2) + outputs["s"] ** 2


PARAMS_SHAPES = {"b": (2,), "w": (3, 2)}  # 8 variables: 2 rows per device
INPUTS = np.linspace(-1.0, 1.0, 15).reshape(5, 3)
TARGETS = np.linspace(0.0, 1.0, 10).reshape(5, 2)


def make_params():
    return {
        name: jnp.asarray(np.linspace(-0.4, 0.7, int(np.prod(shape))).reshape(shape))
        for name, shape in PARAMS_SHAPES.items()
    }


@jax.jit
def reference(params):
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    outputs = model(params, INPUTS, TARGETS)
    out_flat, unravel_out = jax.flatten_util.ravel_pytree(outputs)
    J = jax.jacfwd(lambda z: jax.flatten_util.ravel_pytree(model(unravel(z), INPUTS, TARGETS))[0])
    H = jax.hessian(lambda o: loss(unravel_out(o), INPUTS, TARGETS))(out_flat)
    jacobian = J(flat)
    return jacobian.T @ H @ jacobian


def check_shards(result, sharding, share_shape):
    assert result.sharding.is_equivalent_to(sharding, result.ndim), result.sharding
    for shard in result.addressable_shards:
        assert shard.data.shape == share_shape
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(result)[shard.index])


@pytest.mark.parametrize(
    "spec, options, share",
    [
        (P("d", None), {"batch_size": 1}, (2, 8)),
        (P("d", None), {"mode": "rev", "strategy": "recompute"}, (2, 8)),
        (P(None, "d"), {"batch_size": 2}, (8, 2)),
        (P(), {"nbatches": 3}, (8, 8)),
    ],
)
def test_sharded_ggn_equals_plain_jax(spec, options, share):
    params = make_params()
    sharding = NamedSharding(mesh_of(), spec)
    G = zm.BatchedGGN(model, loss, sharding=sharding, **options)(params, INPUTS, TARGETS)
    close(G, reference(params))
    check_shards(G, sharding, share)


def test_sharded_inside_filter_jit_with_aux_and_a_budget():
    params = make_params()
    sharding = NamedSharding(mesh_of(), P("d", None))

    def with_aux(params, inputs, targets):
        return model(params, inputs, targets), "kept"

    transform = zm.BatchedGGN(with_aux, loss, has_aux=True, batch_size=1, sharding=sharding)
    G, aux = eqx.filter_jit(lambda p: transform(p, INPUTS, TARGETS))(params)
    expected = reference(params)
    close(G, expected)
    assert aux == "kept"
    check_shards(G, sharding, (2, 8))
    budgeted = zm.BatchedGGN(model, loss, max_memory="200MB", sharding=sharding)
    plan = budgeted.plan(params, INPUTS, TARGETS)
    assert plan.total == 2 and "on each of 4 devices" in plan.what
    close(budgeted(params, INPUTS, TARGETS), expected)


def test_devices_must_divide_the_variables():
    params = {"w": jnp.ones(6)}
    sharding = NamedSharding(mesh_of(), P("d", None))
    with pytest.raises(ValueError, match=r"splits the 6 rows over 4 devices"):
        zm.BatchedGGN(lambda w: w["w"] ** 2, lambda o: jnp.sum(o**2), sharding=sharding)(params)
    with pytest.raises(ValueError, match=r"for 3 axes, but the matrix has 2"):
        three = NamedSharding(mesh_of(), P("d", None, None))
        zm.BatchedGGN(lambda w: w["w"] ** 2, lambda o: jnp.sum(o**2), sharding=three)(params)
