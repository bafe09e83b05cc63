"""Runs tests/multidevice in a process of its own with 4 CPU devices.

JAX fixes its devices when it starts, so the tests of work spread over several devices
cannot run in the process that runs the rest of the suite (one CPU device); this test
starts a pytest of its own with `--xla_force_host_platform_device_count=4` and checks
that every test there passed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_multidevice_suite_passes_on_four_cpu_devices():
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    env.pop("JAX_NUM_CPU_DEVICES", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    command.append(str(ROOT / "tests" / "multidevice"))
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    report = done.stdout[-8000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert re.search(r"\d+ passed", done.stdout), report
    assert "skipped" not in done.stdout.splitlines()[-1], report
