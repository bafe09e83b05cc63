"""Peak memory and time of a full Hessian: jax.hessian, zodiax and zodmem.

The case is an `eqx.nn.MLP(32, 1, 96, 2)` with a mean-squared loss over 256
points: n = 12,577 parameters, so the float32 Hessian holds 633 MB. Each case
runs in its own process (see `_harness.py`); `floor` is a process with the same
imports, model and data that computes nothing big.

    python benchmarks/hessian_memory.py                 # every case, ~3 minutes on 2 cores
    python benchmarks/hessian_memory.py --repeat 3      # each case 3 times: max peak, median times
    python benchmarks/hessian_memory.py --cases floor,zodiax-16,zodmem-16
    python benchmarks/hessian_memory.py --quick         # a small model, ~30 s

Results go to `benchmarks/results/hessian_memory.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402

_GB = 1e9


def _problem(args: argparse.Namespace) -> dict[str, Any]:
    """Model, data and the loss in the three forms the tools take."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    width, points = (16, 64) if args.quick else (args.width, args.points)
    model_key, x_key, y_key = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(32, 1, width, args.depth, key=model_key)
    xs = jax.random.normal(x_key, (points, 32))
    ys = jax.random.normal(y_key, (points,))

    def loss(model, xs, ys):
        prediction = jax.vmap(model)(xs)[:, 0]
        return jnp.mean((prediction - ys) ** 2)

    # zodiax and jax.hessian need a pytree of arrays only: split off the activations.
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_of_params(params):
        return loss(eqx.combine(params, static), xs, ys)

    flat, unravel = ravel_pytree(params)

    def loss_of_flat(flat):
        return loss_of_params(unravel(flat))

    # Touch the backend once, as every case does, so the floor includes JAX's runtime.
    jax.block_until_ready(eqx.filter_jit(loss)(model, xs, ys))
    n = flat.size
    info = {
        "n": int(n),
        "hessian_bytes": int(n * n * flat.dtype.itemsize),
        "width": width,
        "depth": args.depth,
        "points": points,
    }
    return dict(
        model=model,
        xs=xs,
        ys=ys,
        loss=loss,
        params=params,
        loss_of_params=loss_of_params,
        flat=flat,
        loss_of_flat=loss_of_flat,
        info=info,
    )


def floor(args: argparse.Namespace) -> _harness.Case:
    return _harness.Case(None, _problem(args)["info"])


def jax_hessian(args: argparse.Namespace) -> _harness.Case:
    import jax

    p = _problem(args)
    hessian = jax.jit(jax.hessian(p["loss_of_flat"]))
    return _harness.Case(lambda: hessian(p["flat"]), p["info"])


def zodiax_hessian(args: argparse.Namespace, nbatches: int) -> _harness.Case:
    from zodiax.diffops import hessian

    p = _problem(args)
    return _harness.Case(
        lambda: hessian(p["loss_of_params"], p["params"], nbatches=nbatches)[0],
        {**p["info"], "nbatches": nbatches},
    )


def zodmem_hessian(args: argparse.Namespace, nbatches: int) -> _harness.Case:
    import zodmem as zm

    p = _problem(args)
    transform = zm.BatchedHessian(p["loss"], nbatches=nbatches)
    return _harness.Case(
        lambda: transform(p["model"], p["xs"], p["ys"]), {**p["info"], "nbatches": nbatches}
    )


def zodmem_compat_hessian(args: argparse.Namespace, nbatches: int) -> _harness.Case:
    from zodmem.compat.zodiax import hessian

    p = _problem(args)
    return _harness.Case(
        lambda: hessian(p["loss_of_params"], p["params"], nbatches=nbatches)[0],
        {**p["info"], "nbatches": nbatches},
    )


CASES = {
    "floor": floor,
    "jax.hessian": jax_hessian,
    "zodiax-16": partial(zodiax_hessian, nbatches=16),
    "zodmem-16": partial(zodmem_hessian, nbatches=16),
    "zodmem-compat-16": partial(zodmem_compat_hessian, nbatches=16),
    "zodiax-128": partial(zodiax_hessian, nbatches=128),
    "zodmem-128": partial(zodmem_hessian, nbatches=128),
    "zodmem-compat-128": partial(zodmem_compat_hessian, nbatches=128),
    "zodmem-512": partial(zodmem_hessian, nbatches=512),
}

# Targets for zodmem, from the design: against zodiax at the same nbatches, and
# against the floor plus one Hessian.
PEAK_VS_ZODIAX = 0.70
PEAK_OVER_FLOOR_VS_HESSIAN = 1.15
TIME_VS_ZODIAX = 0.90


