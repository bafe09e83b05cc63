"""Peak memory and time of maps, microbatches and scans, against the tools they replace.

Four problems, each case in its own process (see `report.py`), each with a `floor`
case that holds the same imports and inputs and computes nothing big:

- `map`: `f(x) = sum(tanh(outer(x, x)) @ x)` over 64 vectors of 3,000 float32, so
  every element makes a 36 MB intermediate: `jax.vmap`, `jax.lax.map(batch_size=)`,
  `powerpax.chunked_vmap`, `optax.microbatching.micro_vmap` and `zm.ChunkedVmap` at
  chunk sizes 4 and 16.
- `microbatch`: the gradient of a mean-squared loss over 256 examples whose
  prediction makes a 4 MB intermediate per example: `jax.grad` over the whole batch,
  `optax.microbatching.microbatch` and `zm.Microbatcher` at microbatch sizes 16 and 64.
- `scan`: 20,000 steps of a 262,144-float32 (1 MB) state, keeping the output of every
  100th step: `zm.SlicedScan` and `powerpax.sliced_scan`; and, at 2,000 steps (the
  20,000 outputs of a plain scan would take 21 GB), `lax.scan` then slicing `ys`.
- `nested`: per-example Hessians of a small MLP's loss over 32 examples,
  `zm.ChunkedVmap(zm.BatchedHessian(loss, nbatches=k), chunk_size=c)` against
  `jax.vmap(jax.hessian(loss))`.

Every case reports the time of its first call (compilation included), then calls
the compiled function `--steady-calls` more times and reports the fastest and the
median of those (`steady`), and the least CPU time (user and system, all threads)
of those calls, which moves less than wall time when other work shares the machine.

    python benchmarks/loops.py                      # every case, ~4 minutes on 2 cores
    python benchmarks/loops.py --cases map/floor,map/jax.vmap,map/zodmem-4
    python benchmarks/loops.py --quick              # small sizes, about a minute

Results go to `benchmarks/results/loops.json` (`loops_quick.json` with `--quick`).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402


def _touch(*arrays: Any) -> None:
    """Import every tool and start the backend, as every case of a group does, so that
    the floor holds what all cases share and differences are the computation's own."""
    import jax
    import jax.numpy as jnp
    import optax.microbatching  # noqa: F401
    import powerpax  # noqa: F401

    import zodmem  # noqa: F401

    jax.block_until_ready([jnp.sum(a) for a in arrays])


def _case(compute: Any, info: dict[str, Any], args: argparse.Namespace) -> report.Case:
    return report.Case(compute, info, repeats=args.steady_calls)


# ----------------------------------------------------------------------------------
# map


def _map_problem(args: argparse.Namespace) -> dict[str, Any]:
    import problems

    f, xs, info = problems.map_problem(args.quick)
    _touch(xs)
    return dict(f=f, xs=xs, info={"group": "map", **info})


def map_floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, {**_map_problem(args)["info"], "tool": "floor"})


def map_vmap(args: argparse.Namespace) -> report.Case:
    import jax

    p = _map_problem(args)
    mapped = jax.jit(jax.vmap(p["f"]))
    return _case(lambda: mapped(p["xs"]), {**p["info"], "tool": "jax.vmap"}, args)


def map_lax_map(args: argparse.Namespace, chunk: int) -> report.Case:
    import jax

    p = _map_problem(args)
    mapped = jax.jit(lambda xs: jax.lax.map(p["f"], xs, batch_size=chunk))
    info = {**p["info"], "tool": "jax.lax.map", "chunk_size": chunk}
    return _case(lambda: mapped(p["xs"]), info, args)


def map_powerpax(args: argparse.Namespace, chunk: int) -> report.Case:
    import jax
    import powerpax

    p = _map_problem(args)
    mapped = jax.jit(powerpax.chunked_vmap(p["f"], chunk))
    info = {**p["info"], "tool": "powerpax", "chunk_size": chunk}
    return _case(lambda: mapped(p["xs"]), info, args)


def map_optax(args: argparse.Namespace, chunk: int) -> report.Case:
    import jax
    from optax import microbatching

    p = _map_problem(args)
    mapped = jax.jit(microbatching.micro_vmap(p["f"], microbatch_size=chunk))
    info = {**p["info"], "tool": "optax", "chunk_size": chunk}
    return _case(lambda: mapped(p["xs"]), info, args)


