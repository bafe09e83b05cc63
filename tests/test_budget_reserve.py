"""What a budget bounds on a CPU: the call's buffers and what compiling and running it
adds to the process, measured while planning; a budget too small to hold both is refused
with a budget that plans."""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import close

import zodmem as zm
from zodmem._budget import least_budget, usable_bytes
from zodmem._memory import budget_bytes


def loss(w, data):
    return jnp.mean(jnp.tanh(data @ w) ** 2)


W, DATA = jnp.linspace(-1, 1, 300), jnp.ones((64, 300))


def test_the_process_extra_is_kept_whatever_the_budget():
    """On a CPU the reserve is no share of the budget: 45 MB with 30 MB of compile heap
    leaves less than 15 MB for the call's buffers."""
    mb = 10**6
    assert usable_bytes(45 * mb, "cpu", 30 * mb) <= 15 * mb
    assert usable_bytes(45 * mb, "cpu", None) <= 5 * mb
    assert usable_bytes(1000 * mb, "gpu") == 980 * mb
    for platform, compile_bytes in (("cpu", 30 * mb), ("cpu", None), ("gpu", None)):
        least = least_budget(12 * mb, platform, compile_bytes)
        assert usable_bytes(least, platform, compile_bytes) >= 12 * mb
        assert usable_bytes(least - 2, platform, compile_bytes) < 12 * mb


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the compile heap of a CPU process")
def test_a_budget_below_the_process_extra_is_refused_with_one_that_plans():
    # The 360 kB Hessian fits a budget of 5 MB by XLA's count, but compiling it alone
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
    close(enough(W, DATA), jax.hessian(loss)(W, DATA), rtol=1e-5)
