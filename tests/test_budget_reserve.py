"""What a budget bounds: the compiled call's own buffers as XLA counts them, less a share
for the allocator's slack, on every platform. A plan depends on the program, the budget
and the devices only, so it is the same in a fresh process, in one whose heap differs,
and in every process of a job; a refusal names the least budget that plans, written
rounded up, and that budget plans."""

import json
import re
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import close
from hypothesis import given, settings, strategies as st

import zodmem as zm
from zodmem._plan._budget import RESERVE_SHARE, policy_of
from zodmem._plan._memory import budget_bytes, format_bytes_up
from zodmem._plan._plans import MemoryBudgetError, refusal

MB = 10**6
SWEEP = Path(__file__).resolve().parent / "plan_sweep.py"


def loss(w, data):
    return jnp.mean(jnp.tanh(data @ w) ** 2)


W, DATA = jnp.linspace(-1, 1, 60), jnp.ones((64, 60))


def test_the_reserve_is_a_share_of_the_budget_on_every_platform():
    kept = int((1 - RESERVE_SHARE) * 100 * MB)
    assert policy_of("cpu").usable(100 * MB) == policy_of("gpu").usable(100 * MB) == kept
    assert policy_of("tpu").usable(100 * MB) == kept
    # Nothing of the process is kept beside it: a budget of a few kB holds a call of a
    # few kB.
    assert policy_of("cpu").usable(5000) == int((1 - RESERVE_SHARE) * 5000)
    # A block's temporaries are capped on a CPU only.
    assert policy_of("cpu").block_bytes is not None and policy_of("gpu").block_bytes is None


@settings(max_examples=200)
@given(peak=st.integers(1, 10**13), platform=st.sampled_from(["cpu", "gpu"]))
def test_the_least_budget_is_the_smallest_that_holds_the_peak(peak, platform):
    policy = policy_of(platform)
    least = policy.least(peak)
    assert policy.usable(least) >= peak
    assert policy.usable(least - 1) < peak


def test_a_refusal_names_the_budget_the_least_and_a_budget_that_plans():
    error = refusal(
        "BatchedHessian",
        50_000,
        81_234,
        output_bytes=80_000,
        output_what="Hessian",
        suggested=82_893,
    )
    assert isinstance(error, MemoryBudgetError) and isinstance(error, ValueError)
    message = str(error)
    assert message.startswith(
        "BatchedHessian: max_memory=50 kB cannot hold even one item per block: the call's "
        "buffers need at least 81.2 kB, of which the Hessian alone is 80 kB. More blocks "
        "are not enough; the way out is a budget of at least 82.9 kB, or less work per "
        "call (the Hessian itself takes most of it"
    )
    assert message.endswith("each call's result moved off the device).")
    # A result under half the budget named: more memory is the only way out given.
    small = refusal(
        "ChunkedVmap", 50_000, 81_234, output_bytes=1000, output_what="output", suggested=82_893
    )
    assert str(small).endswith("the way out is a budget of at least 82.9 kB.")


@pytest.mark.parametrize(
    "size, written",
    [
        (1, "1 B"),
        (1.2, "2 B"),
        (999, "999 B"),
        (1000, "1.00 kB"),
        (1001, "1.01 kB"),
        (999_999, "1000 kB"),
        (1_500_000, "1.50 MB"),
        (12_345_678, "12.4 MB"),
        (100_000_001, "101 MB"),
        (2.5e9, "2.50 GB"),
    ],
)
def test_sizes_are_written_rounded_up(size, written):
    assert format_bytes_up(size) == written


UNITS = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9}


@settings(max_examples=200)
@given(st.one_of(st.integers(1, 10**13), st.floats(1, 1e13)))
def test_a_size_written_rounded_up_is_at_least_the_size_and_less_than_a_digit_over(size):
    number, unit = format_bytes_up(size).split()
    written = Fraction(Decimal(number)) * UNITS[unit]
    digit = Fraction(Decimal(1).scaleb(Decimal(number).as_tuple().exponent)) * UNITS[unit]
    # Float noise of a millionth of the last digit is not rounded up.
    assert written >= Fraction(size) - digit / 10**6
    assert written - Fraction(size) < digit


