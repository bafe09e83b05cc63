"""`Microbatcher`: a function of a batch, evaluated a microbatch at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jax.sharding import PartitionSpec
from jaxtyping import ArrayLike, Int, PyTree, jaxtyped

from .._checks import as_index, check_bool, check_callable, check_int
from .._curvature._operator import BlockedOperator, flat_product, make_operator
from .._engine._block_plans import plan_blocks
from .._engine._blocks import reduce_blocks
from .._engine._progress import label
from .._engine._sharding import (
    Split,
    batch_split,
    check_divides,
    dispatch,
    everywhere,
    to_mesh,
)
from .._plan._memory import check_size_or_memory
from .._plan._plans import Work
from .._plan._transform import AbstractBlocked
from .._pytree import split_variables
from .._traceback import public
from ._accumulate import (
    AccumulationType,
    Accumulator,
    accumulator_for,
    check_accumulator,
    is_accumulator_leaf,
    resolve,
)
from ._microbatch_checks import (
    _as_count,
    _as_indices,
    _as_tuple,
    _batch_axes,
    _batch_size,
    _check_argnames,
    _check_argnums,
    _check_in_axes,
    _check_num_real_microbatches,
    _describe,
)

__all__ = ["Microbatcher", "Accumulator", "AccumulationType"]

_OWNER = "Microbatcher"


class Microbatcher(AbstractBlocked):
    """`fn` evaluated on microbatches of its batch arguments, one after another.

    Use it where a function of a whole batch (a loss, its gradient, a Hessian, a
    forward pass) does not fit in memory: the batch arguments are cut along their
    batch axis into microbatches of `microbatch_size` examples, `fn` is evaluated
    on each in a sequential loop, and the results are combined by an accumulator.
    Peak memory is that of `fn` on one microbatch, plus the accumulated result.

    **Arguments:**

    - `fn`: the function, called as `fn(*args, **kwargs)` with microbatches in place
      of the batch arguments. It returns a pytree of arrays. It may be an Equinox
      module (or another zodmem transform).
    - `microbatch_size`: the number of examples per microbatch, a positive int. A
      size above the batch size means one microbatch. (Here and in `argnums`,
      `in_axes` and `num_real_microbatches`, NumPy integers count as ints.)
    - `max_memory`: instead of `microbatch_size`, a budget for the call's memory: an
      int (bytes), a string with a unit (`"500MB"`, `"2GiB"`) or `"auto"`. The
      microbatch size is then planned, before anything runs, as the fastest whose
      compiled call fits. Give exactly one of `microbatch_size` and `max_memory`.
    - `argnums`: the positional arguments that carry a batch axis, an int or a
      sequence of ints.
    - `argnames`: the keyword arguments that carry a batch axis, a string or a
      sequence of strings.
    - `in_axes`: the batch axis, an int for every batch argument or a sequence of
      ints, one per entry of `argnums` followed by one per entry of `argnames`. It
      applies to every array leaf of that argument; negative values count from the
      end.
    - `accumulator`: how the results of the microbatches are combined: `"sum"`,
      `"mean"`, `"running_mean"`, `"concat"` (or the `zm.AccumulationType`
      members), a `zm.Accumulator`, or a pytree of these that is a prefix of the
      output of `fn`, to combine each part of the output its own way.
    - `num_real_microbatches`: optionally the number of microbatches to evaluate,
      counted from the first: an int or an integer scalar array, which may be
      traced (so one compiled function serves batches padded to a common size).
      The other microbatches are not evaluated and do not contribute. It counts
      microbatches of `microbatch_size`, so it is refused with `max_memory`.
    - `progress`: show a progress bar on stderr (microbatches done of the total, rate,
      time left), updated from inside the compiled loop after each microbatch;
      microbatches skipped by `num_real_microbatches` count as done when passed. Off by
      default, and then nothing is added to the compiled program.

    **Sharded batches:** a batch sharded along its batch axis over a mesh is reduced
    where it lies: each device reduces its own part in microbatches, and the parts are
    combined once, by one all-reduce for `"sum"`, `"mean"` and `"running_mean"`, while
    `"concat"` leaves each device's rows where they are (the result is sharded along
    axis 0). That needs built-in accumulators, every microbatch evaluated and a
    microbatch size that divides each device's part, so that every device's
    microbatches are microbatches of the whole batch; otherwise every device reduces
    the whole batch in order, as one device would. Either way the result is the one
    device's, whatever `fn` is (a mean or a maximum per microbatch included). Batch
    arguments placed differently (one split along the batch, another replicated) are
    all split as the first split one is.

    **Returns:**

    Calling `Microbatcher(fn, ...)(*args, **kwargs)` returns the combined result:
    for `"sum"` the sum of the results, for `"mean"` their mean weighted by
    microbatch size, for `"running_mean"` the same over the evaluated microbatches
    only, for `"concat"` the results concatenated along axis 0 (a scalar result
    gives one entry per microbatch), for an `Accumulator` what its `finalize`
    returns.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import zodmem as zm

        def loss(w, x, y):
            return jnp.mean((x @ w - y) ** 2)

        w, x, y = jnp.ones(3), jnp.ones((10, 3)), jnp.arange(10.0)
        grad = zm.Microbatcher(
            jax.grad(loss), microbatch_size=4, argnums=(1, 2), accumulator="mean"
        )
        grad(w, x, y)  # equals jax.grad(loss)(w, x, y), in microbatches of 4, 4, 2
        ```

    !!! note

        The microbatch size need not divide the batch size: the examples left over
        form a last, smaller microbatch, evaluated by a second call of `fn` at that
        size (no padding). `"sum"` and `"concat"` then give exactly the sum and the
        concatenation over the whole batch, and `"mean"` and `"running_mean"` weight
        each microbatch by its number of examples, so that when `fn` returns a mean
        over its examples the result is the mean over the whole batch. `"sum"`,
        `"mean"` and `"running_mean"` need results of one shape for every
        microbatch. `num_real_microbatches` counts the smaller microbatch as one
        microbatch, the last. `"mean"` divides by the whole batch size even when
        `num_real_microbatches` stops early (microbatches not evaluated count as
        zeros); `"running_mean"` averages over the examples evaluated.

    !!! tip

        `num_real_microbatches` is a field of the module, not static configuration,
        since it may be a traced value. A traced value is taken as given (values
        past the number of microbatches run them all), a Python int above the
        number of microbatches is refused.
    """

    fn: Callable[..., Any]
    microbatch_size: int | None = eqx.field(
        default=None, static=True, kw_only=True, converter=as_index
    )
    max_memory: int | str | None = eqx.field(
        default=None, static=True, kw_only=True, converter=as_index
    )
    argnums: int | Sequence[int] = eqx.field(
        default=0, static=True, kw_only=True, converter=_as_indices
    )
    argnames: str | Sequence[str] = eqx.field(
        default=(), static=True, kw_only=True, converter=_as_tuple
    )
    in_axes: int | Sequence[int] = eqx.field(
        default=0, static=True, kw_only=True, converter=_as_indices
    )
    accumulator: Any = eqx.field(default="sum", static=True, kw_only=True)
    num_real_microbatches: Int[ArrayLike, ""] | None = eqx.field(
        default=None, kw_only=True, converter=_as_count
    )
    progress: bool = eqx.field(default=False, static=True, kw_only=True)

    @public
    def __check_init__(self):
        check_callable(self.fn, "fn", owner=_OWNER)
        check_int(self.microbatch_size, "microbatch_size", owner=_OWNER, minimum=1, optional=True)
        check_size_or_memory(
            self.microbatch_size,
            "microbatch_size",
            self.max_memory,
            owner=_OWNER,
            meaning="the examples per microbatch",
            blocks="microbatches",
        )
        _check_argnums(self.argnums)
        _check_argnames(self.argnames)
        if not self.batch_argnums and not self.batch_argnames:
            raise ValueError(
                f"{_OWNER}: there must be at least one batch argument, but argnums="
                f"{self.argnums!r} and argnames={self.argnames!r} are both empty."
            )
        _check_in_axes(self.in_axes, len(self.batch_argnums) + len(self.batch_argnames))
        check_accumulator(self.accumulator)
        _check_num_real_microbatches(self.num_real_microbatches)
        if self.max_memory is not None and self.num_real_microbatches is not None:
            count = self.num_real_microbatches
            shown = count if isinstance(count, int) else "(an array)"
            raise ValueError(
                f"{_OWNER}: num_real_microbatches={shown} counts microbatches of a size that "
                f"max_memory={self.max_memory!r} would choose, so the examples evaluated would "
                "change with the budget. To evaluate only the first examples of a batch, "
                "give `microbatch_size` with `num_real_microbatches` (and no max_memory)."
            )
        check_bool(self.progress, "progress", owner=_OWNER)

    @property
    def batch_argnums(self) -> tuple[int, ...]:
        """`argnums` as a tuple."""
        return self.argnums if isinstance(self.argnums, tuple) else (self.argnums,)

    @property
    def batch_argnames(self) -> tuple[str, ...]:
        """`argnames` as a tuple."""
        return (self.argnames,) if isinstance(self.argnames, str) else tuple(self.argnames)

    @property
    def batch_in_axes(self) -> tuple[int, ...]:
        """`in_axes` as a tuple, one per batch argument (`argnums`, then `argnames`)."""
        count = len(self.batch_argnums) + len(self.batch_argnames)
        return self.in_axes if isinstance(self.in_axes, tuple) else (self.in_axes,) * count

    @jaxtyped(typechecker=beartype)
    @public
    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        return self._call(args, kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        # Read here, where the arrays are concrete: traced, an array shows its sharding
        # only over explicit mesh axes.
        split = _batch_split(_batch_of(self, args, kwargs))
        if split is not None:  # under jax.distributed: the other inputs as global arrays
            args, kwargs = to_mesh((args, kwargs), split.mesh)
        return _microbatch_jit(self, args, kwargs, split)

    def work(self, *args: Any, **kwargs: Any) -> Work:
        batch = _batch_of(self, args, kwargs)
        total = _batch_size(batch)
        size = total if self.microbatch_size is None else min(self.microbatch_size, total)
        split = _batch_split(batch, planned=True)
        return Work(total, "examples", "result", size).per_device(split)

    def with_block_size(self, size: int, strategy: Any) -> Microbatcher:
        return dataclasses.replace(self, microbatch_size=size, max_memory=None)

    @public
    def operator(self, *args: Any, **kwargs: Any) -> BlockedOperator:
        """The summed or mean matrix of `fn` over the batch, as a `lineax` linear
        operator: each product runs over the microbatches one after another, so it
        takes one microbatch's memory, never the whole batch's.

        Use it around a transform that has an operator (`zm.BatchedHessian`,
        `zm.BatchedJacobian`), for a curvature of a dataset loss that is only multiplied
        by vectors: `Microbatcher(BatchedHessian(loss), microbatch_size=m, argnums=(1, 2),
        accumulator="mean").operator(w, xs, ys)` multiplies by the Hessian of the mean
        loss. Its products (`mv`, `mm`) and tags are those of `fn`'s operator; `mm`
        cuts the vectors into blocks as `fn`'s options say (`nbatches`, `batch_size`,
        `max_memory`) and takes each block through the microbatches once; `as_matrix()`
        is this transform's call.

        **Arguments:** as for the call; the first positional argument is the point `x`,
        which may not be a batch argument. The accumulator must be `"sum"`, `"mean"` or
        `"running_mean"`, and the microbatch size given (`microbatch_size`).

        **Returns:**

        A `lineax.AbstractLinearOperator`, the one of `fn` summed or averaged over
        the batch.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            def loss(w, x, y):
                return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

            w, x, y = jnp.full(3, 0.1), jnp.ones((10, 3)), jnp.arange(10.0)
            hessian = zm.Microbatcher(
                zm.BatchedHessian(loss), microbatch_size=4, argnums=(1, 2), accumulator="mean"
            )
            op = hessian.operator(w, x, y)   # the Hessian of the mean loss over 10 examples
            op.mv(jnp.ones(3))               # one product, in microbatches of 4, 4 and 2
            ```
        """
        if not args:
            raise TypeError(
                f"{_OWNER}.operator: give the point `x` as the first positional argument "
                "(the variables of the operator), then the arguments of `fn`."
            )
        x, rest = args[0], args[1:]
        inner = _inner_operator(self, x, rest, kwargs)
        return make_operator(
            self, _microbatch_products, x, rest, kwargs, square=inner.square, tags=inner.tags
        )


# ----------------------------------------------------------------------------------
# Validation at construction (integers were read by `as_index` already)


# ----------------------------------------------------------------------------------
# The computation


def _batch_of(transform: Microbatcher, args: tuple, kwargs: dict) -> list:
    """`(where, value, axes)` for each batch argument of the call, checked."""
    positions: list[int | str] = [*transform.batch_argnums, *transform.batch_argnames]
    batch = []
    for position, axis in zip(positions, transform.batch_in_axes, strict=True):
        if isinstance(position, int) and position >= len(args):
            raise ValueError(
                f"{_OWNER}: argnums={transform.argnums!r} names positional argument "
                f"{position}, but the call passed {len(args)} positional argument(s)."
            )
        if isinstance(position, str) and position not in kwargs:
            raise ValueError(
                f"{_OWNER}: argnames={transform.argnames!r} names keyword argument {position!r}, "
                f"but the call passed keyword arguments {sorted(kwargs)}."
            )
        value = args[position] if isinstance(position, int) else kwargs[position]
        where = _describe(position)
        batch.append((where, value, _batch_axes(value, axis, where)))

    return batch


def _batch_split(batch: list, planned: bool = False) -> Split | None:
    """How the batch arguments are spread over devices along their batch axes, if at all
    (`planned`: as `batch_split`)."""
    leaves, axes = [], []
    for _, value, value_axes in batch:
        leaves.extend(jax.tree_util.tree_leaves(value))
        axes.extend(jax.tree_util.tree_leaves(value_axes))
    return batch_split(leaves, axes, planned=planned)


# How each built-in accumulator combines the devices' results, once.
_ACROSS_DEVICES = {
    AccumulationType.SUM: jax.lax.psum,
    # Every device reduces as many examples, so the mean is the mean of their means.
    AccumulationType.MEAN: jax.lax.pmean,
    AccumulationType.RUNNING_MEAN: jax.lax.pmean,
    AccumulationType.CONCAT: None,  # the devices' rows stay where they are
}


def _kinds_per_leaf(transform: Microbatcher, output: Any) -> list:
    """The accumulator of each output leaf."""
    kinds, treedef = jax.tree_util.tree_flatten(transform.accumulator, is_leaf=is_accumulator_leaf)
    per_leaf = []
    for kind, subtree in zip(kinds, treedef.flatten_up_to(output), strict=True):
        per_leaf.extend([resolve(kind)] * len(jax.tree_util.tree_leaves(subtree)))
    return per_leaf


def _microbatch(
    transform: Microbatcher, args: tuple, kwargs: dict, split: Split | None = None
) -> Any:
    batch = _batch_of(transform, args, kwargs)
    if split is None:
        split = _batch_split(batch)
    if split is None:
        return dispatch(_whole_batch(transform, batch), (args, kwargs))
    check_divides(_batch_size(batch), split, owner=_OWNER, what="examples of the batch")
    local = _batch_size(batch) // split.count
    size = transform.microbatch_size
    # Each device reduces its own part of the batch, then the parts are combined once;
    # that gives the same result when the accumulators are built in and each device's
    # microbatches are the batch's own: `fn` need not be additive over examples (a mean
    # per microbatch changes with how the examples are grouped).
    options = [
        resolve(kind)
        for kind in jax.tree_util.tree_leaves(transform.accumulator, is_leaf=is_accumulator_leaf)
    ]
    local_ok = (
        all(isinstance(kind, AccumulationType) for kind in options)
        and transform.num_real_microbatches is None
        and size is not None
        and local % size == 0
    )
    if not local_ok:
        # Every device reduces the whole batch, in order, as one device would.
        return dispatch(_whole_batch(transform, batch), (args, kwargs), everywhere(split.mesh))
    positions = [*transform.batch_argnums, *transform.batch_argnames]

    def specs_of(value, axes):
        return jax.tree_util.tree_map(lambda leaf, a: split.spec(jnp.ndim(leaf), a), value, axes)

    def compute(share, split, inputs):
        args, kwargs = inputs
        result = _microbatch_local(transform, args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(result)
        combined = [
            leaf if _ACROSS_DEVICES[kind] is None else _ACROSS_DEVICES[kind](leaf, split.axes)
            for leaf, kind in zip(leaves, _kinds_per_leaf(transform, result), strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, combined)

    def in_specs(arrays):
        specs = jax.tree_util.tree_map(lambda _: PartitionSpec(), arrays)
        arg_specs, kwarg_specs = list(specs[0]), dict(specs[1])
        for position, (_, value, axes) in zip(positions, batch, strict=True):
            if isinstance(position, int):
                arg_specs[position] = specs_of(value, axes)
            else:
                kwarg_specs[position] = specs_of(value, axes)
        return tuple(arg_specs), kwarg_specs

    def out_specs(shapes):
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        specs = [
            split.spec(leaf.ndim, 0) if kind is AccumulationType.CONCAT else PartitionSpec()
            for leaf, kind in zip(leaves, _kinds_per_leaf(transform, shapes), strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, specs)

    return dispatch(compute, (args, kwargs), split, in_specs=in_specs, out_specs=out_specs)


def _whole_batch(transform: Microbatcher, batch: list) -> Any:
    """The reduction of the whole batch, by one device or by each of a mesh's; `batch`,
    the inputs' layout here, is that of the one device's inputs (a device of a mesh reads
    its own)."""

    def whole(share, split, inputs):
        return _microbatch_local(transform, *inputs, batch if share is None else None)

    return whole


def _microbatch_local(
    transform: Microbatcher, args: tuple, kwargs: dict, batch: list | None = None
) -> Any:
    """The reduction of the batch as this device holds it, microbatch by microbatch."""
    if batch is None:
        batch = _batch_of(transform, args, kwargs)
    positions: list[int | str] = [*transform.batch_argnums, *transform.batch_argnames]
    plan = plan_blocks(
        _batch_size(batch), batch_size=transform.microbatch_size, batch_size_name="microbatch_size"
    )
    num_blocks = transform.num_real_microbatches
    if isinstance(num_blocks, int) and num_blocks > plan.num_blocks:
        raise ValueError(
            f"{_OWNER}: num_real_microbatches={num_blocks} is more than the "
            f"{plan.num_blocks} microbatch(es) of a batch of {plan.total} in microbatches "
            f"of {transform.microbatch_size}."
        )

    def read(start, size):
        """The microbatch's slices of the batch arguments."""
        return [
            jax.tree_util.tree_map(
                lambda x, a: jax.lax.dynamic_slice_in_dim(x, start, size, axis=a), value, axes
            )
            for _, value, axes in batch
        ]

    def block_fn(start, size, pieces):
        call_args, call_kwargs = list(args), dict(kwargs)
        for position, piece in zip(positions, pieces, strict=True):
            if isinstance(position, int):
                call_args[position] = piece
            else:
                call_kwargs[position] = piece
        return transform.fn(*call_args, **call_kwargs)

    def shapes(size):
        return jax.eval_shape(lambda s: block_fn(s, size, read(s, size)), jnp.asarray(0, jnp.int32))

    full = shapes(plan.block_size)
    last = shapes(plan.remainder) if plan.remainder else None
    acc_def = jax.tree_util.tree_structure(transform.accumulator, is_leaf=is_accumulator_leaf)
    try:
        acc_def.flatten_up_to(full)
        if last is not None:
            acc_def.flatten_up_to(last)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{_OWNER}: `accumulator` must be a pytree prefix of the output of `fn`, but "
            f"the accumulator has structure {acc_def} and the output has structure "
            f"{jax.tree_util.tree_structure(full)}."
        ) from error

    accumulator = accumulator_for(transform.accumulator, plan, last)

    def update(carry, result, index, size):
        return accumulator.update(carry, result, index)

    init = accumulator.init(full)
    carry = reduce_blocks(
        block_fn, plan, init, update, num_blocks=num_blocks, read=read, progress=label(transform)
    )
    return accumulator.finalize(carry)


