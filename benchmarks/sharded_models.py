"""Curvature of a model laid out over devices: what each device holds, and how long it takes.

The model is the GPT-style transformer of `problems.py` with its head untied from the
token embedding (`problems.gpt(size)`'s weights, plus a head of its own, so that KFAC
reads every weight as a layer), its weights sharded FSDP-style over a mesh of D devices
(each leaf's first axis that D divides is split over the mesh's axis `"d"`, the others
replicated) and its batch of sequences split over `"d"` where D divides it. Each case runs
in a fresh process on D CPU devices (`--xla_force_host_platform_device_count=D`, so the
devices share this machine's cores), making its call as a user makes it, outside any
`jax.jit` of its own (zodmem compiles its programs with the model, the data and the
vectors as their arguments, laid out as they are):

- `products-D`: a block of 8 Gauss-Newton products, `op.mm(V)` of
  `zm.BatchedGGN(outputs, loss).operator(model, inputs, targets)`, the 8 vectors a pytree
  laid out like the weights;
- `eigsh-D`: `zm.eigsh(op, 5, max_steps=40, pytree=True)`, the top 5 eigenpairs;
- `trace-D`: `zm.trace(op, method="hutchinson", num_probes=100)`;
- `kfac-D`: building `zm.KFAC(outputs, loss)(model, inputs, targets)`.

For each: XLA's count of one device's bytes for the largest program the call compiled
(`memory_analysis()`: arguments, output and temporaries of the per-device program, read
as JAX compiles it), the largest share of a
returned n-vector that one device holds (from `addressable_shards`), the first call
(compile included) and the fastest of `--steady-calls` more, and the result's agreement
with the one-device case. `--plot` draws the per-device bytes against D with the ideal
1/D line into `docs/images/sharded_models.png`.

    python benchmarks/sharded_models.py --quick      # a small model, to smoke-test
    python benchmarks/sharded_models.py              # the "cpu" size, D = 1, 2, 4, 8
    python benchmarks/sharded_models.py --gpu        # the GPUs present, a ~1B model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402  (the backend, and with it the device count, starts at first use)
import report  # noqa: E402

CALLS = ("products", "eigsh", "trace", "kfac")
DEVICE_COUNTS = (1, 2, 4, 8)
# The GPU model: wide enough that one GPU cannot hold it with a basis of 40 vectors.
GPU_SHAPE = {"vocabulary": 32768, "length": 256, "width": 2048, "depth": 16, "heads": 16}


def _model(size: str, gpu: bool) -> tuple[Any, Any, Any, Any, Any]:
    """`(model, inputs, targets, outputs, loss)`: the untied GPT and its data."""
    import problems

    import zodmem as zm

    if gpu:
        shape = GPU_SHAPE
        key, data_key, head_key = jax.random.split(jax.random.key(2), 3)
        gpt = problems.GPT(
            shape["vocabulary"],
            shape["length"],
            shape["width"],
            shape["depth"],
            shape["heads"],
            key=key,
        )
        ids = jax.random.randint(data_key, (8, shape["length"] + 1), 0, shape["vocabulary"])
        inputs, targets = ids[:, :-1], ids[:, 1:].reshape(-1)
    else:
        problem = problems.make("gpt", size)
        gpt, inputs, targets = problem.model, problem.inputs, problem.targets
        head_key = jax.random.key(7)
    vocabulary, width = gpt.tokens.weight.shape
    head = eqx.nn.Linear(width, vocabulary, use_bias=False, key=head_key)
    model = Untied(gpt, head)

    def outputs(model, inputs, targets):
        return jax.vmap(model)(inputs).reshape(-1, vocabulary)

    return model, inputs, targets, outputs, zm.losses.SoftmaxCrossEntropy(reduction="mean")


class Untied(eqx.Module):
    """The GPT with a head of its own in place of the token embedding's transpose."""

    gpt: Any
    head: Any

    def __call__(self, ids: Any) -> Any:
        gpt = self.gpt
        h = gpt.tokens.weight[ids] + gpt.positions.weight[: ids.shape[0]]
        for block in gpt.blocks:
            h = block(h)
        return jax.vmap(self.head)(jax.vmap(gpt.norm)(h))


