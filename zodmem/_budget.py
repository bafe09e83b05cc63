"""Planning blocks from a memory budget: the block size whose compiled call fits.

A transform with `max_memory` cuts its work (`total` items: variables, output
elements, batch elements) into blocks, like one given a count or a size; the planner
here chooses the size. It compiles the transform's whole call at candidate block sizes
and reads XLA's own account of the call's buffers (`memory_analysis()`): the output
plus the temporaries, which is what the budget bounds. Nothing runs to plan.

The two ends of the search (one item per block, everything in one block) are probes:
compiled without the backend's code optimisations, which come after XLA has assigned the
buffers, so that each costs about 60% of the call's own compile and reports the same
memory. Sizes between them are compiled for the call, since the first that fits is
usually the plan; a probe that is chosen is compiled again for the call (its memory
checked again; should it not fit, the search is made again from programs compiled for
the call). The chosen candidate's executable is the one the call runs.

How `search` finds a size, in few compiles:

1. the largest size it considers: on a CPU, the largest whose temporaries stay within
   `CPU_BLOCK_BYTES` (the temporaries per item are the slope of the compiled peaks
   between one item per block and the whole work; one item at least), since there a
   block whose temporaries outgrow the caches runs slower per item; on an accelerator,
   where a wider block keeps more of the device busy, the whole work. If it fits, it
   is the plan;
2. one item per block: if that does not fit either, a ladder of sizes (the largest
   considered, halved up to eight times, down to 2) is compiled, since XLA may form a
   large block's products as one matrix product with fewer temporaries than a few
   separate products take. If none of them fits the call is refused with
   `MemoryBudgetError` before anything runs; otherwise the search goes on from the
   largest that fits;
3. between a size known to fit and one known not to, the peak grows about linearly with
   the block size, so a secant step guesses the largest size that fits; each guess is
   compiled and checked, and the search stops when the two sizes are within a
   sixteenth of the one that fits. Where the peak grows faster than that, the secant
   guesses low every time: after two such steps the end that does not fit counts half
   as far over the budget each time (the Illinois rule), so the guesses still close in.
   Sizes are taken as `ceil(total / num_blocks)`, the smallest size for a number of
   blocks, so the blocks come out even.

On a CPU, where the transform can read from its function that one item alone makes a value
larger than `CPU_BLOCK_BYTES` (`ChunkedVmap`: the largest value its function makes from one
element, from the function's jaxpr), the cap is one item: that size is compiled first, for
the call, and is the plan when it fits, in one compile and no probe. Where it does not fit,
the search above is made.

For a derivative with `strategy="auto"`, `make_plan` tries one linearisation kept for
every block first, then `fn` evaluated again inside each block, and takes the first that
plans; the call is refused when none does.

Blocks are planned to fit the budget less a reserve for what the process allocates
beside the call's buffers (`usable_bytes`). On an accelerator it is 2% of the budget,
for the allocator's slack. On a CPU, where the call's memory is the process's own, it is
2% of the budget, plus the most that compiling any candidate grew the process's
resident memory while planning (measured around each compile, from a trimmed heap),
plus `RESERVE_RUNTIME_BYTES` (10 MB) for the executable and the runtime's threads;
where the resident memory cannot be read, `RESERVE_CPU_BYTES` (40 MB) stands for the
compile and the runtime together. That holds compile and call together, as under an
outer transform, whose program runs beside the heap its compile left. A call on
concrete arguments runs once the compile heap is handed back (after planning, and after
any compile of its own), so there the budget need only hold the larger of the two: the
call with 2% and the runtime, and each compile's peak, bounded by the process's peak
after it (`VmHWM`) less the resident memory before it. The reserve has no cap: a budget
too small to hold it is refused rather than exceeded. A refusal names a budget
`SUGGESTION_MARGIN` (15%) over the least that plans in this process (`least_budget`),
since another process's compile may grow the heap more.

The heap the compiler frees is handed back to the system before each candidate is
compiled and once planning ends (`release_heap`), so that planning does not raise the
process's peak memory. Plans are cached per transform, argument shapes, dtypes and
placements, budget and planned call, so the cost is paid by the first call only; with
each plan the executable of its chosen candidate is kept, and it is what the call runs
(`run_compiled`), so that a planned call compiles its program once. A budget whose
usable part cannot hold the output itself is refused from the two ends' compiles, without
the ladder: no block size changes the output.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend as jex
import numpy as np

from ._compiled import (
    LEAN_CPU_OPTIONS,
    Compiled,
    abstract,
    collector_paused,
    compile_call,
    is_traced,
    release_heap,
)
from ._memory import budget_of, format_bytes, format_bytes_up
from ._sharding import placement

__all__ = [
    "usable_bytes",
    "MemoryBudgetError",
    "Plan",
    "CPU_BLOCK_BYTES",
    "Work",
    "abstract",
    "make_plan",
    "largest_made_from",
    "search",
]

# What is kept of a budget for what the process allocates beside the call's own buffers:
# blocks are planned to fit the rest. On a CPU the call's memory is the process's: the
# heap a compile leaves (what compiling a candidate grew the resident memory by while
# planning), where the call runs beside it, plus the runtime's threads and the
# executable, `RESERVE_RUNTIME_BYTES`; where the resident memory cannot be read, a fixed
# `RESERVE_CPU_BYTES` stands for both. On an accelerator only the allocator's slack shares
# the device: 2% of the budget, never more than a tenth.
RESERVE_SHARE = 0.02
RESERVE_CPU_BYTES = 40 * 10**6
RESERVE_RUNTIME_BYTES = 10 * 10**6
# A refusal suggests this much over the least budget that plans here: the compile heap of
# another process differs (on benchmarks/budgets.py's small problem, refusals of 50 MB in
# fresh processes found least budgets 5% apart).
SUGGESTION_MARGIN = 1.15


def usable_bytes(budget: int, platform: str, compile_bytes: int | None = None) -> int:
    """The part of `budget` that the compiled call's peak may take; `compile_bytes` is what
    compiling it adds to a CPU process (`None`: not measured)."""
    if platform != "cpu":
        return int(budget - min(RESERVE_SHARE * budget, 0.1 * budget))
    extra = RESERVE_CPU_BYTES if compile_bytes is None else compile_bytes + RESERVE_RUNTIME_BYTES
    return int(budget * (1 - RESERVE_SHARE) - extra)


def least_budget(peak: int, platform: str, compile_bytes: int | None = None) -> int:
    """The smallest budget whose usable part (`usable_bytes`) holds a call of `peak`."""
    if platform != "cpu":
        return math.ceil(peak / (1 - RESERVE_SHARE))
    extra = RESERVE_CPU_BYTES if compile_bytes is None else compile_bytes + RESERVE_RUNTIME_BYTES
    return math.ceil((peak + extra) / (1 - RESERVE_SHARE))


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux), or `None`."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory so far (Linux's `VmHWM`), or `None`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# On a CPU, the most temporaries a block is planned to make (see the module's docstring).
CPU_BLOCK_BYTES = 16 * 10**6


def largest_made_from(jaxpr: Any, made_from: list[bool]) -> int:
    """The bytes of the largest value that `jaxpr`'s top-level equations make from the
    inputs flagged in `made_from` (its outputs excepted). Values inside nested programs
    (a `jit`, a loop's body) are not looked into, so this errs low."""
    dependent = {var for var, flag in zip(jaxpr.invars, made_from, strict=True) if flag}
    outputs = {id(var) for var in jaxpr.outvars}
    largest = 0
    for eqn in jaxpr.eqns:
        if not any(var in dependent for var in eqn.invars if not isinstance(var, jex.core.Literal)):
            continue
        for var in eqn.outvars:
            dependent.add(var)
            aval = var.aval
            if id(var) in outputs or not hasattr(aval, "shape"):
                continue
            try:
                size = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
            except TypeError:  # a key or token: no plain item size
                continue
            largest = max(largest, size)
    return largest


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
    that would do (and how much of it the result alone takes) and the way out.

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


def _size_for(total: int, block_size: int) -> int:
    """The smallest block size that cuts `total` into as many blocks as `block_size` does."""
    return -(-total // -(-total // block_size))


def search(
    peak_at: Callable[[int], int],
    total: int,
    budget: int,
    *,
    refuse: Callable[[int], Exception],
    block_bytes: int | None = None,
    least: int | None = None,
) -> int:
    """The block size to use: the largest whose peak (`peak_at(size)`) fits `budget` and,
    with `block_bytes`, whose temporaries (the peaks' slope per item times the size) stay
    within it. `least`, where given, is a lower bound of one item's peak (the output,
    which every block size holds) that the slope is taken from instead of compiling one
    item per block: a slope no smaller, so blocks no larger. `refuse(least_peak)` is
    raised when no size fits."""
    peaks: dict[int, int] = {}

    def peak(size: int) -> int:
        if size not in peaks:
            peaks[size] = peak_at(size)
        return peaks[size]

    cap = total
    if block_bytes is not None and total > 1:
        whole = peak(total)
        per_item = (whole - (peak(1) if least is None else least)) / (total - 1)
        if per_item > 0:
            cap = _size_for(total, max(1, min(total, int(block_bytes // per_item))))
    if peak(cap) <= budget:
        return cap
    fits, over = 1, cap
    if peak(1) > budget:
        # Usually nothing fits then; but the peak need not grow with the block size
        # (XLA may form a large block's products as one matrix product, with fewer
        # temporaries than a few separate ones): look down a ladder of sizes first.
        ladder = [_size_for(total, cap >> k) for k in range(1, 9) if cap >> k > 1]
        fitting = [size for size in ladder if peak(size) <= budget]
        if not fitting:
            raise refuse(min(peaks.values()))
        fits = fitting[0]
        over = min(size for size in peaks if size > fits)
    rising = 0  # how many steps in a row have raised the size known to fit
    while over - fits > max(1, fits // 16):
        # The secant between the largest size known to fit and the smallest known not to.
        # Where the peak grows faster than linearly it guesses low every time; from the
        # second such step on, the excess of the end that does not fit is halved each
        # time (the Illinois rule), so the guesses reach the answer in few steps.
        excess = (peak(over) - budget) / 2 ** max(0, rising - 1)
        slope = (budget + excess - peak(fits)) / (over - fits)
        guess = fits + (budget - peak(fits)) / slope if slope > 0 else over - 1
        size = _size_for(total, int(min(max(guess, fits + 1), over - 1)))
        if size <= fits or size >= over:
            break
        if peak(size) <= budget:
            fits, rising = size, rising + 1
        else:
            over, rising = size, 0
    return fits


def refusal(
    owner: str, budget: int, least: int, *, output_bytes: int, output_what: str, suggested: int
) -> MemoryBudgetError:
    """The error for a budget that cannot hold one item per block; `suggested` is the
    least budget that holds a call of `least` bytes (`least_budget`)."""
    way = f"a budget of at least {format_bytes_up(suggested)}"
    if output_bytes >= 0.5 * suggested:
        way += (
            f", or less work per call (the {output_what} itself takes most of it: fewer "
            "variables or outputs per call, each call's result moved off the device)"
        )
    beside = suggested - least
    return MemoryBudgetError(
        f"{owner}: max_memory={format_bytes(budget)} cannot hold even one item per block: "
        f"the call needs at least {format_bytes(least)}, of which the {output_what} alone is "
        f"{format_bytes(output_bytes)}, and compiling and running it takes about "
        f"{format_bytes(beside)} more beside it. More blocks are not enough; the way out is "
        f"{way}."
    )


# Plans made, by transform, argument shapes and dtypes, constants and budget, each with
# the executable compiled for its candidate (`None` where the plan compiled nothing).
_PLANS: dict[Any, tuple[Plan, Any]] = {}
_MAX_PLANS = 64


def _cache_key(tree: Any, budget: Any) -> Any:
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
    return transform._run(*args, **kwargs)


def make_plan(
    transform: Any, args: tuple, kwargs: dict, run: Callable[..., Any] | None = None
) -> Plan:
    """The plan of `transform(*args, **kwargs)` (`compiled_plan`, without the executable)."""
    return compiled_plan(transform, args, kwargs, run)[0]


def compiled_plan(
    transform: Any, args: tuple, kwargs: dict, run: Callable[..., Any] | None = None
) -> tuple[Plan, Any]:
    """The plan of `transform(*args, **kwargs)`: with a budget, the block size (and, for
    derivatives, the strategy) whose compiled call fits it, fastest first; without one,
    the blocks its options give, with the memory they take. Nothing runs: candidates are
    compiled, not called. The arguments may be arrays or tracers. `run(candidate,
    args, kwargs)` is the call whose memory is planned (the streamed call of `zm.to_file`
    holds no output on the device); by default, the transform's own call.

    Returns the plan and the executable compiled for it (`None` where nothing was
    compiled): `run_compiled(executable, candidate, args, kwargs)` runs the planned call
    without compiling it again, on arguments placed as these were (`runs_compiled`)."""
    run = _run if run is None else run
    # A plan for concrete arguments may count on the compile heap being handed back
    # before the call runs; one for traced arguments may not (`_new_plan`).
    traced = is_traced((args, kwargs))
    key = _cache_key((transform, args, kwargs, run), (transform.max_memory, traced))
    if key is not None and key in _PLANS:
        return _PLANS[key]
    with collector_paused():
        return _new_plan(transform, args, kwargs, run, key, traced)


def _new_plan(
    transform: Any, args: tuple, kwargs: dict, run: Callable[..., Any], key: Any, traced: bool
) -> tuple[Plan, Any]:
    owner = type(transform).__name__
    work = transform._work(*args, **kwargs)  # traces fn for a derivative: after the cache
    shapes = abstract((transform, args, kwargs))  # arrays and tracers as abstract values
    measured: dict[Any, Compiled] = {}
    platform = jax.default_backend()
    # What compiling grows the heap by, from the heap as the call will find it (trimmed
    # before each candidate): the most any candidate grew it. The first compile also pays
    # some set-up of the process's own, which errs on the safe side; a larger block's is
    # not always the larger (one block of everything is a program without a loop).
    growths: list[int] = []
    # For concrete arguments the call runs the program compiled here (or one compiled as
    # its first call begins), once the compile heap is handed back: its run does not
    # carry that heap, and the budget holds the larger of the call and a compile, not
    # both. A compile's peak above the heap it began from is at most the process's peak
    # after it less the resident memory before it: an upper bound that is exact where
    # the compile set the process's peak. Under an outer transform the call runs in a
    # program compiled by that transform, beside whatever heap its compile left.
    apart = not traced and platform == "cpu"
    compile_peaks: list[int] = []
    budget, source = budget_of(transform.max_memory)
    # With a budget, the search's two ends are probes (`compile_call`); a chosen probe is
    # compiled again for the call. Should its memory then not fit, the search is made
    # again from programs compiled for the call.
    probing = budget is not None and work.total > 0
    compiles = 0

    def compiled(strategy: Any, size: int | None, probe: bool) -> Compiled:
        nonlocal compiles
        candidate = transform if size is None else transform._with_block_size(size, strategy)
        release_heap()
        before = resident_bytes()
        lean = not probe and platform == "cpu" and getattr(transform, "_lean_program", False)
        options = LEAN_CPU_OPTIONS if lean else None
        result = compile_call(
            run, abstract(candidate), shapes[1], shapes[2], probe=probe, options=options
        )
        after = resident_bytes()
        if before is not None and after is not None:
            growths.append(max(0, after - before))
            peak = peak_resident_bytes()
            if peak is not None:
                compile_peaks.append(max(0, peak - before))
        compiles += 1
        return result

    probes: set[Any] = set()
    for_call: set[Any] = set()  # candidates to compile for the call, not as probes

    def memory(strategy: Any, size: int | None) -> Compiled:
        if (strategy, size) not in measured:
            # The two ends (one item per block, and all in one block) give the slope and
            # are seldom the plan: probes. A size between them is compiled for the call,
            # since the first that fits is usually the plan.
            probe = probing and size in (1, work.total) and work.total > 1
            probe = probe and (strategy, size) not in for_call
            if probe and size == 1 and platform == "cpu" and (strategy, work.total) in measured:
                # Where even the whole work's peak shared out over its items passes the
                # most temporaries a CPU block is given, one item per block is the
                # largest size considered, and the usual plan: compiled for the call.
                whole = measured[strategy, work.total].peak_bytes
                probe = whole / (work.total - 1) < CPU_BLOCK_BYTES
            measured[strategy, size] = compiled(strategy, size, probe)
            if probe:
                probes.add((strategy, size))
        return measured[strategy, size]

    def compile_bytes() -> int | None:
        return max(growths) if growths else None

    def usable_now() -> int:
        """The part of the budget a candidate's peak may take, from the compiles so far."""
        beside = usable_bytes(budget, platform, compile_bytes())
        if apart and compile_peaks:
            alone = usable_bytes(budget, platform, 0)
            if max(compile_peaks) <= alone:
                return max(beside, alone)
        return beside

    def least_now(peak: int) -> int:
        """The least budget in which a call of `peak` bytes plans (`usable_now`)."""
        least = least_budget(peak, platform, compile_bytes())
        if apart and compile_peaks:
            least = min(least, least_budget(max(peak, max(compile_peaks)), platform, 0))
        return least

    def usable(strategy: Any) -> int:
        if platform == "cpu":
            # The search compiles the whole work on a CPU anyway: the heap it grows is
            # measured. Its peak also says whether one item per block is the plan.
            memory(strategy, work.total)
        return usable_now()

    def output_bytes(strategy: Any) -> int:
        # The same for every block size: from whichever end is compiled.
        for size in (work.total, 1):
            if (strategy, size) in measured:
                return measured[strategy, size].output_bytes
        return memory(strategy, 1).output_bytes

    def one_item_first(strategy: Any) -> tuple[Any, int] | None:
        """One item per block, without the slope's probe, where a single item makes a
        value past the temporaries a CPU block is given (`AbstractBlocked._item_bytes`):
        the cap of the search would be one item then. Compiled for the call, it is the
        plan when it fits."""
        item = transform._item_bytes(*args, **kwargs)
        if item is None or item < CPU_BLOCK_BYTES or work.total < 2:
            return None
        for_call.add((strategy, 1))
        if memory(strategy, 1).peak_bytes <= usable_now():
            return strategy, 1
        return None

    def choose() -> tuple[Any, int]:
        """The strategy and block size whose candidate fits the budget."""
        refusals = []
        for strategy in transform._strategies:

            def refuse(least: int, strategy: Any = strategy) -> MemoryBudgetError:
                # Over the least: a new process's compile may grow the heap more.
                suggested = least_now(least) * SUGGESTION_MARGIN
                return refusal(
                    owner,
                    budget,
                    least,
                    output_bytes=output_bytes(strategy),
                    output_what=work.output_what,
                    suggested=math.ceil(suggested),
                )

            if platform == "cpu" and (strategy, 1) not in measured:
                one = one_item_first(strategy)
                if one is not None:
                    return one
            limit = usable(strategy)
            if output_bytes(strategy) > limit:
                # The output alone does not fit, and no block size changes it: refused
                # without searching the ladder of sizes.
                ends = [memory(strategy, 1).peak_bytes]
                if (strategy, work.total) in measured:
                    ends.append(measured[strategy, work.total].peak_bytes)
                refusals.append(refuse(min(ends)))
                continue
            # On a CPU the slope that caps a block's temporaries is taken from the whole
            # work's peak down to the output, unless one item per block is compiled
            # already: one compile fewer where the cap fits the budget.
            least = None
            if platform == "cpu" and (strategy, 1) not in measured:
                least = output_bytes(strategy)
            try:
                size = search(
                    lambda size, strategy=strategy: memory(strategy, size)[0],
                    work.total,
                    limit,
                    refuse=refuse,
                    block_bytes=CPU_BLOCK_BYTES if platform == "cpu" else None,
                    least=least,
                )
            except MemoryBudgetError as error:
                refusals.append(error)
                continue
            return strategy, size
        raise refusals[-1] if len(refusals) == 1 else _both_refused(refusals)

    if not probing:
        chosen = (transform._strategies[0], None)
        final = memory(*chosen)
    else:
        chosen = choose()
        if chosen not in probes:
            final = measured[chosen]
        else:
            final = compiled(*chosen, probe=False)
        if final.peak_bytes > usable_now():
            probing = False
            measured.clear()
            chosen = choose()
            final = memory(*chosen)
    plan = Plan(
        owner=owner,
        what=work.what,
        total=work.total,
        block_size=work.block_size if chosen[1] is None else chosen[1],
        peak_bytes=final.peak_bytes,
        output_bytes=final.output_bytes,
        budget_bytes=budget,
        strategy=chosen[0],
        budget_source=source,
        compiles=compiles,
    )
    # The chosen candidate's executable is the one the call runs; the others are freed.
    measured.clear()
    release_heap()
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan, final.executable
    return plan, final.executable


def _both_refused(refusals: list[MemoryBudgetError]) -> MemoryBudgetError:
    # The message of the strategy that needs less, noting that the other was tried.
    return MemoryBudgetError(
        f"{refusals[-1]} (Both strategies were tried: keeping one linearisation of `fn` "
        "for every block, and evaluating `fn` again inside each block.)"
    )
