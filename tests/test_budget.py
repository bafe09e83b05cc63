"""Memory budgets: `max_memory` parsed and checked, blocks planned to fit the compiled
call's peak, `plan()` without running, `MemoryBudgetError`, stacks, strategies.

These tests compile, and cover the whole path from the option to the call; which sizes
the search tries and chooses is tested on written-down peaks in test_budget_search.py."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close

import zodmem as zm
from zodmem._plan._budget import abstract
from zodmem._plan._compiled import compiled_memory
from zodmem._plan._memory import AUTO_MARGIN, budget_bytes, free_memory

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.

# The search on calls of a few kB: the process's own compile heap is tested apart
# (test_budget_reserve.py).
pytestmark = pytest.mark.usefixtures("float64")


def measured_peak(transform, *args, **kwargs):
    """The peak of the planned call, compiled independently of the planner."""
    planned = transform.planned(args, kwargs).transform
    return compiled_memory(
        lambda t, a, k: t.run(*a, **k), abstract(planned), abstract(args), abstract(kwargs)
    )[0]


def outer_loss(w):
    return jnp.sum(jnp.sin(jnp.outer(w, w)) * w)


DATA = np.cos(np.arange(200 * 120).reshape(200, 120) * 0.37)


def data_loss(w):
    """Each Hessian-vector product goes through the 200 data points: the working set of a
    block grows with its size."""
    n = w.shape[0]
    return jnp.sum(jnp.tanh(DATA[:, :n] @ w) ** 2) + jnp.sum(w**4)


def smooth_loss(w, data):
    return jnp.sum(jnp.tanh(data @ w) ** 2) + jnp.sum(w**4)


def heavy(x):
    """An elementwise-heavy map: each element makes a (200, 200) temporary."""
    return jnp.sum(jnp.tanh(jnp.outer(x, x)) @ x)


# --- the option -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (1000, 1000),
        (np.int64(2048), 2048),
        ("750MB", 750 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("2 gib", 2 * 2**30),
        ("64kB", 64_000),
        ("100B", 100),
        ("1e3MB", 10**9),
    ],
)
def test_budgets_in_bytes(value, expected):
    assert budget_bytes(value) == expected
    transform = zm.BatchedHessian(outer_loss, max_memory=value)
    assert transform.max_memory == value  # kept as written (NumPy integers as ints)
    assert type(transform.max_memory) is (str if isinstance(value, str) else int)


def test_auto_is_the_free_memory_less_the_margin():
    free = free_memory()
    assert 0 < budget_bytes("auto") <= free
    assert budget_bytes("auto") == pytest.approx(free * (1 - AUTO_MARGIN), rel=0.05)


TRANSFORMS = {
    "BatchedJacobian": lambda **o: zm.BatchedJacobian(jnp.sin, **o),
    "BatchedHessian": lambda **o: zm.BatchedHessian(outer_loss, **o),
    "ChunkedVmap": lambda **o: zm.ChunkedVmap(heavy, **o),
    "Microbatcher": lambda **o: zm.Microbatcher(jnp.sum, **o),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize(
    "value, error",
    [
        (0, ValueError),
        (-1, ValueError),
        ("-1GB", ValueError),
        ("0.1B", ValueError),
        ("1.5 parsecs", ValueError),
        ("GB", ValueError),
        ("", ValueError),
        (True, TypeError),
        (1.5e9, TypeError),
        ([1], TypeError),
    ],
)
def test_bad_budgets_are_refused_at_construction(name, value, error):
    with pytest.raises(error, match=rf"^{name}: `max_memory` must be .*{value!r}"):
        TRANSFORMS[name](max_memory=value)


@pytest.mark.parametrize(
    "name, option",
    [
        ("BatchedJacobian", "nbatches"),
        ("BatchedHessian", "batch_size"),
        ("ChunkedVmap", "chunk_size"),
        ("Microbatcher", "microbatch_size"),
    ],
)
def test_a_budget_replaces_the_count(name, option):
    with pytest.raises(ValueError, match=rf"{name}: give .*`max_memory`.*{option}=2"):
        TRANSFORMS[name](max_memory="1GB", **{option: 2})


@pytest.mark.parametrize("name", ["BatchedJacobian", "BatchedHessian"])
def test_a_budget_needs_the_compiled_call(name):
    """The plan is made for the compiled call; op by op, memory follows no plan."""
    with pytest.raises(ValueError, match=rf"{name}: max_memory='1GB' plans .* jit=False"):
        TRANSFORMS[name](max_memory="1GB", jit=False)


@pytest.mark.parametrize("name", ["ChunkedVmap", "Microbatcher"])
def test_maps_need_a_size_or_a_budget(name):
    with pytest.raises(ValueError, match=rf"{name}: give one of .* and `max_memory`"):
        TRANSFORMS[name]()


# --- plans ------------------------------------------------------------------------------


def test_plan_without_a_budget_describes_the_count():
    w = jax.device_put(np.linspace(-1, 1, 40))
    plan = zm.BatchedHessian(outer_loss, nbatches=4).plan(w)
    assert (plan.block_size, plan.num_blocks, plan.total) == (10, 4, 40)
    assert plan.output_bytes == 40 * 40 * 8 and plan.budget_bytes is None and plan.fits
    assert plan.peak_bytes >= plan.output_bytes
    assert "4 block(s) of 10 of 40 variables" in repr(plan) and "no budget" in repr(plan)


def jacobian_fn(w):
    return jnp.tanh(DATA[:30, : w.shape[0]] @ w) * jnp.sum(w**2)


# Each transform and mode under a budget below its whole call's peak (a share of it that
# holds one item per block): `(transform, fn, mode, variables, share, reference)`.
DERIVATIVES = {
    "hessian-fwd": (zm.BatchedHessian, data_loss, "fwd", 120, 0.6, jax.hessian),
    "hessian-rev": (zm.BatchedHessian, data_loss, "rev", 120, 0.6, jax.hessian),
    "jacobian-fwd": (zm.BatchedJacobian, jacobian_fn, "fwd", 20, 0.9, jax.jacfwd),
    "jacobian-rev": (zm.BatchedJacobian, jacobian_fn, "rev", 20, 0.9, jax.jacrev),
}


@pytest.mark.parametrize("name", list(DERIVATIVES))
def test_derivative_budgets_fit_and_give_the_same_answer(name):
    transform_type, fn, mode, n, share, reference = DERIVATIVES[name]
    w = jax.device_put(np.linspace(-1, 1, n))
    budget = int(share * transform_type(fn, mode=mode).plan(w).peak_bytes)
    transform = transform_type(fn, mode=mode, max_memory=budget)
    plan = transform.plan(w)
    assert plan.fits and plan.peak_bytes <= budget and plan.num_blocks > 1
    assert plan.peak_bytes == measured_peak(transform, w)
    assert plan.what == ("output elements" if name == "jacobian-rev" else "variables")
    assert repr(plan).endswith("fits)")
    close(transform(w), jax.jit(reference(fn))(w))


def test_maps_and_microbatches_fit():
    xs = jax.device_put(np.random.default_rng(1).normal(size=(24, 200)))
    one = zm.ChunkedVmap(heavy, chunk_size=1).plan(xs).peak_bytes
    transform = zm.ChunkedVmap(heavy, max_memory=int(4.5 * one))
    plan = transform.plan(xs)
    # The largest chunk that fits is 4; a smaller one may be chosen if it timed faster.
    assert plan.fits and plan.block_size <= 4 and plan.what == "elements"
    assert plan.peak_bytes <= 4.5 * one
    close(transform(xs), jax.jit(jax.vmap(heavy))(xs))

    def loss(w, x):
        return jnp.mean(jax.vmap(heavy)(x * w))

    w = jnp.ones(200)
    grad = zm.Microbatcher(jax.grad(loss), max_memory=int(4.5 * one), argnums=1, accumulator="mean")
    plan = grad.plan(w, xs)
    assert plan.fits and plan.what == "examples" and plan.num_blocks > 1
    close(grad(w, xs), jax.jit(jax.grad(loss))(w, xs))


def test_too_small_a_budget_is_refused_before_anything_runs():
    calls = []

    def counted(w):
        jax.debug.callback(lambda: calls.append(1))
        return outer_loss(w)

    w = jax.device_put(np.linspace(-1, 1, 20))
    # The Hessian alone is 3.2 kB.
    transform = zm.BatchedHessian(counted, max_memory="2kB", strategy="linearize")
    with pytest.raises(zm.MemoryBudgetError) as info:
        transform(w)
    assert isinstance(info.value, ValueError) and calls == []
    message = str(info.value)
    assert "BatchedHessian: max_memory=2 kB cannot hold even one item per block" in message
    assert "the Hessian alone is 3.2 kB" in message and "More blocks are not enough" in message
    with pytest.raises(zm.MemoryBudgetError):
        transform.plan(w)


def test_inside_jit_and_filter_jit():
    w = jax.device_put(np.linspace(-1, 1, 60))
    whole = zm.BatchedHessian(outer_loss).plan(w).peak_bytes
    transform = zm.BatchedHessian(outer_loss, max_memory=int(0.7 * whole))
    expected = jax.jit(jax.hessian(outer_loss))(w)
    close(jax.jit(transform)(w), expected)
    close(eqx.filter_jit(lambda t, w: t(w))(transform, w), expected)
    # Planning under a trace sees the same shapes, so it plans the same blocks.
    planned = []
    jax.jit(lambda w: planned.append(transform.plan(w)) or w)(w)
    assert planned[0].block_size == transform.plan(w).block_size


def test_plans_are_cached():
    w = jax.device_put(np.linspace(-1, 1, 50))
    transform = zm.BatchedHessian(data_loss, max_memory="100kB")
    assert transform.plan(w) is transform.plan(w)
    assert transform.plan(w) is not transform.plan(jax.device_put(np.linspace(-1, 1, 51)))


def test_a_budget_on_the_outer_transform_bounds_the_stack():
    data = jax.device_put(np.random.default_rng(2).normal(size=(16, 5, 30)))
    w = jax.device_put(np.linspace(-1, 1, 30))
    per_example = zm.ChunkedVmap(
        zm.BatchedHessian(smooth_loss, nbatches=3), in_axes=(None, 0), chunk_size=1
    )
    one = per_example.plan(w, data).peak_bytes
    stack = dataclasses.replace(per_example, chunk_size=None, max_memory=int(4.5 * one))
    plan = stack.plan(w, data)
    assert plan.fits and plan.peak_bytes <= 4.5 * one and plan.block_size > 1
    close(stack(w, data), jax.jit(jax.vmap(jax.hessian(smooth_loss), in_axes=(None, 0)))(w, data))


def test_budgets_on_both_layers():
    data = jax.device_put(np.random.default_rng(3).normal(size=(8, 5, 30)))
    w = jax.device_put(np.linspace(-1, 1, 30))
    inner = zm.BatchedHessian(smooth_loss, max_memory="40kB")
    stack = zm.ChunkedVmap(inner, in_axes=(None, 0), max_memory="400kB")
    assert stack.plan(w, data).fits
    close(stack(w, data), jax.jit(jax.vmap(jax.hessian(smooth_loss), in_axes=(None, 0)))(w, data))


# --- the second strategy: fn evaluated again inside each block ---------------------------


def long_simulation(x):
    """A long scan: one linearisation keeps every step's state as residuals."""

    def step(state, _):
        return jnp.tanh(1.1 * state + 0.05 * jnp.roll(state, 1)), None

    final, _ = jax.lax.scan(step, x, None, length=400)
    return final[:4]


