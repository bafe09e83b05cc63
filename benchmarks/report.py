"""The benchmarks' harness and tables: one case per process, and the figures it reports.

A benchmark script describes its cases as functions that build their inputs and return
a `Case` (a zero-argument `compute` and whatever it wants recorded), and hands them to
`main`, which

- in the parent process, runs every selected case in a fresh Python process of the
  same script (so that one case's peak memory can never leak into another's),
  collects the results, prints the script's markdown report and writes
  `benchmarks/results/<name>.json`: the command, the machine, zodmem's last commit at
  the start and the end of the run, the options, every result and the report;
- in the child process (`--child CASE`), builds the case, calls `compute` once,
  waits for its result (`block_until_ready`), and reports

  * `peak_rss_bytes`: the process's peak resident memory, read right after the
    call and before any checking work: `VmHWM` of `/proc/self/status` on Linux, else
    `resource.getrusage(RUSAGE_SELF).ru_maxrss` (also kept, as `ru_maxrss_bytes`).
    On Linux `ru_maxrss` survives `exec`, so a child started by a big parent
    reports at least the parent's size; `VmHWM` starts afresh with the new program.
    The parent imports no JAX (nor `problems.py`), so both agree;
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

The rest of this module turns results into text: numbers in bytes, seconds and ratios,
the verdict on a target, markdown tables and the cells most tables share (a failed
case, the peak above a floor, the agreement with a reference).
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
MB = 1e6
GB = 1e9

_MARKER = "@@zodmem-benchmark-result@@ "
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
# The harness's own options: not forwarded to the children, not part of a case.
_OWN_OPTIONS = {
    "cases",
    "timeout",
    "no_save",
    "save_as",
    "results_dir",
    "repeat",
    "child",
    "help",
}


# -- one case in its own process -------------------------------------------------------------


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
      time on a machine shared with other work. Read once the first call is done, so
      that call may lower it.
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


def status_bytes(field: str) -> int | None:
    """A memory figure of this process from `/proc/self/status` (`VmHWM`, `VmRSS`), or
    None where Linux does not give it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident memory of this program so far: `VmHWM` where Linux gives it."""
    peak = status_bytes("VmHWM")
    return ru_maxrss_bytes() if peak is None else peak


def force_cpu_devices(count: int) -> None:
    """Ask XLA for `count` CPU devices in this process. XLA reads the flag when JAX
    starts its backend, so a case calls this before any computation, and checks
    `jax.device_count()` after."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


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


