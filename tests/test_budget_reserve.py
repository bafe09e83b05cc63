"""What a budget bounds: on an accelerator the call's buffers and a share for the
allocator's slack; on a CPU also what compiling and running the call adds to the process,
measured while planning. A budget too small to hold them is refused with one that plans,
written rounded up."""

import re
from decimal import Decimal
from fractions import Fraction

import jax
import jax.numpy as jnp
import pytest
from helpers import close
from hypothesis import given, settings, strategies as st

import zodmem as zm
from zodmem._budget import (
    RESERVE_CPU_BYTES,
    RESERVE_RUNTIME_BYTES,
    RESERVE_SHARE,
    MemoryBudgetError,
    least_budget,
    refusal,
    usable_bytes,
)
from zodmem._memory import budget_bytes, format_bytes_up

MB = 10**6


def loss(w, data):
    return jnp.mean(jnp.tanh(data @ w) ** 2)


W, DATA = jnp.linspace(-1, 1, 60), jnp.ones((64, 60))


def test_the_reserve_is_a_share_and_on_a_cpu_the_compile_heap_and_the_runtime():
    """On a CPU the process's extra is no share of the budget: 45 MB with 30 MB of compile
    heap leaves less than 15 MB for the call's buffers."""
    assert usable_bytes(45 * MB, "cpu", 30 * MB) <= 15 * MB
    assert usable_bytes(45 * MB, "cpu", None) <= 5 * MB
    kept = (1 - RESERVE_SHARE) * 100 * MB
    assert usable_bytes(100 * MB, "gpu") == usable_bytes(100 * MB, "tpu") == int(kept)
    # The heap a compile grows is the host's: it takes nothing of an accelerator's budget.
    assert usable_bytes(100 * MB, "gpu", 30 * MB) == int(kept)
    assert usable_bytes(100 * MB, "cpu", 20 * MB) == int(kept - 20 * MB - RESERVE_RUNTIME_BYTES)
    assert usable_bytes(100 * MB, "cpu") == int(kept - RESERVE_CPU_BYTES)
    # A budget below the reserve leaves nothing for the call: every plan is refused.
    assert usable_bytes(RESERVE_CPU_BYTES, "cpu") < 0


@settings(max_examples=200)
@given(
    peak=st.integers(1, 10**13),
    platform=st.sampled_from(["cpu", "gpu"]),
    compile_bytes=st.one_of(st.none(), st.integers(0, 10**10)),
)
def test_the_least_budget_is_the_smallest_that_holds_the_peak(peak, platform, compile_bytes):
    least = least_budget(peak, platform, compile_bytes)
    assert usable_bytes(least, platform, compile_bytes) >= peak
    assert usable_bytes(least - 1, platform, compile_bytes) < peak


def test_a_refusal_names_the_budget_the_least_and_a_budget_that_plans():
    error = refusal(
        "BatchedHessian",
        50_000,
        81_234,
        output_bytes=80_000,
        output_what="Hessian",
        suggested=123_456,
    )
    assert isinstance(error, MemoryBudgetError) and isinstance(error, ValueError)
    message = str(error)
    assert message.startswith(
        "BatchedHessian: max_memory=50 kB cannot hold even one item per block: the call "
        "needs at least 81.2 kB, of which the Hessian alone is 80 kB, and compiling and "
        "running it takes about 42.2 kB more beside it. More blocks are not enough; the way "
        "out is a budget of at least 124 kB, or less work per call (the Hessian itself "
        "takes most of it"
    )
    assert message.endswith("each call's result moved off the device).")
    # A result under half the budget named: more memory is the only way out given.
    small = refusal(
        "ChunkedVmap",
        50_000,
        81_234,
        output_bytes=1000,
        output_what="output",
        suggested=123_456,
    )
    assert str(small).endswith("the way out is a budget of at least 124 kB.")


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


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the compile heap of a CPU process")
def test_a_budget_below_the_process_extra_is_refused_with_one_that_plans():
    # The 14.4 kB Hessian fits a budget of 5 MB by XLA's count, but compiling it alone
    # grows a CPU process by more than that.
    transform = zm.BatchedHessian(loss, max_memory="5MB")
    with pytest.raises(zm.MemoryBudgetError) as info:
        transform.plan(W, DATA)
    message = str(info.value)
    assert "compiling and running it takes about" in message
    suggested = re.search(r"a budget of at least ([0-9.]+ [kMG]?B)", message).group(1)
    assert budget_bytes(suggested) > 5 * 10**6
    enough = zm.BatchedHessian(loss, max_memory=suggested)
    plan = enough.plan(W, DATA)
    assert plan.fits
    close(enough(W, DATA), jax.jit(jax.hessian(loss))(W, DATA), rtol=1e-5)


@pytest.fixture
def compiles_that_grow(monkeypatch):
    """The planner's reads of the process, faked: each compile grows the resident memory
    by `growth` and raises the process's peak `peak` over where it began."""
    from zodmem import _budget

    sizes = {"growth": 45 * MB, "peak": 40 * MB}
    base, reads = 500 * MB, []

    def resident():
        reads.append(None)
        # Read before a compile, then after it: the heap grew by `growth`.
        return base + (sizes["growth"] if len(reads) % 2 == 0 else 0)

    monkeypatch.setattr(_budget, "resident_bytes", resident)
    monkeypatch.setattr(_budget, "peak_resident_bytes", lambda: base + sizes["peak"], raising=False)
    _budget._PLANS.clear()
    yield sizes
    _budget._PLANS.clear()


def hessian_bytes(n):
    return n * n * jnp.zeros(()).dtype.itemsize


def test_a_concrete_call_holds_the_larger_of_the_compile_and_the_call(compiles_that_grow):
    """The compile heap is handed back before a call on concrete arguments runs, so its
    budget holds the call or a compile: at 60 MB, with 45 MB of heap grown by a compile
    whose peak is 40 MB, a Hessian of several MB plans, where compile and call together
    (plus the 10 MB runtime) do not fit."""
    n = 1000
    w, data = jnp.linspace(-1, 1, n), jnp.ones((8, n))
    budget = 60 * MB
    assert hessian_bytes(n) + 45 * MB + RESERVE_RUNTIME_BYTES > (1 - RESERVE_SHARE) * budget
    transform = zm.BatchedHessian(loss, max_memory=budget)
    plan = transform.plan(w, data)
    assert plan.fits and plan.peak_bytes > hessian_bytes(n)
    close(transform(w, data), jax.hessian(loss)(w, data), rtol=1e-5)


def test_a_traced_call_holds_the_compile_and_the_call_together(compiles_that_grow):
    """Under an outer `jax.jit` the call runs in that program, beside whatever heap its
    compile left: the same budget is refused there, naming one that holds both."""
    n = 1000
    w, data = jnp.linspace(-1, 1, n), jnp.ones((8, n))
    transform = zm.BatchedHessian(loss, max_memory=60 * MB)
    with pytest.raises(zm.MemoryBudgetError, match="a budget of at least"):
        jax.jit(transform)(w, data)


def test_a_compile_whose_peak_passes_the_budget_keeps_both_together(compiles_that_grow):
    """Where a compile's own peak does not fit the budget, the call on concrete arguments
    is planned beside the compile heap, as a traced one is."""
    compiles_that_grow["peak"] = 55 * MB
    n = 1000
    w, data = jnp.linspace(-1, 1, n), jnp.ones((8, n))
    with pytest.raises(zm.MemoryBudgetError):
        zm.BatchedHessian(loss, max_memory=60 * MB).plan(w, data)
