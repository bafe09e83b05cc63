"""The protocol's test transform (tests/gram.py) spread over 4 CPU devices: a sharding
of its rows, with no wiring of its own, gives each device its rows and the plain answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tests.gram import BlockedGram
from tests.helpers import close

pytestmark = pytest.mark.usefixtures("float64")


def features(x):
    return jnp.stack([jnp.sin(x), jnp.cos(2 * x), x**2], axis=1)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("batch_size", [None, 2, 3])
def test_rows_split_over_devices(kind, batch_size):
    mesh = jax.make_mesh((4,), ("d",), axis_types=(kind,))
    sharding = NamedSharding(mesh, P("d", None))
    x = jnp.linspace(-1.0, 1.0, 12)
    gram = BlockedGram(features, batch_size=batch_size, sharding=sharding)
    result = gram(x)
    close(result, features(x) @ features(x).T)
    assert result.sharding.is_equivalent_to(sharding, 2)
    for shard in result.addressable_shards:
        assert shard.data.shape == (3, 12)
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(result)[shard.index])
    plan = gram.plan(x)
    assert plan.total == 3 and "on each of 4 devices" in plan.what
