"""The reference Hessian spread over devices: what each device holds, and what fits.

The problem is the reference `eqx.nn.MLP(32, 1, 96, 2)` with a mean-squared loss over
256 points (`problems.reference(output_bias_fixed=True)`), with the output layer's bias
held fixed: the network has n = 12,577 parameters, an odd number that no even device count
divides, and without that one bias n = 12,576 = 2^5 x 3 x 131, so the float32 Hessian
holds 633 MB and 1, 2 and 4 devices split it evenly.

Each case runs in its own process (see `report.py`) on 1, 2 or 4 CPU devices,
forced with `XLA_FLAGS=--xla_force_host_platform_device_count=D` before JAX starts,
so the devices share one process and this machine's cores:

- `floor-D`: the same imports, model and data on D devices, no Hessian;
- `jax.hessian`: the anchor, `jax.jit(jax.hessian(loss))` of the raveled loss, 1 device;
- `unsharded`: `zm.BatchedHessian(loss, nbatches=96)`, no `sharding`, 1 device;
- `rows-D`: the same with `sharding=NamedSharding(mesh, P("d", None))` over a mesh of D
  devices: each device computes and holds n / D rows, in blocks of the same 131 rows;
- `columns-4`: `P(None, "d")`, columns, on 4 devices;
- `budget-4`: `max_memory=250MB` per device on 4 devices, with the plan it makes;
- `budget-1`: the same budget on 1 device, where the 633 MB Hessian alone exceeds it:
  planned only, to record the refusal;
- `xla-4`: no run: the rows split on 4 devices compiled at nbatches = 24 ... 384 (blocks
  of 524 ... 33 rows), for the line of a device's temporaries against the block size
  that the report's what-fits table is drawn from;
- `memory-2p`, `stream-2p`: two processes under `jax.distributed` (gloo, one CPU device
  each) split the rows, `--two-process-nbatches` (192: blocks of 66 rows): in memory,
  each process holding its half, and streamed by `zm.to_file` into one `.npy`, each
  process writing its own rows. Each process measures its own floor (its peak once the
  job, model and data are set up), its peak after the call and the call's wall time;
  the report says whether the streamed call met its targets: at most 0.25x the
  Hessian's bytes above the floor in each process, at most 1.2x the in-memory time.

Every case compiles its call first (`jax.jit(...).lower(...).compile()`) and records
XLA's `memory_analysis()` of it, per device for an SPMD program: the output's bytes
(the device's share of H) and the temporaries' bytes, whose sum is the predicted peak
per device. It then calls the compiled program once (the measured call: peak resident
memory of the process, all devices together) and `--steady-calls` more times (the
fastest is the steady time: recorded, not a target, as the forced devices share two
cores). Each result is compared with the 1-device sharded one.

    python benchmarks/sharded.py             # every case, ~8 minutes on 2 cores
    python benchmarks/sharded.py --cases floor-4,rows-4,budget-4
    python benchmarks/sharded.py --quick     # a small model (n = 816), ~2 minutes

Results go to `benchmarks/results/sharded.json` (`sharded_quick.json` with `--quick`).
The report ends with what fits on 80 GB devices for n = 10k, 100k and 300k, from the
measured per-device temporaries.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

_MB = report.MB
_GB = report.GB

DEVICE_COUNTS = (1, 2, 4)
BUDGET = 250e6  # per device, scaled alike with --quick
_FULL_HESSIAN_BYTES = 12_576**2 * 4

# The what-fits table: parameter counts, device counts, bytes per device.
FIT_SIZES = (10_000, 100_000, 300_000)
FIT_DEVICES = (1, 8, 64)
FIT_DEVICE_BYTES = 80e9
FIT_BLOCK = 256  # rows per block, for the table's overhead column
XLA_NBATCHES = (24, 48, 96, 192, 384)  # the block sizes whose temporaries give the model


def _problem(args: argparse.Namespace, devices: int, start: Any = None) -> Any:
    """The reference problem on `devices` CPU devices, every parameter but the output
    layer's bias a variable (`problems.Reference`), the devices in its record.
    `start`, when given, starts JAX's multi-process job (`jax.distributed`) before any
    device is used: this process then holds one of the `devices`."""
    report.force_cpu_devices(devices if start is None else 1)
    import jax
    import problems

    import zodmem  # noqa: F401  (imported by every case, so the floor holds it too)

    if start is not None:
        start()

    r = problems.reference(quick=args.quick, output_bias_fixed=True)
    if len(jax.devices()) != devices:
        raise RuntimeError(f"asked for {devices} devices, JAX sees {len(jax.devices())}")
    device = jax.devices()[0]
    r.info.update(devices=devices, device_kind=device.device_kind, platform=device.platform)
    return r


def _mesh_sharding(spec: tuple[Any, ...]) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    return NamedSharding(mesh, PartitionSpec(*spec))


def _compiled_case(
    function: Any,
    call_args: tuple,
    info: dict[str, Any],
    args: argparse.Namespace,
    replicate: bool = True,
) -> report.Case:
    """Compile `function(*call_args)` ahead of time, record its memory analysis, and time
    calls of the compiled program. With `replicate`, the arguments are first put whole on
    every device of the mesh, as the sharded computation reads them."""
    import jax

    if replicate:
        call_args = jax.device_put(call_args, _mesh_sharding(()))
    start = time.perf_counter()
    compiled = jax.jit(lambda *a: function(*a)).lower(*call_args).compile()
    info["compile_ahead_s"] = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    info.update(
        xla_output_bytes=int(analysis.output_size_in_bytes),
        xla_temp_bytes=int(analysis.temp_size_in_bytes),
        xla_argument_bytes=int(analysis.argument_size_in_bytes),
        xla_alias_bytes=int(analysis.alias_size_in_bytes),
        predicted_peak_bytes=int(analysis.output_size_in_bytes + analysis.temp_size_in_bytes),
    )
    return report.Case(lambda: compiled(*call_args), info, repeats=args.steady_calls)


def _block_info(n: int, devices: int, block_size: int) -> dict[str, Any]:
    share = n // devices
    return {"block_size": block_size, "blocks_per_device": -(-share // block_size)}


def floor(args: argparse.Namespace, devices: int) -> report.Case:
    return report.Case(None, {**_problem(args, devices).info, "tool": "floor"})


def jax_hessian(args: argparse.Namespace) -> report.Case:
    p = _problem(args, 1)
    import jax

    info = {**p.info, "tool": "jax.hessian", "spec": "", "share": 1.0}
    call_args = (p.flat, p.xs, p.ys)
    return _compiled_case(jax.hessian(p.loss_of_flat), call_args, info, args, replicate=False)


def _zodmem_case(
    args: argparse.Namespace, devices: int, spec: tuple[Any, ...] | None, tool: str
) -> report.Case:
    p = _problem(args, devices)
    import zodmem as zm

    n = p.info["n"]
    sharding = None if spec is None else _mesh_sharding(spec)
    transform = zm.BatchedHessian(p.loss_of_params, nbatches=args.nbatches, sharding=sharding)
    block = -(-n // args.nbatches)
    info = {
        **p.info,
        "tool": tool,
        "spec": "" if spec is None else str(sharding.spec),
        "share": 1 / devices if spec is not None else 1.0,
        "nbatches": args.nbatches,
        **_block_info(n, devices if spec is not None else 1, block),
    }
    call_args = (p.params, p.xs, p.ys)
    return _compiled_case(transform, call_args, info, args, replicate=spec is not None)


def xla(args: argparse.Namespace, devices: int) -> report.Case:
    """No run: the per-device memory analysis of the rows split at several block sizes."""
    p = _problem(args, devices)
    import jax

    import zodmem as zm

    n = p.info["n"]
    sharding = _mesh_sharding(("d", None))
    call_args = jax.device_put((p.params, p.xs, p.ys), _mesh_sharding(()))
    sweep = []
    for nbatches in XLA_NBATCHES:
        transform = zm.BatchedHessian(p.loss_of_params, nbatches=nbatches, sharding=sharding)
        analysis = (
            jax.jit(lambda *a, t=transform: t(*a)).lower(*call_args).compile().memory_analysis()
        )
        sweep.append(
            {
                "nbatches": nbatches,
                **_block_info(n, devices, -(-n // nbatches)),
                "xla_output_bytes": int(analysis.output_size_in_bytes),
                "xla_temp_bytes": int(analysis.temp_size_in_bytes),
            }
        )
    info = {**p.info, "tool": "xla", "spec": str(sharding.spec), "sweep": sweep}
    return report.Case(None, info)


def _budget_bytes(p: dict[str, Any]) -> int:
    return int(BUDGET * p.info["hessian_bytes"] / _FULL_HESSIAN_BYTES)


def budget(args: argparse.Namespace, devices: int) -> report.Case:
    p = _problem(args, devices)
    import zodmem as zm

    limit = _budget_bytes(p)
    transform = zm.BatchedHessian(
        p.loss_of_params, max_memory=limit, sharding=_mesh_sharding(("d", None))
    )
    info = {**p.info, "tool": "budget", "max_memory": limit, "share": 1 / devices}
    call_args = (p.params, p.xs, p.ys)
    start = time.perf_counter()
    try:
        plan = transform.plan(*call_args)
    except zm.MemoryBudgetError as error:
        info.update(plan_s=time.perf_counter() - start, refused=str(error))
        return report.Case(None, info)
    info.update(
        plan_s=time.perf_counter() - start,
        spec=str(transform.sharding.spec),
        plan=repr(plan),
        block_size=plan.block_size,
        blocks_per_device=plan.num_blocks,
        plan_peak_bytes=plan.peak_bytes,
        plan_output_bytes=plan.output_bytes,
        plan_budget_bytes=plan.budget_bytes,
        strategy=plan.strategy,
    )
    return _compiled_case(transform, call_args, info, args)


# ----------------------------------------------------------------------------------
# Two processes under jax.distributed, one CPU device each: the rows split in memory,
# and streamed to one file by zm.to_file. Each case starts two worker processes of this
# script (`--process MODE PORT ID FOLDER ...`); each measures its own floor (its peak
# resident memory once the job, model and data are set up), its peak after the call,
# and the call's wall time, tracing and compilation included.

PROCESSES = 2
STREAM_PEAK_TARGET = 0.25  # of the Hessian's bytes, above each process's floor
STREAM_TIME_TARGET = 1.2  # of the in-memory sharded call's time


def _process_main(argv: list[str]) -> None:
    """A worker of the two-process cases: prints its measurements as one JSON line."""
    mode, port, process_id, folder, *rest = argv
    args = report.worker_arguments(rest, _add_arguments)
    os.environ["JAX_PLATFORMS"] = "cpu"

    def start():
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=PROCESSES,
            process_id=int(process_id),
        )

    p = _problem(args, PROCESSES, start=start)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import zodmem as zm

    transform = zm.BatchedHessian(
        p.loss_of_params, nbatches=args.two_process_nbatches, sharding=_mesh_sharding(("d", None))
    )
    call_args = (p.params, p.xs, p.ys)
    multihost_utils.sync_global_devices("set up")
    floor_bytes = report.peak_rss_bytes()
    begin = time.perf_counter()
    if mode == "stream":
        result = zm.to_file(os.path.join(folder, "hessian.npy"), transform, *call_args)
    else:
        result = jax.block_until_ready(transform(*call_args))
    elapsed = time.perf_counter() - begin
    peak = report.peak_rss_bytes()
    if mode == "stream":
        rows = np.asarray(
            result[int(process_id) * (result.shape[0] // PROCESSES) :][
                : result.shape[0] // PROCESSES
            ]
        )
    else:
        rows = np.concatenate([np.asarray(s.data) for s in result.addressable_shards])
    record = {
        "process": int(process_id),
        "floor_bytes": floor_bytes,
        "peak_rss_bytes": peak,
        "time_s": elapsed,
        "rows_sum": float(np.sum(rows, dtype=np.float64)),
        "rows_abs_sum": float(np.sum(np.abs(rows), dtype=np.float64)),
        "info": p.info,
    }
    print(_WORKER_MARKER + json.dumps(record), flush=True)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


_WORKER_MARKER = "@@sharded-process@@ "


def two_processes(args: argparse.Namespace, mode: str) -> report.Case:
    """Start the two workers of `mode` (`memory` or `stream`), wait, and record them."""
    import socket
    import subprocess
    import tempfile

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    forwarded = args.forwarded
    script = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(script)) as folder:
        workers = [
            subprocess.Popen(
                [sys.executable, script, "--process", mode, str(port), str(k), folder, *forwarded],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for k in range(PROCESSES)
        ]
        outputs = [w.communicate(timeout=1500)[0] for w in workers]
    records = []
    for k, output in enumerate(outputs):
        lines = [line for line in output.splitlines() if line.startswith(_WORKER_MARKER)]
        if not lines:
            raise RuntimeError(f"process {k} failed:\n" + "\n".join(output.splitlines()[-20:]))
        records.append(json.loads(lines[-1][len(_WORKER_MARKER) :]))
    n = records[0]["info"]["n"]
    info = {
        **records[0]["info"],
        "tool": f"{mode}-{PROCESSES}p",
        "spec": "P('d', None)",
        "devices": PROCESSES,
        "processes": records,
        "nbatches": args.two_process_nbatches,
        **_block_info(n, PROCESSES, -(-n // args.two_process_nbatches)),
    }
    return report.Case(None, info)


CASES = {
    **{f"floor-{d}": partial(floor, devices=d) for d in DEVICE_COUNTS},
    "jax.hessian": jax_hessian,
    "unsharded": partial(_zodmem_case, devices=1, spec=None, tool="unsharded"),
    **{
        f"rows-{d}": partial(_zodmem_case, devices=d, spec=("d", None), tool="rows")
        for d in DEVICE_COUNTS
    },
    "columns-4": partial(_zodmem_case, devices=4, spec=(None, "d"), tool="columns"),
    "budget-4": partial(budget, devices=4),
    "budget-1": partial(budget, devices=1),
    "xla-4": partial(xla, devices=4),
    "memory-2p": partial(two_processes, mode="memory"),
    "stream-2p": partial(two_processes, mode="stream"),
}


# ----------------------------------------------------------------------------------
# report


def _mb(value: float | None) -> str:
    return report.megabytes(value, ",.0f")


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = report.succeeded(results)
    info = next((r["info"] for r in by_case.values()), {})
    hessian_bytes = info.get("hessian_bytes", 0)
    reference = by_case.get("rows-1")
    headers = [
        "case",
        "devices",
        "spec",
        "block (rows)",
        "blocks / device",
        "output / device (MB)",
        "share of H",
        "temp / device (MB)",
        "predicted peak / device (MB)",
        "process peak (GB)",
        "peak - floor (GB)",
        "steady (s)",
        "steady CPU (s)",
        "check",
    ]

    def row(r: dict[str, Any]) -> list[Any] | None:
        name = r["case"]
        i = r["info"]
        if i.get("tool") in ("floor", "xla", "memory-2p", "stream-2p") or "refused" in i:
            what = {
                "floor": "process floor",
                "xla": "compiled only (see below)",
                "memory-2p": "two processes (see below)",
                "stream-2p": "two processes (see below)",
            }.get(i.get("tool"), "refused (see below)")
            return [name, i["devices"], what] + [""] * (len(headers) - 3)
        above = report.above(r, by_case.get(f"floor-{i['devices']}"))
        return [
            name,
            i["devices"],
            i.get("spec", ""),
            i.get("block_size", ""),
            i.get("blocks_per_device", ""),
            _mb(i["xla_output_bytes"]),
            report.ratio(i["xla_output_bytes"], hessian_bytes, ".3f"),
            _mb(i["xla_temp_bytes"]),
            _mb(i["predicted_peak_bytes"]),
            report.gigabytes(r["peak_rss_bytes"]),
            report.gigabytes(above),
            report.number(r.get("steady_min_s")),
            report.number(r.get("steady_cpu_min_s")),
            report.check_cell(r, reference, "max_rel_diff_vs_rows_1"),
        ]

    lines = [
        report.describe_mlp(info, more=", output bias held fixed")
        + ". Devices: forced CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=D) "
        f"on {os.cpu_count()} cores.",
        "",
        report.case_table(results, headers, row),
        "",
        "output / device, temp / device: XLA's memory_analysis() of the compiled call, per "
        "device; predicted peak = output + temp. share of H: output / device over the whole "
        "Hessian's bytes. process peak: peak resident memory (VmHWM) of the process that "
        "holds all D devices; peak - floor: the same above the floor-D case. steady: the "
        f"fastest of {args.steady_calls} calls of the compiled program (recorded, not a "
        "target: the devices share the cores); steady CPU: the least CPU time of those "
        "calls. check: largest difference from rows-1 over 256 sampled entries and the "
        "sum, relative to the largest sampled |entry|.",
    ]
    lines += _share_checks(by_case, hessian_bytes)
    lines += _budget_lines(by_case)
    lines += _two_process_lines(by_case, hessian_bytes)
    fit = fit_model(by_case)
    if fit:
        lines += ["", what_fits(fit)]
    return "\n".join(lines)


def _share_checks(by_case: dict[str, Any], hessian_bytes: int) -> list[str]:
    checks = []
    for name, r in by_case.items():
        i = r["info"]
        if i.get("tool") not in ("rows", "columns", "budget") or "xla_output_bytes" not in i:
            continue
        expected = hessian_bytes // i["devices"]
        same = i["xla_output_bytes"] == expected
        checks.append(
            f"{name} {i['xla_output_bytes']:,} {'==' if same else '!='} {expected:,}"
            + ("" if same else " MISMATCH")
        )
    if not checks:
        return []
    return ["", "Output bytes per device against n * n * 4 / D: " + "; ".join(checks) + "."]


def _budget_lines(by_case: dict[str, Any]) -> list[str]:
    lines = []
    for name in ("budget-4", "budget-1"):
        r = by_case.get(name)
        if r is None:
            continue
        i = r["info"]
        if "refused" in i:
            lines.append(
                f"- {name}: max_memory={_mb(i['max_memory'])} MB on {i['devices']} device(s), "
                f"refused after {i['plan_s']:.1f} s of planning: {i['refused']}"
            )
        else:
            lines.append(
                f"- {name}: max_memory={_mb(i['max_memory'])} MB per device on {i['devices']} "
                f"devices: {i['plan']}; block_size={i['block_size']}, "
                f"num_blocks={i['blocks_per_device']} per device, "
                f"peak_bytes={i['plan_peak_bytes']:,} (compiled call: "
                f"{i['predicted_peak_bytes']:,}), planned in {i['plan_s']:.1f} s."
            )
    return ["", "Budgets:", ""] + lines if lines else []


def _two_process_lines(by_case: dict[str, Any], hessian_bytes: int) -> list[str]:
    """The two-process cases, process by process, and the streamed call's targets."""
    cases = [by_case[name] for name in ("memory-2p", "stream-2p") if name in by_case]
    if not cases:
        return []
    headers = [
        "case",
        "process",
        "floor (GB)",
        "peak (GB)",
        "peak - floor (MB)",
        "of H",
        "time (s)",
        "sum of its rows",
    ]
    rows = []
    for r in cases:
        for p in r["info"]["processes"]:
            above = p["peak_rss_bytes"] - p["floor_bytes"]
            rows.append(
                [
                    r["case"],
                    p["process"],
                    report.gigabytes(p["floor_bytes"]),
                    report.gigabytes(p["peak_rss_bytes"]),
                    _mb(above),
                    f"{above / hessian_bytes:.3f}",
                    f"{p['time_s']:.2f}",
                    f"{p['rows_sum']:.6e}",
                ]
            )
    lines = [
        "",
        f"Two processes under jax.distributed (gloo), one CPU device each, rows split "
        f"(P('d', None)), blocks of {cases[0]['info']['block_size']} rows: memory-2p "
        "computes the sharded Hessian in memory (each process holds its half); stream-2p "
        "writes it with zm.to_file, each process its own rows, into one .npy on this "
        "machine's disk. floor: the process's peak resident memory once the job, model and "
        "data are set up; peak: after the call; time: the call's wall time, tracing and "
        "compilation included (the first call of each).",
        "",
        report.markdown_table(headers, rows),
    ]
    memory, stream = by_case.get("memory-2p"), by_case.get("stream-2p")
    if memory is not None and stream is not None:
        worst = max(p["peak_rss_bytes"] - p["floor_bytes"] for p in stream["info"]["processes"])
        ratio = max(p["time_s"] for p in stream["info"]["processes"]) / max(
            p["time_s"] for p in memory["info"]["processes"]
        )
        same = max(
            abs(a["rows_sum"] - b["rows_sum"]) / max(b["rows_abs_sum"], 1e-30)
            for a, b in zip(stream["info"]["processes"], memory["info"]["processes"], strict=True)
        )
        stream["stream_peak_of_hessian"] = worst / hessian_bytes
        stream["stream_time_ratio"] = ratio
        lines += [
            "",
            f"- stream-2p peak above floor, largest process: {worst / _MB:,.0f} MB = "
            f"{worst / hessian_bytes:.3f} x H (target <= {STREAM_PEAK_TARGET} x H): "
            f"{report.met(worst <= STREAM_PEAK_TARGET * hessian_bytes)}.",
            f"- stream-2p time / memory-2p time (slowest process of each): {ratio:.2f} "
            f"(target <= {STREAM_TIME_TARGET}): {report.met(ratio <= STREAM_TIME_TARGET)}.",
            f"- the rows each process wrote against those it holds in memory: sums differ "
            f"by {same:.1e} of the sum of |entries|.",
        ]
    return lines


