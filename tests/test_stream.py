"""`zm.to_host` and `zm.to_file`: results that leave the device block by block, and files
that resume after a crash."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close

import zodmem as zm
from zodmem._stream import _npy


def loss(w, data):
    return jnp.sum(jnp.tanh(data @ w) ** 2) + jnp.sum(w**3)


def outputs(params, t):
    return {"y": params["a"] * jnp.sin(params["w"] * t), "z": jnp.sum(params["a"] ** 2)}


def pair(x):
    return jnp.outer(x, x), jnp.sum(x)


W = jnp.linspace(-1.0, 1.0, 10)
DATA = jnp.linspace(0.0, 1.0, 30).reshape(3, 10)
PARAMS = {"a": jnp.arange(1.0, 4.0), "w": jnp.arange(3.0)}
XS = jnp.arange(22.0).reshape(11, 2)

CASES = [
    pytest.param(zm.BatchedHessian(loss, nbatches=3, mode="rev"), (W, DATA), id="hessian-rev"),
    pytest.param(zm.BatchedHessian(loss, batch_size=5, mode="fwd"), (W, DATA), id="hessian-fwd"),
    pytest.param(zm.BatchedJacobian(outputs, nbatches=2, mode="fwd"), (PARAMS, 0.5), id="jac-fwd"),
    pytest.param(
        zm.BatchedJacobian(outputs, batch_size=2, mode="rev"), (PARAMS, 0.5), id="jac-rev"
    ),
    pytest.param(zm.ChunkedVmap(pair, chunk_size=3, out_axes=(1, 0)), (XS,), id="vmap-axes"),
    pytest.param(zm.ChunkedVmap(pair, chunk_size=11), (XS,), id="vmap-one-block"),
]


@pytest.mark.parametrize("transform, args", CASES)
def test_to_host_equals_the_call(transform, args):
    result = zm.to_host(transform, *args)
    assert all(type(leaf) is np.ndarray for leaf in jax.tree_util.tree_leaves(result))
    close(result, transform(*args))


@pytest.mark.parametrize("transform, args", CASES)
def test_to_file_equals_the_call(transform, args, tmp_path):
    path = tmp_path / "result.npy"
    result = zm.to_file(path, transform, *args)
    for leaf in jax.tree_util.tree_leaves(result):
        assert isinstance(leaf, np.memmap) and not leaf.flags.writeable
    close(result, transform(*args))
    close(zm.to_file(path, transform, *args), result, exact=True)  # every block verified
    if isinstance(result, np.ndarray):
        close(np.load(path, mmap_mode="r"), transform(*args))
    else:  # a pytree: one .npy per leaf in a directory, named by key path
        names = sorted(os.listdir(path))
        assert "blocks.journal" in names and all(n.endswith((".npy", ".journal")) for n in names)


def test_budgets_plan_the_streamed_call():
    w, data = jnp.linspace(-1.0, 1.0, 40), jnp.linspace(0.0, 1.0, 120).reshape(3, 40)
    transform = zm.BatchedHessian(loss, max_memory="5kB")
    with pytest.raises(zm.MemoryBudgetError):
        transform(w, data)  # the Hessian alone takes 6.4 kB
    close(zm.to_host(transform, w, data), zm.BatchedHessian(loss)(w, data))
    vmap = zm.ChunkedVmap(pair, max_memory="4kB")
    close(zm.to_host(vmap, XS), vmap(XS))


def test_has_aux_goes_to_host_and_is_refused_by_to_file(tmp_path):
    def with_aux(w, data):
        return loss(w, data), {"label": "loss", "w": w}

    transform = zm.BatchedHessian(with_aux, nbatches=3, has_aux=True)
    close(zm.to_host(transform, W, DATA), transform(W, DATA))
    with pytest.raises(TypeError, match="has_aux=True"):
        zm.to_file(tmp_path / "h.npy", transform, W, DATA)


def test_other_transforms_and_traced_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="BatchedJacobian, zm.BatchedHessian or"):
        zm.to_host(zm.Microbatcher(jnp.sum, microbatch_size=2), XS)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda w: zm.to_host(zm.BatchedHessian(loss), w, DATA))(W)


def test_a_finished_file_returns_without_computing(tmp_path):
    calls = []

    def counted(w, data):
        jax.debug.callback(lambda: calls.append(1))
        return loss(w, data)

    path = tmp_path / "h.npy"
    transform = zm.BatchedHessian(counted, nbatches=3)
    first = zm.to_file(path, transform, W, DATA)
    jax.effects_barrier()
    assert calls
    calls.clear()
    again = zm.to_file(path, transform, W, DATA)
    jax.effects_barrier()
    assert not calls
    np.testing.assert_array_equal(again, first)


@pytest.mark.parametrize(
    "other, args, what",
    [
        (zm.BatchedHessian(loss, nbatches=2), (W, DATA), "transform"),
        (zm.BatchedHessian(loss, nbatches=3), (W + 1, DATA), "input values"),
        (zm.BatchedHessian(loss, nbatches=3), (W[:8], DATA[:, :8]), "shapes"),
        (zm.ChunkedVmap(jnp.outer, chunk_size=3), (W, W), "transform"),
    ],
)
def test_files_of_other_calls_are_refused(other, args, what, tmp_path):
    path = tmp_path / "h.npy"
    zm.to_file(path, zm.BatchedHessian(loss, nbatches=3), W, DATA)
    with pytest.raises(zm.SerialisationError, match=f"(?s){what}.*delete the file"):
        zm.to_file(path, other, *args)


def test_files_without_a_journal_are_refused(tmp_path):
    path = tmp_path / "h.npy"
    np.save(path, np.zeros((10, 10), np.float32))
    with pytest.raises(zm.SerialisationError, match="no journal"):
        zm.to_file(path, zm.BatchedHessian(loss), W, DATA)


def test_damaged_records_are_refused_and_a_torn_last_one_ignored(tmp_path):
    path = tmp_path / "h.npy"
    transform = zm.BatchedHessian(loss, nbatches=3)
    expected = np.asarray(transform(W, DATA))
    zm.to_file(path, transform, W, DATA)
    journal = tmp_path / "h.npy.journal"
    lines = journal.read_bytes().splitlines(keepends=True)
    # A crash while the last record was written: only part of it reached the disk.
    journal.write_bytes(b"".join(lines[:-1]) + lines[-1][:10])
    close(zm.to_file(path, transform, W, DATA), expected)
    assert journal.read_bytes().endswith(b"\n")
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"done"', b'"dune"')
    journal.write_bytes(b"".join(lines))
    with pytest.raises(zm.SerialisationError, match="record 2 .* is damaged"):
        zm.to_file(path, transform, W, DATA)


def test_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "h.npy"
    transform = zm.BatchedHessian(loss, nbatches=3)
    zm.to_file(path, transform, W, DATA)
    with open(path, "r+b") as file:
        file.truncate(200)
    with pytest.raises(zm.SerialisationError, match="header and size"):
        zm.to_file(path, transform, W, DATA)


_CHILD = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
import zodmem as zm

calls = []

def slow(x):
    def host(x):
        calls.append(1)
        time.sleep(float(sys.argv[2]))
        return np.asarray(x)

    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(host, shape, x, vmap_method="broadcast_all")

def fn(x):
    return jnp.outer(slow(x), x)

xs = jnp.arange(48.0).reshape(12, 4)
# argv[3], if given: how many times to stream into the file, one count of blocks each.
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    calls.clear()
    zm.to_file(sys.argv[1], zm.ChunkedVmap(fn, chunk_size=1), xs)
    print("computed", len(calls), flush=True)
"""