def suggested(message: str) -> str:
    return re.search(r"a budget of at least ([0-9.]+ [kMG]?B)", message).group(1)


@pytest.mark.parametrize("n", [60, 300])
def test_a_refused_budget_names_the_least_that_plans(n):
    # The Hessian alone does not fit in 10 kB; the budget the refusal names plans, its
    # peak within it, and gives jax.hessian's answer, and a budget 3% below it (more
    # than its rounding up) is refused.
    w, data = jnp.linspace(-1, 1, n), jnp.ones((64, n))
    with pytest.raises(zm.MemoryBudgetError) as info:
        zm.BatchedHessian(loss, max_memory="10kB").plan(w, data)
    enough = zm.BatchedHessian(loss, max_memory=suggested(str(info.value)))
    plan = enough.plan(w, data)
    assert plan.fits and plan.peak_bytes <= budget_bytes(enough.max_memory)
    close(enough(w, data), jax.jit(jax.hessian(loss))(w, data), rtol=1e-5)
    less = int(0.97 * budget_bytes(enough.max_memory))
    with pytest.raises(zm.MemoryBudgetError):
        zm.BatchedHessian(loss, max_memory=less).plan(w, data)


def test_small_budgets_plan_and_hold_by_xlas_count():
    # A microbatched loss of a 4-byte result under an outer jit in 10 MB, and a Hessian
    # whose blocks need less than its 14.4 kB output beside them in 25 kB.
    x = jnp.linspace(-1, 1, 4000).reshape(200, 20)
    w = jnp.linspace(0, 1, 20)
    batch = zm.Microbatcher(lambda w, x: jnp.sum(jnp.tanh(x @ w)), max_memory="10MB", argnums=1)
    plan = batch.plan(w, x)
    assert plan.fits and plan.peak_bytes <= 10 * MB
    close(eqx.filter_jit(batch)(w, x), jnp.sum(jnp.tanh(x @ w)), rtol=1e-5)
    hessian = zm.BatchedHessian(loss, max_memory="25kB")
    plan = hessian.plan(W, DATA)
    assert plan.fits and plan.peak_bytes <= 25_000 and plan.num_blocks > 1
    close(eqx.filter_jit(hessian)(W, DATA), jax.jit(jax.hessian(loss))(W, DATA), rtol=1e-5)


def test_a_plan_does_not_depend_on_the_traced_or_concrete_call():
    transform = zm.BatchedHessian(loss, max_memory="40kB")
    eager = transform.plan(W, DATA).decision
    traced = []
    jax.jit(lambda w, d: traced.append(transform.plan(w, d).decision) or w)(W, DATA)
    assert traced == [eager]


def sweep_in_a_process(pairs: list[tuple[int, int]], tmp_path: Path) -> list[str]:
    """The decisions on `(case, budget)` pairs of a fresh process that compiles a larger
    program first, so that its heap differs from this one's."""
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(pairs))
    done = subprocess.run(
        [sys.executable, str(SWEEP), "--warm", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_plans_and_suggestions_are_the_same_in_every_process(tmp_path):
    """Random problems at random budgets: every refusal names a budget that plans, here
    and in a fresh process that compiled a larger program first, which plans every
    budget of the sweep as this process (with the history of a test run) does."""
    sys.path.insert(0, str(SWEEP.parent))
    try:
        import plan_sweep
    finally:
        sys.path.pop(0)
    decided = {}
    for index in range(plan_sweep.NUM_CASES):
        budget = plan_sweep.budget_of(index)
        decided[index, budget] = decision = plan_sweep.decide(index, budget)
        if "cannot hold" in decision:
            enough = budget_bytes(suggested(decision))
            assert enough > budget
            decided[index, enough] = planned = plan_sweep.decide(index, enough)
            assert "cannot hold" not in planned, (index, decision, planned)
    refused = len(decided) - plan_sweep.NUM_CASES
    assert 0 < refused < plan_sweep.NUM_CASES, decided  # the sweep sees both
    assert sweep_in_a_process(list(decided), tmp_path) == list(decided.values())
