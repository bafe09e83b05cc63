"""Planning blocks from a memory budget: the block size whose compiled call fits.

A transform with `max_memory` cuts its work (`total` items: variables, output elements,
batch elements) into blocks, like one given a count or a size; the planner here chooses
the size. It compiles the transform's whole call at candidate block sizes and reads
XLA's own account of the call's buffers (`memory_analysis()`): the output plus the
temporaries, on the device the call runs on. That is what the budget bounds, less a
small share kept for the allocator's slack (`Policy`), eagerly, under an outer `jit` and
in the estimators alike. Nothing runs to plan.

A plan is a function of the traced program, the budget and the devices only: it reads
nothing of the process's history, so every process of a job plans the same blocks and a
script plans the same in every run. The host memory the compiler takes while compiling
does not depend on the blocks chosen, so no plan could make it smaller; it is measured
and reported beside the plan (`Plan.compile_bytes`), never counted against the budget.

The planner (`Planner`) reads top to bottom:

1. candidates: the transform's call compiled at a block size (and, for derivatives, a
   strategy). The two ends of the search (one item per block, everything in one block)
   are probes, compiled without the backend's code optimisations, which come after XLA
   has assigned the buffers: they report the same memory at a fraction of the compile.
   Sizes between them are compiled for the call, since the first that fits is usually
   the plan; a chosen probe is compiled again for the call (and, should its memory then
   not fit, the search is made again from programs compiled for the call). The chosen
   candidate's executable is the one the call runs.
2. search (`_search.search`): the largest size that fits, in few compiles. Where the
   platform caps a block's temporaries (a CPU's caches) and the transform can read from
   its function that one item alone makes a value past that cap, one item per block is
   compiled first, for the call, and is the plan when it fits. Where the work's program
   runs a loop (read from its trace), the cap does not apply, and the whole work in one
   block comes first, with the last strategy, compiled for the call: one compile where
   it fits (`Planner.whole_work_first`), unless the work says otherwise
   (`loop_in_one_block`: an estimator's drawn probes).
3. reserve: the platform's policy (`policy_of`), in one place.
4. refusal: where no block size fits, `MemoryBudgetError` names the least budget that
   plans, found by planning it.

Plans are cached per transform, argument shapes, dtypes and placements, budget and
planned call, so their cost is paid by the first call only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from .._digest import program_digest
from .._engine._sharding import placement
from .._memo import BoundedCache
from ._compiled import (
    CPU_LEAN_OPTIONS,
    CPU_PROBE_OPTIONS,
    PROBE_OPTIONS,
    Compiled,
    abstract,
    collector_paused,
    compile_traced,
    trace_call,
    traced_loops,
)
from ._memory import budget_of, resident_bytes
from ._plans import MemoryBudgetError, Plan, refusal
from ._search import CPU_BLOCK_BYTES, search
from ._stored import StoredPlan, stored_plans

__all__ = [
    "CPU_BLOCK_BYTES",
    "Policy",
    "abstract",
    "call_key",
    "compiled_plan",
    "policy_of",
    "search",
]


# -- the platform's policy -------------------------------------------------------------


class Policy(NamedTuple):
    """How plans are made on a platform: the share of a budget kept for the allocator's
    slack, the most temporaries a block is given (`None`: no cap), the compiler options
    of a probe, and those of a call compiled lean (`None`: XLA's defaults)."""

    reserve_share: float
    block_bytes: int | None
    probe_options: dict[str, Any]
    lean_options: dict[str, Any] | None = None

    def usable(self, budget: int) -> int:
        """The part of `budget` that the compiled call's peak may take."""
        return int(budget * (1 - self.reserve_share))

    def least(self, peak: int) -> int:
        """The smallest budget whose usable part holds a call of `peak` bytes."""
        budget = math.ceil(peak / (1 - self.reserve_share))
        while self.usable(budget) < peak:  # float rounding
            budget += 1
        return budget


# The allocator's slack: a share of the budget on every platform. Nothing else is kept:
# the budget bounds the call's buffers, and on a CPU the compiler's heap is the host's,
# reported apart.
RESERVE_SHARE = 0.02
_POLICIES = {
    # A CPU block runs fastest while its temporaries stay in the caches; its probes are
    # compiled with the older fusion emitters too, which assign the same buffers.
    "cpu": Policy(RESERVE_SHARE, CPU_BLOCK_BYTES, CPU_PROBE_OPTIONS, CPU_LEAN_OPTIONS),
}
# An accelerator keeps more of itself busy with wider blocks: no cap.
_ACCELERATOR = Policy(RESERVE_SHARE, None, PROBE_OPTIONS)


def policy_of(platform: str) -> Policy:
    """The policy of plans on `platform` (`"cpu"`, `"gpu"`, `"tpu"`, ...)."""
    return _POLICIES.get(platform, _ACCELERATOR)


# Plans made, by transform, argument shapes and dtypes, constants and budget, each with
# the executable compiled for its candidate (`None` where the plan compiled nothing).
_PLANS = BoundedCache(64)


def call_key(tree: Any, budget: Any) -> Any:
    """A hashable key of a call on `tree` (its structure, its arrays' shapes, dtypes and
    placements, its other leaves) at `budget`; `None` where a leaf is unhashable."""
    # An array's placement is part of it: a batch split over explicit mesh axes is
    # planned per device, the same batch on one device as a whole.
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    signature = tuple(
        (np.shape(leaf), str(leaf.dtype), placement(leaf))
        if eqx.is_array(leaf)
        else ("constant", leaf)
        for leaf in leaves
    )
    key = (treedef, signature, budget)
    try:
        hash(key)
    except TypeError:
        return None  # an unhashable constant: plan every call
    return key


def _run(transform: Any, args: tuple, kwargs: dict) -> Any:
    return transform.run(*args, **kwargs)


def compiled_plan(
    transform: Any, args: tuple, kwargs: dict, run: Callable[..., Any] | None = None
) -> tuple[Plan, Any]:
    """The plan of `transform(*args, **kwargs)`: with a budget, the block size (and, for
    derivatives, the strategy) whose compiled call fits it, fastest first; without one,
    the blocks its options give, with the memory they take. Nothing runs: candidates are
    compiled, not called. The arguments may be arrays or tracers. `run(candidate,
    args, kwargs)` is the call whose memory is planned (the streamed call of `zm.to_file`
    holds no output on the device); by default, the transform's own call.

    Returns the plan and the executable compiled for it: `run_compiled(executable,
    candidate, args, kwargs)` runs the planned call without compiling it again, on
    arguments placed as these were (`runs_compiled`)."""
    run = _run if run is None else run
    key = call_key((transform, args, kwargs, run), transform.max_memory)
    made = _PLANS.get(key)
    if made is None:
        with collector_paused():
            made = Planner(transform, args, kwargs, run).plan()
        _PLANS.put(key, made)
    return made


class _NoFit(Exception):
    """No block size of any strategy fits: the least peak seen, and of which strategy."""

    def __init__(self, least: int, strategy: Any):
        super().__init__(least, strategy)
        self.least, self.strategy = least, strategy


class Planner:
    """The plan of one call: its candidates, the search among them, the reserve of the
    platform's policy, and the refusal. Every figure it decides on is XLA's count of a
    compiled program, so the plan is the same in every process."""

    def __init__(self, transform: Any, args: tuple, kwargs: dict, run: Callable[..., Any]):
        self.transform, self.args, self.kwargs, self.run = transform, args, kwargs, run
        self.owner = transform._owner
        self.work = transform.work(*args, **kwargs)  # traces fn for a derivative
        self.shapes = abstract((transform, args, kwargs))  # arrays and tracers as shapes
        self.policy = policy_of(jax.default_backend())
        self.budget, self.source = budget_of(transform.max_memory)
        self.measured: dict[tuple[Any, int | None], Compiled] = {}
        self.traced: dict[tuple[Any, int | None], Any] = {}  # a probe's serves the call
        self.probes: set[tuple[Any, int | None]] = set()  # measured as probes
        self.for_call: set[tuple[Any, int | None]] = set()  # never to be probes
        self.probing = self.budget is not None and self.work.total > 0
        self.compiles = 0
        self.compile_bytes: int | None = None

    def plan(self) -> tuple[Plan, Any]:
        """The plan and the executable of its chosen candidate."""
        if self.budget is None or self.work.total == 0:
            chosen = (self.transform.strategies[0], None)
            final = self.candidate(*chosen)
        else:
            usable = self.policy.usable(self.budget)
            stored = stored_plans((self.transform, self.args, self.kwargs), self.budget, self.run)
            kept = None if stored is None else self.kept(stored, usable)
            if kept is not None:
                chosen, final = kept
            else:
                try:
                    chosen, final = self.choose(usable)
                except _NoFit as nofit:
                    raise self.refusal(nofit) from None
                if stored is not None:
                    stored.keep(*chosen, final.program)
        plan = Plan(
            owner=self.owner,
            what=self.work.what,
            total=self.work.total,
            block_size=self.work.block_size if chosen[1] is None else chosen[1],
            peak_bytes=final.peak_bytes,
            output_bytes=final.output_bytes,
            budget_bytes=self.budget,
            strategy=chosen[0],
            budget_source=self.source,
            compiles=self.compiles,
            compile_bytes=self.compile_bytes,
        )
        return plan, final.executable

    def kept(self, stored: StoredPlan, usable: int) -> tuple[tuple[Any, int], Compiled] | None:
        """The plan another process kept for this call, where its program is this call's
        and its peak still fits: one compile, for the call. `None` otherwise (the
        candidate compiled stays measured for the search)."""
        choice = stored.choice(self.transform.strategies)
        if choice is None or not 1 <= choice[1] <= self.work.total:
            return None
        strategy, size, digest = choice
        self.for_call.add((strategy, size))
        final = self.candidate(strategy, size)
        if final.peak_bytes > usable or program_digest(final.program) != digest:
            return None
        return (strategy, size), final

    # -- 1. candidates ------------------------------------------------------------------

    def compile(self, strategy: Any, size: int | None, probe: bool) -> Compiled:
        """The call compiled at `size` items per block (`None`: the transform's own
        options) with `strategy`; a probe only for its memory."""
        before = resident_bytes()
        compiled = compile_traced(self.trace(strategy, size), self.options(probe))
        after = resident_bytes()
        if before is not None and after is not None:
            self.compile_bytes = max(self.compile_bytes or 0, after - before)
        self.compiles += 1
        return compiled

    def trace(self, strategy: Any, size: int | None) -> Any:
        """The call at `size` and `strategy`, traced once for all its compiles."""
        if (strategy, size) not in self.traced:
            transform = self.transform
            if size is not None:
                transform = transform.with_block_size(size, strategy)
            shapes = (abstract(transform), self.shapes[1], self.shapes[2])
            self.traced[strategy, size] = trace_call(self.run, *shapes)
        return self.traced[strategy, size]

    def options(self, probe: bool) -> dict[str, Any] | None:
        """The compiler options of a probe, or of the call: XLA's defaults, or the
        platform's lean options for a transform compiled lean."""
        if probe:
            return self.policy.probe_options
        return self.policy.lean_options if self.transform.compiled_lean else None

    def candidate(self, strategy: Any, size: int | None) -> Compiled:
        """The call at `size` and `strategy`, compiled once: the two ends of the search
        (one item per block, all in one) as probes, since they give the slope and are
        seldom the plan; the sizes between them for the call."""
        key = (strategy, size)
        if key not in self.measured:
            total = self.work.total
            probe = self.probing and size in (1, total) and total > 1 and key not in self.for_call
            if probe and size == 1 and self.policy.block_bytes is not None:
                # Where even the whole work's peak shared out over its items passes the
                # temporaries a block is given, one item per block is the largest size
                # considered and the usual plan: compiled for the call.
                whole = self.measured.get((strategy, total))
                if whole is not None:
                    probe = whole.peak_bytes / (total - 1) < self.policy.block_bytes
            self.measured[key] = self.compile(strategy, size, probe)
            if probe:
                self.probes.add(key)
        return self.measured[key]

    def output_bytes(self, strategy: Any) -> int:
        """The output's bytes, the same at every block size: from either end compiled."""
        for size in (self.work.total, 1):
            if (strategy, size) in self.measured:
                return self.measured[strategy, size].output_bytes
        return self.candidate(strategy, 1).output_bytes

    # -- 2. search ------------------------------------------------------------------------

    def choose(self, usable: int) -> tuple[tuple[Any, int], Compiled]:
        """The strategy and block size whose call's peak fits `usable` bytes, and the
        call compiled for it. A chosen probe is compiled again for the call; should its
        memory then not fit, the search is made again without probes."""
        chosen = self.search(usable)
        if chosen in self.probes:
            self.probes.discard(chosen)
            self.measured[chosen] = self.compile(*chosen, probe=False)
        final = self.measured[chosen]
        if final.peak_bytes > usable:
            self.probing = False
            self.measured = {key: c for key, c in self.measured.items() if key not in self.probes}
            self.probes.clear()
            chosen = self.search(usable)
            final = self.candidate(*chosen)
        return chosen, final

    def search(self, usable: int) -> tuple[Any, int]:
        """The first strategy with a block size that fits, and that size; `_NoFit` with
        the least peak seen where none does. Where the work runs a loop, the whole work
        in one block comes first (`whole_work_first`)."""
        first = self.transform.strategies[0]
        one = self.one_item_first(first, usable)
        if one is not None:
            return first, one
        whole = self.whole_work_first(usable)
        if whole is not None:
            return whole
        leasts = []
        for strategy in self.transform.strategies:
            one = self.one_item_first(strategy, usable)
            if one is not None:
                return strategy, one
            try:
                return strategy, self.search_strategy(strategy, usable)
            except _NoFit as nofit:
                leasts.append(nofit)
        raise min(leasts, key=lambda nofit: nofit.least)

    def whole_work_of_loops(self) -> bool:
        """Whether the rule for loops applies: work of two items or more, whose program
        runs a loop (a `scan`, a `while`), and which takes one block of it
        (`loop_in_one_block`). The loop is read from the traced whole work of the last
        strategy (whose loop over its one block runs once, and is none), before anything
        is compiled. Such work's peak is mostly the values its steps save for the
        gradient, each written and read once rather than held in the caches, and its steps
        are each paid once per block (a small step costs its overhead, not its
        arithmetic), so fewer blocks run faster: the platform's cap on a block does not
        apply."""
        if self.work.total < 2 or not self.transform.loop_in_one_block:
            return False
        return traced_loops(self.trace(self.transform.strategies[-1], self.work.total))

    def whole_work_first(self, usable: int) -> tuple[Any, int] | None:
        """Where the work runs a loop, the whole work in one block where it fits, with
        the last strategy (a derivative's `"recompute"`), compiled for the call: in one
        block a kept linearisation serves that block only, so the strategies do the same
        work, and the last keeps nothing beyond the block (its peak is the least or the
        same). `None` where the work holds no loop or that whole work does not fit."""
        total = self.work.total
        if not self.whole_work_of_loops():
            return None
        strategy = self.transform.strategies[-1]
        self.for_call.add((strategy, total))
        return (strategy, total) if self.candidate(strategy, total).peak_bytes <= usable else None

    def one_item_first(self, strategy: Any, usable: int) -> int | None:
        """One item per block, where the platform caps a block's temporaries and one
        item alone makes a value past the cap (`AbstractBlocked.item_bytes`): compiled
        for the call, it is the plan when it fits, in one compile."""
        cap = self.policy.block_bytes
        if cap is None or self.work.total < 2 or (strategy, 1) in self.measured:
            return None
        item = self.transform.item_bytes(*self.args, **self.kwargs)
        if item is None or item < cap:
            return None
        self.for_call.add((strategy, 1))
        return 1 if self.candidate(strategy, 1).peak_bytes <= usable else None

    def search_strategy(self, strategy: Any, usable: int) -> int:
        """The largest block size of `strategy` that fits (`_search.search`)."""
        total, cap = self.work.total, self.policy.block_bytes
        cap = None if self.whole_work_of_loops() else cap
        least = None
        if cap is not None:
            # The whole work is compiled anyway where blocks are capped; where the output
            # alone does not fit, no block size helps, and the ladder is not searched.
            self.candidate(strategy, total)
            if (strategy, 1) not in self.measured:
                # The slope that caps a block is taken down to the output, which every
                # block size holds: one compile fewer where the cap fits.
                least = self.output_bytes(strategy)
        if self.output_bytes(strategy) > usable:
            # No block size fits; the least peak, which the refusal's budget is planned
            # from, is one item per block's (the whole work's where that is less).
            ends = [self.candidate(strategy, 1).peak_bytes]
            if (strategy, total) in self.measured:
                ends.append(self.measured[strategy, total].peak_bytes)
            raise _NoFit(min(ends), strategy)

        def refuse(peak: int) -> _NoFit:
            return _NoFit(peak, strategy)

        return search(
            lambda size: self.candidate(strategy, size).peak_bytes,
            total,
            usable,
            refuse=refuse,
            block_bytes=cap,
            least=least,
        )

    # -- 3 and 4. reserve and refusal -----------------------------------------------------

    def least_budget(self, nofit: _NoFit) -> int:
        """The least budget that plans: the policy's for the least peak seen, checked by
        planning it (planning at a larger budget compiles the same sizes up to the first
        that fits, so this seldom takes a second round)."""
        least = self.policy.least(nofit.least)
        for _ in range(8):
            try:
                self.choose(self.policy.usable(least))
                return least
            except _NoFit as larger:
                least = max(least + 1, self.policy.least(larger.least))
        return least

    def refusal(self, nofit: _NoFit) -> MemoryBudgetError:
        # The message of the strategy that needs less, noting where the other was tried.
        note = (
            " (Both strategies were tried: keeping one linearisation of `fn` for every "
            "block, and evaluating `fn` again inside each block.)"
            if len(self.transform.strategies) > 1
            else ""
        )
        return refusal(
            self.owner,
            self.budget,
            nofit.least,
            output_bytes=self.output_bytes(nofit.strategy),
            output_what=self.work.output_what,
            suggested=self.least_budget(nofit),
            note=note,
        )