def squared_simulation(x):
    return jnp.sum(long_simulation(x) ** 2)


# The references, one program each for every test below (`jax.jacfwd(long_simulation)`
# written in a test would be a new function, and a new compilation, at every call).
simulation_jacobian = jax.jit(jax.jacfwd(long_simulation))
simulation_hessian = jax.jit(jax.hessian(squared_simulation))


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_recompute_gives_the_same_answer(mode):
    x = jax.device_put(np.linspace(-0.5, 0.5, 16))
    for strategy in ("linearize", "recompute"):
        J = zm.BatchedJacobian(long_simulation, mode=mode, strategy=strategy, nbatches=4)(x)
        close(J, simulation_jacobian(x), rtol=1e-10, atol=1e-12)
    H = zm.BatchedHessian(squared_simulation, mode=mode, strategy="recompute", nbatches=3)(x)
    close(H, simulation_hessian(x), rtol=1e-9, atol=1e-10)


def test_the_planner_recomputes_when_the_residuals_do_not_fit():
    x = jax.device_put(np.linspace(-0.5, 0.5, 16))
    keep = zm.BatchedJacobian(long_simulation, mode="fwd", batch_size=1, strategy="linearize")
    again = zm.BatchedJacobian(long_simulation, mode="fwd", batch_size=1, strategy="recompute")
    kept, recomputed = keep.plan(x).peak_bytes, again.plan(x).peak_bytes
    assert recomputed < kept  # 400 steps of residuals against one block's tangents
    budget = (kept + recomputed) // 2
    transform = zm.BatchedJacobian(long_simulation, mode="fwd", max_memory=budget)
    plan = transform.plan(x)
    assert plan.strategy == "recompute" and plan.fits
    close(transform(x), simulation_jacobian(x), rtol=1e-10, atol=1e-12)
    with pytest.raises(zm.MemoryBudgetError):
        zm.BatchedJacobian(
            long_simulation, mode="fwd", max_memory=budget, strategy="linearize"
        ).plan(x)


def test_strategy_is_checked():
    with pytest.raises(ValueError, match="BatchedHessian: `strategy` must be one of"):
        zm.BatchedHessian(outer_loss, strategy="sometimes")


# --- saving ------------------------------------------------------------------------------


def test_save_and_load_keep_the_budget_as_written(tmp_path):
    for transform in (
        zm.BatchedHessian(jax.nn.logsumexp, max_memory="1.5GB", strategy="recompute"),
        zm.ChunkedVmap(jnp.sin, max_memory="auto"),
        zm.Microbatcher(jnp.sum, max_memory=2**20),
    ):
        zm.save(tmp_path / "t.zm", transform)
        loaded = zm.load(tmp_path / "t.zm")
        assert loaded.max_memory == transform.max_memory
        assert type(loaded.max_memory) is type(transform.max_memory)
        assert loaded == transform
