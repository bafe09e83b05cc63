"""One of two processes that compute a sharded `BatchedHessian` (and map and reduce a
split batch) together under `jax.distributed`: run as
`python hessian_worker.py PORT PROCESS_ID`.

Each process holds two CPU devices, so the mesh spans four devices in two processes and
each process computes, and holds, the rows (or columns) of its own two devices. The
inputs are passed as a user's script holds them, mostly process-local arrays (fresh, or
committed to one local device); turning them into the global arrays a computation over
the whole mesh takes is zodmem's work. Every result is checked against `jax.hessian` of
the raveled function, computed whole in this process: the global shape and sharding,
and shard by shard the values this process holds.

Prints `process <id>: OK <count> checks` and exits 0 when every check passes; prints
the error and exits 1 otherwise. `tests/distributed/test_distributed.py` launches it.
"""

import os
import sys

# Two CPU devices per process. Set before jax is imported, replacing any device count a
# parent process asked for, so that every process holds the same number of devices.
_flags = [
    flag
    for flag in os.environ.get("XLA_FLAGS", "").split()
    if not flag.startswith("--xla_force_host_platform_device_count")
]
os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=2"])
os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # would take precedence over the flag
os.environ["JAX_PLATFORMS"] = "cpu"

import hashlib  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

# As in the test suite: every annotated function of zodmem is checked by beartype.
with install_import_hook("zodmem", "beartype.beartype"):
    import zodmem as zm  # noqa: E402

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
NUM_VARIABLES = 16  # 6 + 10 variables, 4 rows (or columns) per device

jax.config.update("jax_cpu_collectives_implementation", "gloo")
# Double precision, so that the blocks agree with jax.hessian to rounding in the last bits.
jax.config.update("jax_enable_x64", True)


def loss(params: dict[str, jax.Array], data: jax.Array) -> jax.Array:
    """A scalar whose Hessian is dense: every variable meets every other one."""
    x, _ = ravel_pytree(params)
    return jnp.sum(jnp.tanh(x * data)) * jnp.sum(x**2) + jnp.sum(jnp.cos(jnp.outer(x, x) * data))


def loss_with_aux(params: dict[str, jax.Array], data: jax.Array) -> tuple[jax.Array, Any]:
    """`loss`, with an array and a non-array leaf beside it."""
    x, _ = ravel_pytree(params)
    return loss(params, data), {"mean": jnp.mean(x), "label": "loss"}


def make_inputs() -> tuple[dict[str, jax.Array], jax.Array]:
    """Process-local inputs, the same values in every process (a fixed seed)."""
    key_a, key_b, key_data = jax.random.split(jax.random.key(0), 3)
    params = {
        "a": jax.random.normal(key_a, (2, 3)),
        "b": jax.random.normal(key_b, (10,)),
    }
    data = jax.random.uniform(key_data, (NUM_VARIABLES,), minval=0.5, maxval=1.5)
    return params, data


def reference_hessian(params: dict[str, jax.Array], data: jax.Array) -> np.ndarray:
    """`jax.hessian` of `loss` as a function of the raveled variables, computed whole on
    this process's own devices."""
    flat, unravel = ravel_pytree(params)
    return np.asarray(jax.hessian(lambda flat: loss(unravel(flat), data))(flat))


def check_sharded(
    name: str, hessian: jax.Array, sharding: NamedSharding, reference: np.ndarray
) -> None:
    """The global Hessian has the asked-for shape and `sharding`, and this process holds
    exactly its two devices' shares, each equal to the matching block of `reference`."""
    split_dim = 0 if sharding.spec[0] is not None else 1
    share_shape = [NUM_VARIABLES, NUM_VARIABLES]
    share_shape[split_dim] //= NUM_PROCESSES * DEVICES_PER_PROCESS
    assert isinstance(hessian, jax.Array), f"{name}: got {type(hessian).__name__}"
    assert hessian.shape == (NUM_VARIABLES, NUM_VARIABLES), f"{name}: shape {hessian.shape}"
    assert hessian.dtype == jnp.float64, f"{name}: dtype {hessian.dtype}"
    assert hessian.sharding.is_equivalent_to(sharding, 2), (
        f"{name}: sharding {hessian.sharding}, expected {sharding}"
    )
    assert not hessian.is_fully_addressable, f"{name}: a process-local array, not a global one"
    shards = hessian.addressable_shards
    assert len(shards) == DEVICES_PER_PROCESS, f"{name}: {len(shards)} addressable shards"
    local_devices = set(jax.local_devices())
    seen_blocks = set()
    for shard in shards:
        assert shard.device in local_devices, f"{name}: shard on {shard.device}, not local"
        assert shard.data.shape == tuple(share_shape), f"{name}: shard shape {shard.data.shape}"
        block = shard.index[split_dim]
        seen_blocks.add((block.start, block.stop))
        np.testing.assert_allclose(
            np.asarray(shard.data),
            reference[shard.index],
            rtol=1e-12,
            atol=1e-12,
            err_msg=f"{name}: the shard at {shard.index} on {shard.device}",
        )
    assert len(seen_blocks) == DEVICES_PER_PROCESS, f"{name}: shards repeat blocks {seen_blocks}"


def input_placements(mesh: jax.sharding.Mesh) -> dict[str, tuple[dict[str, jax.Array], jax.Array]]:
    """The same inputs placed as a user's script may hold them: as freshly made (on no
    device in particular), committed to one of this process's devices (as a previous
    local computation leaves them), and with `data` already a global array split over
    the mesh (each process giving its own part)."""
    params, data = make_inputs()
    local_part = np.asarray(data).reshape(NUM_PROCESSES, -1)[jax.process_index()]
    global_data = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local_part)
    assert not global_data.is_fully_addressable
    return {
        "process-local": (params, data),
        "on a local device": jax.device_put((params, data), jax.local_devices()[-1]),
        "global data": (params, global_data),
    }


