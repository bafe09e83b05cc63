"""`AbstractTransform`, the base of every zodmem transform, and the bases of a blocked
transform (`AbstractBlocked`, `AbstractStreamable`, `AbstractSharded`): the contract that
`zodmem.contract` makes public. The derivatives' own base, `AbstractDerivative`, is in
`zodmem._transforms._derivative`."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
from jax.sharding import NamedSharding, PartitionSpec

from .._engine._progress import closing_bars
from .._engine._sharding import Share, Split, dispatch, split_of, to_mesh
from .._traceback import public
from ._budget import compiled_plan, make_plan
from ._compiled import bind_compiled, runs_compiled
from ._plans import Plan, Work

__all__ = [
    "AbstractTransform",
    "AbstractBlocked",
    "AbstractStreamable",
    "AbstractSharded",
]


class AbstractTransform(eqx.Module):
    """A memory-bounded JAX transform of a function `fn`.

    `fn` is an ordinary field, so when it is a module (an Equinox model or another
    transform) its arrays are leaves of the transform. Every other field is static
    configuration, validated when the transform is built.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        hessian = zm.BatchedHessian(lambda w: jnp.sum(w**3), nbatches=2)
        assert isinstance(hessian, zm.AbstractTransform)
        assert hessian.config["nbatches"] == 2  # the static configuration, by name
        per_example = zm.ChunkedVmap(hessian, chunk_size=2)  # a transform wraps another
        assert per_example(jnp.ones((4, 3))).shape == (4, 3, 3)
        ```
    """

    fn: eqx.AbstractVar[Callable[..., Any]]

    @property
    def config(self) -> dict[str, Any]:
        """The static configuration, field name to value (everything but `fn`)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.metadata.get("static", False)
        }


class AbstractBlocked(AbstractTransform):
    """A transform that cuts its work into blocks, sized by a count option or by a
    memory budget, `max_memory`.

    Calling it plans the blocks when it has a budget (`plan`), then runs the transform
    with that block size. A concrete transform declares `max_memory` and `progress`
    fields and fills two methods:

    - `work(*args, **kwargs)`: what the call with these arguments cuts into blocks (a
      `zodmem.contract.Work`: how many items, named how, and the block size its own count
      option gives);
    - `with_block_size(size, strategy)`: itself with `size` items per block and no
      budget, which is how a plan is applied;

    and may restate `strategies` (ways to compute a block, for the planner to choose
    between) and `item_bytes` (what one item makes on its own). Transforms whose result
    can also be streamed or sharded derive from `AbstractSharded` instead, which runs
    the call for them.
    """

    max_memory: eqx.AbstractVar[int | str | None]
    progress: eqx.AbstractVar[bool]

    @property
    def _owner(self) -> str:
        """The name the planner's messages and refusals give this work: the class's, or
        for work a transform runs on a user's behalf, the call the user made."""
        return type(self).__name__

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
        return make_plan(self._quiet, args, kwargs)

    @property
    def _quiet(self) -> AbstractBlocked:
        """This transform without a progress bar, for planning: the candidates it compiles
        need no callback, and one plan serves the call with and without a bar."""
        return dataclasses.replace(self, progress=False) if self.progress else self

    @public
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The transform's call: planned from `max_memory` (if any), then run. Concrete
        transforms may restate it with their own annotations."""
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        """The call: planned from the budget (if any), then run. The program compiled to
        plan the chosen blocks is the one that runs, where it can (`_bound`). The
        bars of a run that fails are closed, not left for the next run to draw beneath."""
        with closing_bars():
            planned, executable = self._planned_call(args, kwargs)
            bound = self._bound(planned, executable, args, kwargs)
            if bound is not None:
                return bound(args, kwargs)
            return planned._run(*args, **kwargs)

    def _planned_bound(
        self, args: tuple, kwargs: dict
    ) -> tuple[AbstractBlocked, Callable[..., Any] | None]:
        """`(planned, bound)`: this transform with the blocks its budget allows, and the
        program compiled to plan them as `bound(args, kwargs)`, a function of these
        arguments or any with their shapes, dtypes and placement. `bound` is `None`
        where that program cannot run them: no budget, a bar (whose callback is not in
        the planned program), traced arguments or arguments placed elsewhere."""
        planned, executable = self._planned_call(args, kwargs)
        return planned, self._bound(planned, executable, args, kwargs)

    def _bound(
        self, planned: AbstractBlocked, executable: Any, args: tuple, kwargs: dict
    ) -> Callable[..., Any] | None:
        """The program compiled to plan `planned`, bound as `bound(args, kwargs)`, or
        `None` where it cannot run these arguments (see `_planned_bound`)."""
        if executable is None or self.progress:
            return None
        if not runs_compiled(executable, planned, args, kwargs):
            return None
        return bind_compiled(executable, planned)

    def _planned(
        self, args: tuple, kwargs: dict, run: Callable[..., Any] | None = None
    ) -> AbstractBlocked:
        """This transform with the block size (and strategy) that its budget allows for
        `run(transform, args, kwargs)`, the call planned (by default, `_run`)."""
        return self._planned_call(args, kwargs, run)[0]

    def _planned_call(
        self, args: tuple, kwargs: dict, run: Callable[..., Any] | None = None
    ) -> tuple[AbstractBlocked, Any]:
        """`_planned`, and the executable compiled for it while planning (`None` without
        a budget)."""
        if self.max_memory is None:
            return self, None
        plan, executable = compiled_plan(self._quiet, args, kwargs, run=run)
        if plan.total == 0:
            return self, executable
        return self.with_block_size(plan.block_size, plan.strategy), executable

    @property
    def strategies(self) -> tuple[Any, ...]:
        """The ways to compute a block that the planner may choose, the first preferred
        (the default, `(None,)`: one way). The planner tries them in order and takes the
        first whose compiled call fits the budget; `with_block_size` receives it."""
        return (None,)

    @abc.abstractmethod
    def work(self, *args: Any, **kwargs: Any) -> Work:
        """What the call with these arguments cuts into blocks: a `Work` with the number
        of items, their name and the result's name (for messages), and the block size
        the transform's own count option gives (all items when it has none). The
        arguments are those of the call, arrays or tracers; nothing may run here but
        shape evaluation. A sharded transform returns `Work(...).per_device(self._split)`,
        the work of one device."""

    @abc.abstractmethod
    def with_block_size(self, size: int, strategy: Any) -> AbstractBlocked:
        """This transform with `size` items per block, computed by `strategy` (one of
        `strategies`), and no budget: the transform a plan runs. Typically
        `dataclasses.replace(self, batch_size=size, max_memory=None)`."""

    @abc.abstractmethod
    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """The call, in the blocks the count or size option gives."""


class AbstractStreamable(AbstractBlocked):
    """A blocked transform whose result can leave the device block by block, as
    `zm.to_host` and `zm.to_file` take it: each block is handed to a sink instead of
    being written into a result held on the device."""

    @abc.abstractmethod
    def _streamed(self, sink: Any, *args: Any, **kwargs: Any) -> Any:
        """The call in the blocks the count or size option gives, handing each block of
        the result to `sink` (an `OutputSink`); returns the result with `None` at the
        leaves handed over."""


class AbstractSharded(AbstractStreamable):
    """The base of a blocked transform whose result may be planned from a budget,
    streamed to the host or a file (`zm.to_host`, `zm.to_file`) and spread over devices
    (`sharding`).

    The base runs the call: compiled (with `jit`), as global arrays when the mesh spans
    processes, here or over the devices, kept or streamed. A concrete transform declares
    the fields `fn`, `max_memory`, `sharding`, `jit` and `progress` and fills three
    methods: `work` and `with_block_size` (of `AbstractBlocked`) and
    `compute_share(sink, share, split, *args, **kwargs)`, which computes the result (or
    one device's share of it) with the block loops of `zodmem.contract`. It may restate
    `result_specs` where its result is not one array split like `sharding`. The page
    "Writing your own transform" of the documentation builds one.
    """

    sharding: eqx.AbstractVar[NamedSharding | None]
    jit: eqx.AbstractVar[bool]

    @abc.abstractmethod
    def compute_share(
        self, sink: Any, share: Share | None, split: Split | None, *args: Any, **kwargs: Any
    ) -> Any:
        """The result of the call with these arguments, in the blocks `work` describes.

        With `split` (how `sharding` spreads the result) and `share` (this device's
        place in it), only this device's share, which `zodmem.contract.share_of` turns
        into the block plan and the offset of its items. With `sink` (not `None`, the
        call is streamed), each finished block is handed to `sink.part(...)` through the
        block loop's `sink` argument rather than written into a result on the device."""

    def result_specs(self, spec: PartitionSpec) -> Any:
        """The partition specs of the result's parts when `sharding` has the spec `spec`
        (the default: the result is one array placed by `spec`)."""
        return spec

    @property
    def _split(self) -> Split | None:
        """How `sharding` spreads the result over devices (`None`: not at all)."""
        if self.sharding is None:
            return None
        return split_of(self.sharding, owner=type(self).__name__)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.sharding is not None:  # under jax.distributed: the inputs as global arrays
            args, kwargs = to_mesh((args, kwargs), self.sharding.mesh)
        return (_sharded_jit if self.jit else _sharded)(self, args, kwargs)

    def _streamed(self, sink: Any, *args: Any, **kwargs: Any) -> Any:
        return _sharded(self, args, kwargs, sink)


def _sharded(transform: AbstractSharded, args: tuple, kwargs: dict, sink: Any = None) -> Any:
    split = transform._split
    out_specs = None if split is None else transform.result_specs(transform.sharding.spec)

    def compute(share, split, inputs):
        args, kwargs = inputs
        return transform.compute_share(sink, share, split, *args, **kwargs)

    return dispatch(compute, (args, kwargs), split, here=sink is not None, out_specs=out_specs)


_sharded_jit = eqx.filter_jit(_sharded)