def map_zodmem(args: argparse.Namespace, chunk: int) -> report.Case:
    import zodmem as zm

    p = _map_problem(args)
    mapped = zm.ChunkedVmap(p["f"], chunk_size=chunk)
    info = {**p["info"], "tool": "zodmem", "chunk_size": chunk}
    return _case(lambda: mapped(p["xs"]), info, args)


# ----------------------------------------------------------------------------------
# microbatch


def _microbatch_problem(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    width, batch = (128, 64) if args.quick else (1024, 256)
    w_key, v_key, x_key, y_key = jax.random.split(jax.random.key(1), 4)
    params = (
        jax.random.normal(w_key, (width,)),
        jax.random.normal(v_key, (width,)) / width,
    )
    xs = jax.random.normal(x_key, (batch, width)) / jnp.sqrt(width)
    ys = jax.random.normal(y_key, (batch,))

    def loss(params, xs, ys):
        w, v = params

        def predict(x):
            return jnp.sum(jnp.tanh(jnp.outer(x, w)) @ v)  # a width x width intermediate

        return jnp.mean((jax.vmap(predict)(xs) - ys) ** 2)

    _touch(*params, xs, ys)
    info = {
        "group": "microbatch",
        "width": width,
        "batch": batch,
        "intermediate_bytes": width * width * 4,
    }
    return dict(grad=jax.grad(loss), params=params, xs=xs, ys=ys, info=info)


def microbatch_floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, {**_microbatch_problem(args)["info"], "tool": "floor"})


def microbatch_grad(args: argparse.Namespace) -> report.Case:
    import jax

    p = _microbatch_problem(args)
    grad = jax.jit(p["grad"])
    info = {**p["info"], "tool": "jax.grad"}
    return _case(lambda: grad(p["params"], p["xs"], p["ys"]), info, args)


def microbatch_optax(args: argparse.Namespace, size: int) -> report.Case:
    import jax
    from optax import microbatching

    p = _microbatch_problem(args)
    grad = jax.jit(
        microbatching.microbatch(
            p["grad"],
            argnums=(1, 2),
            microbatch_size=size,
            accumulator=microbatching.AccumulationType.MEAN,
        )
    )
    info = {**p["info"], "tool": "optax", "microbatch_size": size}
    return _case(lambda: grad(p["params"], p["xs"], p["ys"]), info, args)


def microbatch_zodmem(args: argparse.Namespace, size: int) -> report.Case:
    import zodmem as zm

    p = _microbatch_problem(args)
    grad = zm.Microbatcher(p["grad"], microbatch_size=size, argnums=(1, 2), accumulator="mean")
    info = {**p["info"], "tool": "zodmem", "microbatch_size": size}
    return _case(lambda: grad(p["params"], p["xs"], p["ys"]), info, args)


# ----------------------------------------------------------------------------------
# scan