def run_checks(mesh: jax.sharding.Mesh) -> int:
    """Every sharded Hessian this process checks, for each placement of the inputs;
    returns how many passed."""
    rows, columns = NamedSharding(mesh, P("d", None)), NamedSharding(mesh, P(None, "d"))
    reference = reference_hessian(*make_inputs())
    expected_mean = np.mean(np.asarray(ravel_pytree(make_inputs()[0])[0]))
    # 3 does not divide a device's 4 rows: each device runs a block of 3, then one of 1.
    transforms = [
        ("rows, batch_size=3", zm.BatchedHessian(loss, sharding=rows, batch_size=3)),
        ("columns, batch_size=3", zm.BatchedHessian(loss, sharding=columns, batch_size=3)),
        ("rows, max_memory='100MB'", zm.BatchedHessian(loss, sharding=rows, max_memory="100MB")),
    ]
    with_aux = zm.BatchedHessian(loss_with_aux, sharding=rows, batch_size=3, has_aux=True)
    passed = 0
    for placement, (params, data) in input_placements(mesh).items():
        for name, transform in transforms:
            hessian = transform(params, data)
            check_sharded(f"{name} ({placement})", hessian, transform.sharding, reference)
            passed += 1

        name = f"rows, has_aux=True ({placement})"
        hessian, aux = with_aux(params, data)
        check_sharded(name, hessian, rows, reference)
        assert aux["label"] == "loss", f"{name}: aux label {aux['label']!r}"
        for shard in aux["mean"].addressable_shards:
            np.testing.assert_allclose(
                np.asarray(shard.data), expected_mean, rtol=1e-12, err_msg=f"{name}: aux mean"
            )
        passed += 1
    return passed + check_batches(mesh) + check_plans_agree(mesh)


def check_batches(mesh: jax.sharding.Mesh) -> int:
    """A `ChunkedVmap` and a `Microbatcher` of a global batch split over the mesh, with a
    weight committed to one of this process's devices: each device maps (or reduces) its
    own 4 elements, and the map's result stays split as the batch is."""
    _, data = make_inputs()
    global_data = input_placements(mesh)["global data"][1]
    weight = jax.device_put(jnp.asarray(1.25), jax.local_devices()[-1])
    expected = np.sin(np.asarray(data)) * 1.25

    mapped = zm.ChunkedVmap(lambda x, w: jnp.sin(x) * w, chunk_size=3, in_axes=(0, None))
    result = mapped(global_data, weight)
    assert result.sharding.is_equivalent_to(NamedSharding(mesh, P("d")), 1), result.sharding
    assert len(result.addressable_shards) == DEVICES_PER_PROCESS
    for shard in result.addressable_shards:
        assert shard.data.shape == (NUM_VARIABLES // 4,), shard.data.shape
        np.testing.assert_allclose(np.asarray(shard.data), expected[shard.index], rtol=1e-12)

    summed = zm.Microbatcher(lambda w, x: jnp.sum(jnp.sin(x) * w), microbatch_size=3, argnums=1)
    total = summed(weight, global_data)
    for shard in total.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), expected.sum(), rtol=1e-12)
    return 2


def check_plans_agree(mesh: jax.sharding.Mesh) -> int:
    """Both processes plan a row-sharded Hessian the same way at every budget of a sweep,
    though process 1 compiled and ran a larger program first (its heap differs): each
    plan, or refusal, is the same in both, so no process takes a branch the other does
    not. The one that plans at the smallest budget then runs, and its rows are checked."""
    if jax.process_index() == 1:
        big = jnp.ones((1500, 1500))
        jax.block_until_ready(jax.jit(lambda m: jnp.linalg.qr(m @ m.T)[0])(big))
    n = 400
    w = jnp.linspace(-1.0, 1.0, n)
    data = jnp.cos(jnp.arange(8 * n, dtype=w.dtype).reshape(8, n))

    def wide_loss(w: jax.Array, data: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(data @ w) ** 2) * jnp.sum(w**2)

    rows = NamedSharding(mesh, P("d", None))
    seen, fitting = [], None
    for budget in ["50kB", "200kB", "400kB", "800kB", "2MB", "40MB", "60MB", "80MB", "92MB"]:
        transform = zm.BatchedHessian(wide_loss, sharding=rows, max_memory=budget)
        try:
            seen.append(repr(transform.plan(w, data).decision))
            fitting = fitting or transform
        except zm.MemoryBudgetError as error:
            seen.append(str(error))
    digest = np.frombuffer(hashlib.sha256("\n".join(seen).encode()).digest()[:8], np.int64)
    digests = multihost_utils.process_allgather(digest)
    assert np.all(digests == digests[0]), f"plans differ between processes: {seen}"
    assert fitting is not None, f"no budget planned: {seen}"
    hessian = fitting(w, data)
    reference = np.asarray(jax.hessian(wide_loss)(w, data))
    for shard in hessian.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), reference[shard.index], rtol=1e-10)
    return 1


def main(port: int, process_id: int) -> int:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
    )
    try:
        num_devices = NUM_PROCESSES * DEVICES_PER_PROCESS
        assert len(jax.devices()) == num_devices, f"devices: {jax.devices()}"
        assert len(jax.local_devices()) == DEVICES_PER_PROCESS, f"local: {jax.local_devices()}"
        mesh = jax.make_mesh((num_devices,), ("d",))
        passed = run_checks(mesh)
    except Exception:
        print(f"process {process_id}: FAILED", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        # Leave at once: waiting at shutdown for a peer that may never arrive only hangs.
        os._exit(1)
    print(f"process {process_id}: OK {passed} checks", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
