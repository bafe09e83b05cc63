"""Memory budgets: does `max_memory` hold, and is its plan as fast as the best hand-picked knob?

A budget bounds the call's own buffers as XLA counts them (output and temporaries,
`memory_analysis()` of the compiled call), per device, less 2% for the allocator; the
host memory the compiler takes is reported apart, as `Plan.compile_bytes`. This script
checks that contract on a few problems, each case in its own process (see
`report.py`), each group with a `floor` case that holds the same imports and inputs
and computes nothing big:

- `hessian`: the reference Hessian (`problems.mlp`: an `eqx.nn.MLP(32, 1, 96, 2)`,
  mean squared error over 256 points, n = 12,577, H = 633 MB float32):
  `zm.BatchedHessian(loss, max_memory=B)` at B = 0.65, 0.7, 0.8, 1.0, 1.5 GB and
  `"auto"`, beside the hand-picked `zm.BatchedHessian(loss, nbatches=k)`.
- `small`: the budgets of a laptop's or a CI runner's job, on a small Hessian: the same
  loss with `eqx.nn.MLP(32, 1, 40, 2)` (n = 3,001, H = 36 MB float32) at B = 40, 50,
  100 and 200 MB, beside `nbatches` = 1, 4, 16, 64, 256; and at 20 MB, which cannot
  hold the Hessian and is refused: the budget the refusal names is checked by planning
  it, and against the least budget that one row per block needs.
- `map`: `f(x) = sum(tanh(outer(x, x)) @ x)` over 64 vectors of 3,000 float32 (36 MB
  intermediate per element): `zm.ChunkedVmap(f, max_memory=B)` at B = 100, 250 and
  500 MB, beside the hand-picked `chunk_size` = 1, 2, 3, 4, 6, 8, 13.
- `microbatch`: `zm.Microbatcher` of `sum(tanh(x @ W))` over 8,192 examples (a 4-byte
  result) at `max_memory="10MB"`, called under `eqx.filter_jit`.
- `sharded`: a 228-variable Hessian (208 kB) with its columns over 4 CPU devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=4`, set by these cases
  themselves before JAX starts) at 2 MB per device.

A budgeted case plans first (`transform.plan(...)`, timed: on a fresh process this is
the planning every first call pays) and then calls the transform, which reuses the
cached plan; its first-call time holds both. Every case that runs reports the time of
its first call and the fastest of `--steady-calls` further calls. Once the calls are
timed and the peak is read, each case compiles its call under `eqx.filter_jit` and
reads XLA's count of its buffers (the `memory_analysis()` of that program: temporaries
and output), untimed.

Per budgeted case:

- (a) the verdict on the budget: the plan's predicted peak (`plan.peak_bytes`) and
  XLA's count of the call compiled on its own both within the budget;
- (b) for information, not a verdict: the peak resident memory above the floor process
  (after the first call, and after planning alone), beside `plan.compile_bytes`, the
  plan's estimate of the host memory compiling took;
- (c) steady time <= 1.15 x that of the fastest hand-picked knob whose XLA count fits
  the same budget, and the whole first call, planning included, <= 1.15 x the fastest
  first call of such a knob (timings are noisy on a shared machine).

A refused budget (`small/budget-20MB`): the budget the refusal names plans, and is
within rounding of the least budget that holds one item per block (its XLA count, less
the 2% for the allocator).

    python benchmarks/budgets.py                   # every case, ~8 minutes on 2 cores
    python benchmarks/budgets.py --repeat 2        # each case twice: max peak, median times
    python benchmarks/budgets.py --cases map/floor,map/budget-100MB,map/chunk-2
    python benchmarks/budgets.py --quick           # small sizes (budgets scaled alike), ~4 minutes

Results go to `benchmarks/results/budgets.json` (`budgets_quick.json` with `--quick`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

_MB = report.MB

HESSIAN_BUDGETS = {
    "0.65GB": 0.65e9,
    "0.7GB": 0.7e9,
    "0.8GB": 0.8e9,
    "1.0GB": 1.0e9,
    "1.5GB": 1.5e9,
    "auto": None,
}
HESSIAN_NBATCHES = (8, 32, 128, 256, 512)
SMALL_WIDTH = 40  # n = 3,001 variables, H = 36 MB (float32)
SMALL_BUDGETS = {"20MB": 20e6, "40MB": 40e6, "50MB": 50e6, "100MB": 100e6, "200MB": 200e6}
SMALL_NBATCHES = (1, 4, 16, 64, 256)
MAP_BUDGETS = {"100MB": 100e6, "250MB": 250e6, "500MB": 500e6}
MAP_CHUNKS = (1, 2, 3, 4, 6, 8, 13)
MICROBATCH_BUDGET = "10MB"
SHARDED_BUDGET = "2MB"
SHARDED_DEVICES = 4
SHARDED_VARIABLES = 228  # divisible by the devices; H = 208 kB (float32)

# Full-size outputs and intermediates, to scale the budgets of the --quick sizes alike.
_FULL_HESSIAN_BYTES = 12_577**2 * 4
_FULL_SMALL_HESSIAN_BYTES = 3001**2 * 4
_FULL_MAP_INTERMEDIATE_BYTES = 3000**2 * 4

# The share of a budget the planner keeps for the allocator's slack (docs/budgets.md).
RESERVE_SHARE = 0.02
# (c): the planned call against the best hand-picked knob that fits.
TIME_VS_BEST_KNOB = 1.15
FIRST_CALL_VS_BEST_KNOB = 1.15
# A refusal writes the budget it names with three significant digits, rounded up.
NAMED_ROUNDING = 1.01


def _budget(label: str, budgets: dict[str, float | None], scale: float) -> int | str:
    value = budgets[label]
    return "auto" if value is None else int(value * scale)


def _xla_bytes(transform: Any, call_args: tuple) -> int:
    """XLA's count of the call's buffers: the temporaries and output of the call
    compiled on its own under `eqx.filter_jit` (the inputs are its parameters)."""
    import equinox as eqx

    lowered = eqx.filter_jit(lambda t, a: t(*a)).lower(transform, call_args)
    analysis = lowered.compile().compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def _plan_info(plan: Any) -> dict[str, Any]:
    return {
        "block_size": plan.block_size,
        "num_blocks": plan.num_blocks,
        "predicted_peak_bytes": plan.peak_bytes,
        "predicted_output_bytes": plan.output_bytes,
        "budget_bytes": plan.budget_bytes,
        "strategy": plan.strategy,
        "compiles": plan.compiles,
        "compile_bytes": plan.compile_bytes,
        "budget_source": plan.budget_source,
        "decision": list(plan.decision),
        "plan": repr(plan),
    }


def _refusal_info(transform_of: Any, call_args: tuple, error: Exception) -> dict[str, Any]:
    """The checks of the budget a refusal names: that it plans, and that it is no more
    than the least budget that holds one item per block, itself checked by planning it.
    `transform_of(**options)` makes the transform with a budget or a block size."""
    import zodmem as zm

    message = str(error)
    info: dict[str, Any] = {}
    named = re.search(r"a budget of at least ([0-9.]+ [kMG]?B)", message)
    if named is None:
        return info
    info["named"] = named.group(1)
    try:
        plan = transform_of(max_memory=named.group(1).replace(" ", "")).plan(*call_args)
        info["named_bytes"], info["named_plans"] = plan.budget_bytes, True
    except zm.MemoryBudgetError:
        info["named_plans"] = False
    one_item = transform_of(batch_size=1).plan(*call_args).peak_bytes
    least = math.ceil(one_item / (1 - RESERVE_SHARE))
    try:
        transform_of(max_memory=least).plan(*call_args)
        info["least_plans"] = True
    except zm.MemoryBudgetError:
        info["least_plans"] = False
    info.update(one_item_peak_bytes=one_item, least_bytes=least)
    return info


def _budgeted_case(
    transform: Any,
    call_args: tuple,
    info: dict[str, Any],
    args: argparse.Namespace,
    jit: bool = False,
    refusal: Any = None,
) -> report.Case:
    """A case whose first call plans (timed on its own) and then runs on the cached plan;
    with `jit`, both under `eqx.filter_jit`. A refused budget runs nothing, and is
    checked by `refusal(error)` once the calls are timed."""
    import equinox as eqx
    import jax
    import numpy as np

    import zodmem as zm

    def plan_of(t, a):
        return t.plan(*a)

    def call_of(t, a):
        return t(*a)

    if jit:
        plan_of, call_of = eqx.filter_jit(plan_of), eqx.filter_jit(call_of)
    planned, refused = [], []

    def compute():
        if refused:
            return np.zeros(1)
        if not planned:
            start = time.perf_counter()
            try:
                plan = plan_of(transform, call_args)
            except zm.MemoryBudgetError as error:
                refused.append(error)
                info["tool"] = "refused"
                return np.zeros(1)
            info["plan_s"] = time.perf_counter() - start
            # What planning alone left: the process's peak, before the call allocates.
            info["peak_after_plan_bytes"] = report.status_bytes("VmHWM")
            info.update(_plan_info(plan))
            planned.append(plan)
        # The harness samples entries of arrays with at least one axis: a loss's scalar
        # comes back as one entry (a reshape, where jnp.atleast_1d copies every array).
        return jax.tree.map(_with_an_axis, call_of(transform, call_args))

    def after():
        # Work of the benchmark's own, once the calls are timed and the peak read.
        if planned:
            info["xla_peak_bytes"] = _xla_bytes(transform, call_args)
        if refused:
            info["refusal"] = str(refused[0])
            if refusal is not None:
                info.update(refusal(refused[0]))

    return report.Case(compute, info, repeats=args.steady_calls, after=after)


def _with_an_axis(leaf: Any) -> Any:
    return leaf.reshape(1) if leaf.ndim == 0 else leaf


def _knob_case(
    transform: Any, call_args: tuple, info: dict[str, Any], args: argparse.Namespace
) -> report.Case:
    """A hand-picked knob: its calls timed, then (untimed) XLA's count of its call."""

    info["tool"] = "knob"

    def after():
        info["xla_peak_bytes"] = _xla_bytes(transform, call_args)

    return report.Case(lambda: transform(*call_args), info, args.steady_calls, after)


