"""Shared machinery for zodmem's benchmarks: one case per process, peak memory and time.

A benchmark script describes its cases as functions that build their inputs and
return a `Case` (a zero-argument `compute` and whatever it wants recorded). The
script hands them to `main`, which

- in the parent process, runs every selected case in a fresh Python process of the
  same script (so that one case's peak memory can never leak into another's),
  collects the results, prints a markdown table and writes
  `benchmarks/results/<name>.json`;
- in the child process (`--child CASE`), builds the case, calls `compute` once,
  waits for its result (`block_until_ready`), and reports

  * `peak_rss_bytes`: the process's peak resident memory, read right after the
    call and before any checking work: `VmHWM` of `/proc/self/status` on Linux, else
    `resource.getrusage(RUSAGE_SELF).ru_maxrss` (also kept, as `ru_maxrss_bytes`).
    On Linux `ru_maxrss` survives `exec`, so a child started by a big parent
    reports at least the parent's size; `VmHWM` starts afresh with the new program.
    The parent here imports no JAX, so both agree;
  * `time_s`: wall time of the call, tracing and compilation included;
  * `cpu_s`: CPU time of the process over the call, all threads together (less
    disturbed than wall time when other processes share the machine);
  * `compile_s`: the part of it JAX spent tracing, lowering and compiling (from
    `jax.monitoring`'s duration events), and `run_s = time_s - compile_s`;
  * `output_bytes`: the bytes of the result's array leaves;
  * `check`: a fingerprint of the result (sums and a fixed sample of entries) for
    comparing cases with each other, computed after the measurement.

A case whose `compute` is `None` measures the process floor: the same imports and
inputs, no computation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_MARKER = "@@zodmem-benchmark-result@@ "
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


@dataclasses.dataclass
class Case:
    """One benchmark case, built inside its own process.

    - `compute`: called once and timed; returns a pytree of arrays. `None` for
      the process floor.
    - `info`: extra figures to record with the result (sizes, options).
    - `repeats`: after the measured call, call `compute` this many more times and
      record their wall times (`steady_s`, `steady_min_s`, `steady_median_s`): the
      time of a call that is already compiled; and the CPU time (user and system,
      all threads) of each (`steady_cpu_s`, `steady_cpu_min_s`), steadier than wall
      time on a machine shared with other work.
    - `after`: called once the calls are timed and the peak read, untimed: for figures
      of the case that cost work of their own (say, XLA's flop count of the call).
    """

    compute: Callable[[], Any] | None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    repeats: int = 0
    after: Callable[[], None] | None = None


def ru_maxrss_bytes() -> int:
    """`ru_maxrss` in bytes (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory of this program so far: `VmHWM` where Linux gives it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return ru_maxrss_bytes()


def machine_info() -> dict[str, Any]:
    import jax
    import jaxlib

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _array_leaves(tree: Any) -> list[Any]:
    import jax

    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "nbytes")]


def fingerprint(tree: Any, samples: int = 256) -> dict[str, Any]:
    """Sums and a fixed pseudo-random sample of entries of the first array leaf.

    The sample positions depend only on the leaf's shape, so two results of the
    same shape are compared entry for entry.
    """
    import numpy as np

    leaf = np.asarray(_array_leaves(tree)[0])
    rng = np.random.default_rng(0)
    index = tuple(rng.integers(0, dim, samples) for dim in leaf.shape)
    return {
        "shape": list(leaf.shape),
        "dtype": str(leaf.dtype),
        "sum": float(np.sum(leaf, dtype=np.float64)),
        "abs_sum": float(np.sum(np.abs(leaf), dtype=np.float64)),
        "sample": [float(v) for v in leaf[index]],
    }


