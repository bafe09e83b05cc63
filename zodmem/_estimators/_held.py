"""An estimator's whole iteration checked against its operator's budget before it runs.

Lanczos holds a basis of `max_steps` vectors beside each product: on a model sharded
over devices, each device holds its share of every vector. Where the operator's
transform has a `max_memory`, the iteration's program is compiled first and XLA's own
count of what one device holds while it runs (the basis, the product's temporaries and
the rest) is compared with the budget; a program that does not fit is refused in words
that name the figure per device and the least budget that holds it, and one that fits is
run from the executable compiled for the check, compiling nothing again.

The iteration is compiled lean (`zodmem._plan._lean`): its time is products of one
vector at a time, which the lean options make no slower, and its compile sets its peak
on a CPU (`docs/benchmarks.md` has the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._memo import BoundedCache
from .._operators._operator import BlockedOperator
from .._operators._options import options_of
from .._plan._budget import call_key, policy_of
from .._plan._compiled import abstract, compile_call, run_compiled, runs_compiled
from .._plan._lean import lean_jit, lean_options
from .._plan._memory import budget_of, format_bytes, format_bytes_up
from .._plan._plans import MemoryBudgetError

__all__ = ["operator_budget", "run_within_budget"]

# The iterations compiled for a check, by their call's key: a later call of the same
# shapes runs the same executable (as `jax.jit`'s own cache would).
_COMPILED = BoundedCache(16)


def operator_budget(operator: Any) -> Any:
    """The `max_memory` of the transform that made `operator` (a zodmem operator), or
    `None` where it has none."""
    if isinstance(operator, BlockedOperator):
        return options_of(operator.transform).max_memory
    return None


def run_within_budget(
    program: Callable[..., Any],
    inputs: tuple,
    *,
    budget: Any,
    owner: str,
    held: str,
) -> Any:
    """`program(*inputs)`, compiled with the platform's lean options: without a budget,
    as `lean_jit` compiles it; with one, compiled first and refused (`MemoryBudgetError`)
    where XLA's count of its peak on a device is over the budget's usable part, else run
    from that executable (under an outer `jit`, traced into it). `held` says what the
    program keeps, for the message."""
    budget_bytes, _ = budget_of(budget)
    if budget_bytes is None:
        return lean_jit(program)(*inputs)
    key = call_key((program, inputs), budget_bytes)
    compiled = _COMPILED.get(key)
    if compiled is None:
        # Kept without its traced program, which holds the constants it closes over.
        compiled = compile_call(program, *abstract(inputs), options=lean_options())
        compiled = compiled._replace(program=None)
        _COMPILED.put(key, compiled)
    policy = policy_of(jax.default_backend())
    if compiled.peak_bytes > policy.usable(budget_bytes):
        least = policy.least(compiled.peak_bytes)
        error = MemoryBudgetError(
            f"{owner}: the operator's max_memory={format_bytes(budget_bytes)} cannot hold "
            f"the iteration: by XLA's count it needs {format_bytes(compiled.peak_bytes)} "
            f"per device ({held}, beside a product's temporaries). Give the operator's "
            f"transform max_memory of at least {format_bytes_up(least)} (bytes per "
            "device), or fewer `max_steps`."
        )
        error.budget_bytes, error.suggested_bytes = budget_bytes, least
        raise error
    if runs_compiled(compiled.executable, *inputs):
        return run_compiled(compiled.executable, *inputs)
    return lean_jit(program)(*inputs)
