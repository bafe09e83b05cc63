"""A sharded transform streamed by rows on 4 CPU devices: `zm.to_file` writes every
device's rows into one `.npy` file (resumable, checked), `zm.to_host` returns them.

Run in a process of its own with `--xla_force_host_platform_device_count=4`.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zodmem as zm
from tests.helpers import close
from zodmem._stream import _npy
from zodmem._stream._journal import _record

pytestmark = pytest.mark.usefixtures("float64")


def loss(params, data):
    """A scalar loss of a pytree whose Hessian is dense (16 variables)."""
    x, _ = ravel_pytree(params)
    return jnp.sum(jnp.tanh(x * data)) * jnp.sum(x**2) + jnp.sum(jnp.cos(jnp.outer(x, x)))


def other_loss(params, data):
    x, _ = ravel_pytree(params)
    return jnp.sum(jnp.sin(x * data) ** 2)


def inputs():
    params = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.linspace(0.2, 0.9, 10)}
    return params, jnp.linspace(0.5, 1.5, 16)


def reference():
    params, data = inputs()
    flat, unravel = ravel_pytree(params)
    return np.asarray(jax.hessian(lambda v: loss(unravel(v), data))(flat))


def rows(devices=4, kind=AxisType.Explicit):
    mesh = jax.make_mesh((devices,), ("d",), axis_types=(kind,), devices=jax.devices()[:devices])
    return NamedSharding(mesh, P("d", None))


def hessian(batch_size=3, fn=loss, **kwargs):
    kwargs.setdefault("sharding", rows())
    return zm.BatchedHessian(fn, batch_size=batch_size, **kwargs)


def rows_recorded(path):
    """The runs of rows each journal of `path` records, by process."""
    counts = {}
    for name in os.listdir(os.path.dirname(path)):
        if name.startswith(os.path.basename(path) + ".journal.p"):
            lines = open(os.path.join(os.path.dirname(path), name), "rb").read().splitlines()
            bodies = [json.loads(line.split(b" ", 1)[1]) for line in lines[1:]]
            counts[name] = sum(len(body.get("rows", ())) for body in bodies)
    return counts


@pytest.fixture
def writes(monkeypatch):
    """The first rows of every run of rows this process writes."""
    written = []
    write_rows = _npy.ResultFiles.write_rows

    def counted(self, leaf, piece, first):
        written.append(first)
        return write_rows(self, leaf, piece, first)

    monkeypatch.setattr(_npy.ResultFiles, "write_rows", counted)
    return written


def test_to_file_equals_the_hessian_and_returns_a_finished_file_at_once(tmp_path, writes):
    # 3 does not divide a device's 4 rows: each device's last block overlaps the one before.
    transform = hessian(batch_size=3)
    path = str(tmp_path / "h.npy")
    result = zm.to_file(path, transform, *inputs())
    assert isinstance(result, np.memmap) and not result.flags.writeable
    close(np.asarray(result), reference())
    assert sorted(os.listdir(tmp_path)) == ["h.npy", "h.npy.journal.p0"]
    assert len(writes) == 4 * 2  # every block of every device: rows 0-2, then row 3
    writes.clear()
    close(np.asarray(zm.to_file(path, transform, *inputs())), reference())
    assert writes == []  # finished: nothing computed


def test_to_host_gives_the_rows_of_this_process():
    transform = hessian(batch_size=1, sharding=rows(kind=AxisType.Auto))
    close(zm.to_host(transform, *inputs()), reference())  # one process: every row


def test_a_jacobian_streams_its_rows(tmp_path):
    def fn(x):
        return {"u": jnp.outer(jnp.sin(x), x)[:8], "v": jnp.cos(x) * x[0]}

    x = jnp.linspace(0.1, 1.0, 8)
    transform = zm.BatchedJacobian(fn, batch_size=3, sharding=rows())
    result = zm.to_file(str(tmp_path / "j"), transform, x)
    close(jax.tree_util.tree_map(np.asarray, result), jax.jacrev(fn)(x))


def _as_if_two_processes(path, keep):
    """The journal of `path` split in two, as if two processes had written rows 0-7 and
    8-15, and stopped after writing the first `keep` runs of rows of each."""
    journal = path + ".journal.p0"
    lines = open(journal, "rb").read().splitlines(keepends=True)
    header = json.loads(lines[0].split(b" ", 1)[1])
    regions = [r for line in lines[1:] for r in json.loads(line.split(b" ", 1)[1])["rows"]]
    for process in (0, 1):
        mine = sorted(r for r in regions if r[3] // 8 == process)[:keep]
        header["sharded"].update(process=process, processes=2)
        with open(f"{path}.journal.p{process}", "wb") as file:
            file.writelines([_record(header), _record({"rows": mine})])


def test_a_file_resumes_over_another_mesh_and_processes_with_the_unfinished_rows(tmp_path, writes):
    path = str(tmp_path / "h.npy")
    zm.to_file(path, hessian(batch_size=1), *inputs())
    _as_if_two_processes(path, 3)
    assert rows_recorded(path) == {"h.npy.journal.p0": 3, "h.npy.journal.p1": 3}
    writes.clear()
    # One process over 2 devices takes the rows two processes left as they are.
    result = zm.to_file(path, hessian(batch_size=1, sharding=rows(2)), *inputs())
    close(np.asarray(result), reference())
    assert sorted(writes) == [3, 4, 5, 6, 7, 11, 12, 13, 14, 15]
    assert sum(rows_recorded(path).values()) == 16


_CHILD = """
import sys, time
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import zodmem as zm
from zodmem._stream import _npy
from zodmem._stream._journal import _record