def _scan_problem(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    import jax.numpy as jnp

    size = 4096 if args.quick else 262_144
    steps = steps // 10 if args.quick else steps
    x0 = jnp.linspace(0.0, 1.0, size, dtype=jnp.float32)

    def step(x, _):
        x = 0.999 * x + 0.001
        return x, x

    _touch(x0)
    kept = range(99, steps, 100)
    info = {
        "group": "scan",
        "steps": steps,
        "state_bytes": size * 4,
        "kept": len(kept),
        "kept_bytes": len(kept) * size * 4,
        "all_ys_bytes": steps * size * 4,
    }
    return dict(step=step, x0=x0, steps=steps, info=info)


def scan_floor(args: argparse.Namespace, steps: int) -> report.Case:
    return report.Case(None, {**_scan_problem(args, steps)["info"], "tool": "floor"})


def scan_lax(args: argparse.Namespace, steps: int) -> report.Case:
    import jax

    p = _scan_problem(args, steps)

    @jax.jit
    def run(x0):
        _, ys = jax.lax.scan(p["step"], x0, None, length=p["steps"])
        return ys[99::100]

    info = {**p["info"], "tool": "jax.lax.scan then slice"}
    return _case(lambda: run(p["x0"]), info, args)


def scan_powerpax(args: argparse.Namespace, steps: int) -> report.Case:
    import jax
    import powerpax

    p = _scan_problem(args, steps)

    @jax.jit
    def run(x0):
        _, ys = powerpax.sliced_scan(p["step"], x0, None, length=p["steps"], start=99, step=100)
        return ys

    return _case(lambda: run(p["x0"]), {**p["info"], "tool": "powerpax"}, args)


def scan_zodmem(args: argparse.Namespace, steps: int) -> report.Case:
    import zodmem as zm

    p = _scan_problem(args, steps)
    scan = zm.SlicedScan(p["step"], start=99, step=100, length=p["steps"])
    return _case(lambda: scan(p["x0"])[1], {**p["info"], "tool": "zodmem"}, args)


# ----------------------------------------------------------------------------------
# nested: per-example Hessians


def _nested_problem(args: argparse.Namespace) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    width, points, batch = (8, 16, 8) if args.quick else (32, 64, 32)
    model_key, x_key, y_key = jax.random.split(jax.random.key(2), 3)
    model = eqx.nn.MLP(8, 1, width, 2, key=model_key)
    xs = jax.random.normal(x_key, (batch, points, 8))
    ys = jax.random.normal(y_key, (batch, points))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)

    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)

    def loss_of_flat(flat, x, y):
        return loss(eqx.combine(unravel(flat), static), x, y)

    _touch(flat, xs, ys)
    n = int(flat.size)
    info = {
        "group": "nested",
        "n": n,
        "points": points,
        "batch": batch,
        "hessian_bytes": n * n * 4,
        "all_hessians_bytes": batch * n * n * 4,
    }
    return dict(
        model=model, xs=xs, ys=ys, loss=loss, flat=flat, loss_of_flat=loss_of_flat, info=info
    )


def nested_floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, {**_nested_problem(args)["info"], "tool": "floor"})


def nested_jax(args: argparse.Namespace) -> report.Case:
    import jax

    p = _nested_problem(args)
    hessians = jax.jit(jax.vmap(jax.hessian(p["loss_of_flat"]), in_axes=(None, 0, 0)))
    info = {**p["info"], "tool": "jax.vmap(jax.hessian)"}
    return _case(lambda: hessians(p["flat"], p["xs"], p["ys"]), info, args)


def nested_zodmem(args: argparse.Namespace, chunk: int, nbatches: int) -> report.Case:
    import zodmem as zm

    p = _nested_problem(args)
    hessians = zm.ChunkedVmap(
        zm.BatchedHessian(p["loss"], nbatches=nbatches), chunk_size=chunk, in_axes=(None, 0, 0)
    )
    info = {**p["info"], "tool": "zodmem", "chunk_size": chunk, "nbatches": nbatches}
    return _case(lambda: hessians(p["model"], p["xs"], p["ys"]), info, args)


CASES = {
    "map/floor": map_floor,
    "map/jax.vmap": map_vmap,
    "map/jax.lax.map-4": partial(map_lax_map, chunk=4),
    "map/powerpax-4": partial(map_powerpax, chunk=4),
    "map/optax-4": partial(map_optax, chunk=4),
    "map/zodmem-4": partial(map_zodmem, chunk=4),
    "map/jax.lax.map-16": partial(map_lax_map, chunk=16),
    "map/powerpax-16": partial(map_powerpax, chunk=16),
    "map/optax-16": partial(map_optax, chunk=16),
    "map/zodmem-16": partial(map_zodmem, chunk=16),
    "microbatch/floor": microbatch_floor,
    "microbatch/jax.grad": microbatch_grad,
    "microbatch/optax-16": partial(microbatch_optax, size=16),
    "microbatch/zodmem-16": partial(microbatch_zodmem, size=16),
    "microbatch/optax-64": partial(microbatch_optax, size=64),
    "microbatch/zodmem-64": partial(microbatch_zodmem, size=64),
    "scan/floor@2000": partial(scan_floor, steps=2000),
    "scan/jax.lax.scan@2000": partial(scan_lax, steps=2000),
    "scan/powerpax@2000": partial(scan_powerpax, steps=2000),
    "scan/zodmem@2000": partial(scan_zodmem, steps=2000),
    "scan/floor@20000": partial(scan_floor, steps=20000),
    "scan/powerpax@20000": partial(scan_powerpax, steps=20000),
    "scan/zodmem@20000": partial(scan_zodmem, steps=20000),
    "nested/floor": nested_floor,
    "nested/jax.vmap(jax.hessian)": nested_jax,
    "nested/zodmem-4": partial(nested_zodmem, chunk=4, nbatches=8),
    "nested/zodmem-8": partial(nested_zodmem, chunk=8, nbatches=4),
}

