"""`Microbatcher`: a function of a batch, evaluated a microbatch at a time."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import ArrayLike, Int, PyTree, jaxtyped

from ._blocks import plan_blocks, reduce_blocks
from ._transform import AbstractTransform, check_callable

__all__ = ["Microbatcher", "Accumulator", "AccumulationType", "aggregate_stacked"]

_OWNER = "Microbatcher"


class AccumulationType(enum.Enum):
    """The built-in ways for `Microbatcher` to combine the results of its microbatches.

    Each member has a string form (its value) that `Microbatcher` accepts as well:

    - `SUM` (`"sum"`): add the results up.
    - `MEAN` (`"mean"`): the mean over the whole batch of per-microbatch means,
      each microbatch weighted by its number of examples.
    - `RUNNING_MEAN` (`"running_mean"`): like `MEAN`, but over the microbatches that
      were evaluated only (they differ when `num_real_microbatches` stops early).
    - `CONCAT` (`"concat"`): concatenate the results along their axis 0.
    """

    SUM = "sum"
    MEAN = "mean"
    RUNNING_MEAN = "running_mean"
    CONCAT = "concat"


class Accumulator(eqx.Module):
    """A user-defined way to combine the results of microbatches.

    Given the results `r_0, ..., r_{k-1}` of the microbatches evaluated, in order, it
    stands for

    ```python
    carry = init(shapes_of_one_result)
    for i in range(k):
        carry = update(carry, r_i, i)
    result = finalize(carry)
    ```

    **Arguments:**

    - `init`: `init(shapes)`, the starting carry, from a pytree of
      `jax.ShapeDtypeStruct` describing the result of one full microbatch.
    - `update`: `update(carry, value, index)`, the carry after the microbatch
      `index` (a traced int) gave `value`. It must return arrays of the carry's
      shapes and dtypes.
    - `finalize`: `finalize(carry)`, the combined result.
    - `aggregate`: `aggregate(values)`, the same combination done in one go on
      values stacked along axis 0 (used by `zodmem.compat.optax.micro_vmap` inside a
      microbatch). Optional for `Microbatcher`.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        largest = zm.Accumulator(
            init=lambda s: jnp.full(s.shape, -jnp.inf, s.dtype),
            update=lambda carry, value, index: jnp.maximum(carry, value),
            finalize=lambda carry: carry,
            aggregate=lambda values: jnp.max(values, axis=0),
        )
        worst = zm.Microbatcher(jnp.max, microbatch_size=4, accumulator=largest)
        worst(jnp.arange(10.0))  # 9.0
        ```

    !!! warning

        When the microbatch size does not divide the batch size, `update` also
        receives the result of the last, smaller microbatch, whose shape may differ
        from the shapes given to `init` if `fn` returns per-example values.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], Any]
    finalize: Callable[[Any], Any]
    aggregate: Callable[[Any], Any] | None = None

    def __check_init__(self):
        for name in ("init", "update", "finalize"):
            check_callable(getattr(self, name), name, owner="Accumulator")
        if self.aggregate is not None:
            check_callable(self.aggregate, "aggregate", owner="Accumulator")


def _is_accumulator_leaf(node: Any) -> bool:
    return node is None or isinstance(node, (str, AccumulationType, Accumulator))


def _as_tuple(value: Any) -> Any:
    """Turn a list (or other non-string sequence) into a tuple; leave the rest as is."""
    if isinstance(value, Sequence) and not isinstance(value, (str, tuple)):
        return tuple(value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Microbatcher(AbstractTransform):
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
      size above the batch size means one microbatch.
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
      The other microbatches are not evaluated and do not contribute.

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
    microbatch_size: int = eqx.field(static=True, kw_only=True)
    argnums: int | Sequence[int] = eqx.field(
        default=0, static=True, kw_only=True, converter=_as_tuple
    )
    argnames: str | Sequence[str] = eqx.field(
        default=(), static=True, kw_only=True, converter=_as_tuple
    )
    in_axes: int | Sequence[int] = eqx.field(
        default=0, static=True, kw_only=True, converter=_as_tuple
    )
    accumulator: Any = eqx.field(default="sum", static=True, kw_only=True)
    num_real_microbatches: Int[ArrayLike, ""] | None = eqx.field(default=None, kw_only=True)

    def __check_init__(self):
        check_callable(self.fn, "fn", owner=_OWNER)
        _check_microbatch_size(self.microbatch_size)
        _check_argnums(self.argnums)
        _check_argnames(self.argnames)
        if not self.batch_argnums and not self.batch_argnames:
            raise ValueError(
                f"{_OWNER}: there must be at least one batch argument, but argnums="
                f"{self.argnums!r} and argnames={self.argnames!r} are both empty."
            )
        _check_in_axes(self.in_axes, len(self.batch_argnums) + len(self.batch_argnames))
        _check_accumulator(self.accumulator)
        _check_num_real_microbatches(self.num_real_microbatches)

    @property
    def batch_argnums(self) -> tuple[int, ...]:
        """`argnums` as a tuple."""
        return (self.argnums,) if _is_int(self.argnums) else tuple(self.argnums)

    @property
    def batch_argnames(self) -> tuple[str, ...]:
        """`argnames` as a tuple."""
        return (self.argnames,) if isinstance(self.argnames, str) else tuple(self.argnames)

    @property
    def batch_in_axes(self) -> tuple[int, ...]:
        """`in_axes` as a tuple, one per batch argument (`argnums`, then `argnames`)."""
        count = len(self.batch_argnums) + len(self.batch_argnames)
        return (self.in_axes,) * count if _is_int(self.in_axes) else tuple(self.in_axes)

    @jaxtyped(typechecker=beartype)
    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        return _microbatch_jit(self, args, kwargs)


# ----------------------------------------------------------------------------------
# Validation at construction


def _check_microbatch_size(value: Any) -> None:
    if not _is_int(value):
        raise TypeError(
            f"{_OWNER}: `microbatch_size` must be a positive int, got {value!r} of type "
            f"{type(value).__name__}."
        )
    if value <= 0:
        raise ValueError(
            f"{_OWNER}: `microbatch_size` must be a positive int, got microbatch_size={value}."
        )


def _check_argnums(value: Any) -> None:
    items = (value,) if _is_int(value) else value
    if not isinstance(items, tuple) or not all(_is_int(i) for i in items):
        raise TypeError(
            f"{_OWNER}: `argnums` must be an int or a sequence of ints (positional "
            f"argument indices), got {value!r}."
        )
    if any(i < 0 for i in items):
        raise ValueError(
            f"{_OWNER}: `argnums` must hold non-negative indices, got argnums={value!r}."
        )
    if len(set(items)) != len(items):
        raise ValueError(f"{_OWNER}: `argnums` has repeated indices: argnums={value!r}.")


def _check_argnames(value: Any) -> None:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, tuple) or not all(isinstance(n, str) for n in items):
        raise TypeError(
            f"{_OWNER}: `argnames` must be a string or a sequence of strings (keyword "
            f"argument names), got {value!r}."
        )
    if len(set(items)) != len(items):
        raise ValueError(f"{_OWNER}: `argnames` has repeated names: argnames={value!r}.")


def _check_in_axes(value: Any, count: int) -> None:
    if _is_int(value):
        return
    if not isinstance(value, tuple) or not all(_is_int(a) for a in value):
        raise TypeError(f"{_OWNER}: `in_axes` must be an int or a sequence of ints, got {value!r}.")
    if len(value) != count:
        raise ValueError(
            f"{_OWNER}: `in_axes` must have one entry per batch argument (argnums, then "
            f"argnames): {count} expected, got in_axes={value!r}."
        )


_KNOWN = ", ".join(repr(a.value) for a in AccumulationType)


def _check_accumulator(tree: Any) -> None:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_accumulator_leaf)
    if not leaves:
        raise ValueError(
            f"{_OWNER}: `accumulator` must be one of {_KNOWN}, an AccumulationType, an "
            f"Accumulator, or a pytree of these; got {tree!r}, which holds none."
        )
    for leaf in leaves:
        _resolve(leaf)


def _resolve(leaf: Any) -> AccumulationType | Accumulator:
    """The accumulator a leaf of the `accumulator` tree names (refuse unknown ones)."""
    if isinstance(leaf, (AccumulationType, Accumulator)):
        return leaf
    if isinstance(leaf, str):
        try:
            return AccumulationType(leaf)
        except ValueError:
            pass
    raise ValueError(
        f"{_OWNER}: unknown accumulator {leaf!r}. An accumulator is one of {_KNOWN}, an "
        "AccumulationType member or an Accumulator (or a pytree of these)."
    )


def _check_num_real_microbatches(value: Any) -> None:
    if value is None:
        return
    if _is_int(value):
        if value < 0:
            raise ValueError(
                f"{_OWNER}: `num_real_microbatches` must be non-negative, got "
                f"num_real_microbatches={value}."
            )
        return
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or shape != ():
        raise TypeError(
            f"{_OWNER}: `num_real_microbatches` must be None, an int or an integer scalar "
            f"array, got {value!r}."
        )


# ----------------------------------------------------------------------------------
# Built-in accumulators. Each works on the part of the output that one leaf of the
# `accumulator` tree covers: `init(full, last)` from the shapes of a full microbatch's
# result and of the last, smaller one's (None when there is none),
# `update(carry, value, index, size)`, `finalize(carry)`.


class _Sum:
    name = "sum"

    def __init__(self, plan):
        self.plan = plan

    def check(self, full, last):
        if last is None:
            return
        for f, s in zip(
            jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(last), strict=True
        ):
            if f.shape != s.shape:
                raise ValueError(
                    f"{_OWNER}: accumulator {self.name!r} needs results of one shape from "
                    f"every microbatch, but an output leaf has shape {f.shape} for a "
                    f"microbatch of {self.plan.block_size} examples and {s.shape} for the "
                    f"last microbatch of {self.plan.remainder}. Use 'concat' for results "
                    "with one entry per example, or a microbatch_size that divides the "
                    f"batch size {self.plan.total}."
                )

    def init(self, full, last):
        self.check(full, last)
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), full)

    def update(self, carry, value, index, size):
        return jax.tree_util.tree_map(lambda c, v: (c + v).astype(c.dtype), carry, value)

    def finalize(self, carry):
        return carry


class _Mean(_Sum):
    name = "mean"

    def check(self, full, last):
        for leaf in jax.tree_util.tree_leaves(full):
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise ValueError(
                    f"{_OWNER}: accumulator {self.name!r} needs floating-point (or complex) "
                    f"results, but an output leaf has dtype {leaf.dtype} and shape "
                    f"{leaf.shape}. Use 'sum' for integer results, or return floats."
                )
        super().check(full, last)

    def update(self, carry, value, index, size):
        if size == self.plan.block_size:
            return super().update(carry, value, index, size)
        weight = size / self.plan.block_size
        return jax.tree_util.tree_map(lambda c, v: (c + v * weight).astype(c.dtype), carry, value)

    def finalize(self, carry):
        plan = self.plan
        # Divide by an int when every microbatch is full: the plain mean of the results.
        count = plan.num_blocks if plan.remainder == 0 else plan.total / plan.block_size
        return jax.tree_util.tree_map(lambda c: c / count, carry)


class _RunningMean(_Mean):
    name = "running_mean"

    def update(self, carry, value, index, size):
        seen = index * self.plan.block_size

        def mix(c, v):
            real = jnp.finfo(c.dtype).dtype
            keep = (seen / (seen + size)).astype(real)
            return (c * keep + v * (1 - keep)).astype(c.dtype)

        return jax.tree_util.tree_map(mix, carry, value)

    def finalize(self, carry):
        return carry


class _Concat:
    def __init__(self, plan):
        self.plan = plan

    def _rows(self, full, last):
        """Rows each full microbatch writes, checking that the last one fits."""
        if full.ndim == 0:
            if last is not None and last.ndim != 0:
                raise ValueError(
                    f"{_OWNER}: accumulator 'concat' got a scalar result from a full "
                    f"microbatch and shape {last.shape} from the last one."
                )
            return 1
        if last is not None and (last.ndim == 0 or last.shape[1:] != full.shape[1:]):
            raise ValueError(
                f"{_OWNER}: accumulator 'concat' joins results along axis 0, so they must "
                f"agree on the other axes, but an output leaf has shape {full.shape} for a "
                f"microbatch of {self.plan.block_size} examples and {last.shape} for the "
                f"last microbatch of {self.plan.remainder}."
            )
        return full.shape[0]

    def init(self, full, last):
        lasts = (
            jax.tree_util.tree_leaves(last)
            if last is not None
            else [None] * len(jax.tree_util.tree_leaves(full))
        )
        self.rows = [
            self._rows(f, s) for f, s in zip(jax.tree_util.tree_leaves(full), lasts, strict=True)
        ]

        def buffer(f, s, rows):
            total = rows * self.plan.num_full_blocks
            if s is not None:
                total += s.shape[0] if s.ndim else 1
            return jnp.zeros((total, *f.shape[1:]), f.dtype)

        leaves, treedef = jax.tree_util.tree_flatten(full)
        return jax.tree_util.tree_unflatten(
            treedef, [buffer(f, s, r) for f, s, r in zip(leaves, lasts, self.rows, strict=True)]
        )

    def update(self, carry, value, index, size):
        carries, treedef = jax.tree_util.tree_flatten(carry)
        values = treedef.flatten_up_to(value)
        written = []
        for buf, piece, rows in zip(carries, values, self.rows, strict=True):
            piece = jnp.reshape(piece, (-1, *buf.shape[1:])).astype(buf.dtype)
            start = (index * rows).astype(jnp.int32)
            written.append(jax.lax.dynamic_update_slice_in_dim(buf, piece, start, axis=0))
        return jax.tree_util.tree_unflatten(treedef, written)

    def finalize(self, carry):
        return carry


class _Custom:
    def __init__(self, accumulator: Accumulator):
        self.accumulator = accumulator

    def init(self, full, last):
        return self.accumulator.init(full)

    def update(self, carry, value, index, size):
        return self.accumulator.update(carry, value, index)

    def finalize(self, carry):
        return self.accumulator.finalize(carry)


_BUILT_IN = {
    AccumulationType.SUM: _Sum,
    AccumulationType.MEAN: _Mean,
    AccumulationType.RUNNING_MEAN: _RunningMean,
    AccumulationType.CONCAT: _Concat,
}


def _combiner(leaf: Any, plan) -> Any:
    kind = _resolve(leaf)
    if isinstance(kind, Accumulator):
        return _Custom(kind)
    return _BUILT_IN[kind](plan)


# ----------------------------------------------------------------------------------
# The computation


def _describe(position: int | str) -> str:
    if isinstance(position, int):
        return f"positional argument {position}"
    return f"keyword argument {position!r}"


def _batch_axes(value: Any, axis: int, where: str) -> Any:
    """The normalised batch axis of every leaf of one batch argument."""

    def leaf_axis(leaf):
        if not hasattr(leaf, "shape"):
            raise TypeError(
                f"{_OWNER}: every leaf of a batch argument must be an array with a batch "
                f"axis, but {where} has a leaf {leaf!r} of type {type(leaf).__name__}."
            )
        ndim = len(leaf.shape)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{_OWNER}: {where} has batch axis {axis} (from in_axes), but one of its "
                f"leaves has shape {tuple(leaf.shape)}, with no axis {axis}."
            )
        return axis % ndim

    return jax.tree_util.tree_map(leaf_axis, value)


def _batch_size(batch: list[tuple[str, Any, Any]]) -> int:
    sizes = {}
    for where, value, axes in batch:
        for leaf, axis in zip(
            jax.tree_util.tree_leaves(value), jax.tree_util.tree_leaves(axes), strict=True
        ):
            sizes.setdefault(where, set()).add((axis, leaf.shape[axis]))
    found = sorted({size for pairs in sizes.values() for _, size in pairs})
    if not found:
        raise ValueError(
            f"{_OWNER}: the batch arguments ({', '.join(w for w, _, _ in batch)}) hold no "
            "arrays, so there is no batch to cut into microbatches."
        )
    if len(found) > 1:
        listing = "; ".join(
            f"{where}: " + ", ".join(f"{size} along axis {axis}" for axis, size in sorted(p))
            for where, p in sizes.items()
        )
        raise ValueError(
            f"{_OWNER}: the batch arguments must all have the same batch size along their "
            f"in_axes, but found {listing}."
        )
    if found[0] == 0:
        raise ValueError(f"{_OWNER}: the batch is empty (batch size 0); there is nothing to do.")
    return found[0]


def _microbatch(t: Microbatcher, args: tuple, kwargs: dict) -> Any:
    positions: list[int | str] = [*t.batch_argnums, *t.batch_argnames]
    batch = []
    for position, axis in zip(positions, t.batch_in_axes, strict=True):
        if isinstance(position, int) and position >= len(args):
            raise ValueError(
                f"{_OWNER}: argnums={t.argnums!r} names positional argument {position}, but "
                f"the call passed {len(args)} positional argument(s)."
            )
        if isinstance(position, str) and position not in kwargs:
            raise ValueError(
                f"{_OWNER}: argnames={t.argnames!r} names keyword argument {position!r}, "
                f"but the call passed keyword arguments {sorted(kwargs)}."
            )
        value = args[position] if isinstance(position, int) else kwargs[position]
        where = _describe(position)
        batch.append((where, value, _batch_axes(value, axis, where)))

    plan = plan_blocks(
        _batch_size(batch), batch_size=t.microbatch_size, batch_size_name="microbatch_size"
    )
    num_blocks = t.num_real_microbatches
    if _is_int(num_blocks) and num_blocks > plan.num_blocks:
        raise ValueError(
            f"{_OWNER}: num_real_microbatches={num_blocks} is more than the "
            f"{plan.num_blocks} microbatch(es) of a batch of {plan.total} in microbatches "
            f"of {t.microbatch_size}."
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
        return t.fn(*call_args, **call_kwargs)

    def shapes(size):
        return jax.eval_shape(lambda s: block_fn(s, size, read(s, size)), jnp.asarray(0, jnp.int32))

    full = shapes(plan.block_size)
    last = shapes(plan.remainder) if plan.remainder else None

    kinds, acc_def = jax.tree_util.tree_flatten(t.accumulator, is_leaf=_is_accumulator_leaf)
    try:
        full_parts = acc_def.flatten_up_to(full)
        last_parts = acc_def.flatten_up_to(last) if last is not None else [None] * len(kinds)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{_OWNER}: `accumulator` must be a pytree prefix of the output of `fn`, but "
            f"the accumulator has structure {acc_def} and the output has structure "
            f"{jax.tree_util.tree_structure(full)}."
        ) from error
    combiners = [_combiner(kind, plan) for kind in kinds]
    init = [c.init(f, s) for c, f, s in zip(combiners, full_parts, last_parts, strict=True)]

    def update(carry, result, index, size):
        parts = acc_def.flatten_up_to(result)
        return [
            c.update(acc, part, index, size)
            for c, acc, part in zip(combiners, carry, parts, strict=True)
        ]

    carry = reduce_blocks(block_fn, plan, init, update, num_blocks=num_blocks, read=read)
    return acc_def.unflatten([c.finalize(acc) for c, acc in zip(combiners, carry, strict=True)])


_microbatch_jit = eqx.filter_jit(_microbatch)


def aggregate_stacked(accumulator: Any, values: Any) -> Any:
    """Combine results stacked along axis 0 in one go, the way `accumulator` combines
    the results of microbatches: `"sum"` sums axis 0, `"mean"` and `"running_mean"`
    average it, `"concat"` keeps it, an `Accumulator` applies its `aggregate`."""
    kinds, acc_def = jax.tree_util.tree_flatten(accumulator, is_leaf=_is_accumulator_leaf)
    combined = []
    for kind, part in zip(kinds, acc_def.flatten_up_to(values), strict=True):
        kind = _resolve(kind)
        if isinstance(kind, Accumulator):
            if kind.aggregate is None:
                raise ValueError(
                    f"{_OWNER}: this Accumulator has no `aggregate`, which combining "
                    "stacked results needs; give one when building it."
                )
            combined.append(kind.aggregate(part))
        elif kind is AccumulationType.SUM:
            combined.append(jax.tree_util.tree_map(lambda v: jnp.sum(v, axis=0), part))
        elif kind is AccumulationType.CONCAT:
            combined.append(part)
        else:
            combined.append(jax.tree_util.tree_map(lambda v: jnp.mean(v, axis=0), part))
    return acc_def.unflatten(combined)