def _blocks_done(journal):
    if not os.path.exists(journal):
        return 0
    done = 0
    for line in open(journal, "rb").read().splitlines():
        record = json.loads(line.split(b" ", 1)[1])
        done = record.get("done", done)
    return done


def test_a_killed_job_resumes_at_the_first_unfinished_block(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    path = str(tmp_path / "outer.npy")
    child = subprocess.Popen([sys.executable, str(script), path, "0.25"], stdout=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _blocks_done(path + ".journal") < 3:
        assert child.poll() is None and time.monotonic() < deadline, "the job did not start"
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    done = _blocks_done(path + ".journal")
    assert 3 <= done < 12

    # Resumed, then run again in the same process (one start of Python fewer; the test
    # below runs a finished file in a process of its own).
    result = subprocess.run(
        [sys.executable, str(script), path, "0", "2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed, again = (int(line.split()[-1]) for line in result.stdout.splitlines())
    assert resumed <= 12 - done + 1
    xs = jnp.arange(48.0).reshape(12, 4)
    expected = jax.vmap(jnp.outer)(xs, xs)
    np.testing.assert_array_equal(np.load(path, mmap_mode="r"), expected)
    assert again == 0  # finished: nothing computed


def test_pytree_results_go_to_a_directory(tmp_path):
    class Model(eqx.Module):
        weight: jax.Array
        name: str = eqx.field(static=True)

        def __call__(self, x):
            return {"out": self.weight * x, "odd key": [jnp.sum(x), x**2]}

    vmap = zm.ChunkedVmap(Model(jnp.arange(2.0), "m"), chunk_size=4)
    result = zm.to_file(tmp_path / "outputs", vmap, XS)
    close(result, vmap(XS))
    names = sorted(os.listdir(tmp_path / "outputs"))
    assert names == ["blocks.journal", "odd_key_0.npy", "odd_key_1.npy", "out.npy"]


def _function(body, constant):
    """A `lambda` of the same name whatever its body and the array it closes over."""
    if body == "square":
        return lambda x: jnp.outer(x, x) * constant
    return lambda x: jnp.outer(x, x) + constant


@pytest.mark.parametrize("body, constant", [("square", 3.0), ("add", 2.0)], ids=["value", "body"])
def test_files_of_other_functions_of_the_same_name_are_refused(body, constant, tmp_path):
    path = tmp_path / "outer.npy"
    made = zm.ChunkedVmap(_function("square", jnp.full(2, 2.0)), chunk_size=4)
    zm.to_file(path, made, XS)
    other = zm.ChunkedVmap(_function(body, jnp.full(2, constant)), chunk_size=4)
    with pytest.raises(zm.SerialisationError, match="(?s)computation.*delete the file"):
        zm.to_file(path, other, XS)
    # The same refusal for a file cut short: no block of the other function is added.
    journal = tmp_path / "outer.npy.journal"
    journal.write_bytes(b"".join(journal.read_bytes().splitlines(keepends=True)[:2]))
    with pytest.raises(zm.SerialisationError, match="(?s)computation.*delete the file"):
        zm.to_file(path, other, XS)
    again = zm.to_file(path, made, XS)
    np.testing.assert_array_equal(again, made(XS))


def test_a_finished_file_is_taken_by_the_same_script_in_another_process(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    path = str(tmp_path / "outer.npy")
    counts = []
    for seed in ("1", "2"):
        environment = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, str(script), path, "0"],
            capture_output=True,
            text=True,
            timeout=120,
            env=environment,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        counts.append(int(result.stdout.split()[-1]))
    assert counts[0] > 0 and counts[1] == 0


def _flip_byte(path, offset):
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))


# Files are read back in pieces of at most `_READ_SIZE` bytes: whole runs at a time, or
# each block's part of a run when a run is longer.
READ_SIZES = pytest.mark.parametrize("read_size", [None, 24], ids=["runs", "parts-of-runs"])


@READ_SIZES
def test_a_damaged_block_is_refused(read_size, tmp_path, monkeypatch):
    if read_size:
        monkeypatch.setattr(_npy, "_READ_SIZE", read_size)
    path = tmp_path / "h.npy"
    transform = zm.BatchedHessian(loss, nbatches=3)
    zm.to_file(path, transform, W, DATA)
    header = np.load(path, mmap_mode="r").offset
    _flip_byte(path, header + 4 * 10 * 5 + 8)  # row 5 lies in block 1 (rows 4 to 7)
    with pytest.raises(zm.SerialisationError, match=r"(?s)block 1 of .*h\.npy.*delete the file"):
        zm.to_file(path, transform, W, DATA)


@READ_SIZES
def test_a_damaged_block_of_a_file_cut_short_is_refused(read_size, tmp_path, monkeypatch):
    if read_size:
        monkeypatch.setattr(_npy, "_READ_SIZE", read_size)
    path = tmp_path / "v.npy"
    vmap = zm.ChunkedVmap(lambda x: jnp.outer(x, x), chunk_size=3, out_axes=1)
    journal = tmp_path / "v.npy.journal"

    def cut_short():  # as if killed after the first record of blocks on disk
        journal.write_bytes(b"".join(journal.read_bytes().splitlines(keepends=True)[:2]))

    zm.to_file(path, vmap, XS)
    cut_short()
    close(zm.to_file(path, vmap, XS), vmap(XS), exact=True)  # its blocks check out
    cut_short()
    # The result is (2, 11, 2) with blocks along axis 1: item 1 of row 0 is in block 0.
    _flip_byte(path, np.load(path, mmap_mode="r").offset + 4 * 2 + 1)
    with pytest.raises(zm.SerialisationError, match=r"(?s)block 0 of .*v\.npy.*delete the file"):
        zm.to_file(path, vmap, XS)


def test_a_damaged_whole_leaf_is_refused(tmp_path):
    vmap = zm.ChunkedVmap(lambda x: (x**2, jnp.arange(3.0)), chunk_size=3, out_axes=(0, None))
    result = zm.to_file(tmp_path / "out", vmap, jnp.arange(8.0))
    close(result, vmap(jnp.arange(8.0)))
    leaf = tmp_path / "out" / "1.npy"
    _flip_byte(leaf, np.load(leaf, mmap_mode="r").offset + 5)
    with pytest.raises(zm.SerialisationError, match=r"(?s)1\.npy.*delete the file"):
        zm.to_file(tmp_path / "out", vmap, jnp.arange(8.0))


def _held_at_first_block():
    """A function whose first block waits for `release` (once `entered` is set)."""
    entered, release, calls = threading.Event(), threading.Event(), []

    def host(x):
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            release.wait(60)
        return np.asarray(x)

    def fn(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jnp.outer(jax.pure_callback(host, shape, x, vmap_method="broadcast_all"), x)

    return fn, entered, release


def test_a_second_writer_of_the_same_path_is_refused(tmp_path):
    fn, entered, release = _held_at_first_block()
    vmap = zm.ChunkedVmap(fn, chunk_size=4)
    xs = XS.reshape(-1, 2)
    path = tmp_path / "outer.npy"
    results = []
    first = threading.Thread(target=lambda: results.append(zm.to_file(path, vmap, xs)))
    first.start()
    try:
        assert entered.wait(60)
        with pytest.raises(zm.SerialisationError, match=r"(?s)outer\.npy is being written"):
            zm.to_file(path, vmap, xs)
    finally:
        release.set()
        first.join(60)
    np.testing.assert_array_equal(results[0], jax.vmap(jnp.outer)(xs, xs))
    np.testing.assert_array_equal(zm.to_file(path, vmap, xs), results[0])  # the lock is free


def test_the_lock_is_released_when_the_call_fails(tmp_path):
    failing = []

    def host(x):
        if failing:
            raise RuntimeError("the block failed")
        return np.asarray(x)

    def fn(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jnp.outer(jax.pure_callback(host, shape, x, vmap_method="broadcast_all"), x)

    vmap = zm.ChunkedVmap(fn, chunk_size=4)
    path = tmp_path / "outer.npy"
    failing.append(True)
    with pytest.raises(Exception, match="the block failed"):
        zm.to_file(path, vmap, XS)
    failing.clear()
    np.testing.assert_array_equal(zm.to_file(path, vmap, XS), jax.vmap(jnp.outer)(XS, XS))
    assert sorted(os.listdir(tmp_path)) == ["outer.npy", "outer.npy.journal"]


def test_a_transform_sharded_by_rows_streams_on_one_device(tmp_path):
    # A mesh of this one device: the rows of its one share, written by this process.
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    sharded = zm.BatchedHessian(loss, batch_size=3, sharding=rows)
    expected = zm.BatchedHessian(loss, batch_size=3)(W, DATA)
    path = str(tmp_path / "h.npy")
    close(np.asarray(zm.to_file(path, sharded, W, DATA)), expected)
    assert sorted(os.listdir(tmp_path)) == ["h.npy", "h.npy.journal.p0"]
    close(zm.to_host(sharded, W, DATA), expected)
    with pytest.raises(zm.SerialisationError, match="rows of a sharded call"):
        zm.to_file(path, zm.BatchedHessian(loss, batch_size=3), W, DATA)
    columns = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "d"))
    with pytest.raises(ValueError, match="Split the rows"):
        zm.to_file(str(tmp_path / "c.npy"), zm.BatchedHessian(loss, sharding=columns), W, DATA)


def test_a_file_cut_short_while_it_is_read_is_refused(tmp_path):
    # The sizes are checked before the blocks are read; a file cut shorter between the
    # two is refused in words, not hashed short.
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(10)))
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = memoryview(bytearray(8))
        assert bytes(_npy._read_exactly(fd, buffer[:6], 2)) == bytes(range(2, 8))
        with pytest.raises(zm.SerialisationError, match="ended 4 bytes before"):
            _npy._read_exactly(fd, buffer, 6)
    finally:
        os.close(fd)


def test_files_are_read_back_where_the_system_has_no_preadv(tmp_path, monkeypatch):
    # Where Python has `os.pread` but no `os.preadv`, the check reads and copies instead.
    from zodmem import _files

    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(16)))
    monkeypatch.delattr(os, "preadv")
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = memoryview(bytearray(8))
        assert _files.pread_into(fd, buffer, 4) == 8 and bytes(buffer) == bytes(range(4, 12))
        assert _files.pread_into(fd, buffer, 12) == 4
    finally:
        os.close(fd)
