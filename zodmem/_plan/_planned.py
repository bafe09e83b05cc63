"""`AbstractPlanned`, work in blocks whose size a memory budget plans, and `Planned`, such
work with its plan applied.

This is the part of a blocked transform that the planner needs, and no more: what the
work is (`work`), how a plan is applied (`with_block_size`), the ways to compute a block
(`strategies`), what one item makes (`item_bytes`) and the call in the blocks the options
give (`run`); on that, the base plans (`plan`, `planned`) and calls (`__call__`: planned,
then run, by the program compiled to plan it where it can). It sits here, below the
transforms, because two layers fill it: the transform base of `zodmem._transforms._base`
(`AbstractBlocked`, the contract's base, which adds `fn`, the devices and streaming and
fills `run` from `compute_share`), and the blocks of products and probes of the operators
and estimators (`zodmem._operators._vector_blocks`), which are planned like a transform
but are not one a user builds.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx

from .._checks import NamedInMessages
from .._engine._progress import closing_bars
from .._traceback import public
from ._budget import compiled_plan
from ._compiled import bind_compiled, runs_compiled
from ._plans import Plan, Work

__all__ = ["AbstractPlanned", "Planned"]


class Planned(NamedTuple):
    """Planned work: `transform`, the work with the block size (and strategy) its budget
    allows and no budget left; `bound`, the program compiled to plan it, as
    `bound(args, kwargs)` for the arguments it was planned for (or any with their shapes,
    dtypes and placement), or `None` where that program cannot run them (no budget, a
    progress bar, traced arguments, arguments placed elsewhere)."""

    transform: Any
    bound: Callable[..., Any] | None


class AbstractPlanned(NamedInMessages):
    """Work cut into blocks, sized by a count option or by a memory budget, `max_memory`.

    A subclass declares `max_memory` and `progress` and fills `work`, `with_block_size`
    and `run`; it may restate `strategies` and `item_bytes`. Calling it plans the blocks
    when it has a budget, then runs them.
    """

    max_memory: eqx.AbstractVar[int | str | None]
    progress: eqx.AbstractVar[bool]
    # Whether work whose program runs a loop is planned as the whole work in one block
    # where it fits (the planner's `whole_work_first`): a block of vectors a caller gave.
    # An estimator's drawn probes say no: they are many, and one block of all of them
    # holds every probe's loop state at once.
    loop_in_one_block: ClassVar[bool] = True
    # Whether the planned call is compiled with the platform's lean options (a CPU's:
    # XLA's older fusion emitters), whose compile heap is about half the default's: a
    # pass over the data run once per call of a larger job (KFAC's statistics), whose
    # compile, not its run, sets its peak.
    compiled_lean: ClassVar[bool] = False

    @abc.abstractmethod
    def work(self, *args: Any, **kwargs: Any) -> Work:
        """What the call with these arguments cuts into blocks: a `Work` with the number
        of items, their name and the result's name (for messages), and the block size
        the transform's own count option gives (all items when it has none). The
        arguments are those of the call, arrays or tracers; nothing may run here but
        shape evaluation. Work spread over devices returns
        `Work(...).per_device(split)`, the work of one device."""

    @abc.abstractmethod
    def with_block_size(self, size: int, strategy: Any) -> AbstractPlanned:
        """This transform with `size` items per block, computed by `strategy` (one of
        `strategies`), and no budget: the transform a plan runs. Typically
        `dataclasses.replace(self, batch_size=size, max_memory=None)`."""

    @abc.abstractmethod
    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The call, in the blocks the count or size option gives; nothing is planned.
        The transform base (`zodmem.contract.AbstractBlocked`) fills it from
        `compute_share`."""

    @property
    def strategies(self) -> tuple[Any, ...]:
        """The ways to compute a block that the planner may choose, the first preferred
        (the default, `(None,)`: one way). The planner tries them in order and takes the
        first whose compiled call fits the budget; `with_block_size` receives it."""
        return (None,)

    def item_bytes(self, *args: Any, **kwargs: Any) -> int | None:
        """The bytes of the largest value that one item of the work makes on its own, as
        far as the transform can read it from its function without compiling (`None`, the
        default: not known). On a CPU the planner takes one item per block straight away
        where this passes the temporaries a block is given, rather than compiling
        candidates that cannot be faster."""
        return None

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """How the call with these arguments will be cut into blocks, and the memory it
        will take, without running it: a `zm.Plan` with `block_size`, `num_blocks`,
        `peak_bytes` (predicted from the compiled call) and `output_bytes`.

        With `max_memory`, this is the plan the call will use (the block size, and for
        derivatives the strategy, whose compiled peak fits the budget); a budget that
        cannot hold one item per block raises `zm.MemoryBudgetError`. Without one, it
        describes the blocks the count or size option gives. The arguments may be
        arrays or tracers (inside `jax.jit`).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            def loss(w, data):
                return jnp.mean(jnp.tanh(data @ w) ** 2)

            w, data = jnp.ones(2000), jnp.ones((256, 2000))
            zm.BatchedHessian(loss).plan(w, data).peak_bytes     # about 18 MB at once
            plan = zm.BatchedHessian(loss, max_memory="100MB").plan(w, data)
            assert plan.fits  # the 16 MB Hessian and the blocks' temporaries
            ```
        """
        return compiled_plan(self._quiet, args, kwargs)[0]

    def planned(self, args: tuple, kwargs: dict, call: Callable[..., Any] | None = None) -> Planned:
        """This work with the block size (and strategy) its budget allows for
        `call(transform, args, kwargs)` (by default, `transform.run(*args, **kwargs)`;
        `zm.to_host` plans its streamed call), and the program compiled to plan it. The
        arguments are those of the call, arrays or tracers. Without a budget, the work
        as it is."""
        if self.max_memory is None:
            return Planned(self, None)
        plan, executable = compiled_plan(self._quiet, args, kwargs, run=call)
        planned = self
        if plan.total != 0:
            planned = self.with_block_size(plan.block_size, plan.strategy)
        if executable is None or self.progress or call is not None:
            return Planned(planned, None)  # a bar's callback is not in the planned program
        if not runs_compiled(executable, planned, args, kwargs):
            return Planned(planned, None)
        return Planned(planned, bind_compiled(executable, planned))

    @property
    def _quiet(self) -> AbstractPlanned:
        """This work without a progress bar, for planning: the candidates it compiles
        need no callback, and one plan serves the call with and without a bar."""
        return dataclasses.replace(self, progress=False) if self.progress else self

    @public
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The call: planned from `max_memory` (if any), then run, by the program
        compiled to plan it where it can. The bars of a run that fails are closed, not
        left for the next run to draw beneath. Transforms restate it with their own
        annotations."""
        with closing_bars():
            planned, bound = self.planned(args, kwargs)
            if bound is not None:
                return bound(args, kwargs)
            return planned.run(*args, **kwargs)