def _nbatches(name: str) -> str | None:
    return name.rsplit("-", 1)[1] if name[-1].isdigit() else None


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = {r["case"]: r for r in results if "error" not in r}
    floor_bytes = by_case.get("floor", {}).get("peak_rss_bytes")
    info = next((r["info"] for r in by_case.values()), {})
    hessian_bytes = info.get("hessian_bytes")
    headers = [
        "case",
        "peak RSS (GB)",
        "peak - floor (GB)",
        "peak / zodiax",
        "time (s)",
        "run (s)",
        "CPU (s)",
        "time / zodiax",
        "CPU / zodiax",
        "output (MB)",
        "check",
    ]
    rows = []
    reference = by_case.get("jax.hessian") or by_case.get("zodiax-16") or by_case.get("zodiax-128")
    for r in results:
        name = r["case"]
        if "error" in r:
            rows.append([name, "failed: " + r["error"]] + [""] * (len(headers) - 2))
            continue
        zodiax = by_case.get(f"zodiax-{_nbatches(name)}") if _nbatches(name) else None
        peak = r["peak_rss_bytes"]
        time_s = r.get("time_s")
        check = ""
        if "check" in r and reference is not None and reference is not r:
            r["max_rel_diff_vs_reference"] = _harness.compare_fingerprints(
                r["check"], reference["check"]
            )
            check = f"{r['max_rel_diff_vs_reference']:.1e}"
        elif reference is r:
            check = "reference"
        rows.append(
            [
                name,
                f"{peak / _GB:.2f}",
                f"{(peak - floor_bytes) / _GB:.2f}" if floor_bytes else "",
                f"{peak / zodiax['peak_rss_bytes']:.2f}" if zodiax and zodiax is not r else "",
                f"{time_s:.1f}" if time_s is not None else "",
                f"{r['run_s']:.1f}" if time_s is not None else "",
                f"{r['cpu_s']:.1f}" if time_s is not None else "",
                f"{time_s / zodiax['time_s']:.2f}" if zodiax and zodiax is not r else "",
                f"{r['cpu_s'] / zodiax['cpu_s']:.2f}" if zodiax and zodiax is not r else "",
                f"{r['output_bytes'] / 1e6:.0f}",
                check,
            ]
        )
    lines = [
        f"Hessian of an eqx.nn.MLP(32, 1, {info.get('width')}, {info.get('depth')}) "
        f"mean-squared loss over {info.get('points')} points: n = {info.get('n', 0):,}, "
        f"H = {(hessian_bytes or 0) / 1e6:.0f} MB (float32).",
        "",
        _harness.markdown_table(headers, rows),
        "",
        "time: wall time of the call, compilation included; run: the same less "
        "JAX's tracing, lowering and compiling; CPU: CPU time of the call, all threads. "
        "check: largest difference from "
        f"{'jax.hessian' if reference is by_case.get('jax.hessian') else 'zodiax'} over "
        "256 sampled entries and the sum, relative to the largest sampled |entry|.",
    ]
    if not args.quick:
        lines += _targets(by_case, floor_bytes, hessian_bytes)
    return "\n".join(lines)


def _targets(by_case: dict[str, Any], floor_bytes: Any, hessian_bytes: Any) -> list[str]:
    lines = []
    for name, r in by_case.items():
        if not name.startswith("zodmem-"):
            continue
        zodiax = by_case.get(f"zodiax-{_nbatches(name)}")
        verdicts = []
        if zodiax:
            ratio = r["peak_rss_bytes"] / zodiax["peak_rss_bytes"]
            verdicts.append(_verdict("peak/zodiax", ratio, PEAK_VS_ZODIAX))
            ratio = r["time_s"] / zodiax["time_s"]
            verdicts.append(_verdict("time/zodiax", ratio, TIME_VS_ZODIAX))
            ratio = r["cpu_s"] / zodiax["cpu_s"]
            verdicts.append(_verdict("CPU/zodiax", ratio, TIME_VS_ZODIAX))
        if floor_bytes and hessian_bytes:
            ratio = (r["peak_rss_bytes"] - floor_bytes) / hessian_bytes
            verdicts.append(_verdict("(peak-floor)/H", ratio, PEAK_OVER_FLOOR_VS_HESSIAN))
        if verdicts:
            lines.append(f"- {name}: " + ", ".join(verdicts))
    return ["", "Targets:"] + lines if lines else []


def _verdict(what: str, value: float, limit: float) -> str:
    return f"{what} {value:.2f} {'<=' if value <= limit else '>'} {limit:.2f} " + (
        "ok" if value <= limit else "MISSED"
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, default=96, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers of the MLP")
    parser.add_argument("--points", type=int, default=256, help="data points in the loss")


if __name__ == "__main__":
    _harness.main(
        name="hessian_memory",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report,
        add_arguments=_add_arguments,
    )