def package_versions(*packages: str) -> dict[str, str | None]:
    """The installed version of each distribution (None for one not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for package in packages:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return versions


def source_info() -> dict[str, Any]:
    """The last commit of `zodmem/`, the checkout's, and whether `zodmem/` has changes
    beside them: others may change it while a long run goes on, so `main` reads it at
    the start and at the end."""

    def git(*command: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *command], cwd=ROOT, capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.strip()

    return {
        "zodmem_commit": git("log", "-1", "--format=%H", "--", "zodmem"),
        "checkout": git("rev-parse", "HEAD"),
        "zodmem_changed": bool(git("status", "--porcelain", "--", "zodmem")),
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


def relative_difference(a: Any, b: Any) -> float:
    """Largest |a - b| over the whole arrays, relative to the largest |b|."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
        cpu_start = _cpu_seconds()
        start = time.perf_counter()
        jax.block_until_ready(case.compute())
        steady.append(time.perf_counter() - start)
        steady_cpu.append(_cpu_seconds() - cpu_start)
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


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeated runs of a case: the largest peak, the median times
    (the fastest of the steady calls).

    The runs themselves are kept under `runs`.
    """
    good = [r for r in runs if "error" not in r]
    if not good or len(runs) == 1:
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


# -- the command line --------------------------------------------------------------------------


def main(
    *,
    name: str,
    description: str,
    cases: dict[str, Callable[[argparse.Namespace], Case]],
    report: Callable[[list[dict[str, Any]], argparse.Namespace], str],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    steady_calls: int | None = None,
    argv: Sequence[str] | None = None,
    command: Sequence[str] | None = None,
) -> None:
    """Command-line entry point of a benchmark script.

    - `name`: the results file is `benchmarks/results/<name>.json`.
    - `cases`: case name to builder; builders run only in the child process. A builder
      finds the script's own options as given in `args.forwarded`, to start more
      processes of the script with.
    - `report(results, args)`: the markdown printed (and stored) for the results.
    - `add_arguments`: the script's own options; they are forwarded to children.
    - `steady_calls`: the default of `--steady-calls`, the timed calls after the first
      that a script's cases make (`Case.repeats`); no such option where None.
    - `argv`: the options (default: the command line's); `command`: those to record
      as the command, where they differ (a script that expands its own options).

    Common options: `--cases a,b` selects cases (default: all, in order),
    `--repeat N` runs each of them N times, in turn,
    `--quick` asks the builders for a small smoke-test size (results go to
    `<name>_quick.json`), `--timeout` limits each child, `--no-save` skips the JSON
    file, `--save-as` names it and `--results-dir` puts it elsewhere.
    """
    parser = _parser(description, add_arguments)
    if steady_calls is not None:
        parser.add_argument(
            "--steady-calls",
            type=int,
            default=steady_calls,
            help=f"timed calls after the first (default {steady_calls})",
        )
    parser.add_argument(
        "--cases", default=",".join(cases), help="comma-separated cases (default: all)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per case")
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    parser.add_argument(
        "--save-as", default=None, help="the JSON file's name, for a run of some cases only"
    )
    parser.add_argument(
        "--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON file goes"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every case this many times, in turn; report the largest peak and median times",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.forwarded = _forwarded_arguments(parser, args)

    if args.child is not None:
        result = _run_child(cases[args.child](args))
        print(_MARKER + json.dumps(result), flush=True)
        return

    selected = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in selected if c not in cases]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(cases)}")
    script = os.path.abspath(sys.argv[0])
    source = source_info()
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in selected}
    for repeat in range(args.repeat):
        for case in selected:
            print(f"running {case} ({repeat + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            runs[case].append(run_case_in_subprocess(script, case, args.forwarded, args.timeout))
            if "error" in runs[case][-1]:
                print(f"  {case} failed: {runs[case][-1]}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    print(f"{len(selected)} cases in {elapsed / 60:.1f} minutes", file=sys.stderr)
    results = [combine_runs(runs[case]) for case in selected]
    text = report(results, args)
    print(text)
    source = {"start": source, "end": source_info()}
    if source["start"]["zodmem_commit"] != source["end"]["zodmem_commit"]:
        print(f"zodmem changed during the run: {source}", file=sys.stderr)
    if args.no_save:
        return
    typed = list(command if command is not None else argv if argv is not None else sys.argv[1:])
    payload = {
        "benchmark": name,
        "command": " ".join(["python", os.path.relpath(script, ROOT), *typed]),
        "machine": machine_info(),
        "source": source,
        "elapsed_s": elapsed,
        "options": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("child", "forwarded")
        },
        "results": results,
        "report": text,
    }
    path = write_results(
        args.save_as or name + ("_quick" if args.quick else ""), payload, args.results_dir
    )
    print(f"\nwrote {_shown(path)}", file=sys.stderr)


def worker_arguments(
    argv: Sequence[str], add_arguments: Callable[[argparse.ArgumentParser], None]
) -> argparse.Namespace:
    """The options of a process a case starts beside the harness's children (a job to
    kill, a process of a distributed job), from the `args.forwarded` it was given."""
    args, _ = _parser("", add_arguments).parse_known_args(list(argv))
    return args


def _parser(
    description: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None
) -> argparse.ArgumentParser:
    """The options a case is built from: `--quick` and the script's own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, to smoke-test")
    if add_arguments is not None:
        add_arguments(parser)
    return parser


def _forwarded_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options children need to build the same case: everything but the harness's own."""
    forwarded: list[str] = []
    for action in parser._actions:
        if action.dest in _OWN_OPTIONS or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                forwarded.append(flag)
        elif value is not None:
            forwarded.extend([flag, str(value)])
    return forwarded


# -- results files -----------------------------------------------------------------------------


def write_results(name: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def read_results(path: Path) -> list[dict[str, Any]] | None:
    """The successful cases of a results file, or None (with a message) if there are none."""
    if not path.exists():
        print(f"skip {path.name}: not found (run the benchmark that writes it)", file=sys.stderr)
        return None
    try:
        payload = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        print(f"skip {path.name}: cannot be read ({error})", file=sys.stderr)
        return None
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list):
        print(f"skip {path.name}: no `results` list", file=sys.stderr)
        return None
    failed = [r.get("case") for r in results if isinstance(r, dict) and "error" in r]
    if failed:
        print(f"note {path.name}: leaving out failed cases {failed}", file=sys.stderr)
    ok = [r for r in results if isinstance(r, dict) and "error" not in r and "case" in r]
    return ok or None


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# -- figures as text ---------------------------------------------------------------------------


def number(value: float | None, form: str = ".2f") -> str:
    """`value` in the format `form`, or an empty cell for None."""
    return "" if value is None else format(value, form)


def megabytes(value: float | None, form: str = ".0f") -> str:
    return "" if value is None else format(value / MB, form)