def compare_fingerprints(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest sampled difference between two results, relative to the largest |entry|.

    Returns `inf` when the shapes differ.
    """
    if a["shape"] != b["shape"]:
        return float("inf")
    scale = max(max(abs(v) for v in b["sample"]), 1e-30)
    worst = max(abs(x - y) for x, y in zip(a["sample"], b["sample"], strict=True))
    sums = abs(a["sum"] - b["sum"]) / max(b["abs_sum"], 1e-30)
    return max(worst / scale, sums)


def _run_child(case: Case) -> dict[str, Any]:
    import jax

    compile_seconds = [0.0]

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            compile_seconds[0] += duration

    result: dict[str, Any] = {"info": case.info}
    if case.compute is None:
        result.update(
            peak_rss_bytes=peak_rss_bytes(), ru_maxrss_bytes=ru_maxrss_bytes(), output_bytes=0
        )
        return result
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    cpu_start = _cpu_seconds()
    start = time.perf_counter()
    out = jax.block_until_ready(case.compute())
    elapsed = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_start
    peak = peak_rss_bytes()
    result.update(
        peak_rss_bytes=peak,
        ru_maxrss_bytes=ru_maxrss_bytes(),
        time_s=elapsed,
        compile_s=compile_seconds[0],
        run_s=elapsed - compile_seconds[0],
        cpu_s=cpu,
        output_bytes=sum(int(leaf.nbytes) for leaf in _array_leaves(out)),
        check=fingerprint(out),
    )
    del out
    steady, steady_cpu = [], []
    for _ in range(case.repeats):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        jax.block_until_ready(case.compute())
        steady.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        steady_cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    if steady:
        result.update(
            steady_s=steady,
            steady_min_s=min(steady),
            steady_median_s=sorted(steady)[len(steady) // 2],
            steady_cpu_s=steady_cpu,
            steady_cpu_min_s=min(steady_cpu),
        )
    if case.after is not None:
        case.after()
    return result


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeated runs of a case: the largest peak, the median times
    (the fastest of the steady calls).

    The runs themselves are kept under `runs`.
    """
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    if len(runs) == 1:
        return runs[0]
    combined = dict(good[0])
    combined["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in good)
    for key in ("time_s", "compile_s", "run_s", "cpu_s", "steady_median_s"):
        if key in good[0]:
            values = sorted(r[key] for r in good)
            combined[key] = values[len(values) // 2]
    for key in ("steady_min_s", "steady_cpu_min_s"):
        if key in good[0]:
            combined[key] = min(r[key] for r in good)
    # Each run keeps the figures its case measured into `info` (bytes and seconds).
    combined["runs"] = [
        {
            **{k: v for k, v in r.items() if k != "info"},
            "measured": {
                k: v
                for k, v in r.get("info", {}).items()
                if k.endswith(("_bytes", "_s")) and isinstance(v, (int, float))
            },
        }
        for r in runs
    ]
    return combined


def run_case_in_subprocess(
    script: str, name: str, forwarded: Sequence[str], timeout: float | None
) -> dict[str, Any]:
    """Run `script --child name *forwarded` in a fresh process and return its result."""
    command = [sys.executable, script, "--child", name, *forwarded]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            return {"case": name, **json.loads(line[len(_MARKER) :])}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return {"case": name, "error": f"exit code {proc.returncode}", "stderr_tail": tail}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; numbers should already be formatted as strings."""
    widths = [
        max(len(str(h)), *(len(str(row[i])) for row in rows)) if rows else len(str(h))
        for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [line(headers), "| " + " | ".join("-" * w for w in widths) + " |"]
        + [line(row) for row in rows]
    )


def write_results(name: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def main(
    *,
    name: str,
    description: str,
    cases: dict[str, Callable[[argparse.Namespace], Case]],
    report: Callable[[list[dict[str, Any]], argparse.Namespace], str],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: Sequence[str] | None = None,
) -> None:
    """Command-line entry point of a benchmark script.

    - `name`: the results file is `benchmarks/results/<name>.json`.
    - `cases`: case name to builder; builders run only in the child process.
    - `report(results, args)`: the markdown printed (and stored) for the results.
    - `add_arguments`: the script's own options; they are forwarded to children.

    Common options: `--cases a,b` selects cases (default: all, in order),
    `--repeat N` runs each of them N times, in turn,
    `--quick` asks the builders for a small smoke-test size (results go to
    `<name>_quick.json`), `--timeout` limits
    each child, `--no-save` skips the JSON file.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--cases", default=",".join(cases), help="comma-separated cases (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, to smoke-test")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per case")
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    parser.add_argument(
        "--save-as", default=None, help="the JSON file's name, for a run of some cases only"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every case this many times, in turn; report the largest peak and median times",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)

    if args.child is not None:
        result = _run_child(cases[args.child](args))
        print(_MARKER + json.dumps(result), flush=True)
        return

    selected = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in selected if c not in cases]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(cases)}")
    forwarded = _forwarded_arguments(parser, args)
    script = os.path.abspath(sys.argv[0])
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in selected}
    for repeat in range(args.repeat):
        for case in selected:
            print(f"running {case} ({repeat + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            runs[case].append(run_case_in_subprocess(script, case, forwarded, args.timeout))
            if "error" in runs[case][-1]:
                print(f"  {case} failed: {runs[case][-1]}", file=sys.stderr, flush=True)
    results = [combine_runs(runs[case]) for case in selected]
    text = report(results, args)
    print(text)
    if not args.no_save:
        payload = {
            "benchmark": name,
            "command": " ".join(["python", os.path.relpath(script), *(argv or sys.argv[1:])]),
            "machine": machine_info(),
            "options": {k: v for k, v in vars(args).items() if k != "child"},
            "results": results,
            "report": text,
        }
        path = write_results(args.save_as or name + ("_quick" if args.quick else ""), payload)
        print(f"\nwrote {os.path.relpath(path)}", file=sys.stderr)


def _forwarded_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options children need to build the same case: everything but the harness's own."""
    own = {"cases", "timeout", "no_save", "save_as", "repeat", "child", "help"}
    forwarded: list[str] = []
    for action in parser._actions:
        if action.dest in own or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                forwarded.append(flag)
        elif value is not None:
            forwarded.extend([flag, str(value)])
    return forwarded