def fit_model(by_case: dict[str, Any]) -> dict[str, Any] | None:
    """Per-device temporaries as `fixed + block_size * per_product`: the least-squares
    line through the `xla-4` case's compiled block sizes."""
    xla_case = by_case.get("xla-4")
    if xla_case is None:
        return None
    sweep = xla_case["info"]["sweep"]
    blocks = [s["block_size"] for s in sweep]
    temps = [s["xla_temp_bytes"] for s in sweep]
    mean_b, mean_t = sum(blocks) / len(blocks), sum(temps) / len(temps)
    per_product = sum(
        (b - mean_b) * (t - mean_t) for b, t in zip(blocks, temps, strict=True)
    ) / sum((b - mean_b) ** 2 for b in blocks)
    fixed = mean_t - per_product * mean_b
    n = xla_case["info"]["n"]
    worst = max(abs(fixed + per_product * b - t) / t for b, t in zip(blocks, temps, strict=True))
    return {
        "n": n,
        "blocks": blocks,
        "temps": temps,
        "per_product_bytes": per_product,
        "per_product_rows": per_product / (4 * n),
        "fixed_bytes": fixed,
        "worst_fit_error": worst,
    }


def what_fits(fit: dict[str, Any]) -> str:
    """Per-device bytes of an n-variable float32 Hessian over D devices: the share,
    n * n * 4 / D, plus one block of FIT_BLOCK rows at the measured cost per product,
    `per_product_rows` rows of n float32 each; and the largest block the rest of a
    device holds. Where D does not divide n, n is padded to the next multiple of D
    (variables held fixed), as the split requires."""
    rows_per_product = fit["per_product_rows"]
    headers = [
        "n",
        "H (GB)",
        "devices",
        "rows / device",
        "share / device (GB)",
        f"block of {FIT_BLOCK} (GB)",
        "total / device (GB)",
        f"fits {FIT_DEVICE_BYTES / _GB:.0f} GB",
        "largest block (rows)",
    ]
    rows = []
    for n in FIT_SIZES:
        for devices in FIT_DEVICES:
            per_device = -(-n // devices)
            padded = per_device * devices
            share = per_device * padded * 4
            product = rows_per_product * 4 * padded
            block = FIT_BLOCK * product
            total = share + block
            room = FIT_DEVICE_BYTES - share
            largest = min(int(room / product), per_device) if room > 0 else 0
            rows.append(
                [
                    f"{n:,}" + (f" (padded to {padded:,})" if padded != n else ""),
                    f"{n * n * 4 / _GB:,.1f}",
                    devices,
                    f"{per_device:,}",
                    f"{share / _GB:,.2f}",
                    f"{block / _GB:.3f}",
                    f"{total / _GB:,.2f}",
                    "yes" if total <= FIT_DEVICE_BYTES else "no",
                    f"{largest:,}" if largest else "none",
                ]
            )
    return (
        f"What fits on devices of {FIT_DEVICE_BYTES / _GB:.0f} GB (float32). Measured here "
        f"(xla-4), per device: temporaries of "
        + ", ".join(
            f"{t / _MB:.1f} MB in blocks of {b}"
            for b, t in sorted(zip(fit["blocks"], fit["temps"], strict=True))
        )
        + f": a line of {fit['per_product_bytes'] / 1e3:,.0f} kB per product (row), "
        f"{rows_per_product:.1f} rows of n = {fit['n']:,} float32, beside "
        f"{fit['fixed_bytes'] / _MB:.1f} MB that does not grow with the block (the line "
        f"misses each point by {fit['worst_fit_error']:.0%} at most). The model: per-device "
        f"peak = n^2 * 4 / D + block_size * {rows_per_product:.1f} * 4n bytes, the "
        "cost per product taken as the same number of rows of n at every n; the fixed part "
        "(the gradient's residuals: the network's activations over the data) depends on the "
        "network and the data, not on n, and is left out.\n\n"
        + report.markdown_table(headers, rows)
        + f"\n\nlargest block: the rows per block that the rest of a device holds at "
        f"{rows_per_product:.1f} rows' worth per product, at most the device's share. "
        "Where the devices do not divide n, n is padded to a multiple of them, as the split "
        "needs (with variables the loss ignores; or hold a few variables fixed instead)."
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nbatches", type=int, default=96, help="blocks of the whole Hessian (default 96)"
    )
    parser.add_argument(
        "--two-process-nbatches",
        type=int,
        default=192,
        help="blocks of the whole Hessian in the two-process cases (default 192: 66 rows)",
    )


if __name__ == "__main__" and sys.argv[1:2] == ["--process"]:
    _process_main(sys.argv[2:])
elif __name__ == "__main__":
    report.main(
        name="sharded",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report_text,
        add_arguments=_add_arguments,
        steady_calls=3,
    )