def gigabytes(value: float | None, form: str = ".2f") -> str:
    return "" if value is None else format(value / GB, form)


def small_bytes(value: float | None) -> str:
    """Bytes as MB, or in kB or B where that is under 1 MB (the calls of small budgets)."""
    if value is None:
        return ""
    size = abs(value)
    if size >= 10 * MB:
        return f"{value / MB:,.0f}"
    if size >= MB:
        return f"{value / MB:.3g}"
    return f"{value / 1e3:.3g} kB" if size >= 1e3 else f"{value:.0f} B"


def ratio(a: float | None, b: float | None, form: str = ".2f") -> str:
    """`a / b`, or an empty cell where either is missing or `b` is not positive."""
    return "" if a is None or b is None or b <= 0 else format(a / b, form)


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def verdict(what: str, value: float, limit: float, unit: str = "", form: str = ".2f") -> str:
    """`what value <= limit: met`, or `> ...: MISSED`: the figure against its target."""
    ok = value <= limit
    return f"{what} {value:{form}}{unit} {'<=' if ok else '>'} {limit:{form}}{unit}: {met(ok)}"


# -- tables ------------------------------------------------------------------------------------


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


def succeeded(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The cases that ran, by name."""
    return {r["case"]: r for r in results if "error" not in r}


def case_table(
    results: Sequence[dict[str, Any]],
    headers: Sequence[str],
    row: Callable[[dict[str, Any]], list[Any] | None],
) -> str:
    """A markdown table of a row a case: `row(result)` for a case that ran (None leaves
    it out), and `failed_row` for one that did not."""
    rows = []
    for result in results:
        if "error" in result:
            rows.append(failed_row(result, len(headers)))
        elif (cells := row(result)) is not None:
            rows.append(cells)
    return markdown_table(headers, rows)


def failed_row(result: dict[str, Any], width: int, shown: str | None = None) -> list[str]:
    """The row of a failed case: its name (or `shown`), why (the last line it wrote to
    stderr, or the harness's reason), and empty cells to the table's `width`."""
    reason = "; ".join(result.get("stderr_tail", [])[-1:]) or result["error"]
    # The whole reason is in the results file; a cell holds its start.
    return [shown or result["case"], f"failed: {reason[:80]}"] + [""] * (width - 2)


def above(
    result: dict[str, Any] | None, floor: dict[str, Any] | None, key: str = "peak_rss_bytes"
) -> float | None:
    """`result[key] - floor[key]`: by default the peak above the floor process; None
    where either is missing."""
    if result is None or floor is None or result.get(key) is None or floor.get(key) is None:
        return None
    return result[key] - floor[key]


def check_cell(
    result: dict[str, Any],
    reference: dict[str, Any] | None,
    key: str = "max_rel_diff_vs_reference",
) -> str:
    """`reference` for the reference itself, else the largest sampled difference from it
    (also stored in `result[key]`), or an empty cell where there is nothing to compare."""
    if reference is None:
        return ""
    if reference is result:
        return "reference"
    if "check" not in result or "check" not in reference:
        return ""
    result[key] = compare_fingerprints(result["check"], reference["check"])
    return f"{result[key]:.1e}"


CHECK_NOTE = "over 256 sampled entries and the sum, relative to the largest sampled |entry|"


def section(title: str, lines: Sequence[str]) -> list[str]:
    """`lines` under a title and a blank line, or nothing where there are none."""
    return ["", title, *lines] if lines else []


def further_calls(args: argparse.Namespace) -> str:
    """The calls *steady* is taken from in a run of these options."""
    repeat = getattr(args, "repeat", 1)
    runs = f" in each of {repeat} runs" if repeat > 1 else ""
    return f"{args.steady_calls} further calls of the compiled function{runs}"


def describe_mlp(info: dict[str, Any], subject: str = "Hessian", more: str = "") -> str:
    """The reference network's problem, from a case's `info`: `subject` (of its loss),
    its size, `more`, and its Hessian's bytes."""
    return (
        f"{subject} of an eqx.nn.MLP(32, 1, {info.get('width')}, {info.get('depth')}) "
        f"mean-squared loss over {info.get('points')} points{more}: n = {info.get('n', 0):,}, "
        f"H = {info.get('hessian_bytes', 0) / MB:,.0f} MB (float32)"
    )


def curvlinops_line(info: dict[str, Any], remark: str = "") -> str:
    """The versions and threads the curvlinops cases ran with, or why they did not run."""
    if "missing" in info:
        return f"curvlinops cases not run: {info['missing']}."
    return (
        f"curvlinops-for-pytorch {info.get('curvlinops')}, torch "
        f"{info.get('torch')}, {info.get('torch_threads')} threads{remark}."
    )
