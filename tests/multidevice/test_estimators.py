"""Estimators over 4 CPU devices: the probes spread over the devices of a sharding's
split axes, each device running its own blocks, with the one-device answer.

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


PARAMS = {"b": np.float64(0.3), "w": np.linspace(0.1, 0.9, 7)}  # 8 variables
DATA = np.linspace(-1.0, 1.0, 21).reshape(3, 7)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_sharded_exact_diagonal(kind):
    mesh = jax.make_mesh((4,), ("d",), axis_types=(kind,))
    op = zm.BatchedHessian(loss).operator(PARAMS, DATA)
    expected = zm.diagonal(op)
    result = zm.diagonal(op, sharding=NamedSharding(mesh, P("d")), batch_size=1)
    close(result, expected)
    # Each device made the entries of its own 2 unit vectors, and holds only them.
    assert result.sharding.is_equivalent_to(NamedSharding(mesh, P("d")), 1)
    assert {shard.data.shape for shard in result.addressable_shards} == {(2,)}
    close(zm.trace(op, sharding=NamedSharding(mesh, P("d"))), jnp.sum(expected))


def test_sharded_estimates_follow_the_transform_and_equal_one_device():
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    sharded = zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P(None, ("x", "y"))))
    op, plain = sharded.operator(PARAMS, DATA), zm.BatchedHessian(loss).operator(PARAMS, DATA)
    key = jax.random.key(4)
    for method in ("hutchinson", "hutch++"):
        close(
            zm.trace(op, method=method, num_probes=12, key=key),
            zm.trace(plain, method=method, num_probes=12, key=key),
            rtol=1e-10,
        )
    close(
        zm.diagonal(op, method="diag++", num_probes=16, key=key),
        zm.diagonal(plain, method="diag++", num_probes=16, key=key),
        rtol=1e-10,
        atol=1e-12,
    )


def test_probes_the_devices_do_not_divide():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    op = zm.BatchedHessian(loss).operator(PARAMS, DATA)
    # Unit vectors: the last device's share runs past the end, and is cut.
    op6 = zm.BatchedHessian(loss).operator({**PARAMS, "w": PARAMS["w"][:5]}, DATA[:, :5])
    close(zm.diagonal(op6, sharding=NamedSharding(mesh, P("d"))), zm.diagonal(op6))
    # Random probes: the extra ones count for nothing.
    key = jax.random.key(0)
    close(
        zm.trace(
            op, method="hutchinson", num_probes=10, key=key, sharding=NamedSharding(mesh, P("d"))
        ),
        zm.trace(op, method="hutchinson", num_probes=10, key=key),
        rtol=1e-12,
    )


def test_sharded_spectral_density():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    op = zm.BatchedHessian(loss).operator(PARAMS, DATA)
    key = jax.random.key(5)
    expected = zm.spectral_density(op, num_probes=6, num_steps=5, key=key)
    result = zm.spectral_density(
        op, num_probes=6, num_steps=5, key=key, sharding=NamedSharding(mesh, P("d"))
    )
    close(result, expected, rtol=1e-9, atol=1e-12)


def test_solves_of_a_sharded_transform_run_on_one_device():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    sharded = zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P("d", None)))
    op, plain = sharded.operator(PARAMS, DATA), zm.BatchedHessian(loss).operator(PARAMS, DATA)
    B = np.random.default_rng(1).normal(size=(8, 6))
    close(zm.solve(op, B, damping=1.0), zm.solve(plain, B, damping=1.0), rtol=1e-9, atol=1e-12)
    close(
        zm.marginal_variances(op, [1, 4, 6], damping=1.0),
        zm.marginal_variances(plain, [1, 4, 6], damping=1.0),
        rtol=1e-9,
        atol=1e-12,
    )
