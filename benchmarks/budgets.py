"""Memory budgets: does `max_memory` hold, and is its plan as fast as the best hand-picked knob?

Two problems, each case in its own process (see `_harness.py`), each with a `floor`
case that holds the same imports and inputs and computes nothing big:

- `hessian`: the reference Hessian, an `eqx.nn.MLP(32, 1, 96, 2)` mean-squared loss
  over 256 points (n = 12,577, H = 633 MB float32):
  `zm.BatchedHessian(loss, max_memory=B)` at B = 0.7, 0.8, 1.0, 1.5 GB and `"auto"`,
  beside the hand-picked `zm.BatchedHessian(loss, nbatches=k)` for k = 1 ... 512.
- `small`: the budgets of a laptop's or a CI runner's job, on a small Hessian: the same
  loss with `eqx.nn.MLP(32, 1, 40, 2)` (n = 3,001, H = 36 MB float32) at B = 50, 100
  and 200 MB (and 150 MB), beside `nbatches` = 1, 4, 16, 64. On a CPU a budget also holds what
  compiling the call adds to the process (tens of MB), so the smallest is refused: the
  table says with which least budget.
- `map`: `f(x) = sum(tanh(outer(x, x)) @ x)` over 64 vectors of 3,000 float32 (36 MB
  intermediate per element): `zm.ChunkedVmap(f, max_memory=B)` at B = 100, 250 and
  500 MB, beside the hand-picked `chunk_size` = 1, 2, 3, 4, 6, 8, 13.

Beside them, `hessian/same-B` gives the blocks that the budget B plans by hand
(`batch_size`, planned untimed first), and `hessian/matmul` measures this machine's
float32 matrix product rate in the same run, from which the compute floor of a call is
its flops (XLA's `cost_analysis()` of the planned call) at that rate.

A budgeted case plans first (`transform.plan(...)`, timed: on a fresh process this is
the planning every first call pays) and then calls the transform, which reuses the
cached plan; its first-call time holds both. The `xla` case of each problem compiles
every hand-picked knob without running it and records XLA's predicted peak
(`plan().peak_bytes`, from `memory_analysis()`), to compare with what each knob
measures. Every case that runs reports the time of its first call (compilation and
planning included) and the fastest of `--steady-calls` further calls.

The verdicts, per budgeted case:

- (a) measured peak above the floor <= the budget;
- (b) steady time <= 1.15 x the steady time of the fastest hand-picked knob whose
  measured peak above the floor fits the same budget (first-call ratios, planning
  included, are reported beside it);
- (c) the plan's predicted peak within 15% of the call's own peak: the peak resident
  memory of the call above what the process held when it began, after planning (the
  peak above the floor where planning, not the call, set the process's peak). Planning
  hands its compile heap back, so a call starts below the floor process's own peak and
  the peak above the floor undercounts it;
- (d) the whole first call, planning included, <= 1.15 x the fastest first call of a
  hand-picked knob that fits (a budget costs nothing);
- (e) steady time <= 1.05 x that of the same blocks given by hand;
- (f) steady time <= 1.5 x the compute floor (the Hessians only: the map's time goes to
  its elementwise tanh, not to products).

    python benchmarks/budgets.py                   # every case, ~15 minutes on 2 cores
    python benchmarks/budgets.py --repeat 2        # each case twice: max peak, median times
    python benchmarks/budgets.py --cases map/floor,map/budget-100MB,map/chunk-2
    python benchmarks/budgets.py --quick           # small sizes (budgets scaled alike), ~2 minutes
    python benchmarks/budgets.py --cases small/floor,small/budget-50MB --save-as budgets_small

Results go to `benchmarks/results/budgets.json` (`budgets_quick.json` with `--quick`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
import hessian_memory  # noqa: E402
import loops  # noqa: E402

_MB = 1e6
_GB = 1e9

HESSIAN_BUDGETS = {"0.7GB": 0.7e9, "0.8GB": 0.8e9, "1.0GB": 1.0e9, "1.5GB": 1.5e9, "auto": None}
HESSIAN_NBATCHES = (1, 4, 8, 16, 32, 64, 128, 256, 512)
SMALL_WIDTH = 40  # n = 3,001 variables, H = 36 MB (float32)
SMALL_BUDGETS = {"50MB": 50e6, "100MB": 100e6, "150MB": 150e6, "200MB": 200e6}
SMALL_NBATCHES = (1, 4, 16, 64)
MAP_BUDGETS = {"100MB": 100e6, "250MB": 250e6, "500MB": 500e6}
MAP_CHUNKS = (1, 2, 3, 4, 6, 8, 13)

# Full-size outputs and intermediates, to scale the budgets of the --quick sizes alike.
_FULL_HESSIAN_BYTES = 12_577**2 * 4
_FULL_MAP_INTERMEDIATE_BYTES = 3000**2 * 4
_FULL_SMALL_HESSIAN_BYTES = 3001**2 * 4

# Targets: (a) the budget holds; (b) the planned block is about as fast as the best knob
# that fits; (c) the plan predicts the peak.
TIME_VS_BEST_KNOB = 1.15
PREDICTION_TOLERANCE = 0.15
# (d) a budget costs nothing: the whole first call, planning included, against the best
# hand-picked first call; (e) the planned blocks run as fast as the same blocks by hand;
# (f) the planned call against the compute floor (its flops at this machine's matmul rate).
FIRST_CALL_VS_BEST_KNOB = 1.15
STEADY_VS_SAME_BLOCKS = 1.05
STEADY_VS_COMPUTE_FLOOR = 1.5


def _status_bytes(field: str) -> int | None:
    """A memory figure of this process from `/proc/self/status` (`VmHWM`, `VmRSS`)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _budget(label: str, budgets: dict[str, float | None], scale: float) -> int | str:
    value = budgets[label]
    return "auto" if value is None else int(value * scale)