# The case each group's ratios and checks are taken against.
REFERENCES = {
    "map": "map/jax.vmap",
    "microbatch": "microbatch/jax.grad",
    "scan@2000": "scan/jax.lax.scan@2000",
    "scan@20000": "scan/powerpax@20000",
    "nested": "nested/jax.vmap(jax.hessian)",
}

# Targets: zodmem against each anchor at the same chunk size (steady time and peak
# at most the anchor's, up to the noise of the readings: 5% for times, which move
# more than that between runs of one case on a shared machine, and the larger of 2%
# and 16 MB for resident memory), and the chunk-4 map against the whole-batch vmap.
TIME_SLACK = 1.05
PEAK_SLACK = 1.02
PEAK_SLACK_BYTES = 16e6
MAP_VS_VMAP = 1.3


def _group(name: str) -> str:
    """`scan/zodmem@2000` -> `scan@2000`; `map/zodmem-4` -> `map`."""
    group, _, rest = name.partition("/")
    return group + ("@" + rest.rsplit("@", 1)[1] if "@" in rest else "")


def _floor_of(name: str) -> str:
    group, _, rest = name.partition("/")
    return f"{group}/floor" + ("@" + rest.rsplit("@", 1)[1] if "@" in rest else "")


def _steady(r: dict[str, Any]) -> float | None:
    return r.get("steady_min_s", r.get("run_s"))


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = report.succeeded(results)
    headers = [
        "case",
        "peak RSS (GB)",
        "peak - floor (GB)",
        "peak / ref",
        "first call (s)",
        "steady min (s)",
        "steady median (s)",
        "steady CPU (s)",
        "steady / ref",
        "output (MB)",
        "check",
    ]

    def row(r: dict[str, Any]) -> list[Any] | None:
        name = r["case"]
        peak = r["peak_rss_bytes"]
        if "time_s" not in r:  # a floor
            return [name, report.gigabytes(peak)] + [""] * (len(headers) - 2)
        reference = by_case.get(REFERENCES.get(_group(name), ""))
        other = reference if reference is not r else None
        return [
            name,
            report.gigabytes(peak),
            report.gigabytes(report.above(r, by_case.get(_floor_of(name)))),
            report.ratio(peak, other and other["peak_rss_bytes"]),
            report.number(r["time_s"]),
            report.number(r.get("steady_min_s")),
            report.number(r.get("steady_median_s")),
            report.number(r.get("steady_cpu_min_s")),
            report.ratio(_steady(r), other and _steady(other)),
            report.megabytes(r["output_bytes"], ".1f"),
            report.check_cell(r, reference),
        ]

    lines = [
        _problem_lines(by_case),
        "",
        report.case_table(results, headers, row),
        "",
        "first call: wall time of the first call, tracing and compilation included. "
        f"steady: the fastest and the median of {report.further_calls(args)}"
        "; steady CPU: the least CPU time (user and system, all threads) of those "
        "calls. ref: "
        + ", ".join(f"{REFERENCES[g]} for {g}" for g in REFERENCES)
        + f". check: largest difference from ref {report.CHECK_NOTE}.",
    ]
    if not args.quick:  # smoke-test sizes take milliseconds: their ratios say nothing
        lines += report.section("Targets:", _targets(by_case)) + _nested_bounds(by_case)
    return "\n".join(lines)


