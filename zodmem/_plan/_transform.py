"""`AbstractTransform`, the base of every zodmem transform, and `AbstractDerivative`,
the configuration and the checks that `BatchedJacobian` and `BatchedHessian` share."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .._checks import as_index, check_block_options, check_bool, check_callable, check_choice
from .._engine._progress import closing_bars
from .._engine._sharding import Kept, Share, Split, check_sharding, dispatch, split_of, to_mesh
from .._pytree import Variables
from .._traceback import public
from ._budget import Plan, Work, compiled_plan, make_plan
from ._compiled import bind_compiled, runs_compiled
from ._memory import check_memory

__all__ = [
    "AbstractTransform",
    "AbstractBlocked",
    "AbstractStreamable",
    "AbstractSharded",
    "AbstractDerivative",
    "product_function",
    "split_aux",
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
        plan the chosen blocks is the one that runs, where it can (`_planned_bound`). The
        bars of a run that fails are closed, not left for the next run to draw beneath."""
        with closing_bars():
            planned, bound = self._planned_bound(args, kwargs)
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
        if executable is None or self.progress:
            return planned, None
        if not runs_compiled(executable, planned, args, kwargs):
            return planned, None
        return planned, bind_compiled(executable, planned)

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


class AbstractDerivative(AbstractSharded):
    """The configuration shared by `BatchedJacobian` and `BatchedHessian`.

    Both differentiate `fn` with respect to its first argument, in blocks of
    products planned from `nbatches`, `batch_size` or `max_memory`, in forward or
    reverse mode.
    """

    fn: Callable[..., Any]
    nbatches: int | None = eqx.field(default=None, static=True, kw_only=True, converter=as_index)
    batch_size: int | None = eqx.field(default=None, static=True, kw_only=True, converter=as_index)
    max_memory: int | str | None = eqx.field(
        default=None, static=True, kw_only=True, converter=as_index
    )
    strategy: Literal["auto", "linearize", "recompute"] = eqx.field(
        default="auto", static=True, kw_only=True
    )
    mode: Literal["auto", "fwd", "rev"] = eqx.field(default="auto", static=True, kw_only=True)
    holomorphic: bool = eqx.field(default=False, static=True, kw_only=True)
    has_aux: bool = eqx.field(default=False, static=True, kw_only=True)
    jit: bool = eqx.field(default=True, static=True, kw_only=True)
    checkpoint: bool = eqx.field(default=False, static=True, kw_only=True)
    sharding: NamedSharding | None = eqx.field(default=None, static=True, kw_only=True)
    progress: bool = eqx.field(default=False, static=True, kw_only=True)

    @public
    def __check_init__(self):
        owner = type(self).__name__
        check_sharding(self.sharding, owner=owner)
        check_callable(self.fn, "fn", owner=owner)
        check_block_options(self.nbatches, self.batch_size, owner=owner)
        check_memory(self.max_memory, owner=owner)
        if self.max_memory is not None and (self.nbatches, self.batch_size) != (None, None):
            given = "nbatches" if self.nbatches is not None else "batch_size"
            raise ValueError(
                f"{owner}: give at most one of `nbatches`, `batch_size` and `max_memory`, "
                f"got {given}={getattr(self, given)} and max_memory={self.max_memory!r}."
            )
        if self.max_memory is not None and not self.jit:
            raise ValueError(
                f"{owner}: max_memory={self.max_memory!r} plans the blocks of the compiled "
                "call, but with jit=False the call runs op by op, whose memory no plan "
                "describes. Leave jit=True with a budget, or give nbatches or batch_size."
            )
        check_choice(self.strategy, "strategy", ("auto", "linearize", "recompute"), owner=owner)
        check_choice(self.mode, "mode", ("auto", "fwd", "rev"), owner=owner)
        for name in ("holomorphic", "has_aux", "jit", "checkpoint", "progress"):
            check_bool(getattr(self, name), name, owner=owner)

    @property
    def strategies(self) -> tuple[str, ...]:
        # Keeping one linearisation is faster; recomputing is the way out when its
        # residuals leave no room for a block.
        if self.strategy != "auto":
            return (self.strategy,)
        return ("linearize", "recompute") if self.max_memory is not None else ("linearize",)

    def with_block_size(self, size: int, strategy: Any) -> AbstractDerivative:
        return dataclasses.replace(
            self, nbatches=None, batch_size=size, max_memory=None, strategy=strategy
        )

    def result_specs(self, spec: PartitionSpec) -> Any:
        return (spec, PartitionSpec()) if self.has_aux else spec

    def _split_mode(self, mode: str, what: str) -> str:
        """`mode`, the one that makes the axis `sharding` splits (rows by VJPs: `"rev"`,
        columns by JVPs: `"fwd"`), unless the transform was given the other."""
        if self.mode not in ("auto", mode):
            made = "rows" if self.mode == "rev" else "columns"
            split = "rows" if mode == "rev" else "columns"
            raise ValueError(
                f"{type(self).__name__}: mode={self.mode!r} makes the {what} in blocks of "
                f"{made}, but `sharding` ({self.sharding.spec}) splits its {split} over the "
                f"devices, and each device makes whole {split} of its share. Use "
                f"mode={mode!r} or 'auto' with this sharding."
            )
        return mode

    def _products(self, fn: Callable[[Any], Any], primal: Any, *, reverse: bool) -> tuple:
        """`(out, product, aux)` of `product_function` with this transform's `has_aux`
        and strategy (`"auto"` keeps one linearisation)."""
        return product_function(
            fn,
            primal,
            reverse=reverse,
            has_aux=self.has_aux,
            recompute=self.strategy == "recompute",
        )

    def _check_variables(self, variables: Variables) -> None:
        """Refuse complex variables unless `holomorphic`, and real ones with it, as
        `jax.jacfwd`/`jax.jacrev`/`jax.hessian` do."""
        owner = type(self).__name__
        for name, dtype in zip(variables.names, variables.dtypes, strict=True):
            is_complex = jnp.issubdtype(dtype, jnp.complexfloating)
            if self.holomorphic and not is_complex:
                raise TypeError(
                    f"{owner}: with holomorphic=True every variable must be complex, as in "
                    f"jax.jacfwd(holomorphic=True), but x{name} has dtype {dtype}. Cast it "
                    "to a complex dtype, or leave holomorphic=False."
                )
            if not self.holomorphic and is_complex:
                raise TypeError(
                    f"{owner}: x{name} has the complex dtype {dtype}. As in jax.jacfwd and "
                    "jax.jacrev, complex variables are differentiated only with "
                    "holomorphic=True (for holomorphic functions); for a function that is "
                    "not holomorphic, split the variables into real and imaginary parts."
                )

    def _output_shapes(self, fn_of_flat: Callable[[Any], Any], flat: Any, what: str) -> Any:
        """The shapes of what `fn` returns (without `aux`), checking that it returns a pair
        `(what, aux)` when `has_aux`. Leaves that are not arrays are kept as they are."""
        shapes = eqx.filter_eval_shape(fn_of_flat, flat)
        if self.has_aux:
            if not (isinstance(shapes, tuple) and len(shapes) == 2):
                raise TypeError(
                    f"{type(self).__name__}: with has_aux=True, `fn` must return a pair "
                    f"({what}, aux), but it returned {shapes}."
                )
            shapes = shapes[0]
        return shapes

    def _check_outputs(self, outputs: Any, what: str) -> None:
        """Refuse outputs that cannot be differentiated: integer ones, and real ones with
        `holomorphic=True` (as `jax.jacfwd(holomorphic=True)` does)."""
        owner = type(self).__name__
        paths_leaves = jax.tree_util.tree_flatten_with_path(outputs)[0]
        for path, leaf in paths_leaves:
            where = f"{what}{jax.tree_util.keystr(path)}"
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise TypeError(
                    f"{owner}: `fn` must return floating-point (or complex) arrays to be "
                    f"differentiated, but one output leaf has dtype {leaf.dtype} and shape "
                    f"{leaf.shape} ({where})."
                )
            if self.holomorphic and not jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                raise TypeError(
                    f"{owner}: with holomorphic=True `fn` must return complex arrays, as in "
                    f"jax.jacfwd(holomorphic=True), but {where} has dtype {leaf.dtype}."
                )


