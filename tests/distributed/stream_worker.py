"""One of two processes that stream a sharded `BatchedHessian` to one `.npy` file under
`jax.distributed`: run as `python stream_worker.py PORT PROCESS_ID PATH MODE`.

Each process holds two CPU devices, so the mesh spans four devices in two processes; each
process writes the rows of its own two devices into the file at `PATH`, which both see.

- `MODE` `slow`: every block's rows take a quarter of a second to write, so that the test
  can kill a process part way (the call is never let finish).
- `MODE` `resume`: the call again, at full speed. Prints `computed <blocks>` (the blocks
  this process wrote), checks the file against `jax.hessian`, `zm.to_host`'s rows of
  this process, and the refusals (another function on the same path, a column split),
  and prints `process <id>: OK` when every check passed.
"""

import os
import sys

_flags = [
    flag
    for flag in os.environ.get("XLA_FLAGS", "").split()
    if not flag.startswith("--xla_force_host_platform_device_count")
]
os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=2"])
os.environ.pop("JAX_NUM_CPU_DEVICES", None)
os.environ["JAX_PLATFORMS"] = "cpu"

import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zodmem as zm  # noqa: E402
from zodmem._stream import _npy  # noqa: E402

NUM_PROCESSES = 2
NUM_VARIABLES = 16  # 4 rows per device, one block a row
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)


def loss(w, data):
    return jnp.sum(jnp.tanh(w * data)) * jnp.sum(w**2) + jnp.sum(jnp.cos(jnp.outer(w, w) * data))


def other_loss(w, data):
    return jnp.sum(jnp.sin(w * data) ** 2)


def count_writes(delay: float) -> list:
    """Count (and, with `delay`, slow) every run of rows this process writes."""
    calls = []
    write_rows = _npy.ResultFiles.write_rows

    def counted(self, *args, **kwargs):
        time.sleep(delay)
        calls.append(1)
        return write_rows(self, *args, **kwargs)

    _npy.ResultFiles.write_rows = counted
    return calls


def main(port: int, process_id: int, path: str, mode: str) -> int:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
    )
    try:
        mesh = jax.make_mesh((4,), ("d",))
        rows = NamedSharding(mesh, P("d", None))
        w = jnp.linspace(-1.0, 1.0, NUM_VARIABLES)
        data = jnp.linspace(0.5, 1.5, NUM_VARIABLES)
        hessian = zm.BatchedHessian(loss, sharding=rows, batch_size=1)
        calls = count_writes(0.25 if mode == "slow" else 0.0)
        result = zm.to_file(path, hessian, w, data)
        print(f"computed {len(calls)}", flush=True)
        reference = np.asarray(jax.hessian(loss)(w, data))
        assert not result.flags.writeable, "the result is writeable"
        np.testing.assert_allclose(result, reference, rtol=1e-12, atol=1e-12)

        mine = zm.to_host(hessian, w, data)
        lo = process_id * NUM_VARIABLES // NUM_PROCESSES
        np.testing.assert_allclose(mine, reference[lo : lo + NUM_VARIABLES // NUM_PROCESSES])

        other = zm.BatchedHessian(other_loss, sharding=rows, batch_size=1)
        try:
            zm.to_file(path, other, w, data)
        except zm.SerialisationError as error:
            assert "another call" in str(error), str(error)
        else:
            raise AssertionError("a file of another function was resumed")
        columns = zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P(None, "d")))
        try:
            zm.to_file(path + ".columns.npy", columns, w, data)
        except ValueError as error:
            assert "Split the rows" in str(error), str(error)
        else:
            raise AssertionError("a column split was streamed")
    except Exception:
        print(f"process {process_id}: FAILED", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print(f"process {process_id}: OK", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
