"""The reference Hessian spread over devices: what each device holds, and what fits.

The problem is the Hessian benchmark's `eqx.nn.MLP(32, 1, 96, 2)` with a mean-squared
loss over 256 points (see `hessian_memory.py`), with the output layer's bias held
fixed: the network has n = 12,577 parameters, an odd number that no even device count
divides, and without that one bias n = 12,576 = 2^5 x 3 x 131, so the float32 Hessian
holds 633 MB and 1, 2 and 4 devices split it evenly.

Each case runs in its own process (see `_harness.py`) on 1, 2 or 4 CPU devices,
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
  that the report's what-fits table is drawn from.

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
import os
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
import hessian_memory  # noqa: E402

_MB = 1e6
_GB = 1e9

DEVICE_COUNTS = (1, 2, 4)
BUDGET = 250e6  # per device, scaled alike with --quick
_FULL_HESSIAN_BYTES = 12_576**2 * 4

# The what-fits table: parameter counts, device counts, bytes per device.
FIT_SIZES = (10_000, 100_000, 300_000)
FIT_DEVICES = (1, 8, 64)
FIT_DEVICE_BYTES = 80e9
FIT_BLOCK = 256  # rows per block, for the table's overhead column
XLA_NBATCHES = (24, 48, 96, 192, 384)  # the block sizes whose temporaries give the model


def _force_devices(count: int) -> None:
    """Ask XLA for `count` CPU devices; only before JAX is imported does it take effect."""
    if "jax" in sys.modules:
        raise RuntimeError("the device count must be set before JAX is imported")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def _problem(args: argparse.Namespace, devices: int) -> dict[str, Any]:
    """The reference model and data on `devices` CPU devices; its loss, a function of
    every parameter but the output layer's bias, and that loss of the raveled parameters."""
    _force_devices(devices)
    import equinox as eqx
    import jax
    from jax.flatten_util import ravel_pytree

    import zodmem  # noqa: F401  (imported by every case, so the floor holds it too)

    p = hessian_memory._problem(args)
    if len(jax.devices()) != devices:
        raise RuntimeError(f"asked for {devices} devices, JAX sees {len(jax.devices())}")
    model = p["model"]
    variables = jax.tree_util.tree_map(eqx.is_inexact_array, model)
    variables = eqx.tree_at(lambda m: m.layers[-1].bias, variables, replace=False)
    params, fixed = eqx.partition(model, variables)

    def loss(params, xs, ys):
        return p["loss"](eqx.combine(params, fixed), xs, ys)

    flat, unravel = ravel_pytree(params)

    def loss_of_flat(flat, xs, ys):
        return loss(unravel(flat), xs, ys)

    n = int(flat.size)
    info = {
        **p["info"],
        "n": n,
        "hessian_bytes": n * n * flat.dtype.itemsize,
        "devices": devices,
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
    }
    return dict(
        loss=loss,
        loss_of_flat=loss_of_flat,
        params=params,
        flat=flat,
        xs=p["xs"],
        ys=p["ys"],
        info=info,
    )


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
) -> _harness.Case:
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
    return _harness.Case(lambda: compiled(*call_args), info, repeats=args.steady_calls)