def split_aux(fn: Callable[[Any], tuple[Any, Any]]) -> tuple[Callable, Callable]:
    """`fn` returning `(out, aux)`, as a function whose `aux` holds only arrays (the
    other leaves ride in its structure, as `Kept`), and the function that puts them back.

    JAX's transforms and loops carry arrays only; a string, an int or `None` in `aux`
    is returned unchanged, as `jax.jacrev` does.
    """

    def arrays_only(z):
        result = fn(z)
        if not (isinstance(result, tuple) and len(result) == 2):
            return result  # not a pair: refused by the caller, with what it returned
        out, aux = result
        arrays, others = eqx.partition(aux, eqx.is_array)
        return out, (arrays, Kept(others))

    def restore(aux: Any) -> Any:
        arrays, others = aux
        return eqx.combine(arrays, others.value)

    return arrays_only, restore


def product_function(
    fn: Callable[[Any], Any], primal: Any, *, reverse: bool, has_aux: bool, recompute: bool
) -> tuple[Any, Callable[[Any], Any], Any]:
    """`(out, product, aux)`: `product(v)` is the JVP of `fn` at `primal` with the tangent
    `v` (or, with `reverse`, its VJP with the cotangent `v`).

    By default `fn` is linearised once (`jax.linearize`, `jax.vjp`) and its residuals
    are kept for every product. With `recompute`, each product evaluates `fn` again
    (`jax.jvp`, `jax.vjp` inside the product): nothing of `fn`'s forward pass outlives a
    block, at the cost of one more forward pass per block; `out` is then the outputs'
    shapes (`jax.ShapeDtypeStruct`s).
    """
    if not recompute:
        if reverse:
            if has_aux:
                out, vjp, aux = jax.vjp(fn, primal, has_aux=True)
            else:
                (out, vjp), aux = jax.vjp(fn, primal), None
            return out, lambda cotangent: vjp(cotangent)[0], aux
        if has_aux:
            out, jvp, aux = jax.linearize(fn, primal, has_aux=True)
        else:
            (out, jvp), aux = jax.linearize(fn, primal), None
        return out, jvp, aux

    def value(z):
        return fn(z)[0] if has_aux else fn(z)

    out = jax.eval_shape(value, primal)
    aux = fn(primal)[1] if has_aux else None
    if reverse:
        return out, lambda cotangent: jax.vjp(value, primal)[1](cotangent)[0], aux
    return out, lambda tangent: jax.jvp(value, (primal,), (tangent,))[1], aux
