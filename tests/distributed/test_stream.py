"""A sharded `BatchedHessian` streamed to one `.npy` file by two processes under
`jax.distributed` (`stream_worker.py`), one of them killed part way, then resumed.

The first run writes every block's rows slowly; once process 1's journal records two
runs of rows, both processes are killed (`SIGKILL`). The second run computes only the
blocks whose rows are not on disk (one more per process at most), and each worker checks
the file against `jax.hessian`, its own rows from `zm.to_host` and the refusals.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_distributed import free_port, gloo_unavailable, worker_env

WORKER = Path(__file__).resolve().parent / "stream_worker.py"
REPO_ROOT = WORKER.parent.parent.parent
NUM_PROCESSES = 2
NUM_BLOCKS = 16  # 16 rows, one block a row
TIMEOUT_S = 240


def start(path: Path, mode: str, logs: list[Path]) -> list[subprocess.Popen]:
    port, processes = free_port(), []
    for process_id, log in enumerate(logs):
        with log.open("w") as out:
            command = [sys.executable, str(WORKER), str(port), str(process_id), str(path), mode]
            processes.append(
                subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO_ROOT
                )
            )
    return processes


def rows_recorded(path: Path) -> list[int]:
    """The runs of rows each process's journal records."""
    counts = []
    for process_id in range(NUM_PROCESSES):
        journal = Path(f"{path}.journal.p{process_id}")
        records = journal.read_bytes().splitlines() if journal.exists() else []
        bodies = [json.loads(record.split(b" ", 1)[1]) for record in records[1:]]
        counts.append(sum(len(body.get("rows", ())) for body in bodies))
    return counts


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()


def test_a_streamed_sharded_hessian_resumes_after_a_process_is_killed(tmp_path):
    reason = gloo_unavailable()
    if reason is not None:
        pytest.skip(reason)
    path = tmp_path / "hessian.npy"
    logs = [tmp_path / f"slow_{p}.log" for p in range(NUM_PROCESSES)]
    processes = start(path, "slow", logs)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while rows_recorded(path)[1] < 2:
            alive = all(p.poll() is None for p in processes)
            said = "\n".join(log.read_text()[-3000:] for log in logs)
            assert alive and time.monotonic() < deadline, f"the first run stopped:\n{said}"
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGKILL)  # process 1 dies first, mid-run
    finally:
        stop(processes)
    done = sum(rows_recorded(path))
    assert 2 <= done < NUM_BLOCKS

    logs = [tmp_path / f"resume_{p}.log" for p in range(NUM_PROCESSES)]
    processes = start(path, "resume", logs)
    try:
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        stop(processes)
    outputs = [log.read_text() for log in logs]
    report = "\n".join(f"--- process {p} ---\n{out[-6000:]}" for p, out in enumerate(outputs))
    computed = 0
    for process_id, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0 and f"process {process_id}: OK" in output, report
        computed += int(output.split("computed ")[1].split()[0])
    assert computed <= NUM_BLOCKS - done + NUM_PROCESSES, report
    assert sum(rows_recorded(path)) == done + computed
