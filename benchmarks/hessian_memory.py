"""Peak memory and time of a full Hessian: jax.hessian, zodiax and zodmem.

The case is the reference problem (`problems.reference()`): an `eqx.nn.MLP(32, 1, 96, 2)`
with a mean-squared loss over 256 points, n = 12,577 parameters, so the float32 Hessian
holds 633 MB. Each case runs in its own process (see `report.py`); `floor` is a process
with the same imports, model and data that computes nothing big.

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

import report  # noqa: E402


def _problem(args: argparse.Namespace) -> Any:
    import problems

    return problems.reference(quick=args.quick)


def floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, _problem(args).info)


def jax_hessian(args: argparse.Namespace) -> report.Case:
    import jax

    r = _problem(args)
    hessian = jax.jit(jax.hessian(lambda flat: r.loss_of_flat(flat, r.xs, r.ys)))
    return report.Case(lambda: hessian(r.flat), r.info)


def _zodiax_form(hessian: Any, args: argparse.Namespace, nbatches: int) -> report.Case:
    """`hessian(loss, params, nbatches=...)` of zodiax's form, the loss of the variables
    alone (the data closed over)."""
    r = _problem(args)

    def loss(params):
        return r.loss_of_params(params, r.xs, r.ys)

    return report.Case(
        lambda: hessian(loss, r.params, nbatches=nbatches)[0], {**r.info, "nbatches": nbatches}
    )


def zodiax_hessian(args: argparse.Namespace, nbatches: int) -> report.Case:
    from zodiax.diffops import hessian

    return _zodiax_form(hessian, args, nbatches)


def zodmem_hessian(args: argparse.Namespace, nbatches: int) -> report.Case:
    import zodmem as zm

    r = _problem(args)
    transform = zm.BatchedHessian(r.loss, nbatches=nbatches)
    return report.Case(lambda: transform(r.model, r.xs, r.ys), {**r.info, "nbatches": nbatches})


def zodmem_compat_hessian(args: argparse.Namespace, nbatches: int) -> report.Case:
    from zodmem.compat.zodiax import hessian

    return _zodiax_form(hessian, args, nbatches)


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


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = report.succeeded(results)
    floor_case = by_case.get("floor")
    info = next((r["info"] for r in by_case.values()), {})
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
    reference = by_case.get("jax.hessian") or by_case.get("zodiax-16") or by_case.get("zodiax-128")

    def row(r: dict[str, Any]) -> list[Any] | None:
        zodiax = _zodiax_of(r["case"], by_case)
        zodiax = zodiax if zodiax is not r else None
        return [
            r["case"],
            report.gigabytes(r["peak_rss_bytes"]),
            report.gigabytes(report.above(r, floor_case)),
            report.ratio(r["peak_rss_bytes"], zodiax and zodiax["peak_rss_bytes"]),
            report.number(r.get("time_s"), ".1f"),
            report.number(r.get("run_s"), ".1f"),
            report.number(r.get("cpu_s"), ".1f"),
            report.ratio(r.get("time_s"), zodiax and zodiax["time_s"]),
            report.ratio(r.get("cpu_s"), zodiax and zodiax["cpu_s"]),
            report.megabytes(r["output_bytes"]),
            report.check_cell(r, reference),
        ]

    compared = "jax.hessian" if reference is by_case.get("jax.hessian") else "zodiax"
    lines = [
        report.describe_mlp(info) + ".",
        "",
        report.case_table(results, headers, row),
        "",
        "time: wall time of the call, compilation included; run: the same less "
        "JAX's tracing, lowering and compiling; CPU: CPU time of the call, all threads. "
        f"check: largest difference from {compared} {report.CHECK_NOTE}.",
    ]
    if not args.quick:
        lines += report.section("Targets:", _targets(by_case, info.get("hessian_bytes")))
    return "\n".join(lines)


def _zodiax_of(name: str, by_case: dict[str, Any]) -> dict[str, Any] | None:
    """zodiax's case at the same `nbatches` as `name`."""
    nbatches = name.rsplit("-", 1)[1] if name[-1].isdigit() else None
    return by_case.get(f"zodiax-{nbatches}") if nbatches else None


def _targets(by_case: dict[str, Any], hessian_bytes: Any) -> list[str]:
    lines = []
    for name, r in by_case.items():
        if not name.startswith("zodmem-"):
            continue
        zodiax = _zodiax_of(name, by_case)
        verdicts = []
        if zodiax:
            verdicts += [
                report.verdict(
                    "peak/zodiax", r["peak_rss_bytes"] / zodiax["peak_rss_bytes"], PEAK_VS_ZODIAX
                ),
                report.verdict("time/zodiax", r["time_s"] / zodiax["time_s"], TIME_VS_ZODIAX),
                report.verdict("CPU/zodiax", r["cpu_s"] / zodiax["cpu_s"], TIME_VS_ZODIAX),
            ]
        above = report.above(r, by_case.get("floor"))
        if above is not None and hessian_bytes:
            verdicts.append(
                report.verdict("(peak-floor)/H", above / hessian_bytes, PEAK_OVER_FLOOR_VS_HESSIAN)
            )
        if verdicts:
            lines.append(f"- {name}: " + ", ".join(verdicts))
    return lines


if __name__ == "__main__":
    report.main(
        name="hessian_memory",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report_text,
    )
