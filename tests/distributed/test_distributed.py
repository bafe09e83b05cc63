"""A sharded `BatchedHessian` over a mesh that spans two processes under `jax.distributed`.

The two processes run `hessian_worker.py` on this machine, each with two CPU devices,
talking over gloo (JAX's CPU collectives) through a coordinator on a free local port.
Each worker checks its own shares of the results and prints `OK` only when every check
passed; this test launches them, bounds how long they may take, and reads what they say.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "hessian_worker.py"
CURVATURE_WORKER = WORKER.parent / "curvature_worker.py"
REPO_ROOT = WORKER.parent.parent.parent
NUM_PROCESSES = 2
# For both processes together: starting JAX and compiling take most of it (about 15 s on
# two CPU cores); a process left waiting for a peer that failed is stopped by this bound.
TIMEOUT_S = 240


def gloo_unavailable() -> str | None:
    """Why this jaxlib cannot run CPU collectives over gloo, or `None` when it can (or
    when it cannot be told, so that the workers run and say for themselves)."""
    try:
        from jax._src.lib import _jax
    except ImportError:
        return None
    if not hasattr(_jax, "make_gloo_tcp_collectives"):
        return "this jaxlib was built without gloo CPU collectives"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for the coordinator."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker_env() -> dict[str, str]:
    """This environment, with this checkout's zodmem first on the path. The workers set
    their own device count (replacing any in `XLA_FLAGS`), so the parent's flags stay."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_sharded_hessian_over_two_processes(tmp_path):
    run_workers(WORKER, tmp_path)


def test_curvature_of_a_model_laid_out_over_two_processes(tmp_path):
    """eigsh and trace of a model whose weights are split over the eight devices of two
    processes, against the whole model in one process."""
    run_workers(CURVATURE_WORKER, tmp_path)


def run_workers(worker: Path, tmp_path: Path) -> None:
    """Launch `worker` in each process, wait for both within the bound, and read what
    each said."""
    reason = gloo_unavailable()
    if reason is not None:
        pytest.skip(reason)
    port = free_port()
    # Output to files, not pipes: a worker that writes much (a traceback, a dump of its
    # threads when a peer fails) must never block on a pipe nobody reads yet.
    logs = [tmp_path / f"process_{process_id}.log" for process_id in range(NUM_PROCESSES)]
    processes = []
    for process_id, log in enumerate(logs):
        with log.open("w") as out:
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(worker), str(port), str(process_id)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=worker_env(),
                    cwd=REPO_ROOT,
                )
            )
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    try:
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    outputs = [log.read_text() for log in logs]
    report = "\n".join(
        f"--- process {process_id} (exit {process.returncode}) ---\n{output[-6000:]}"
        for process_id, (process, output) in enumerate(zip(processes, outputs, strict=True))
    )
    assert not timed_out, f"the workers did not finish within {TIMEOUT_S} s:\n{report}"
    for process_id, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, f"process {process_id} failed:\n{report}"
        assert f"process {process_id}: OK" in output, f"process {process_id} said:\n{report}"
