"""A Hessian bigger than one wants in memory, streamed to disk: `zm.to_file` against the
in-memory `BatchedHessian`, and a job killed half-way and resumed.

The case is an `eqx.nn.MLP(32, 1, 128, 2)` with a mean-squared loss over 256 points:
n = 20,865 parameters, so the float32 Hessian holds 1.74 GB. Each case runs in its own
process (see `_harness.py`):

- `floor`: the same imports, model and data, no Hessian;
- `in-memory`: `BatchedHessian(nbatches=256)`, the Hessian assembled in memory (blocks
  of 82 rows, whose temporaries stay small);
- `to_file`: `zm.to_file` with the same transform, a fresh file;
- `resumed`: before the measured call, a separate process runs the same `to_file` and
  is killed (SIGKILL) once the journal shows half the blocks on disk; the measured call
  is the rerun, which finishes the file.

    python benchmarks/long_jobs.py            # every case, a few minutes on 2 cores
    python benchmarks/long_jobs.py --quick    # a small model, seconds

Results go to `benchmarks/results/long_jobs.json`; the files go to a temporary
directory (`--directory`), deleted after each case.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
import hessian_memory  # noqa: E402

_GB = 1e9

# Targets: peak resident memory above the floor against the output's bytes; time
# against the in-memory Hessian; the rerun of a job killed half-way against a full run.
PEAK_OVER_FLOOR_VS_OUTPUT = 0.25
TIME_VS_IN_MEMORY = 1.2
RESUMED_VS_FULL = 0.6


def _problem(args: argparse.Namespace) -> dict[str, Any]:
    """The Hessian benchmark's model, data and loss (at this script's width), streamed."""
    import zodmem as zm

    p = hessian_memory._problem(args)
    transform = zm.BatchedHessian(p["loss"], nbatches=args.nbatches)
    info = {**p["info"], "nbatches": args.nbatches}
    return dict(transform=transform, args=(p["model"], p["xs"], p["ys"]), info=info)


def _fresh_path(args: argparse.Namespace) -> str:
    directory = tempfile.mkdtemp(prefix="zodmem-long-jobs-", dir=args.directory)
    return os.path.join(directory, "hessian.npy")


def _write(path: str, args: argparse.Namespace) -> Any:
    import zodmem as zm

    p = _problem(args)
    return zm.to_file(path, p["transform"], *p["args"])


def floor(args: argparse.Namespace) -> _harness.Case:
    return _harness.Case(None, _problem(args)["info"])


def in_memory(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    return _harness.Case(lambda: p["transform"](*p["args"]), p["info"])


def to_file(args: argparse.Namespace) -> _harness.Case:
    import zodmem as zm

    p = _problem(args)
    path = _fresh_path(args)
    return _harness.Case(lambda: zm.to_file(path, p["transform"], *p["args"]), p["info"])


def _blocks_done(journal: str) -> tuple[int, int]:
    """(blocks on disk, blocks in all) from a journal's records; (0, 0) before it exists."""
    try:
        lines = open(journal, "rb").read().splitlines()
    except OSError:
        return 0, 0
    records = []
    for line in lines:
        try:
            records.append(json.loads(line.split(b" ", 1)[1]))
        except (IndexError, ValueError):
            break  # a record being written
    if not records:
        return 0, 0
    header = records[0]
    n = header["files"][0]["shape"][0]
    total = -(-n // header["block_size"])
    done = max([r["done"] for r in records[1:] if "done" in r], default=0)
    return done, total


def resumed(args: argparse.Namespace) -> _harness.Case:
    import zodmem as zm

    p = _problem(args)
    path = _fresh_path(args)
    command = [sys.executable, os.path.abspath(__file__), "--write-only", path]
    command += _harness._forwarded_arguments(_parser_for_forwarding(), args)
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    started = time.perf_counter()
    deadline = started + args.kill_timeout
    while True:
        done, total = _blocks_done(path + ".journal")
        if total and done >= total // 2:
            break
        if job.poll() is not None or time.perf_counter() > deadline:
            raise RuntimeError(f"the job to kill ended or stalled first ({done} of {total})")
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait()
    done, total = _blocks_done(path + ".journal")
    info = {**p["info"], "killed_after_s": time.perf_counter() - started}
    info.update(blocks_done_when_killed=done, blocks=total)
    return _harness.Case(lambda: zm.to_file(path, p["transform"], *p["args"]), info)


CASES = {"floor": floor, "in-memory": in_memory, "to_file": to_file, "resumed": resumed}


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = {r["case"]: r for r in results if "error" not in r}
    floor_bytes = by_case.get("floor", {}).get("peak_rss_bytes")
    info = next((r["info"] for r in by_case.values()), {})
    output = info.get("hessian_bytes")
    memory = by_case.get("in-memory")
    full = by_case.get("to_file")
    headers = [
        "case",
        "peak RSS (GB)",
        "peak - floor (GB)",
        "(peak - floor) / H",
        "time (s)",
        "CPU (s)",
        "time / in-memory",
        "time / to_file",
        "check",
    ]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["case"], "failed: " + r["error"]] + [""] * (len(headers) - 2))
            continue
        timed = "time_s" in r
        above = r["peak_rss_bytes"] - floor_bytes if floor_bytes else None
        check = ""
        if timed and memory is not None and memory is not r:
            r["max_rel_diff_vs_in_memory"] = _harness.compare_fingerprints(
                r["check"], memory["check"]
            )
            check = f"{r['max_rel_diff_vs_in_memory']:.1e}"
        rows.append(
            [
                r["case"],
                f"{r['peak_rss_bytes'] / _GB:.2f}",
                f"{above / _GB:.2f}" if above is not None else "",
                f"{above / output:.3f}" if above is not None and output and timed else "",
                f"{r['time_s']:.1f}" if timed else "",
                f"{r['cpu_s']:.1f}" if timed else "",
                f"{r['time_s'] / memory['time_s']:.2f}" if timed and memory else "",
                f"{r['time_s'] / full['time_s']:.2f}" if timed and full else "",
                check,
            ]
        )
    resumed = by_case.get("resumed")
    lines = [
        f"Hessian of an eqx.nn.MLP(32, 1, {info.get('width')}, {info.get('depth')}) "
        f"mean-squared loss over {info.get('points')} points: n = {info.get('n', 0):,}, "
        f"H = {(output or 0) / 1e6:.0f} MB (float32), nbatches={info.get('nbatches')}.",
        "",
        _harness.markdown_table(headers, rows),
        "",
        "time: wall time of the call, compilation included. check: largest difference from "
        "the in-memory Hessian over 256 sampled entries and the sum.",
    ]
    if resumed:
        lines.append(
            f"resumed: the first job was killed after {resumed['info']['killed_after_s']:.1f} s "
            f"with {resumed['info']['blocks_done_when_killed']} of "
            f"{resumed['info']['blocks']} blocks on disk."
        )
    verdicts = []
    if full and floor_bytes and output:
        ratio = (full["peak_rss_bytes"] - floor_bytes) / output
        verdicts.append(_verdict("to_file (peak - floor) / H", ratio, PEAK_OVER_FLOOR_VS_OUTPUT))
    if full and memory:
        ratio = full["time_s"] / memory["time_s"]
        verdicts.append(_verdict("to_file time / in-memory", ratio, TIME_VS_IN_MEMORY))
    if resumed and full:
        ratio = resumed["time_s"] / full["time_s"]
        verdicts.append(_verdict("resumed time / to_file", ratio, RESUMED_VS_FULL))
    if verdicts:
        lines += ["", "Targets:"] + [f"- {v}" for v in verdicts]
    return "\n".join(lines)


def _verdict(what: str, value: float, limit: float) -> str:
    return f"{what} {value:.2f} {'<=' if value <= limit else '>'} {limit:.2f} " + (
        "ok" if value <= limit else "MISSED"
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, default=128, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers of the MLP")
    parser.add_argument("--points", type=int, default=256, help="data points in the loss")
    parser.add_argument("--nbatches", type=int, default=256, help="blocks of the Hessian")
    parser.add_argument("--directory", default=None, help="where the files go (a temp dir)")
    parser.add_argument(
        "--kill-timeout", type=float, default=1200.0, help="seconds to wait for half the blocks"
    )


def _parser_for_forwarding() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    _add_arguments(parser)
    return parser


def _cleanup(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The report, once the files the cases wrote are removed."""
    root = args.directory or tempfile.gettempdir()
    for name in os.listdir(root):
        if name.startswith("zodmem-long-jobs-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return report(results, args)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--write-only":
        path = sys.argv[2]
        _write(path, _parser_for_forwarding().parse_args(sys.argv[3:]))
    else:
        _harness.main(
            name="long_jobs",
            description=__doc__.splitlines()[0],
            cases=CASES,
            report=_cleanup,
            add_arguments=_add_arguments,
        )
