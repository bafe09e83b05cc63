"""Progress bars: drawn from inside the compiled loops, one per call, and nothing at all
(not even a callback in the program) when they are off."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_init, close

import zodmem as zm
from zodmem._engine import _progress

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


def loss(w, data):
    return jnp.sum(jnp.tanh(data @ w) ** 2)


def step(carry, x):
    return carry * 0.5 + x, carry


W, DATA, XS = jnp.linspace(0.1, 0.6, 6), jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), jnp.ones(7)

# (name, transform with progress on or off, its arguments, the bar's label and total).
CASES = {
    "jacobian-fwd": (
        lambda on: zm.BatchedJacobian(jnp.sin, nbatches=3, mode="fwd", progress=on),
        (W,),
        "BatchedJacobian",
        3,
    ),
    "jacobian-rev": (
        lambda on: zm.BatchedJacobian(jnp.sin, batch_size=4, mode="rev", progress=on),
        (W,),
        "BatchedJacobian",
        2,
    ),
    "hessian": (
        lambda on: zm.BatchedHessian(loss, nbatches=3, progress=on),
        (W, DATA),
        "BatchedHessian",
        3,
    ),
    "hessian-one-block": (
        lambda on: zm.BatchedHessian(loss, progress=on),
        (W, DATA),
        "BatchedHessian",
        1,
    ),
    "vmap": (
        lambda on: zm.ChunkedVmap(jnp.sin, chunk_size=3, progress=on),
        (XS,),
        "ChunkedVmap",
        3,
    ),
    "vmap-one-chunk": (
        lambda on: zm.ChunkedVmap(jnp.sin, chunk_size=10, progress=on),
        (XS,),
        "ChunkedVmap",
        1,
    ),
    "microbatch": (
        lambda on: zm.Microbatcher(jnp.sum, microbatch_size=3, progress=on),
        (XS,),
        "Microbatcher",
        3,
    ),
    "microbatch-real": (
        lambda on: zm.Microbatcher(
            jnp.sum, microbatch_size=3, num_real_microbatches=2, progress=on
        ),
        (XS,),
        "Microbatcher",
        3,
    ),
    "sliced-xs": (
        lambda on: zm.SlicedScan(step, step=2, progress=on),
        (0.0, XS),
        "SlicedScan",
        7,
    ),
    "sliced-length": (
        lambda on: zm.SlicedScan(lambda c, _: (c + 1.0, c), step=2, length=7, progress=on),
        (0.0,),
        "SlicedScan",
        4,
    ),
    "sliced-none-kept": (
        lambda on: zm.SlicedScan(step, start=7, progress=on),
        (0.0, XS),
        "SlicedScan",
        7,
    ),
    "checkpointed": (
        lambda on: zm.CheckpointedScan(step, chunk_size=3, progress=on),
        (0.0, XS),
        "CheckpointedScan",
        3,
    ),
    "checkpointed-reverse": (
        lambda on: zm.CheckpointedScan(step, chunk_size=3, reverse=True, progress=on),
        (0.0, XS),
        "CheckpointedScan",
        3,
    ),
}


def bars(text, label, total):
    """`(opened, finished)`: how many bars of `label` were drawn at 0/total and at
    total/total."""
    opened = len(re.findall(rf"{label}:\s+0%\|[^|]*\| 0/{total} ", text))
    finished = len(re.findall(rf"{label}: 100%\|[^|]*\| {total}/{total} ", text))
    return opened, finished


def stderr_of(capsys, call):
    capsys.readouterr()
    result = jax.block_until_ready(call())
    jax.effects_barrier()
    return result, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES)
def test_a_bar_reaches_its_total_once_per_call(case, capsys):
    make, args, label, total = CASES[case]
    transform = make(True)
    for _ in range(3):  # the compiled program is cached: each run still gets its own bar
        _, err = stderr_of(capsys, lambda: transform(*args))
        assert bars(err, label, total) == (1, 1), err
    assert not _progress._BARS


@pytest.mark.parametrize("case", CASES)
def test_values_are_those_without_progress(case, capsys):
    make, args, _, _ = CASES[case]
    # Bit for bit, as a user's programs are compiled (the suite turns the backend's
    # optimisations and fusion emitters off, and without them a callback may change how
    # XLA rounds).
    optimised = {"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True}

    def call(progress):
        return jax.jit(lambda *a: make(progress)(*a), compiler_options=optimised)(*args)

    close(call(True), call(False), exact=True)


@pytest.mark.parametrize("case", CASES)
def test_off_prints_nothing_and_compiles_no_callback(case, capsys):
    make, args, _, _ = CASES[case]
    _, err = stderr_of(capsys, lambda: make(False)(*args))
    assert err == ""
    assert "callback" not in str(jax.make_jaxpr(lambda *a: make(False)(*a))(*args))
    assert "debug_callback" in str(jax.make_jaxpr(lambda *a: make(True)(*a))(*args))


@pytest.mark.parametrize("jit", [jax.jit, eqx.filter_jit])
def test_under_jit_one_bar_per_call(jit, capsys):
    transform = zm.BatchedHessian(loss, nbatches=3, progress=True, jit=False)
    call = jit(lambda w, data: transform(w, data))
    for _ in range(3):
        _, err = stderr_of(capsys, lambda: call(W, DATA))
        assert bars(err, "BatchedHessian", 3) == (1, 1), err


def test_transform_passed_to_filter_jit(capsys):
    transform = zm.ChunkedVmap(jnp.sin, chunk_size=3, progress=True)
    call = eqx.filter_jit(lambda t, x: t(x))
    for _ in range(2):
        _, err = stderr_of(capsys, lambda: call(transform, XS))
        assert bars(err, "ChunkedVmap", 3) == (1, 1), err


def test_vmap_shows_one_bar_for_all_lanes(capsys):
    transform = zm.ChunkedVmap(jnp.sin, chunk_size=3, progress=True)
    lanes = jnp.ones((5, 7))
    result, err = stderr_of(capsys, lambda: jax.jit(jax.vmap(transform))(lanes))
    assert bars(err, "ChunkedVmap", 3) == (1, 1), err
    close(result, np.sin(np.ones((5, 7), np.float32)))
    microbatched = zm.Microbatcher(jnp.sum, microbatch_size=3, progress=True)
    _, err = stderr_of(capsys, lambda: jax.vmap(microbatched)(lanes))
    assert bars(err, "Microbatcher", 3) == (1, 1), err


def test_vmap_over_the_number_of_real_microbatches(capsys):
    def call(count):
        return zm.Microbatcher(
            jnp.sum, microbatch_size=3, num_real_microbatches=count, progress=True
        )(XS)

    result, err = stderr_of(capsys, lambda: jax.vmap(call)(jnp.arange(4)))
    assert bars(err, "Microbatcher", 3) == (1, 1), err
    close(result, jax.device_put(np.asarray([0.0, 3.0, 6.0, 7.0])))


def test_nested_transform_shows_a_bar_per_outer_chunk(capsys):
    inner = zm.BatchedHessian(loss, nbatches=3, progress=True)
    outer = zm.ChunkedVmap(inner, chunk_size=2, in_axes=(0, None), progress=True)
    ws = jax.device_put(np.outer([1, 2, 3, 4], np.asarray(W)).astype(np.float32))
    result, err = stderr_of(capsys, lambda: outer(ws, DATA))
    # The inner loop runs once per chunk, for both lanes of the chunk at once; its bar,
    # below the outer one, is cleared when it closes.
    assert bars(err, "BatchedHessian", 3)[0] == 2, err
    assert bars(err, "ChunkedVmap", 2) == (1, 1), err
    assert not _progress._BARS
    close(
        result, eqx.filter_jit(jax.vmap(jax.hessian(loss), in_axes=(0, None)))(ws, DATA), rtol=1e-5
    )


def test_grad_shows_the_forward_loop(capsys):
    def total(x0):
        carry, ys = zm.CheckpointedScan(step, chunk_size=3, progress=True)(x0, XS)
        return carry + jnp.sum(ys)

    def reference(x0):
        carry, ys = jax.lax.scan(step, x0, XS)
        return carry + jnp.sum(ys)

    gradient, err = stderr_of(capsys, lambda: jax.grad(total)(1.0))
    # The backward pass runs its own loop, without a bar.
    assert bars(err, "CheckpointedScan", 3) == (1, 1), err
    close(gradient, jax.jit(jax.grad(reference))(1.0))  # the reference in one program


def test_a_bar_left_open_by_a_failed_run_is_replaced(capsys):
    bar = _progress.Progress("Loop", 3)
    bar._open()
    bar._done(jnp.asarray(1))  # the run fails here
    bar._open()
    for count in (1, 2, 3):
        bar._done(jnp.asarray(count))
    assert bar.key not in _progress._BARS
    assert bars(capsys.readouterr().err, "Loop", 3) == (2, 1)


def test_planning_runs_show_no_bar(capsys):
    transform = zm.ChunkedVmap(lambda x: jnp.sin(x) * x, max_memory="1GB", progress=True)
    transform.plan(jnp.ones(64))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "cls, config",
    [
        (zm.BatchedJacobian, {}),
        (zm.BatchedHessian, {}),
        (zm.ChunkedVmap, {"chunk_size": 2}),
        (zm.Microbatcher, {"microbatch_size": 2}),
        (zm.SlicedScan, {}),
        (zm.CheckpointedScan, {}),
    ],
)
def test_progress_must_be_a_bool(cls, config):
    with pytest.raises(TypeError):
        cls(jnp.sin, progress=1, **config)
    message = f"{cls.__name__}: `progress` must be True or False, got 1 of type int."
    with pytest.raises(TypeError, match=re.escape(message)):
        check_init(cls, progress=1, **config)


def test_streamed_results_show_their_bar(tmp_path, capsys):
    w = jnp.linspace(-1.0, 1.0, 12)
    hessian = zm.BatchedHessian(lambda w: jnp.sum(jnp.tanh(w) ** 3), nbatches=4, progress=True)
    _, err = stderr_of(capsys, lambda: zm.to_host(hessian, w))
    assert bars(err, "BatchedHessian", 4) == (1, 1), err
    vmapped = zm.ChunkedVmap(jnp.sin, chunk_size=3, progress=True)
    _, err = stderr_of(capsys, lambda: zm.to_file(tmp_path / "v.npy", vmapped, w))
    assert bars(err, "ChunkedVmap", 4) == (1, 1), err
    assert not _progress._BARS


def _failing_at_block(block):
    """`jnp.sin` through a host function that raises on the given block (of 3 rows)."""

    def host(x):
        if x[0] >= 3 * block:
            raise RuntimeError("the block failed")
        return np.sin(x)

    def fn(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(host, shape, x, vmap_method="broadcast_all")

    return fn


@pytest.mark.parametrize("stream", ["to_host", "to_file"])
def test_a_failed_streamed_call_closes_its_bar(stream, tmp_path, capsys):
    failing = zm.ChunkedVmap(_failing_at_block(1), chunk_size=3, progress=True)
    xs = jnp.arange(9.0)
    call = zm.to_host if stream == "to_host" else functools.partial(zm.to_file, tmp_path / "v.npy")
    with pytest.raises(Exception, match="the block failed"):
        call(failing, xs)
    jax.effects_barrier()
    assert not _progress._BARS
    capsys.readouterr()
    later = zm.ChunkedVmap(jnp.cos, chunk_size=3, progress=True)
    _, err = stderr_of(capsys, lambda: zm.to_host(later, xs))
    assert bars(err, "ChunkedVmap", 3) == (1, 1), err
    assert "1/3" not in err  # the failed bar is not drawn again
    assert not _progress._BARS


def test_bars_opened_in_an_interrupted_call_are_closed(capsys):
    bar = _progress.Progress("Loop", 3)
    with pytest.raises(KeyboardInterrupt), _progress.closing_bars():
        bar._open()
        bar._done(jnp.asarray(1))
        raise KeyboardInterrupt
    assert not _progress._BARS
    bar._done(jnp.asarray(2))  # the computation goes on a while: its updates draw nothing
    assert not _progress._BARS
    assert bars(capsys.readouterr().err, "Loop", 3) == (1, 0)
    bar._open()  # the next run of the same loop has a bar of its own
    for count in (1, 2, 3):
        bar._done(jnp.asarray(count))
    assert not _progress._BARS
    assert bars(capsys.readouterr().err, "Loop", 3) == (1, 1)


@pytest.mark.parametrize("name", ["ChunkedVmap", "Microbatcher", "SlicedScan"])
def test_a_failed_call_closes_its_bar(name, capsys):
    failing = _failing_at_block(1)

    def scan_of(fn):
        # Steps of 3 rows each, the second failing: a bar of 3 steps.
        return zm.SlicedScan(lambda c, x: (c, fn(x)), progress=True)

    make = {
        "ChunkedVmap": lambda fn: zm.ChunkedVmap(fn, chunk_size=3, progress=True),
        "Microbatcher": lambda fn: zm.Microbatcher(
            fn, microbatch_size=3, accumulator="concat", progress=True
        ),
        "SlicedScan": scan_of,
    }[name]
    xs = jnp.arange(9.0).reshape(3, 3) if name == "SlicedScan" else jnp.arange(9.0)
    call = (lambda t: t(0.0, xs)) if name == "SlicedScan" else (lambda t: t(xs))
    with pytest.raises(Exception, match="the block failed"):
        jax.block_until_ready(call(make(failing)))
    jax.effects_barrier()
    assert not _progress._BARS
    capsys.readouterr()
    _, err = stderr_of(capsys, lambda: call(make(jnp.cos)))
    assert bars(err, name, 3) == (1, 1), err
    assert "1/3" not in err  # the failed bar is not drawn again
    assert not _progress._BARS
