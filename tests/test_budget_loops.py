"""Plans of work that runs a loop (a recurrent model's `lax.scan`, an ODE solver's
`while`): the whole work in one block where it fits, with the last strategy (recomputed
in the block), and no cap of a block's temporaries; work without a loop is planned as
before."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import close

import zodmem as zm
from zodmem._operators._vector_blocks import ProductBlocks
from zodmem._plan import _budget
from zodmem._plan._compiled import trace_call, traced_loops

STEPS, SEQUENCES, WIDTH = 48, 32, 24


def recurrent_loss(weights, inputs):
    # A small recurrent cell run over the steps: the loop saves every step's state.
    def step(state, features):
        state = jnp.tanh(state @ weights["recurrent"] + features @ weights["input"])
        return state, None

    final, _ = jax.lax.scan(step, jnp.zeros((SEQUENCES, WIDTH)), jnp.swapaxes(inputs, 0, 1))
    return jnp.mean(final**2)


def mlp_loss(weights, inputs):
    hidden = jnp.tanh(inputs[:, 0] @ weights["input"])
    return jnp.mean((hidden @ weights["recurrent"]) ** 2)


def problem(vectors):
    rng = np.random.default_rng(0)
    weights = {
        "input": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / WIDTH, jnp.float32),
        "recurrent": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / WIDTH, jnp.float32),
    }
    inputs = jnp.asarray(rng.normal(size=(SEQUENCES, STEPS, WIDTH)), jnp.float32)
    matrix = jnp.asarray(rng.normal(size=(2 * WIDTH * WIDTH, vectors)), jnp.float32)
    return weights, inputs, matrix


def loops(call, *args):
    """Whether the planner reads a loop in `call(*args)`: from its trace, before any
    compile."""
    return traced_loops(trace_call(call, *args))


def test_a_traced_call_says_whether_it_runs_a_loop():
    weights, inputs, _ = problem(1)
    assert loops(jax.grad(recurrent_loss), weights, inputs)
    assert not loops(jax.grad(mlp_loss), weights, inputs)


def test_products_of_a_loop_are_planned_as_one_block_recomputed_in_one_compile():
    weights, inputs, matrix = problem(64)
    operator = zm.BatchedHessian(recurrent_loss, max_memory="2GB").operator(weights, inputs)
    plan = ProductBlocks.of(operator).plan(matrix)
    # Before, the cap of a CPU block's temporaries cut these products into many blocks.
    assert (plan.num_blocks, plan.block_size) == (1, 64), plan
    # In one block the strategies do the same work; the last keeps nothing beyond the
    # block, and its peak is the least or the same. It is compiled for the call, once.
    peaks = {
        strategy: ProductBlocks.of(operator.with_strategy(strategy))
        .with_block_size(64, strategy)
        .plan(matrix)
        .peak_bytes
        for strategy in ("linearize", "recompute")
    }
    assert plan.strategy == "recompute" and plan.compiles == 1, plan
    assert peaks["recompute"] <= peaks["linearize"], peaks
    # The same plan in every call: it is read from compiled programs only.
    again = zm.BatchedHessian(recurrent_loss, max_memory="2GB").operator(weights, inputs)
    assert ProductBlocks.of(again).plan(matrix) == plan
    dense = zm.BatchedHessian(recurrent_loss)(weights, inputs)
    close(operator.mm(matrix), dense @ matrix, rtol=1e-4, atol=1e-5)


def test_a_budget_too_small_for_one_block_of_a_loop_still_plans_blocks():
    weights, inputs, matrix = problem(64)
    operator = zm.BatchedHessian(recurrent_loss, max_memory="2GB").operator(weights, inputs)
    whole = ProductBlocks.of(operator).plan(matrix)
    tight = zm.BatchedHessian(recurrent_loss, max_memory=whole.peak_bytes // 2)
    plan = ProductBlocks.of(tight.operator(weights, inputs)).plan(matrix)
    assert plan.fits and plan.num_blocks > 1, plan


def test_products_without_a_loop_keep_the_linearisation():
    weights, inputs, matrix = problem(64)
    operator = zm.BatchedHessian(mlp_loss, max_memory="2GB").operator(weights, inputs)
    assert ProductBlocks.of(operator).plan(matrix).strategy == "linearize"


def test_a_loop_of_one_step_is_no_loop():
    # The whole work in one block runs the blocks' loop once: what it holds decides.
    weights, inputs, _ = problem(1)

    def once(body):
        def call(weights, inputs):
            return jax.lax.scan(lambda c, _: (c, body(weights, inputs)), 0.0, None, length=1)[1]

        return call

    assert not loops(once(jax.grad(mlp_loss)), weights, inputs)
    assert loops(once(jax.grad(recurrent_loss)), weights, inputs)


def test_an_estimators_probes_of_a_loop_keep_the_cap_on_a_block(capfd):
    # Products of vectors a caller gives are planned as one block where the program
    # loops; the probes an estimator draws are not: one block would hold every probe's
    # loop state at once.
    weights, inputs, _ = problem(1)
    operator = zm.BatchedHessian(recurrent_loss, max_memory="2GB").operator(weights, inputs)
    key = jax.random.key(0)
    planned = zm.trace(
        operator, method="hutchinson", num_probes=64, key=key, max_memory="2GB", progress=True
    )
    bar = capfd.readouterr().err
    blocks = bar.strip().split("\r")[-1]
    assert "64/64" not in blocks and "1/1" not in blocks, blocks
    whole = zm.trace(operator, method="hutchinson", num_probes=64, key=key, batch_size=64)
    close(planned, whole, rtol=1e-4, atol=1e-6)


def test_a_loop_s_plan_traces_its_work_once_and_compiles_it_once(monkeypatch):
    # Whether the work runs a loop is read from the trace that the plan then compiles,
    # for the call: one trace and one compile of the blocked work.
    traced, compiled = [], []
    trace_call, compile_traced = _budget.trace_call, _budget.compile_traced

    def tracing(*args):
        traced.append(trace_call(*args))
        return traced[-1]

    def compiling(trace, options=None):
        compiled.append((trace, options))
        return compile_traced(trace, options)

    monkeypatch.setattr(_budget, "trace_call", tracing)
    monkeypatch.setattr(_budget, "compile_traced", compiling)
    _budget._PLANS.clear()
    weights, inputs, matrix = problem(64)
    operator = zm.BatchedHessian(recurrent_loss, max_memory="2GB").operator(weights, inputs)
    ProductBlocks.of(operator).plan(matrix)
    assert len(traced) == 1 and compiled == [(traced[0], None)], (traced, compiled)