def _problem_lines(by_case: dict[str, Any]) -> str:
    def info(group: str) -> dict[str, Any]:
        return next((r["info"] for n, r in by_case.items() if n.startswith(group + "/")), {})

    lines = []
    m = info("map")
    if m:
        lines.append(
            f"- map: f(x) = sum(tanh(outer(x, x)) @ x), {m['batch']} vectors of {m['size']:,} "
            f"float32, {m['intermediate_bytes'] / 1e6:.0f} MB intermediate per element."
        )
    m = info("microbatch")
    if m:
        lines.append(
            f"- microbatch: gradient of a mean-squared loss over {m['batch']} examples, "
            f"{m['intermediate_bytes'] / 1e6:.0f} MB intermediate per example "
            f"(width {m['width']:,})."
        )
    scans = sorted({r["info"]["steps"] for n, r in by_case.items() if n.startswith("scan/")})
    m = info("scan")
    if m:
        lines.append(
            f"- scan: {' and '.join(f'{s:,}' for s in scans)} steps of a "
            f"{m['state_bytes'] / 1e6:.2f} MB float32 state, keeping the output of every "
            "100th step (steps 99, 199, ...)."
        )
    m = info("nested")
    if m:
        lines.append(
            f"- nested: per-example Hessians of an MLP loss over {m['points']} points, "
            f"n = {m['n']:,} parameters, {m['batch']} examples: "
            f"{m['all_hessians_bytes'] / 1e6:.0f} MB of Hessians."
        )
    return "\n".join(lines)


def _targets(by_case: dict[str, Any]) -> list[str]:
    lines = []
    for name, r in by_case.items():
        tool = r["info"].get("tool")
        if tool != "zodmem" or "steady_min_s" not in r:
            continue
        group, _, rest = name.partition("/")
        suffix = rest[len("zodmem") :]
        verdicts = []
        for anchor in ("jax.lax.map", "powerpax", "optax"):
            other = by_case.get(f"{group}/{anchor}{suffix}")
            if other is None or "steady_min_s" not in other:
                continue
            ratio = r["steady_min_s"] / other["steady_min_s"]
            verdicts.append(report.verdict(f"steady/{anchor}", ratio, TIME_SLACK))
            slack = max(PEAK_SLACK, 1 + PEAK_SLACK_BYTES / other["peak_rss_bytes"])
            ratio = r["peak_rss_bytes"] / other["peak_rss_bytes"]
            verdicts.append(report.verdict(f"peak/{anchor}", ratio, slack))
        if name == "map/zodmem-4" and "map/jax.vmap" in by_case:
            vmap = by_case["map/jax.vmap"]
            ratio = r["steady_min_s"] / vmap["steady_min_s"]
            verdicts.append(report.verdict("steady/jax.vmap", ratio, MAP_VS_VMAP))
        if verdicts:
            lines.append(f"- {name}: " + ", ".join(verdicts))
    return lines


def _nested_bounds(by_case: dict[str, Any]) -> list[str]:
    """What a nested stack should hold at its peak: the output, plus one chunk of
    examples each holding one Hessian and the working set of one block of columns,
    sized from the unchunked reference's working set per example and column."""
    reference = by_case.get(REFERENCES["nested"])
    floor = by_case.get("nested/floor")
    if reference is None or floor is None:
        return []
    info = reference["info"]
    n, batch, hessian = info["n"], info["batch"], info["hessian_bytes"]
    output = info["all_hessians_bytes"]
    working = reference["peak_rss_bytes"] - floor["peak_rss_bytes"] - output
    per_column = working / (batch * n)
    lines = [
        "",
        f"Nested stacks: jax.vmap(jax.hessian) works with {per_column / 1e3:.0f} kB per "
        f"example and Hessian column above its output; a stack should need about the "
        "output plus chunk x (one Hessian + one block of columns).",
    ]
    for name, r in by_case.items():
        if not name.startswith("nested/zodmem"):
            continue
        chunk, nbatches = r["info"]["chunk_size"], r["info"]["nbatches"]
        columns = -(-n // nbatches)
        expected = output + chunk * (hessian + columns * per_column)
        measured = r["peak_rss_bytes"] - floor["peak_rss_bytes"]
        lines.append(
            f"- {name} (chunk_size={chunk}, nbatches={nbatches}): peak - floor "
            f"{measured / report.GB:.2f} GB; expected {output / report.GB:.2f} + {chunk} x "
            f"({hessian / 1e6:.1f} MB + {columns} columns x {per_column / 1e3:.0f} kB) = "
            f"{expected / report.GB:.2f} GB; unchunked {(working + output) / report.GB:.2f} GB."
        )
    return lines


if __name__ == "__main__":
    report.main(
        name="loops",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report_text,
        steady_calls=3,
    )
