"""A planned call compiles its program once: the executable compiled to plan the chosen
blocks is the one the call runs, and a second call compiles nothing."""

import contextlib
import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close

import zodmem as zm
from zodmem import _memo
from zodmem._jaxpr import largest_made_from
from zodmem._operators._vector_blocks import ProductBlocks
from zodmem._plan import _budget
from zodmem._plan._budget import compiled_plan

pytestmark = pytest.mark.usefixtures("float64")

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles():
    """The programs XLA compiles inside the block, one entry each."""
    compiled = []

    def listen(name, seconds, **kwargs):
        if name == BACKEND_COMPILE:
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def smooth_loss(w, data):
    return jnp.sum(jnp.tanh(data @ w) ** 2) + jnp.sum(w**4)


def outputs(w, data):
    return {"a": jnp.tanh(data @ w), "b": w[:3] ** 2}


def heavy(x):
    return jnp.sum(jnp.tanh(jnp.outer(x, x)) @ x)


DATA = jnp.asarray(np.cos(np.arange(40 * 30).reshape(40, 30) * 0.37))
W = jnp.linspace(-1, 1, 30)
XS = jnp.asarray(np.random.default_rng(0).normal(size=(12, 40)))


def _mean_grad(w, x):
    return jax.grad(lambda w: jnp.mean(jax.vmap(heavy)(x * w)))(w)