def _block_info(n: int, devices: int, block_size: int) -> dict[str, Any]:
    share = n // devices
    return {"block_size": block_size, "blocks_per_device": -(-share // block_size)}


def floor(args: argparse.Namespace, devices: int) -> _harness.Case:
    return _harness.Case(None, {**_problem(args, devices)["info"], "tool": "floor"})


def jax_hessian(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args, 1)
    import jax

    info = {**p["info"], "tool": "jax.hessian", "spec": "", "share": 1.0}
    call_args = (p["flat"], p["xs"], p["ys"])
    return _compiled_case(jax.hessian(p["loss_of_flat"]), call_args, info, args, replicate=False)


def _zodmem_case(
    args: argparse.Namespace, devices: int, spec: tuple[Any, ...] | None, tool: str
) -> _harness.Case:
    p = _problem(args, devices)
    import zodmem as zm

    n = p["info"]["n"]
    sharding = None if spec is None else _mesh_sharding(spec)
    transform = zm.BatchedHessian(p["loss"], nbatches=args.nbatches, sharding=sharding)
    block = -(-n // args.nbatches)
    info = {
        **p["info"],
        "tool": tool,
        "spec": "" if spec is None else str(sharding.spec),
        "share": 1 / devices if spec is not None else 1.0,
        "nbatches": args.nbatches,
        **_block_info(n, devices if spec is not None else 1, block),
    }
    call_args = (p["params"], p["xs"], p["ys"])
    return _compiled_case(transform, call_args, info, args, replicate=spec is not None)


def xla(args: argparse.Namespace, devices: int) -> _harness.Case:
    """No run: the per-device memory analysis of the rows split at several block sizes."""
    p = _problem(args, devices)
    import jax

    import zodmem as zm

    n = p["info"]["n"]
    sharding = _mesh_sharding(("d", None))
    call_args = jax.device_put((p["params"], p["xs"], p["ys"]), _mesh_sharding(()))
    sweep = []
    for nbatches in XLA_NBATCHES:
        transform = zm.BatchedHessian(p["loss"], nbatches=nbatches, sharding=sharding)
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
    info = {**p["info"], "tool": "xla", "spec": str(sharding.spec), "sweep": sweep}
    return _harness.Case(None, info)


def _budget_bytes(p: dict[str, Any]) -> int:
    return int(BUDGET * p["info"]["hessian_bytes"] / _FULL_HESSIAN_BYTES)


def budget(args: argparse.Namespace, devices: int) -> _harness.Case:
    p = _problem(args, devices)
    import zodmem as zm

    limit = _budget_bytes(p)
    transform = zm.BatchedHessian(p["loss"], max_memory=limit, sharding=_mesh_sharding(("d", None)))
    info = {**p["info"], "tool": "budget", "max_memory": limit, "share": 1 / devices}
    call_args = (p["params"], p["xs"], p["ys"])
    start = time.perf_counter()
    try:
        plan = transform.plan(*call_args)
    except zm.MemoryBudgetError as error:
        info.update(plan_s=time.perf_counter() - start, refused=str(error))
        return _harness.Case(None, info)
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
}


# ----------------------------------------------------------------------------------
# report


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value / _MB:,.0f}"


def _gb(value: float | None) -> str:
    return "" if value is None else f"{value / _GB:.2f}"


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = {r["case"]: r for r in results if "error" not in r}
    info = next((r["info"] for r in by_case.values()), {})
    n = info.get("n", 0)
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
    rows = []
    for r in results:
        name = r["case"]
        if "error" in r:
            rows.append([name, "failed: " + r["error"]] + [""] * (len(headers) - 2))
            continue
        i = r["info"]
        if i.get("tool") in ("floor", "xla") or "refused" in i:
            what = {"floor": "process floor", "xla": "compiled only (see below)"}.get(
                i.get("tool"), "refused (see below)"
            )
            rows.append([name, i["devices"], what] + [""] * (len(headers) - 3))
            continue
        floor_case = by_case.get(f"floor-{i['devices']}")
        above = r["peak_rss_bytes"] - floor_case["peak_rss_bytes"] if floor_case else None
        check = ""
        if reference is r:
            check = "reference"
        elif reference is not None and "check" in r:
            r["max_rel_diff_vs_rows_1"] = _harness.compare_fingerprints(
                r["check"], reference["check"]
            )
            check = f"{r['max_rel_diff_vs_rows_1']:.1e}"
        share = i["xla_output_bytes"] / hessian_bytes if hessian_bytes else None
        rows.append(
            [
                name,
                i["devices"],
                i.get("spec", ""),
                i.get("block_size", ""),
                i.get("blocks_per_device", ""),
                _mb(i["xla_output_bytes"]),
                f"{share:.3f}" if share is not None else "",
                _mb(i["xla_temp_bytes"]),
                _mb(i["predicted_peak_bytes"]),
                _gb(r["peak_rss_bytes"]),
                _gb(above),
                f"{r['steady_min_s']:.2f}" if "steady_min_s" in r else "",
                f"{r['steady_cpu_min_s']:.2f}" if "steady_cpu_min_s" in r else "",
                check,
            ]
        )
    lines = [
        f"Hessian of an eqx.nn.MLP(32, 1, {info.get('width')}, {info.get('depth')}) "
        f"mean-squared loss over {info.get('points')} points, output bias held fixed: "
        f"n = {n:,}, H = {hessian_bytes / _MB:,.0f} MB (float32). Devices: forced CPU "
        f"devices (XLA_FLAGS=--xla_force_host_platform_device_count=D) on "
        f"{os.cpu_count()} cores.",
        "",
        _harness.markdown_table(headers, rows),
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
        + _harness.markdown_table(headers, rows)
        + f"\n\nlargest block: the rows per block that the rest of a device holds at "
        f"{rows_per_product:.1f} rows' worth per product, at most the device's share. "
        "Where the devices do not divide n, n is padded to a multiple of them, as the split "
        "needs (with variables the loss ignores; or hold a few variables fixed instead)."
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    hessian_memory._add_arguments(parser)
    parser.add_argument(
        "--nbatches", type=int, default=96, help="blocks of the whole Hessian (default 96)"
    )
    parser.add_argument(
        "--steady-calls", type=int, default=3, help="timed calls after the first (default 3)"
    )


if __name__ == "__main__":
    _harness.main(
        name="sharded",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report,
        add_arguments=_add_arguments,
    )
