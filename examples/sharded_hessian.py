"""A network's Hessian spread over the devices at hand: each computes and holds its share.

`zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P("d", None)))` gives each device
of the mesh n / D rows of the Hessian, computed in blocks inside one `jax.shard_map`;
the result is one global `jax.Array` with that sharding, no device holding the whole.
The script prints where each share lives, checks the result against `jax.hessian`, and
reads each device's memory from XLA's analysis of the compiled call.

On a machine with GPUs it uses the devices present. On a CPU alone, XLA is asked for 4
CPU devices before JAX starts (they share the machine's cores, so this shows the
layout, not a speed-up). The network is sized so that n = 2,520 divides evenly over
1 to 10 devices, and 12.

    python examples/sharded_hessian.py
"""

import os

# Only takes effect before JAX starts. It adds CPU devices and nothing else: where a GPU
# is present, JAX's devices are the GPUs, unchanged.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zodmem as zm  # noqa: E402

model_key, x_key = jax.random.split(jax.random.key(0))
# n = 15 * 42 + 42 + 42 * 42 + 42 + 42 = 2,520 (no bias on the output layer).
model = eqx.nn.MLP(15, 1, 42, 2, use_final_bias=False, key=model_key)
xs = jax.random.normal(x_key, (128, 15))
ys = jnp.sin(xs[:, 0])


def loss(model, xs, ys):
    return jnp.mean((jax.vmap(model)(xs)[:, 0] - ys) ** 2)


mesh = jax.make_mesh((len(jax.devices()),), ("d",))
rows = NamedSharding(mesh, P("d", None))
hessian = zm.BatchedHessian(loss, sharding=rows, nbatches=40)  # blocks of 63 rows

H = hessian(model, xs, ys)
n = H.shape[0]
print(f"Hessian {H.shape} over {len(mesh.devices.flat)} {jax.devices()[0].platform} devices")
print(f"sharding: {H.sharding.spec}")
for shard in H.addressable_shards:
    first, last = shard.index[0].start or 0, shard.index[0].stop or n
    print(f"  {shard.device}: rows {first}:{last}, shard {shard.data.shape}")

# The same Hessian from jax.hessian, of the raveled parameters, on one device.
params, static = eqx.partition(model, eqx.is_inexact_array)
flat, unravel = ravel_pytree(params)
reference = jax.hessian(lambda flat: loss(eqx.combine(unravel(flat), static), xs, ys))(flat)
print(f"sharded Hessian equals jax.hessian: {bool(jnp.allclose(H, reference, atol=1e-6))}")

# Columns instead of rows: each device makes its columns from forward-mode products.
columns = zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P(None, "d")), nbatches=40)
H_columns = columns(model, xs, ys)
print(
    f"column split {H_columns.sharding.spec} equals jax.hessian: "
    f"{bool(jnp.allclose(H_columns, reference, atol=1e-6))}"
)

# What each device holds: XLA's analysis of the compiled call is per device.
compiled = (
    jax.jit(lambda params, xs, ys: hessian(eqx.combine(params, static), xs, ys))
    .lower(params, xs, ys)
    .compile()
)
analysis = compiled.memory_analysis()
share = n * n * H.dtype.itemsize // len(mesh.devices.flat)
print(
    f"per-device: output {analysis.output_size_in_bytes / 1e6:.2f} MB "
    f"(its share, n * n * 4 / D = {share / 1e6:.2f} MB; the whole Hessian "
    f"{H.nbytes / 1e6:.2f} MB), temporaries {analysis.temp_size_in_bytes / 1e6:.2f} MB"
)
print(f"per-device output is the share: {analysis.output_size_in_bytes == share}")

# A budget is per device: here a device's share and 100 MB beside it for the blocks'
# temporaries, planned for its rows alone.
budgeted = zm.BatchedHessian(loss, sharding=rows, max_memory=share + 100 * 10**6)
print(budgeted.plan(model, xs, ys))