jax.config.update("jax_enable_x64", True)
calls, write_rows = [], _npy.ResultFiles.write_rows

def slow(self, *args):
    calls.append(1)
    time.sleep(float(sys.argv[2]))
    return write_rows(self, *args)

_npy.ResultFiles.write_rows = slow
def loss(x):
    return jnp.sum(jnp.tanh(x)) * jnp.sum(x**2) + jnp.sum(jnp.cos(jnp.outer(x, x)))

rows = NamedSharding(jax.make_mesh((4,), ("d",)), P("d", None))
x = jnp.linspace(-1.0, 1.0, 16)
zm.to_file(sys.argv[1], zm.BatchedHessian(loss, batch_size=1, sharding=rows), x)
print("computed", len(calls), flush=True)
"""


def test_a_killed_job_resumes_with_the_unfinished_rows(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    path = str(tmp_path / "h.npy")
    child = subprocess.Popen([sys.executable, str(script), path, "0.1"], stdout=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while sum(rows_recorded(path).values()) < 3 if os.path.exists(path) else True:
        assert child.poll() is None and time.monotonic() < deadline, "the job did not start"
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    done = sum(rows_recorded(path).values())
    assert 3 <= done < 16
    result = subprocess.run(
        [sys.executable, str(script), path, "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) <= 16 - done + 1
    x = jnp.linspace(-1.0, 1.0, 16)
    expected = jax.hessian(
        lambda x: jnp.sum(jnp.tanh(x)) * jnp.sum(x**2) + jnp.sum(jnp.cos(jnp.outer(x, x)))
    )(x)
    close(np.load(path, mmap_mode="r"), np.asarray(expected))


def test_files_of_other_calls_layouts_and_damaged_rows_are_refused(tmp_path):
    path = str(tmp_path / "h.npy")
    zm.to_file(path, hessian(), *inputs())
    with pytest.raises(zm.SerialisationError, match="another call"):
        zm.to_file(path, hessian(fn=other_loss), *inputs())
    params, data = inputs()
    with pytest.raises(zm.SerialisationError, match="another call"):
        zm.to_file(path, hessian(), params, data * 2)
    with pytest.raises(zm.SerialisationError, match="rows of a sharded call"):
        zm.to_file(path, zm.BatchedHessian(loss, batch_size=3), *inputs())  # one device
    with open(path, "r+b") as file:  # a byte of the last row, changed on disk
        file.seek(-3, os.SEEK_END)
        byte = file.read(1)
        file.seek(-3, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(zm.SerialisationError, match="changed or damaged"):
        zm.to_file(path, hessian(), *inputs())

    single = str(tmp_path / "single.npy")
    zm.to_file(single, zm.BatchedHessian(loss, batch_size=3), *inputs())
    with pytest.raises(zm.SerialisationError, match="call on one device"):
        zm.to_file(single, hessian(), *inputs())

    # A journal whose header says its blocks are not rows: another layout.
    journal = path + ".journal.p0"
    lines = open(journal, "rb").read().splitlines(keepends=True)
    header = json.loads(lines[0].split(b" ", 1)[1])
    header["sharded"]["axis"] = 1
    open(journal, "wb").writelines([_record(header), *lines[1:]])
    with pytest.raises(zm.SerialisationError, match="another layout"):
        zm.to_file(path, hessian(), *inputs())


def test_splits_other_than_rows_are_refused(tmp_path):
    mesh = jax.make_mesh((4,), ("d",))
    columns = hessian(sharding=NamedSharding(mesh, P(None, "d")))
    with pytest.raises(ValueError, match="Split the rows"):
        zm.to_file(str(tmp_path / "c.npy"), columns, *inputs())
    with pytest.raises(ValueError, match="Split the rows"):
        zm.to_host(columns, *inputs())
    grid = jax.make_mesh((2, 2), ("x", "y"))
    half = hessian(sharding=NamedSharding(grid, P("x", None)))
    with pytest.raises(ValueError, match="every mesh axis"):
        zm.to_file(str(tmp_path / "g.npy"), half, *inputs())
    with_aux = hessian(fn=lambda p, d: (loss(p, d), 1.0), has_aux=True)
    with pytest.raises(TypeError, match="has_aux"):
        zm.to_host(with_aux, *inputs())