def _lay_out(model: Any, inputs: Any, targets: Any, mesh: Any) -> tuple[Any, Any, Any]:
    """The weights FSDP-style (each leaf's first axis the mesh divides, over `"d"`) and the
    batch over `"d"` where the mesh divides it."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = mesh.devices.size

    def place(leaf):
        if not eqx.is_array(leaf):
            return leaf
        spec = [None] * leaf.ndim
        for axis, size in enumerate(leaf.shape):
            if size % devices == 0:
                spec[axis] = "d"
                break
        return jax.device_put(leaf, NamedSharding(mesh, P(*spec)))

    def batch(array):
        spec = P("d") if array.shape[0] % devices == 0 else P()
        return jax.device_put(array, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(place, model), batch(inputs), batch(targets)


def _compiled_programs() -> list:
    """The executables JAX compiles from here on, each as it is compiled (read through
    JAX's own compile step: the programs of an eager call are compiled by no public
    `lower()`)."""
    from jax._src.interpreters import pxla

    compiled: list = []
    compile_computation = pxla.MeshComputation.compile

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        executable = compile_computation(self, *args, **kwargs)
        compiled.append(executable)
        return executable

    pxla.MeshComputation.compile = recorded
    return compiled


def _bytes(memory: Any) -> int | None:
    """One device's bytes of a compiled program: its arguments, output and temporaries."""
    if memory is None:
        return None
    return memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes


def _largest_share(tree: Any) -> float | None:
    """The largest fraction of an n-vector (a pytree of leaves, or their block) that one
    device holds, all its leaves together (`None` for no vectors)."""
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "sharding")]
    total = sum(leaf.size for leaf in leaves)
    if not total:
        return None
    held: dict[Any, int] = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.size
    return max(held.values()) / total