_microbatch_jit = eqx.filter_jit(_microbatch)


# ----------------------------------------------------------------------------------
# Operators: `fn`'s operator summed or averaged over the microbatches


def _inner_operator(transform: Microbatcher, x: Any, args: tuple, kwargs: dict) -> Any:
    """`fn`'s operator at the whole batch, for its shapes and tags, after the checks."""
    owner = f"{_OWNER}.operator"
    if not callable(getattr(transform.fn, "operator", None)):
        raise TypeError(
            f"{owner}: `fn` must have an operator (a zm.BatchedHessian or "
            f"zm.BatchedJacobian, say), but it is {type(transform.fn).__name__}, which has "
            "no `operator` method."
        )
    if 0 in transform.batch_argnums:
        raise ValueError(
            f"{owner}: argnums={transform.argnums!r} makes the first argument, the point "
            "`x` whose variables the operator acts on, a batch argument; the batch "
            "arguments are the data that follow it, e.g. argnums=(1, 2)."
        )
    if transform.microbatch_size is None:
        raise ValueError(
            f"{owner}: give `microbatch_size`: max_memory={transform.max_memory!r} plans "
            "the microbatches of the call, whose memory differs from a product's."
        )
    kinds = jax.tree_util.tree_leaves(transform.accumulator, is_leaf=is_accumulator_leaf)
    allowed = (AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.RUNNING_MEAN)
    if not all(resolve(kind) in allowed for kind in kinds):
        raise ValueError(
            f"{owner}: accumulator={transform.accumulator!r} does not combine the "
            "microbatches' matrices into one; use 'sum', 'mean' or 'running_mean'."
        )
    # At one microbatch's shapes, placed nowhere: as each microbatch will be seen.
    call_args, call_kwargs = [x, *args], dict(kwargs)
    size = min(transform.microbatch_size, _batch_size(_batch_of(transform, (x, *args), kwargs)))
    positions = [*transform.batch_argnums, *transform.batch_argnames]
    for position, axis in zip(positions, transform.batch_in_axes, strict=True):
        holder = call_args if isinstance(position, int) else call_kwargs

        def shrink(leaf, axis=axis):
            shape = list(jnp.shape(leaf))
            shape[axis % len(shape)] = size
            return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

        holder[position] = jax.tree_util.tree_map(shrink, holder[position])

    def inner(x, args, kwargs):
        return transform.fn.operator(x, *args, **kwargs)

    return eqx.filter_eval_shape(inner, call_args[0], tuple(call_args[1:]), call_kwargs)


class _ProductAt(eqx.Module):
    """`fn`'s operator at a microbatch, times `vector`: the function reduced over the
    microbatches for one product."""

    inner: Any
    vector: Any

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return flat_product(self.inner.operator(x, *args, **kwargs), self.vector)


def _microbatch_products(transform: Microbatcher, x: Any, args: tuple, kwargs: dict) -> tuple:
    """`(flat, variables, mv)`: `mv(v)` reduces `fn`'s product with `v` over the
    microbatches, one microbatch at a time."""
    flat, variables = split_variables(x, owner=f"{_OWNER}.operator")

    def mv(vector):
        per_microbatch = dataclasses.replace(transform, fn=_ProductAt(transform.fn, vector))
        return _microbatch(per_microbatch, (x, *args), kwargs)

    return flat, variables, mv