# (transform, args, reference); each budget differs from the others, so that no test finds
# a plan that another made.
CASES = {
    "hessian": (
        lambda budget: zm.BatchedHessian(smooth_loss, max_memory=budget),
        (W, DATA),
        jax.hessian(smooth_loss),
    ),
    "jacobian": (
        lambda budget: zm.BatchedJacobian(outputs, max_memory=budget, mode="fwd"),
        (W, DATA),
        jax.jacfwd(outputs),
    ),
    "vmap": (
        lambda budget: zm.ChunkedVmap(heavy, max_memory=budget),
        (XS,),
        jax.vmap(heavy),
    ),
    # An argument the program never reads is dropped when it is compiled: the call still
    # runs the planned executable.
    "unused argument": (
        lambda budget: zm.BatchedHessian(
            lambda w, data, unused: smooth_loss(w, data), max_memory=budget
        ),
        (W, DATA, jnp.arange(5.0)),
        jax.hessian(lambda w, data, unused: smooth_loss(w, data)),
    ),
    "microbatch": (
        lambda budget: zm.Microbatcher(
            lambda w, x: _mean_grad(w, x) * x.shape[0], max_memory=budget, argnums=1
        ),
        (jnp.ones(40), XS),
        lambda w, x: _mean_grad(w, x) * x.shape[0],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_planned_call_compiles_its_program_once(name):
    make, args, reference = CASES[name]
    # A budget of this test's own, so that no plan another test made serves it.
    transform = make(f"{7 + list(CASES).index(name)}.{len(name)}1 MB")
    with counting_compiles() as first:
        result = transform(*args)
    plan, executable = compiled_plan(transform._quiet, args, {})
    assert plan.compiles >= 1 and executable is not None
    # Planning compiled its candidates; the call itself compiled nothing more (a few
    # tiny programs may make the arguments, never a second copy of the call).
    assert len(first) == plan.compiles, (len(first), plan)
    with counting_compiles() as second:
        again = transform(*args)
    assert second == []
    close(result, jax.jit(reference)(*args))
    close(again, result)


def test_planned_products_compile_their_program_once():
    # Targets the squared error's Hessian never reads: the program drops them.
    def predict(w, data, targets):
        return jnp.tanh(data @ w)

    transform = zm.BatchedGGN(
        predict, zm.losses.SquaredError(weights=jnp.asarray(0.5)), max_memory="6.43 MB"
    )
    targets = jnp.ones(40)
    operator = transform.operator(W, DATA, targets)
    matrix = jnp.asarray(np.random.default_rng(1).normal(size=(30, 7)), W.dtype)
    with counting_compiles() as first:
        result = operator.mm(matrix)
    blocks = ProductBlocks.of(operator)
    plan, executable = compiled_plan(blocks._quiet, (matrix,), {})
    assert executable is not None
    assert len(first) == plan.compiles, (len(first), plan)
    with counting_compiles() as second:
        again = operator.mm(matrix)
    assert second == []
    dense = transform(W, DATA, targets)
    close(result, dense @ matrix)
    close(again, result)
    # Another width is planned for itself; the first width's program is still kept.
    close(operator.mm(matrix[:, :3]), dense @ matrix[:, :3])
    with counting_compiles() as third:
        operator.mm(matrix)
    assert third == []
    # Under an outer jit the products are traced into the outer program.
    close(eqx.filter_jit(lambda op, m: op.mm(m))(operator, matrix), result)
    # What the operator kept goes with it.
    kept = len(_memo._MEMOS)
    del operator, blocks
    gc.collect()
    assert len(_memo._MEMOS) == kept - 1


def test_the_executable_keeps_weak_types_as_the_call_does():
    # A Python number made an array is weakly typed: the planned program promotes it
    # as the unplanned one does (float32 data times a weak scalar stays float32).
    def loss(w, scale):
        return jnp.sum(jnp.tanh(w * scale) ** 2)

    w = jnp.linspace(-1, 1, 8, dtype=jnp.float32)
    scale = jnp.asarray(2.0)
    planned = zm.BatchedHessian(loss, max_memory="9.87MB")(w, scale)
    by_count = zm.BatchedHessian(loss, nbatches=2)(w, scale)
    assert planned.dtype == by_count.dtype == jnp.float32
    close(planned, by_count)


def test_a_call_under_jit_is_traced_into_the_outer_program():
    transform = zm.BatchedHessian(smooth_loss, max_memory="8.73 MB")
    with counting_compiles() as compiled:
        result = jax.jit(transform)(W, DATA)
    plan = compiled_plan(transform._quiet, (W, DATA), {})[0]
    # The candidates, then the outer program (which holds the call): no copy of its own.
    assert len(compiled) == plan.compiles + 1
    close(result, jax.jit(jax.hessian(smooth_loss))(W, DATA))


def test_a_call_with_a_progress_bar_compiles_the_bar_into_its_program(capsys):
    transform = zm.BatchedHessian(smooth_loss, max_memory="8.91 MB", progress=True)
    result = transform(W, DATA)
    close(result, jax.jit(jax.hessian(smooth_loss))(W, DATA))
    assert "BatchedHessian" in capsys.readouterr().err


def test_planned_programs_are_compiled_with_xlas_defaults(monkeypatch):
    # Only a probe, compiled for its memory and never run, takes other options: every
    # program a call runs (a transform's, an estimate's) keeps XLA's defaults.
    names, seen = [], []
    trace_call, compile_traced = _budget.trace_call, _budget.compile_traced

    def tracing(*args):
        names.append(type(args[1]).__name__)
        return trace_call(*args)

    def recording(traced, options=None):
        seen.append(options)
        return compile_traced(traced, options)

    monkeypatch.setattr(_budget, "trace_call", tracing)
    monkeypatch.setattr(_budget, "compile_traced", recording)
    probe = _budget.policy_of(jax.default_backend()).probe_options
    transform = zm.BatchedHessian(smooth_loss, max_memory="6.47 MB")
    estimate, _ = zm.trace(
        transform.operator(W, DATA), method="hutchinson", num_probes=9, key=jax.random.key(3)
    )
    assert jnp.isfinite(estimate)
    transform(W, DATA)
    zm.diagonal(zm.BatchedHessian(smooth_loss, max_memory="6.48 MB").operator(W, DATA))
    assert set(names) >= {"Probes", "BatchedHessian"}, names
    assert seen and all(options in (None, probe) for options in seen), seen


@pytest.mark.parametrize("name", ["hessian", "jacobian", "ggn"])
def test_planning_traces_fn_once_for_all_its_candidates(name):
    # Each candidate block size is a program of its own, and each differentiates `fn`;
    # `fn` itself is traced once for them all (and for the call), and JAX differentiates
    # the program it keeps.
    traces = []

    def counted(w, data):
        traces.append(1)
        return smooth_loss(w, data) if name == "hessian" else outputs(w, data)

    budget = f"7.9{len(name)} MB"
    make = {
        "hessian": lambda **options: zm.BatchedHessian(counted, **options),
        "jacobian": lambda **options: zm.BatchedJacobian(counted, mode="rev", **options),
        "ggn": lambda **options: zm.BatchedGGN(
            counted, lambda out, data: jnp.sum(out["a"] ** 4) + jnp.sum(out["b"] ** 2), **options
        ),
    }[name]
    transform = make(max_memory=budget)
    result = transform(W, DATA)
    plan = compiled_plan(transform._quiet, (W, DATA), {})[0]
    assert plan.compiles >= 2
    assert len(traces) == 1, len(traces)
    # Without jit the call runs op by op: `fn` is called as it is, and gives the same.
    eager = make(nbatches=2, jit=False)(W, DATA)
    close(eager, result)


@pytest.mark.parametrize(
    "count, size, budget, sizes, compiles",
    [
        # Each element's intermediate (a 1,500 x 1,500 float64 matrix, 18 MB) passes the
        # temporaries a CPU block is given, as `fn`'s jaxpr shows: one item per block, the
        # plan, is compiled once, for the call, and no probe is compiled.
        (3, 1500, "61.3 MB", {1}, 1),
        # Each element's intermediate (600 x 600, 2.9 MB) caps a CPU block at a few
        # elements: the slope from the whole work's peak down to the output says so, and
        # the cap, which fits the budget, is the plan, compiled for the call. One item
        # per block is never compiled.
        (8, 600, "500 MB", {2, 3, 4, 5, 6, 7}, 2),
    ],
)
def test_a_plan_takes_few_compiles_where_the_cap_fits(count, size, budget, sizes, compiles):
    xs = jnp.asarray(np.random.default_rng(size).normal(size=(count, size)))
    transform = zm.ChunkedVmap(heavy, max_memory=budget)
    with counting_compiles() as compiled:
        result = transform(xs)
    plan = compiled_plan(transform._quiet, (xs,), {})[0]
    if jax.default_backend() == "cpu":
        assert plan.block_size in sizes and plan.compiles == compiles, plan
    assert len(compiled) == plan.compiles
    close(result, jax.jit(jax.vmap(heavy))(xs))


def test_planning_pauses_the_cycle_collector_and_restores_it():
    seen = []
    original = _budget.compile_traced

    def compile_traced(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(_budget, "compile_traced", compile_traced)
                zm.ChunkedVmap(heavy, max_memory=f"{40 + enabled} MB")(XS)
            assert gc.isenabled() == enabled
        finally:
            gc.enable()
    assert seen and not any(seen)


def test_one_item_per_block_first_falls_back_to_the_search_where_it_does_not_fit():
    # One element's 18 MB intermediate says one item per block; under a budget that
    # cannot hold it the search is made as before, and refuses with the least budget.
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(3, 1500)))
    transform = zm.ChunkedVmap(heavy, max_memory="15 MB")
    with pytest.raises(zm.MemoryBudgetError, match="cannot hold even one item per block"):
        transform.plan(xs)


def test_largest_value_made_from_the_mapped_inputs():
    def fn(x, table):
        grid = jnp.outer(x, x)  # made from x: 8 x 8 float32, 256 bytes
        fixed = table @ table.T  # made from the table alone: not counted
        return jnp.sum(jnp.tanh(grid)) + jnp.sum(fixed), x * 2.0  # outputs: not counted

    x, table = jnp.ones(8, jnp.float32), jnp.ones((50, 3), jnp.float32)
    jaxpr = jax.make_jaxpr(fn)(x, table).jaxpr
    assert largest_made_from(jaxpr, [True, False]) == 8 * 8 * 4
    assert largest_made_from(jaxpr, [False, True]) == 50 * 50 * 4
    assert largest_made_from(jaxpr, [False, False]) == 0


def test_chunked_vmap_reads_one_elements_largest_value():
    def fn(x, scale):
        return jnp.sum(jnp.tanh(jnp.outer(x, x)) * scale)

    xs = jnp.ones((5, 30))
    transform = zm.ChunkedVmap(fn, in_axes=(0, None), max_memory="1GB")
    assert transform.item_bytes(xs, 2.0) == 30 * 30 * xs.dtype.itemsize
    # The mapped axis need not lead: one element is a column here.
    columns = zm.ChunkedVmap(fn, in_axes=(1, None), max_memory="1GB")
    assert columns.item_bytes(jnp.ones((30, 5)), 2.0) == 30 * 30 * xs.dtype.itemsize
    # Nothing mapped: nothing to read.
    assert zm.ChunkedVmap(fn, in_axes=None, max_memory="1GB").item_bytes(xs, 2.0) is None
