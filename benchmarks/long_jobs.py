"""A Hessian bigger than one wants in memory, streamed to disk: `zm.to_file` against the
in-memory `BatchedHessian`, and a job killed half-way and resumed.

The case is an `eqx.nn.MLP(32, 1, 128, 2)` with a mean-squared loss over 256 points:
n = 20,865 parameters, so the float32 Hessian holds 1.74 GB. Each case runs in its own
process (see `report.py`):

- `floor`: the same imports, model and data, no Hessian;
- `in-memory`: `BatchedHessian(nbatches=256)`, the Hessian assembled in memory (blocks
  of 82 rows, whose temporaries stay small);
- `to_file`: `zm.to_file` with the same transform, a fresh file;
- `resumed`: before the measured call, a separate process runs the same `to_file` and
  is killed (SIGKILL) once the journal shows a share of the blocks on disk (`--kill-at`,
  half by default); the measured call is the rerun, which finishes the file.

    python benchmarks/long_jobs.py            # every case, a few minutes on 2 cores
    python benchmarks/long_jobs.py --quick    # a small model, seconds
    python benchmarks/long_jobs.py --cases floor,to_file,resumed --kill-at 0.6

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

import report  # noqa: E402

WIDTH = 128  # n = 20,865: a 1.74 GB float32 Hessian

# Targets: peak resident memory above the floor against the output's bytes; time
# against the in-memory Hessian; the rerun of a killed job against a full run.
PEAK_OVER_FLOOR_VS_OUTPUT = 0.25
TIME_VS_IN_MEMORY = 1.2
RESUMED_VS_FULL = 0.6


def _problem(args: argparse.Namespace) -> dict[str, Any]:
    """The reference problem at this script's width, and its Hessian's transform."""
    import problems

    import zodmem as zm

    r = problems.reference(quick=args.quick, width=WIDTH)
    transform = zm.BatchedHessian(r.loss, nbatches=args.nbatches)
    info = {**r.info, "nbatches": args.nbatches}
    return dict(transform=transform, args=(r.model, r.xs, r.ys), info=info)


def _fresh_path(args: argparse.Namespace) -> str:
    directory = tempfile.mkdtemp(prefix="zodmem-long-jobs-", dir=args.directory)
    return os.path.join(directory, "hessian.npy")


def _write(path: str, args: argparse.Namespace) -> Any:
    import zodmem as zm

    p = _problem(args)
    return zm.to_file(path, p["transform"], *p["args"])


def floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, _problem(args)["info"])


def in_memory(args: argparse.Namespace) -> report.Case:
    p = _problem(args)
    return report.Case(lambda: p["transform"](*p["args"]), p["info"])


def to_file(args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    p = _problem(args)
    path = _fresh_path(args)
    return report.Case(lambda: zm.to_file(path, p["transform"], *p["args"]), p["info"])


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


def resumed(args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    p = _problem(args)
    path = _fresh_path(args)
    command = [sys.executable, os.path.abspath(__file__), "--write-only", path, *args.forwarded]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    started = time.perf_counter()
    deadline = started + args.kill_timeout
    while True:
        done, total = _blocks_done(path + ".journal")
        if total and done >= int(total * args.kill_at):
            break
        if job.poll() is not None or time.perf_counter() > deadline:
            raise RuntimeError(f"the job to kill ended or stalled first ({done} of {total})")
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait()
    done, total = _blocks_done(path + ".journal")
    info = {**p["info"], "killed_after_s": time.perf_counter() - started}
    info.update(blocks_done_when_killed=done, blocks=total)
    return report.Case(lambda: zm.to_file(path, p["transform"], *p["args"]), info)


CASES = {"floor": floor, "in-memory": in_memory, "to_file": to_file, "resumed": resumed}


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = report.succeeded(results)
    floor_case = by_case.get("floor")
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

    def row(r: dict[str, Any]) -> list[Any] | None:
        timed = "time_s" in r
        above = report.above(r, floor_case)
        return [
            r["case"],
            report.gigabytes(r["peak_rss_bytes"]),
            report.gigabytes(above),
            report.ratio(above, output, ".3f") if timed else "",
            report.number(r.get("time_s"), ".1f"),
            report.number(r.get("cpu_s"), ".1f"),
            report.ratio(r.get("time_s"), memory and memory["time_s"]),
            report.ratio(r.get("time_s"), full and full["time_s"]),
            report.check_cell(r, memory, "max_rel_diff_vs_in_memory")
            if timed and memory is not r
            else "",
        ]

    resumed = by_case.get("resumed")
    lines = [
        report.describe_mlp(info) + f", nbatches={info.get('nbatches')}.",
        "",
        report.case_table(results, headers, row),
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
    above = report.above(full, floor_case)
    if above is not None and output:
        verdicts.append(
            report.verdict("to_file (peak - floor) / H", above / output, PEAK_OVER_FLOOR_VS_OUTPUT)
        )
    if full and memory:
        ratio = full["time_s"] / memory["time_s"]
        verdicts.append(report.verdict("to_file time / in-memory", ratio, TIME_VS_IN_MEMORY))
    if resumed and full:
        ratio = resumed["time_s"] / full["time_s"]
        verdicts.append(report.verdict("resumed time / to_file", ratio, RESUMED_VS_FULL))
    lines += report.section("Targets:", [f"- {v}" for v in verdicts])
    return "\n".join(lines)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nbatches", type=int, default=256, help="blocks of the Hessian")
    parser.add_argument("--directory", default=None, help="where the files go (a temp dir)")
    parser.add_argument(
        "--kill-at", type=float, default=0.5, help="the share of the blocks on disk at the kill"
    )
    parser.add_argument(
        "--kill-timeout", type=float, default=1200.0, help="seconds to wait for those blocks"
    )


def _cleanup(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The report, once the files the cases wrote are removed."""
    root = args.directory or tempfile.gettempdir()
    for name in os.listdir(root):
        if name.startswith("zodmem-long-jobs-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return report_text(results, args)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--write-only":
        _write(sys.argv[2], report.worker_arguments(sys.argv[3:], _add_arguments))
    else:
        report.main(
            name="long_jobs",
            description=__doc__.splitlines()[0],
            cases=CASES,
            report=_cleanup,
            add_arguments=_add_arguments,
        )