def _plan_info(plan: Any) -> dict[str, Any]:
    return {
        "block_size": plan.block_size,
        "num_blocks": plan.num_blocks,
        "predicted_peak_bytes": plan.peak_bytes,
        "predicted_output_bytes": plan.output_bytes,
        "budget_bytes": plan.budget_bytes,
        "strategy": plan.strategy,
        "compiles": plan.compiles,
        "budget_source": plan.budget_source,
        "plan": repr(plan),
    }


def _flops(one_block: Any, call_args: tuple) -> float | None:
    """XLA's count of the floating-point operations of the call, from the program that
    does all its work in one block (XLA counts a loop's body once, not per block)."""
    import equinox as eqx

    lowered = eqx.filter_jit(lambda t, a: t(*a)).lower(one_block, call_args)
    analysis = lowered.lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    flops = (analysis or {}).get("flops")
    return float(flops) if flops else None


def _budgeted_case(
    transform: Any, call_args: tuple, info: dict[str, Any], args: Any, one_block: Any = None
):
    """A case whose first call plans (timed on its own) and then runs on the cached plan."""
    planned = []

    import numpy as np

    import zodmem as zm

    def compute():
        if info.get("tool") == "refused":
            return np.zeros(1)
        if not planned:
            start = time.perf_counter()
            try:
                plan = transform.plan(*call_args)
            except zm.MemoryBudgetError as error:
                # A budget too small to honour is refused before anything runs.
                info.update(tool="refused", refusal=str(error))
                return np.zeros(1)
            info["plan_s"] = time.perf_counter() - start
            # What planning alone left: its compiles' heap, before the call allocates.
            info["peak_after_plan_bytes"] = _status_bytes("VmHWM")
            info["rss_after_plan_bytes"] = _status_bytes("VmRSS")
            info.update(_plan_info(plan))
            planned.append(plan)
            return transform(*call_args)
        return transform(*call_args)

    def after():
        # Tracing the one-block program for its flops is work of the benchmark's own:
        # done once the calls are timed, so that it is in none of their times.
        if one_block is not None and info.get("tool") != "refused":
            info["flops"] = _flops(one_block, call_args)

    return _harness.Case(compute, info, repeats=args.steady_calls, after=after)