# ----------------------------------------------------------------------------------
# hessian and small


def _hessian_problem(args: argparse.Namespace, group: str) -> dict[str, Any]:
    """The reference Hessian's problem (`hessian`), or the small one (`small`: the same
    loss with a narrower network, for the budgets a laptop's or a CI runner's job gives)."""
    import equinox as eqx
    import jax
    import problems

    if args.quick:
        problem = problems.mlp("quick")
    else:
        problem = problems.mlp("cpu", SMALL_WIDTH if group == "small" else None)
    call = (problem.model, problem.inputs, problem.targets)
    # Touch the backend once, as every case does, so the floor holds JAX's runtime.
    jax.block_until_ready(eqx.filter_jit(problem.loss)(*call))
    n = problem.info["n"]
    info = {**problem.info, "group": group, "hessian_bytes": n * n * 4}
    full = _FULL_SMALL_HESSIAN_BYTES if group == "small" else _FULL_HESSIAN_BYTES
    return {"loss": problem.loss, "call": call, "info": info, "scale": n * n * 4 / full}


def hessian_floor(args: argparse.Namespace, group: str) -> report.Case:
    return report.Case(None, {**_hessian_problem(args, group)["info"], "tool": "floor"})


def hessian_budget(args: argparse.Namespace, label: str, group: str) -> report.Case:
    import zodmem as zm

    p = _hessian_problem(args, group)
    budgets = SMALL_BUDGETS if group == "small" else HESSIAN_BUDGETS
    budget = _budget(label, budgets, p["scale"])
    transform = zm.BatchedHessian(p["loss"], max_memory=budget)
    info = {**p["info"], "tool": "budget", "max_memory": budget}

    def refusal(error: Exception) -> dict[str, Any]:
        return _refusal_info(partial(zm.BatchedHessian, p["loss"]), p["call"], error)

    return _budgeted_case(transform, p["call"], info, args, refusal=refusal)


