"""What a plan is: the work a transform cuts into blocks (`Work`), the plan of a call
(`Plan`), and the refusal of a budget that cannot hold one item per block
(`MemoryBudgetError`). The planner that makes them is `_budget`."""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx

from ._memory import format_bytes, format_bytes_up

__all__ = ["MemoryBudgetError", "Plan", "Work", "refusal"]


class Work(NamedTuple):
    """What a transform's call cuts into blocks: `total` items (`what` they are), the
    result's name for messages, and the block size its count options give."""

    total: int
    what: str
    output_what: str
    block_size: int

    def per_device(self, split: Any) -> Work:
        """The work of one device when `split` (a `Split`, or `None`) spreads the items
        over devices: its share of the items, in blocks of the same size at most."""
        if split is None or split.dim is None or self.total % split.count:
            return self  # not split (or refused when the call is traced)
        total = self.total // split.count
        what = f"{self.what} on each of {split.count} devices"
        return self._replace(total=total, what=what, block_size=min(self.block_size, total))


class MemoryBudgetError(ValueError):
    """A `max_memory` budget that cannot hold even one item per block.

    A `ValueError`, raised before any computation, that names the budget, the least
    that would do (and how much of it the result alone takes) and the way out. Its
    `budget_bytes` is the budget refused and `suggested_bytes` the least budget that
    plans, in bytes (`None` where it does not say).

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        try:  # the 40 kB Hessian alone is more than the budget
            zm.BatchedHessian(lambda w: jnp.sum(w**3), max_memory="1kB")(jnp.ones(100))
        except zm.MemoryBudgetError as error:
            print(error)
        ```
    """

    budget_bytes: int | None = None
    suggested_bytes: int | None = None


class Plan(eqx.Module):
    """How a transform will cut its work, and the memory its call is predicted to take.

    `transform.plan(*args, **kwargs)` returns one without running anything.

    - `block_size`, `num_blocks`: the items per block and the number of blocks.
    - `total`: the items (`what`: variables, output elements, elements, examples).
    - `peak_bytes`: the predicted peak of the call's own buffers (output and XLA's
      temporaries, from `memory_analysis()` of the compiled call).
    - `output_bytes`: the bytes of the result.
    - `budget_bytes`: the budget the plan was made for (`None` without one).
    - `budget_source`: where that figure came from: `"given"` for a budget written as
      bytes, and for `"auto"` the memory it read (the device's allocator, the machine's
      `MemAvailable`, or the container's cgroup limit where that leaves less).
    - `compiles`: how many candidate calls were compiled to make the plan (a plan taken
      from the cache of plans already made says how many it took then).
    - `compile_bytes`: an estimate of the host memory compiling took: the most that
      compiling one candidate grew this process's resident memory (`None` where that
      cannot be read). It is measured, so it varies from process to process; it is
      reported beside the plan and never counted against the budget, and it is no part
      of the choice (`decision`), which is the same in every process.
    - `strategy`: for derivatives, `"linearize"` (one linearisation of `fn` kept for every
      block) or `"recompute"` (`fn` evaluated again inside each block); `None` otherwise.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        plan = zm.BatchedHessian(jnp.sum, nbatches=4).plan(jnp.ones(8))
        assert (plan.block_size, plan.num_blocks, plan.total) == (2, 4, 8)
        ```
    """

    owner: str = eqx.field(static=True)
    what: str = eqx.field(static=True)
    total: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    peak_bytes: int = eqx.field(static=True)
    output_bytes: int = eqx.field(static=True)
    budget_bytes: int | None = eqx.field(static=True, default=None)
    strategy: str | None = eqx.field(static=True, default=None)
    budget_source: str | None = eqx.field(static=True, default=None)
    compiles: int = eqx.field(static=True, default=0)
    compile_bytes: int | None = eqx.field(static=True, default=None)

    @property
    def decision(self) -> tuple:
        """What the plan chose and predicts, the same in every process that plans the
        same program, budget and devices: `(block_size, num_blocks, strategy,
        peak_bytes, output_bytes, budget_bytes)`."""
        return (
            self.block_size,
            self.num_blocks,
            self.strategy,
            self.peak_bytes,
            self.output_bytes,
            self.budget_bytes,
        )

    @property
    def num_blocks(self) -> int:
        return -(-self.total // self.block_size) if self.total else 0

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget (always, without one)."""
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes

    def __repr__(self) -> str:
        budget = (
            "no budget"
            if self.budget_bytes is None
            else f"budget {format_bytes(self.budget_bytes)}"
            + ("" if self.budget_source in (None, "given") else f" ({self.budget_source})")
            + (": fits" if self.fits else ": does NOT fit")
        )
        how = f", strategy={self.strategy!r}" if self.strategy else ""
        return (
            f"Plan({self.owner}: {self.num_blocks} block(s) of {self.block_size} of "
            f"{self.total} {self.what}{how}; peak {format_bytes(self.peak_bytes)}, output "
            f"{format_bytes(self.output_bytes)}; {budget})"
        )


def refusal(
    owner: str,
    budget: int,
    least: int,
    *,
    output_bytes: int,
    output_what: str,
    suggested: int,
    note: str = "",
) -> MemoryBudgetError:
    """The error for a budget that cannot hold one item per block: `least` is the least
    peak of the call's buffers, `suggested` the least budget that plans; `note` is
    added at the end."""
    way = f"a budget of at least {format_bytes_up(suggested)}"
    if output_bytes >= 0.5 * suggested:
        way += (
            f", or less work per call (the {output_what} itself takes most of it: fewer "
            "variables or outputs per call, each call's result moved off the device)"
        )
    error = MemoryBudgetError(
        f"{owner}: max_memory={format_bytes(budget)} cannot hold even one item per block: "
        f"the call's buffers need at least {format_bytes(least)}, of which the "
        f"{output_what} alone is {format_bytes(output_bytes)}. More blocks are not enough; "
        f"the way out is {way}.{note}"
    )
    error.budget_bytes, error.suggested_bytes = budget, suggested
    return error