def _xla_case(transforms: dict[int, Any], call_args: tuple, info: dict[str, Any]):
    """No run: XLA's predicted peak of every hand-picked knob, from its plan."""
    info["predicted_peak_bytes"] = {
        str(knob): transform.plan(*call_args).peak_bytes for knob, transform in transforms.items()
    }
    return _harness.Case(None, {**info, "tool": "xla"})


# ----------------------------------------------------------------------------------
# hessian


def _hessian_problem(args: argparse.Namespace, group: str = "hessian") -> dict[str, Any]:
    """The reference Hessian's problem (`hessian`), or the small one (`small`: the same
    loss with a narrower network, for the budgets a laptop's or a CI runner's job gives)."""
    import zodmem  # noqa: F401  (imported by every case, so the floor holds it too)

    if group == "small":
        args = argparse.Namespace(**{**vars(args), "width": SMALL_WIDTH})
    p = hessian_memory._problem(args)
    p["info"] = {**p["info"], "group": group}
    full = _FULL_SMALL_HESSIAN_BYTES if group == "small" else _FULL_HESSIAN_BYTES
    p["scale"] = p["info"]["hessian_bytes"] / full
    return p


def hessian_floor(args: argparse.Namespace, group: str = "hessian") -> _harness.Case:
    return _harness.Case(None, {**_hessian_problem(args, group)["info"], "tool": "floor"})


def hessian_budget(args: argparse.Namespace, label: str, group: str = "hessian") -> _harness.Case:
    import zodmem as zm

    p = _hessian_problem(args, group)
    budgets = SMALL_BUDGETS if group == "small" else HESSIAN_BUDGETS
    budget = _budget(label, budgets, p["scale"])
    transform = zm.BatchedHessian(p["loss"], max_memory=budget)
    info = {**p["info"], "tool": "budget", "max_memory": budget}
    one_block = zm.BatchedHessian(p["loss"], nbatches=1)
    return _budgeted_case(transform, (p["model"], p["xs"], p["ys"]), info, args, one_block)