def hessian_knob(args: argparse.Namespace, nbatches: int, group: str) -> report.Case:
    import zodmem as zm

    p = _hessian_problem(args, group)
    transform = zm.BatchedHessian(p["loss"], nbatches=nbatches)
    n = p["info"]["n"]
    info = {**p["info"], "nbatches": nbatches, "block_size": -(-n // nbatches)}
    info["num_blocks"] = -(-n // info["block_size"])
    return _knob_case(transform, p["call"], info, args)


# ----------------------------------------------------------------------------------
# map


def _map_problem(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import problems

    import zodmem  # noqa: F401  (imported by every case, so the floor holds it too)

    f, xs, info = problems.map_problem(args.quick)
    jax.block_until_ready(jax.jit(jnp.sum)(xs))
    scale = info["intermediate_bytes"] / _FULL_MAP_INTERMEDIATE_BYTES
    return {"f": f, "xs": xs, "info": {"group": "map", **info}, "scale": scale}


def map_floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, {**_map_problem(args)["info"], "tool": "floor"})


def map_budget(args: argparse.Namespace, label: str) -> report.Case:
    import zodmem as zm

    p = _map_problem(args)
    budget = _budget(label, MAP_BUDGETS, p["scale"])
    transform = zm.ChunkedVmap(p["f"], max_memory=budget)
    info = {**p["info"], "tool": "budget", "max_memory": budget}
    return _budgeted_case(transform, (p["xs"],), info, args)


def map_knob(args: argparse.Namespace, chunk: int) -> report.Case:
    import zodmem as zm

    p = _map_problem(args)
    transform = zm.ChunkedVmap(p["f"], chunk_size=chunk)
    batch = p["info"]["batch"]
    info = {**p["info"], "chunk_size": chunk, "block_size": chunk, "num_blocks": -(-batch // chunk)}
    return _knob_case(transform, (p["xs"],), info, args)


# ----------------------------------------------------------------------------------
# microbatch and sharded: the small budgets a CPU used to refuse


def _microbatch_problem(args: argparse.Namespace) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import zodmem  # noqa: F401

    weight_key, x_key = jax.random.split(jax.random.key(0))
    weights = jax.random.normal(weight_key, (256, 512)) / 16
    xs = jax.random.normal(x_key, (8192, 256))

    def loss(weights, xs):
        return jnp.sum(jnp.tanh(xs @ weights))

    jax.block_until_ready(eqx.filter_jit(loss)(weights, xs))
    info = {"group": "microbatch", "examples": 8192, "features": 256, "outputs": 512}
    return {"loss": loss, "call": (weights, xs), "info": info}


def microbatch_floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, {**_microbatch_problem(args)["info"], "tool": "floor"})


def microbatch_budget(args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    p = _microbatch_problem(args)
    transform = zm.Microbatcher(p["loss"], max_memory=MICROBATCH_BUDGET, argnums=1)
    info = {**p["info"], "tool": "budget", "max_memory": MICROBATCH_BUDGET}
    return _budgeted_case(transform, p["call"], info, args, jit=True)


def _sharded_problem(args: argparse.Namespace) -> dict[str, Any]:
    """A Hessian with its columns over 4 CPU devices: the devices are made by XLA's flag,
    which must be set before JAX starts its backend, as this case's process does here."""
    report.force_cpu_devices(SHARDED_DEVICES)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import zodmem  # noqa: F401

    if jax.device_count() != SHARDED_DEVICES:
        raise RuntimeError(
            f"the sharded cases need {SHARDED_DEVICES} devices; JAX started with "
            f"{jax.device_count()} (was the backend started before XLA_FLAGS was set?)"
        )
    n = SHARDED_VARIABLES
    w = jnp.linspace(-1.0, 1.0, n)
    data = jnp.cos(jnp.arange(8 * n, dtype=w.dtype).reshape(8, n))

    def loss(w, data):
        return jnp.sum(jnp.tanh(data @ w) ** 2) * jnp.sum(w**2)

    jax.block_until_ready(jax.jit(loss)(w, data))
    mesh = jax.make_mesh((SHARDED_DEVICES,), ("d",))
    columns = NamedSharding(mesh, PartitionSpec(None, "d"))
    info = {"group": "sharded", "n": n, "hessian_bytes": n * n * 4, "devices": SHARDED_DEVICES}
    return {"loss": loss, "call": (w, data), "sharding": columns, "info": info}


def sharded_floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, {**_sharded_problem(args)["info"], "tool": "floor"})


def sharded_budget(args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    p = _sharded_problem(args)
    transform = zm.BatchedHessian(p["loss"], sharding=p["sharding"], max_memory=SHARDED_BUDGET)
    info = {**p["info"], "tool": "budget", "max_memory": SHARDED_BUDGET}
    return _budgeted_case(transform, p["call"], info, args)


CASES = {
    "hessian/floor": partial(hessian_floor, group="hessian"),
    **{
        f"hessian/budget-{b}": partial(hessian_budget, label=b, group="hessian")
        for b in HESSIAN_BUDGETS
    },
    **{
        f"hessian/nbatches-{k}": partial(hessian_knob, nbatches=k, group="hessian")
        for k in HESSIAN_NBATCHES
    },
    "small/floor": partial(hessian_floor, group="small"),
    **{f"small/budget-{b}": partial(hessian_budget, label=b, group="small") for b in SMALL_BUDGETS},
    **{
        f"small/nbatches-{k}": partial(hessian_knob, nbatches=k, group="small")
        for k in SMALL_NBATCHES
    },
    "map/floor": map_floor,
    **{f"map/budget-{b}": partial(map_budget, label=b) for b in MAP_BUDGETS},
    **{f"map/chunk-{c}": partial(map_knob, chunk=c) for c in MAP_CHUNKS},
    "microbatch/floor": microbatch_floor,
    f"microbatch/budget-{MICROBATCH_BUDGET}": microbatch_budget,
    "sharded/floor": sharded_floor,
    f"sharded/budget-{SHARDED_BUDGET}": sharded_budget,
}


# ----------------------------------------------------------------------------------
# report


def _group(name: str) -> str:
    return name.partition("/")[0]


def _above_floor(r: dict[str, Any], by_case: dict[str, Any], peak: int | None = None) -> int | None:
    floor = by_case.get(f"{_group(r['case'])}/floor")
    peak = r["peak_rss_bytes"] if peak is None else peak
    return peak - floor["peak_rss_bytes"] if floor and peak is not None else None


def _fits(r: dict[str, Any], budget: int) -> bool:
    return r["info"].get("xla_peak_bytes") is not None and r["info"]["xla_peak_bytes"] <= budget


def _best_knob(group: str, budget: int, by_case: dict[str, Any], by: str) -> dict[str, Any] | None:
    """The hand-picked knob of `group` with the least `by` (`steady_min_s`, `time_s`)
    whose call, by XLA's count, fits `budget`."""
    fitting = [
        r
        for r in by_case.values()
        if _group(r["case"]) == group
        and r["info"].get("tool") == "knob"
        and by in r
        and _fits(r, budget)
    ]
    return min(fitting, key=lambda r: r[by]) if fitting else None


def _budget_label(info: dict[str, Any]) -> str:
    text = report.small_bytes(info.get("budget_bytes"))
    return f"auto: {text}" if info.get("max_memory") == "auto" else text


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = report.succeeded(results)
    failed = [r for r in results if "error" in r]
    planned = [r for r in by_case.values() if r["info"].get("tool") == "budget"]
    knobs = [r for r in by_case.values() if r["info"].get("tool") == "knob"]
    refused = [r for r in by_case.values() if r["info"].get("tool") == "refused"]
    lines = [_problem_lines(by_case), ""]
    if planned:
        lines += [_budget_table(planned, by_case), "", _BUDGET_NOTE, ""]
    if knobs:
        lines += [_knob_table(knobs, by_case), "", _KNOB_NOTE, ""]
    if refused:
        lines += [_refusal_table(refused), "", _REFUSAL_NOTE, ""]
    # Smoke-test sizes run in milliseconds, inside the noise of a process's start: no
    # verdicts on time.
    if planned and not args.quick:
        lines += [_time_table(planned, by_case), "", _time_note(args), ""]
    for r in failed:
        tail = " ".join(r.get("stderr_tail", [])[-3:])
        lines.append(f"- {r['case']} failed: {r['error']} {tail}")
    return "\n".join(lines).rstrip() + "\n"


def _budget_table(planned: list[dict[str, Any]], by_case: dict[str, Any]) -> str:
    headers = [
        "case",
        "budget (MB)",
        "plan",
        "compiles",
        "predicted peak (MB)",
        "XLA's count (MB)",
        "(a)",
        "peak - floor (MB)",
        "planning's peak - floor (MB)",
        "compile estimate (MB)",
    ]
    rows = []
    for r in planned:
        info = r["info"]
        budget, predicted, xla = info["budget_bytes"], info["predicted_peak_bytes"], None
        xla = info.get("xla_peak_bytes")
        held = predicted <= budget and xla is not None and xla <= budget
        blocks = f"{info['num_blocks']} x {info['block_size']}"
        if info.get("strategy"):
            blocks += f" ({info['strategy']})"
        rows.append(
            [
                r["case"],
                _budget_label(info),
                blocks,
                info.get("compiles", ""),
                report.small_bytes(predicted),
                report.small_bytes(xla),
                report.met(held),
                report.small_bytes(_above_floor(r, by_case)),
                report.small_bytes(_above_floor(r, by_case, info.get("peak_after_plan_bytes"))),
                report.small_bytes(info.get("compile_bytes")),
            ]
        )
    return report.markdown_table(headers, rows)


_BUDGET_NOTE = (
    "plan: blocks x items per block (strategy); compiles: candidates the plan compiled. "
    "(a) the verdict: the plan's predicted peak (plan.peak_bytes) and XLA's count of the "
    "call compiled on its own under eqx.filter_jit (memory_analysis(): temporaries and "
    "output, per device) both within the budget. For information: peak - floor, the "
    "process's peak resident memory (VmHWM) after the first call above the floor process "
    "of the same group; planning's peak - floor, the same right after plan(), before the "
    "call; compile estimate, plan.compile_bytes (the most one candidate's compile grew the "
    "process's resident memory)."
)


def _knob_table(knobs: list[dict[str, Any]], by_case: dict[str, Any]) -> str:
    headers = [
        "case",
        "blocks",
        "XLA's count (MB)",
        "peak - floor (MB)",
        "first call (s)",
        "steady (s)",
        "steady CPU (s)",
    ]
    rows = [
        [
            r["case"],
            f"{r['info']['num_blocks']} x {r['info']['block_size']}",
            report.small_bytes(r["info"].get("xla_peak_bytes")),
            report.small_bytes(_above_floor(r, by_case)),
            report.number(r.get("time_s")),
            report.number(r.get("steady_min_s")),
            report.number(r.get("steady_cpu_min_s")),
        ]
        for r in knobs
    ]
    return report.markdown_table(headers, rows)


_KNOB_NOTE = (
    "The hand-picked knobs: XLA's count of each call compiled on its own, and the peak "
    "resident memory above the floor of its group."
)


def _refusal_table(refused: list[dict[str, Any]]) -> str:
    headers = [
        "case",
        "budget (MB)",
        "names",
        "named plans",
        "one item per block: XLA's count (MB)",
        "least budget (MB)",
        "least plans",
        "named <= least",
    ]
    rows = []
    for r in refused:
        info = r["info"]
        named, least = info.get("named_bytes"), info.get("least_bytes")
        tight = named is not None and least is not None and named <= least * NAMED_ROUNDING
        rows.append(
            [
                r["case"],
                report.small_bytes(info.get("max_memory")),
                info.get("named", "(none)"),
                report.met(bool(info.get("named_plans"))),
                report.small_bytes(info.get("one_item_peak_bytes")),
                report.small_bytes(least),
                report.met(bool(info.get("least_plans"))),
                report.met(tight),
            ]
        )
    return report.markdown_table(headers, rows)


_REFUSAL_NOTE = (
    "A refused budget: the budget its message names, planned in the same process; the "
    "least budget that holds one item per block (XLA's count of the call with "
    "batch_size=1, over 1 - 2%), planned too; the named budget should be no more than "
    f"that, to within its rounding up ({NAMED_ROUNDING - 1:.0%})."
)


def _time_table(planned: list[dict[str, Any]], by_case: dict[str, Any]) -> str:
    headers = [
        "case",
        "plan (s)",
        "first call (s)",
        "steady (s)",
        "steady CPU (s)",
        "fastest knob that fits",
        "steady / knob's",
        "(c)",
        "least CPU knob that fits",
        "steady CPU / knob's",
        "(c)",
        "first call / best knob's",
        "(c)",
    ]
    rows = []
    for r in planned:
        budget, group = r["info"]["budget_bytes"], _group(r["case"])
        row = [
            r["case"],
            report.number(r["info"].get("plan_s")),
            report.number(r.get("time_s")),
            report.number(r.get("steady_min_s")),
            report.number(r.get("steady_cpu_min_s")),
        ]
        for key, target, named in (
            ("steady_min_s", TIME_VS_BEST_KNOB, True),
            ("steady_cpu_min_s", TIME_VS_BEST_KNOB, True),
            ("time_s", FIRST_CALL_VS_BEST_KNOB, False),
        ):
            knob = _best_knob(group, budget, by_case, key)
            if named:
                row.append(knob["case"].split("/", 1)[1] if knob else "(no knob)")
            if knob is None or key not in r:
                row += ["", ""]
                continue
            ratio = r[key] / knob[key]
            row += [f"{ratio:.2f}", report.met(ratio <= target)]
        rows.append(row)
    return report.markdown_table(headers, rows)


def _time_note(args: argparse.Namespace) -> str:
    repeat = getattr(args, "repeat", 1)
    runs = f" in each of {repeat} runs" if repeat > 1 else ""
    first = " (the median of the runs' first calls; of two, the slower)" if repeat > 1 else ""
    return (
        "plan: plan() on a fresh process; first call: wall time of the first call, planning "
        f"and compilation included{first}; steady: the fastest of {args.steady_calls} further "
        f"calls{runs}, and steady CPU the least CPU time (user and system, all threads) of "
        f"those calls. (c) steady <= {TIME_VS_BEST_KNOB:.2f} x that of the fastest hand-picked "
        "knob whose XLA count fits the budget (by wall time, and by CPU time, which depends "
        "less on what else the machine runs), and the whole first call <= "
        f"{FIRST_CALL_VS_BEST_KNOB:.2f} x the fastest first call of such a knob."
    )


def _problem_lines(by_case: dict[str, Any]) -> str:
    def first(group: str) -> dict[str, Any] | None:
        return next((r["info"] for n, r in by_case.items() if _group(n) == group), None)

    lines = []
    for group in ("hessian", "small"):
        h = first(group)
        if h:
            lines.append(
                f"- {group}: eqx.nn.MLP(32, 1, {h['width']}, {h['depth']}), mean squared error "
                f"over {h['points']} points: n = {h['n']:,}, "
                f"H = {h['hessian_bytes'] / _MB:,.0f} MB (float32)."
            )
    m = first("map")
    if m:
        lines.append(
            f"- map: f(x) = sum(tanh(outer(x, x)) @ x), {m['batch']} vectors of {m['size']:,} "
            f"float32, {m['intermediate_bytes'] / _MB:.0f} MB intermediate per element."
        )
    b = first("microbatch")
    if b:
        lines.append(
            f"- microbatch: Microbatcher of sum(tanh(x @ W)) over {b['examples']:,} examples "
            f"of {b['features']} features, W {b['features']} x {b['outputs']}, a 4-byte "
            "result, called under eqx.filter_jit."
        )
    s = first("sharded")
    if s:
        lines.append(
            f"- sharded: the Hessian of {s['n']} variables ({s['hessian_bytes'] / 1e3:.0f} kB), "
            f"its columns over {s['devices']} CPU devices; the budget is per device."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    report.main(
        name="budgets",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report_text,
        steady_calls=2,
    )