def child(call: str, devices: int, size: str, steady_calls: int, gpu: bool) -> dict[str, Any]:
    """One case in this process: compile, run once, run `steady_calls` more."""
    if not gpu:
        report.force_cpu_devices(devices)
    import jax.numpy as jnp
    from jax.sharding import AxisType

    import zodmem as zm

    mesh = jax.make_mesh((devices,), ("d",), axis_types=(AxisType.Auto,))
    model, inputs, targets, outputs, loss = _model(size, gpu)
    model, inputs, targets = _lay_out(model, inputs, targets, mesh)
    params = eqx.filter(model, eqx.is_inexact_array)
    n = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))

    key = jax.random.key(0)
    # Each call as a user makes it, outside any `jax.jit` of its own: zodmem compiles its
    # programs with the model, the data and the vectors as their arguments, laid out as
    # they are (a `jax.jit` closing over them would make them constants on one device).
    programs = _compiled_programs()
    started = time.perf_counter()
    op = zm.BatchedGGN(outputs, loss).operator(model, inputs, targets)
    if call == "products":
        block = jax.tree_util.tree_map(
            lambda leaf: jax.device_put(
                jnp.broadcast_to(jnp.ones_like(leaf), (8, *leaf.shape)),
                jax.sharding.NamedSharding(
                    mesh, jax.sharding.PartitionSpec(None, *leaf.sharding.spec)
                ),
            ),
            params,
        )

        def run():
            return op.mm(block)

    elif call == "eigsh":

        def run():
            return zm.eigsh(op, 5, max_steps=40, key=key, pytree=True)

    elif call == "trace":

        def run():
            return zm.trace(op, method="hutchinson", num_probes=100, key=key)

    else:

        def run():
            return zm.KFAC(outputs, loss)(model, inputs, targets)

    result = jax.block_until_ready(run())
    first = time.perf_counter() - started
    # The largest program the call compiled, by XLA's count of one device's bytes.
    analysis = max(
        (program.memory_analysis() for program in programs),
        key=lambda memory: _bytes(memory) or 0,
        default=None,
    )
    steady = []
    for _ in range(steady_calls):
        started = time.perf_counter()
        jax.block_until_ready(run())
        steady.append(time.perf_counter() - started)
    # The n-vectors the call returns: the products, the eigenvectors.
    vectors = {"products": result, "eigsh": result[1] if call == "eigsh" else None}.get(call)
    per_device = None if analysis is None else _bytes(analysis)
    return {
        "call": call,
        "devices": devices,
        "n": int(n),
        "per_device_bytes": per_device,
        "temp_bytes": None if analysis is None else analysis.temp_size_in_bytes,
        "largest_share": _largest_share(vectors),
        "first_seconds": first,
        "steady_seconds": min(steady) if steady else None,
        "fingerprint": report.fingerprint(jax.tree_util.tree_map(jnp.atleast_1d, result)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick-size model")
    parser.add_argument("--gpu", action="store_true", help="the GPUs present, a ~1B model")
    parser.add_argument("--calls", default=",".join(CALLS))
    parser.add_argument("--devices", default=",".join(map(str, DEVICE_COUNTS)))
    parser.add_argument("--steady-calls", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--plot", action="store_true", help="draw docs/images/sharded_models.png")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = "quick" if args.quick else "cpu"
    if args.child:
        call, devices = args.child.split("-")
        print(json.dumps(child(call, int(devices), size, args.steady_calls, args.gpu)))
        return
    device_counts = [int(d) for d in args.devices.split(",")]
    if args.gpu:
        device_counts = [len(jax.devices("gpu"))]
    results = []
    for call in args.calls.split(","):
        for devices in device_counts:
            command = [sys.executable, __file__, "--child", f"{call}-{devices}"]
            command += ["--steady-calls", str(args.steady_calls)]
            command += ["--quick"] * args.quick + ["--gpu"] * args.gpu
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                results.append({"call": call, "devices": devices, "failed": "timed out"})
                continue
            if done.returncode:
                lines = done.stderr.strip().splitlines() or ["(no output)"]
                last = next((line for line in reversed(lines) if "Error" in line), lines[-1])
                results.append({"call": call, "devices": devices, "failed": last[:300]})
            else:
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = _table(results)
    print(text)
    name = "sharded_models" + ("_gpu" if args.gpu else "_quick" if args.quick else "")
    if not args.no_save:
        payload = {
            "command": " ".join(sys.argv),
            "machine": report.machine_info(),
            "source": report.source_info(),
            "results": results,
            "report": text,
        }
        report.write_results(name, payload)
    if args.plot:
        _plot(results)


def _table(results: list[dict[str, Any]]) -> str:
    ones = {r["call"]: r for r in results if r.get("devices") == 1 and "failed" not in r}
    rows = []
    for result in results:
        if "failed" in result:
            rows.append(
                [result["call"], result["devices"], "failed: " + result["failed"]] + [""] * 6
            )
            continue
        one = ones.get(result["call"])
        ratio = (
            report.ratio(result["per_device_bytes"], one["per_device_bytes"])
            if one and result["per_device_bytes"]
            else ""
        )
        agree = (
            f"{report.compare_fingerprints(result['fingerprint'], one['fingerprint']):.1e}"
            if one
            else ""
        )
        share = result["largest_share"]
        rows.append(
            [
                result["call"],
                result["devices"],
                report.megabytes(result["per_device_bytes"], ".1f"),
                ratio,
                f"{1 / result['devices']:.3f}",
                "" if share is None else f"{share:.3f}",
                report.number(result["first_seconds"], ".2f"),
                report.number(result["steady_seconds"], ".3f"),
                agree,
            ]
        )
    headers = [
        "call",
        "devices",
        "per device (MB, XLA)",
        "/ 1 device",
        "ideal",
        "largest share of a vector",
        "first (s)",
        "steady (s)",
        "vs 1 device",
    ]
    return report.markdown_table(headers, rows)


def _plot(results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for call in CALLS:
        points = sorted(
            (r["devices"], r["per_device_bytes"] / 1e6)
            for r in results
            if r.get("call") == call and r.get("per_device_bytes")
        )
        if not points:
            continue
        devices, megabytes = zip(*points, strict=True)
        axes.plot(devices, megabytes, marker="o", label=call)
        axes.plot(
            devices,
            [megabytes[0] * devices[0] / d for d in devices],
            color="grey",
            linestyle=":",
            linewidth=1,
        )
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("devices")
    axes.set_ylabel("bytes per device, XLA's count (MB)")
    axes.set_title("A GPT's curvature laid out over devices (dotted: 1/D)")
    axes.legend()
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "images", "sharded_models.png")
    figure.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    print("wrote", os.path.normpath(path))


if __name__ == "__main__":
    main()