def hessian_knob(args: argparse.Namespace, nbatches: int, group: str = "hessian") -> _harness.Case:
    import zodmem as zm

    p = _hessian_problem(args, group)
    transform = zm.BatchedHessian(p["loss"], nbatches=nbatches)
    n = p["info"]["n"]
    info = {
        **p["info"],
        "tool": "knob",
        "nbatches": nbatches,
        "block_size": -(-n // nbatches),
        "num_blocks": nbatches,
    }
    call = (p["model"], p["xs"], p["ys"])
    return _harness.Case(lambda: transform(*call), info, repeats=args.steady_calls)


def hessian_same_blocks(
    args: argparse.Namespace, label: str, group: str = "hessian"
) -> _harness.Case:
    """The blocks that the budget `label` plans, given by hand (`batch_size`): the plan
    is made first, untimed, and the knob's calls are timed as any knob's."""
    import zodmem as zm

    p = _hessian_problem(args, group)
    budgets = SMALL_BUDGETS if group == "small" else HESSIAN_BUDGETS
    budget = _budget(label, budgets, p["scale"])
    call = (p["model"], p["xs"], p["ys"])
    try:
        plan = zm.BatchedHessian(p["loss"], max_memory=budget).plan(*call)
    except zm.MemoryBudgetError as error:
        return _harness.Case(None, {**p["info"], "tool": "refused", "refusal": str(error)})
    transform = zm.BatchedHessian(p["loss"], batch_size=plan.block_size, strategy=plan.strategy)
    info = {
        **p["info"],
        "tool": "same-blocks",
        "max_memory": budget,
        "block_size": plan.block_size,
        "num_blocks": plan.num_blocks,
        "strategy": plan.strategy,
    }
    return _harness.Case(lambda: transform(*call), info, repeats=args.steady_calls)


def matmul_rate(args: argparse.Namespace) -> _harness.Case:
    """This machine's float32 matrix product rate, measured in the same run as the calls:
    the compute floor of a call is its flops at this rate."""
    import jax
    import jax.numpy as jnp

    size = 1024 if args.quick else 4096
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    product = jax.jit(lambda a: a @ a)
    product(a).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        product(a).block_until_ready()
        times.append(time.perf_counter() - start)
    rate = 2 * size**3 / min(times)
    info = {"tool": "matmul", "size": size, "flops_per_s": rate}
    return _harness.Case(None, info)


def hessian_xla(args: argparse.Namespace, group: str = "hessian") -> _harness.Case:
    import zodmem as zm

    p = _hessian_problem(args, group)
    counts = SMALL_NBATCHES if group == "small" else HESSIAN_NBATCHES
    transforms = {k: zm.BatchedHessian(p["loss"], nbatches=k) for k in counts}
    return _xla_case(transforms, (p["model"], p["xs"], p["ys"]), p["info"])


# ----------------------------------------------------------------------------------
# map


def _map_problem(args: argparse.Namespace) -> dict[str, Any]:
    import zodmem  # noqa: F401

    p = loops._map_problem(args)
    p["scale"] = p["info"]["intermediate_bytes"] / _FULL_MAP_INTERMEDIATE_BYTES
    return p


def map_floor(args: argparse.Namespace) -> _harness.Case:
    return _harness.Case(None, {**_map_problem(args)["info"], "tool": "floor"})


def map_budget(args: argparse.Namespace, label: str) -> _harness.Case:
    import zodmem as zm

    p = _map_problem(args)
    budget = _budget(label, MAP_BUDGETS, p["scale"])
    transform = zm.ChunkedVmap(p["f"], max_memory=budget)
    info = {**p["info"], "tool": "budget", "max_memory": budget}
    one_block = zm.ChunkedVmap(p["f"], chunk_size=p["info"]["batch"])
    return _budgeted_case(transform, (p["xs"],), info, args, one_block)


def map_knob(args: argparse.Namespace, chunk: int) -> _harness.Case:
    import zodmem as zm

    p = _map_problem(args)
    transform = zm.ChunkedVmap(p["f"], chunk_size=chunk)
    batch = p["info"]["batch"]
    info = {
        **p["info"],
        "tool": "knob",
        "chunk_size": chunk,
        "block_size": chunk,
        "num_blocks": -(-batch // chunk),
    }
    return _harness.Case(lambda: transform(p["xs"]), info, repeats=args.steady_calls)


def map_same_blocks(args: argparse.Namespace, label: str) -> _harness.Case:
    """The chunks that the budget `label` plans, given by hand (`chunk_size`)."""
    import zodmem as zm

    p = _map_problem(args)
    budget = _budget(label, MAP_BUDGETS, p["scale"])
    try:
        plan = zm.ChunkedVmap(p["f"], max_memory=budget).plan(p["xs"])
    except zm.MemoryBudgetError as error:
        return _harness.Case(None, {**p["info"], "tool": "refused", "refusal": str(error)})
    transform = zm.ChunkedVmap(p["f"], chunk_size=plan.block_size)
    info = {
        **p["info"],
        "tool": "same-blocks",
        "max_memory": budget,
        "chunk_size": plan.block_size,
        "block_size": plan.block_size,
        "num_blocks": plan.num_blocks,
    }
    return _harness.Case(lambda: transform(p["xs"]), info, repeats=args.steady_calls)


def map_xla(args: argparse.Namespace) -> _harness.Case:
    import zodmem as zm

    p = _map_problem(args)
    transforms = {c: zm.ChunkedVmap(p["f"], chunk_size=c) for c in MAP_CHUNKS}
    return _xla_case(transforms, (p["xs"],), p["info"])


CASES = {
    "hessian/floor": hessian_floor,
    "hessian/matmul": matmul_rate,
    **{f"hessian/budget-{b}": partial(hessian_budget, label=b) for b in HESSIAN_BUDGETS},
    **{f"hessian/same-{b}": partial(hessian_same_blocks, label=b) for b in HESSIAN_BUDGETS},
    **{f"hessian/nbatches-{k}": partial(hessian_knob, nbatches=k) for k in HESSIAN_NBATCHES},
    "hessian/xla": hessian_xla,
    "small/floor": partial(hessian_floor, group="small"),
    **{f"small/budget-{b}": partial(hessian_budget, label=b, group="small") for b in SMALL_BUDGETS},
    **{
        f"small/nbatches-{k}": partial(hessian_knob, nbatches=k, group="small")
        for k in SMALL_NBATCHES
    },
    "small/xla": partial(hessian_xla, group="small"),
    "map/floor": map_floor,
    "map/matmul": matmul_rate,
    **{f"map/budget-{b}": partial(map_budget, label=b) for b in MAP_BUDGETS},
    **{f"map/same-{b}": partial(map_same_blocks, label=b) for b in MAP_BUDGETS},
    **{f"map/chunk-{c}": partial(map_knob, chunk=c) for c in MAP_CHUNKS},
    "map/xla": map_xla,
}


# ----------------------------------------------------------------------------------
# report


def _group(name: str) -> str:
    return name.partition("/")[0]


def _knob(name: str) -> str:
    return name.rsplit("-", 1)[1]


def _above_floor(r: dict[str, Any], by_case: dict[str, Any]) -> int | None:
    floor = by_case.get(f"{_group(r['case'])}/floor")
    return r["peak_rss_bytes"] - floor["peak_rss_bytes"] if floor else None


def _predicted(r: dict[str, Any], by_case: dict[str, Any]) -> int | None:
    """The plan's predicted peak: the case's own plan, or (a knob) the `xla` case's."""
    if "predicted_peak_bytes" in r["info"]:
        return r["info"]["predicted_peak_bytes"]
    xla = by_case.get(f"{_group(r['case'])}/xla")
    return xla["info"]["predicted_peak_bytes"].get(_knob(r["case"])) if xla else None


def _call_peak(r: dict[str, Any]) -> int | None:
    """The call's own peak: where the first call after planning set the process's peak,
    that peak less the resident memory the call started from; the largest over the
    runs. Planning hands its compile heap back, so the call starts below the floor
    process's peak, and `peak - floor` undercounts it (the map's 36 MB intermediate
    measured 19 MB). Taken after the first call: later calls may hold two results while
    the runtime frees the last one."""
    peaks = []
    for run in r.get("runs", [r]):
        measured = run.get("measured", run.get("info", {}))
        start, planned = measured.get("rss_after_plan_bytes"), measured.get("peak_after_plan_bytes")
        if start and planned and run["peak_rss_bytes"] > planned:
            peaks.append(run["peak_rss_bytes"] - start)
    return max(peaks) if peaks else None


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value / _MB:,.0f}"


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _fastest_first_call(r: dict[str, Any]) -> float:
    """The fastest of a case's first calls over its runs (each in a fresh process)."""
    return min(run["time_s"] for run in r.get("runs", [r]) if "time_s" in run)


def _best_knob(
    group: str, budget: int, by_case: dict[str, Any], by: Any = "steady_min_s"
) -> dict[str, Any] | None:
    """The hand-picked knob with the least time (`by`: steady, `time_s` for the median
    first call, or a function of the result) whose peak above the floor fits."""
    fitting = [
        r
        for r in by_case.values()
        if r["case"].startswith(group + "/")
        and r["info"].get("tool") == "knob"
        and "steady_min_s" in r
        and (_above_floor(r, by_case) or 0) <= budget
    ]
    key = by if callable(by) else (lambda r: r[by])
    return min(fitting, key=key) if fitting else None


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = {r["case"]: r for r in results if "error" not in r}
    headers = [
        "case",
        "budget (MB)",
        "block size",
        "blocks",
        "strategy",
        "predicted peak (MB)",
        "peak - floor (MB)",
        "predicted / measured",
        "call's own peak (MB)",
        "predicted / call's",
        "plan (s)",
        "first call (s)",
        "steady min (s)",
        "steady CPU (s)",
    ]
    rows = []
    for r in results:
        name = r["case"]
        if "error" in r:
            rows.append([name, "failed: " + r["error"]] + [""] * (len(headers) - 2))
            continue
        info = r["info"]
        if info.get("tool") in ("floor", "xla", "matmul"):
            what = {
                "floor": "process floor",
                "xla": "compiled only",
                "matmul": f"float32 matmul: {info.get('flops_per_s', 0) / 1e9:.0f} GFLOP/s",
            }[info["tool"]]
            rows.append([name, what] + [""] * (len(headers) - 2))
            continue
        if info.get("tool") == "refused":
            least = re.search(r"a budget of at least ([0-9.]+ [kMG]?B)", info["refusal"])
            what = "refused" + (f": needs {least.group(1)}" if least else "")
            rows.append([name, _mb(info.get("max_memory")), what] + [""] * (len(headers) - 3))
            continue
        above = _above_floor(r, by_case)
        predicted = _predicted(r, by_case)
        own = _call_peak(r)
        rows.append(
            [
                name,
                _mb(info.get("budget_bytes")),
                info.get("block_size", ""),
                info.get("num_blocks", ""),
                info.get("strategy") or "",
                _mb(predicted),
                _mb(above),
                f"{predicted / above:.2f}" if predicted and above else "",
                _mb(own),
                f"{predicted / own:.2f}" if predicted and own else "",
                _seconds(info.get("plan_s")),
                _seconds(r.get("time_s")),
                _seconds(r.get("steady_min_s")),
                _seconds(r.get("steady_cpu_min_s")),
            ]
        )
    lines = [
        _problem_lines(by_case),
        "",
        _harness.markdown_table(headers, rows),
        "",
        "budget: the bytes max_memory came to (auto: the free memory less 20%, when planned). "
        "predicted peak: the plan's peak_bytes (output and XLA's temporaries, from "
        "memory_analysis); for a knob, its plan compiled in the xla case. peak - floor: "
        "peak resident memory (VmHWM) above the process floor of the same problem. call's own "
        "peak: a budgeted call's peak above the resident memory it started from, after "
        "planning (where the call, not planning, set the process's peak). plan: "
        "plan() on a fresh process. first call: wall time of the first call, planning and "
        "compilation included. steady: the fastest of "
        f"{args.steady_calls} further calls"
        + (f" in each of {args.repeat} runs" if getattr(args, "repeat", 1) > 1 else "")
        + "; steady CPU: the least CPU time (user and system, all threads) of those calls.",
    ]
    # Smoke-test sizes sit inside the noise of a process's own memory: no verdicts.
    verdicts = "" if args.quick else _verdicts(by_case)
    if verdicts:
        lines += ["", "Targets:", "", verdicts]
    return "\n".join(lines)


def _problem_lines(by_case: dict[str, Any]) -> str:
    lines = []
    for group in ("hessian", "small"):
        h = next((r["info"] for n, r in by_case.items() if n.startswith(group + "/")), None)
        if h:
            lines.append(
                f"- {group}: eqx.nn.MLP(32, 1, {h['width']}, {h['depth']}) mean-squared loss "
                f"over {h['points']} points: n = {h['n']:,}, "
                f"H = {h['hessian_bytes'] / _MB:,.0f} MB (float32)."
            )
    m = next((r["info"] for n, r in by_case.items() if n.startswith("map/")), None)
    if m:
        lines.append(
            f"- map: f(x) = sum(tanh(outer(x, x)) @ x), {m['batch']} vectors of {m['size']:,} "
            f"float32, {m['intermediate_bytes'] / _MB:.0f} MB intermediate per element."
        )
    return "\n".join(lines)


def _verdicts(by_case: dict[str, Any]) -> str:
    headers = [
        "case",
        "budget (MB)",
        "(a) peak - floor (MB)",
        "(a)",
        "fastest knob that fits",
        "(b) steady / knob",
        "(b)",
        "(c) predicted / call's own peak",
        "(c)",
        "compiles",
        "(d) whole first call / best knob's",
        "(d)",
        "(d) fastest of the runs' / best knob's fastest",
        "(d)",
        "(e) steady / same blocks",
        "(e)",
        "(f) steady / compute floor",
        "(f)",
    ]
    rows = []
    for name, r in by_case.items():
        info = r["info"]
        if info.get("tool") != "budget" or "budget_bytes" not in info:
            continue
        budget = info["budget_bytes"]
        above = _above_floor(r, by_case)
        if above is None:
            continue
        group = _group(name)
        knob = _best_knob(group, budget, by_case)
        first_knob = _best_knob(group, budget, by_case, by="time_s")
        fastest_knob = _best_knob(group, budget, by_case, by=_fastest_first_call)
        same = by_case.get(name.replace("/budget-", "/same-"))
        matmul = by_case.get(f"{group}/matmul")
        predicted = info["predicted_peak_bytes"]
        steady = r["steady_min_s"] / knob["steady_min_s"] if knob else None
        first = r["time_s"] / first_knob["time_s"] if first_knob else None
        fastest = (
            _fastest_first_call(r) / _fastest_first_call(fastest_knob) if fastest_knob else None
        )
        vs_same = r["steady_min_s"] / same["steady_min_s"] if same else None
        floor = None
        # The floor of a call bound by matrix products (the Hessian); the map is bound by
        # its elementwise tanh, which the matmul rate says nothing about.
        if group != "map" and matmul and info.get("flops"):
            floor = info["flops"] / matmul["info"]["flops_per_s"]
        vs_floor = r["steady_min_s"] / floor if floor else None
        # The call's own peak where it was measured; otherwise the peak above the floor.
        measured = _call_peak(r) or above
        error = abs(predicted - measured) / measured

        def ratio(value: float | None, target: float) -> list[str]:
            if value is None:
                return ["", ""]
            return [f"{value:.2f}", _mark(value <= target)]

        rows.append(
            [
                name,
                _mb(budget),
                _mb(above),
                _mark(above <= budget),
                knob["case"].split("/", 1)[1] if knob else "none fits",
                *ratio(steady, TIME_VS_BEST_KNOB),
                f"{predicted / measured:.2f}",
                _mark(error <= PREDICTION_TOLERANCE),
                info.get("compiles", ""),
                *ratio(first, FIRST_CALL_VS_BEST_KNOB),
                *ratio(fastest, FIRST_CALL_VS_BEST_KNOB),
                *ratio(vs_same, STEADY_VS_SAME_BLOCKS),
                *ratio(vs_floor, STEADY_VS_COMPUTE_FLOOR),
            ]
        )
    if not rows:
        return ""
    return (
        _harness.markdown_table(headers, rows)
        + "\n\n(a) peak - floor <= budget; (b) steady min <= "
        f"{TIME_VS_BEST_KNOB:.2f} x that of the fastest hand-picked knob whose peak - floor "
        f"fits the budget; (c) predicted peak within {PREDICTION_TOLERANCE:.0%} of the "
        "call's own peak (peak - floor where not measured); compiles: candidates the plan "
        "compiled; (d) the whole first call, planning "
        f"included, <= {FIRST_CALL_VS_BEST_KNOB:.2f} x the fastest first call of a knob that "
        "fits (the medians of the runs' first calls, and beside them the fastest of each: "
        "what else the machine does slows a fresh process's first call, never speeds it, "
        "as for the steady calls' minima)"
        f"; (e) steady min <= {STEADY_VS_SAME_BLOCKS:.2f} x that of the same blocks given "
        f"by hand (batch_size); (f) steady min <= {STEADY_VS_COMPUTE_FLOOR:.2f} x the compute "
        "floor, XLA's flops of the call (cost_analysis) at the float32 matmul rate measured "
        "in the same run."
    )


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    hessian_memory._add_arguments(parser)
    parser.add_argument(
        "--steady-calls", type=int, default=3, help="timed calls after the first (default 3)"
    )


if __name__ == "__main__":
    _harness.main(
        name="budgets",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report,
        add_arguments=_add_arguments,
    )
