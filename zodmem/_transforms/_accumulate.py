"""Accumulators: how `Microbatcher` combines the results of its microbatches.

There is one protocol, `Accumulator(init, update, finalize, aggregate)`. The built-in
ways of combining (`AccumulationType`) are accumulators of one array, lifted over the
leaves of a pytree by `lift`; a pytree of accumulators, each covering a part of the
output, is made into one accumulator by `compose`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._checks import NamedInMessages, check_callable
from .._engine._block_plans import BlockPlan
from .._traceback import public

__all__ = [
    "AccumulationType",
    "Accumulator",
    "accumulator_for",
    "aggregate_stacked",
    "check_accumulator",
    "compose",
    "is_accumulator_leaf",
    "lift",
]

# Accumulators are an option of `Microbatcher`, so their errors speak for it.


class AccumulationType(enum.Enum):
    """The built-in ways for `Microbatcher` to combine the results of its microbatches.

    Each member has a string form (its value) that `Microbatcher` accepts as well:

    - `SUM` (`"sum"`): add the results up.
    - `MEAN` (`"mean"`): the mean over the whole batch of per-microbatch means,
      each microbatch weighted by its number of examples.
    - `RUNNING_MEAN` (`"running_mean"`): like `MEAN`, but over the microbatches that
      were evaluated only (they differ when `num_real_microbatches` stops early).
    - `CONCAT` (`"concat"`): concatenate the results along their axis 0.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        assert zm.AccumulationType("mean") is zm.AccumulationType.MEAN
        total = zm.Microbatcher(jnp.sum, microbatch_size=4, accumulator=zm.AccumulationType.SUM)
        total(jnp.arange(10.0))  # 45.0
        ```
    """

    SUM = "sum"
    MEAN = "mean"
    RUNNING_MEAN = "running_mean"
    CONCAT = "concat"


class Accumulator(NamedInMessages):
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

    @public
    def __check_init__(self):
        for name in ("init", "update", "finalize"):
            check_callable(getattr(self, name), name, owner=self._owner)
        if self.aggregate is not None:
            check_callable(self.aggregate, "aggregate", owner=self._owner)


# ----------------------------------------------------------------------------------
# The `accumulator` option: a pytree of names, members and accumulators

_KNOWN = ", ".join(repr(a.value) for a in AccumulationType)


def is_accumulator_leaf(node: Any) -> bool:
    """Whether `node` is a leaf of an `accumulator` option (None is one, to be refused)."""
    return node is None or isinstance(node, (str, AccumulationType, Accumulator))


def resolve(leaf: Any, *, owner: str) -> AccumulationType | Accumulator:
    """The accumulator a leaf of the `accumulator` option names (refuse unknown ones)."""
    if isinstance(leaf, (AccumulationType, Accumulator)):
        return leaf
    if isinstance(leaf, str):
        try:
            return AccumulationType(leaf)
        except ValueError:
            pass
    raise ValueError(
        f"{owner}: `accumulator` holds the unknown accumulator {leaf!r}. An accumulator "
        f"is one of {_KNOWN}, an AccumulationType member or an Accumulator (or a pytree of "
        "these)."
    )


def check_accumulator(tree: Any, *, owner: str) -> None:
    """Refuse an `accumulator` option that names no accumulator, or an unknown one."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_accumulator_leaf)
    if not leaves:
        raise ValueError(
            f"{owner}: `accumulator` must be one of {_KNOWN}, an AccumulationType, an "
            f"Accumulator, or a pytree of these; got {tree!r}, which holds none."
        )
    for leaf in leaves:
        resolve(leaf, owner=owner)


# ----------------------------------------------------------------------------------
# Lifting and composing


def lift(leaf: Accumulator, last: Any = None) -> Accumulator:
    """`leaf`, an accumulator of one array, applied to every leaf of a pytree.

    `last`, when the last microbatch is smaller than the others, is the pytree of
    shapes of its result; each leaf's is handed to `leaf.init` as `last=`.
    """

    def init(shapes):
        if last is None:
            return jax.tree_util.tree_map(leaf.init, shapes)
        return jax.tree_util.tree_map(lambda s, end: leaf.init(s, last=end), shapes, last)

    def update(carry, value, index):
        return jax.tree_util.tree_map(lambda c, v: leaf.update(c, v, index), carry, value)

    def finalize(carry):
        return jax.tree_util.tree_map(leaf.finalize, carry)

    def aggregate(values):
        return jax.tree_util.tree_map(leaf.aggregate, values)

    return Accumulator(init, update, finalize, aggregate)


def compose(accumulators: Any, *, owner: str) -> Accumulator:
    """One accumulator from a pytree of them, each combining its part of the results.

    The pytree of accumulators is a prefix of the results: each accumulator gets the
    subtree at its place, and the carry has one entry per accumulator.
    """
    parts, treedef = jax.tree_util.tree_flatten(
        accumulators, is_leaf=lambda node: isinstance(node, Accumulator)
    )

    def each(method, *trees):
        pieces = [treedef.flatten_up_to(tree) for tree in trees]
        return treedef.unflatten([method(a, *p) for a, *p in zip(parts, *pieces, strict=True)])

    def aggregate(accumulator, values):
        if accumulator.aggregate is None:
            raise ValueError(
                f"{owner}: this Accumulator has no `aggregate`, which combining "
                "stacked results needs; give one when building it."
            )
        return accumulator.aggregate(values)

    return Accumulator(
        init=lambda shapes: each(lambda a, s: a.init(s), shapes),
        update=lambda carry, value, index: each(
            lambda a, c, v: a.update(c, v, index), carry, value
        ),
        finalize=lambda carry: each(lambda a, c: a.finalize(c), carry),
        aggregate=lambda values: each(aggregate, values),
    )


# ----------------------------------------------------------------------------------
# The built-in accumulators, each of one array. `plan` is the run's plan of
# microbatches (None where only `aggregate` is used). `init` takes, as `last=`, the
# shape of the last microbatch's result when that microbatch is smaller than the others.


def _check_one_shape(kind: str, shape: Any, last: Any, plan: BlockPlan, owner: str) -> None:
    if last is not None and shape.shape != last.shape:
        raise ValueError(
            f"{owner}: accumulator {kind!r} needs results of one shape from every "
            f"microbatch, but an output leaf has shape {shape.shape} for a microbatch of "
            f"{plan.block_size} examples and {last.shape} for the last microbatch of "
            f"{plan.remainder}. Use 'concat' for results with one entry per example, or a "
            f"microbatch_size that divides the batch size {plan.total}."
        )


def _check_inexact(kind: str, shape: Any, owner: str) -> None:
    if not jnp.issubdtype(shape.dtype, jnp.inexact):
        raise ValueError(
            f"{owner}: accumulator {kind!r} needs floating-point (or complex) results, but "
            f"an output leaf has dtype {shape.dtype} and shape {shape.shape}. Use 'sum' for "
            "integer results, or return floats."
        )


def _size_of(plan: BlockPlan, index: Any) -> Any:
    """The number of examples in microbatch `index` (traced)."""
    if not plan.remainder:
        return plan.block_size
    return jnp.where(index < plan.num_full_blocks, plan.block_size, plan.remainder)


def _sum(plan: BlockPlan | None, owner: str) -> Accumulator:
    def init(shape, *, last=None):
        _check_one_shape("sum", shape, last, plan, owner)
        return jnp.zeros(shape.shape, shape.dtype)

    return Accumulator(
        init=init,
        update=lambda carry, value, index: (carry + value).astype(carry.dtype),
        finalize=lambda carry: carry,
        aggregate=lambda values: jnp.sum(values, axis=0),
    )


def _mean(plan: BlockPlan | None, owner: str, kind: str = "mean") -> Accumulator:
    def init(shape, *, last=None):
        _check_inexact(kind, shape, owner)
        _check_one_shape(kind, shape, last, plan, owner)
        return jnp.zeros(shape.shape, shape.dtype)

    def update(carry, value, index):
        if plan.remainder:
            # The smaller last microbatch counts in proportion to its examples.
            full = jnp.asarray(1, value.dtype)
            part = jnp.asarray(plan.remainder / plan.block_size, value.dtype)
            value = value * jnp.where(index < plan.num_full_blocks, full, part)
        return (carry + value).astype(carry.dtype)

    def finalize(carry):
        # Divide by an int when every microbatch is full: the plain mean of the results.
        count = plan.num_blocks if plan.remainder == 0 else plan.total / plan.block_size
        return carry / count

    return Accumulator(init, update, finalize, lambda values: jnp.mean(values, axis=0))


def _running_mean(plan: BlockPlan | None, owner: str) -> Accumulator:
    def update(carry, value, index):
        seen = index * plan.block_size
        keep = (seen / (seen + _size_of(plan, index))).astype(jnp.finfo(carry.dtype).dtype)
        return (carry * keep + value * (1 - keep)).astype(carry.dtype)

    mean = _mean(plan, owner, "running_mean")
    return Accumulator(mean.init, update, lambda carry: carry, mean.aggregate)


def _concat(plan: BlockPlan | None, owner: str) -> Accumulator:
    def init(shape, *, last=None):
        if shape.ndim == 0:
            if last is not None and last.ndim != 0:
                raise ValueError(
                    f"{owner}: accumulator 'concat' got a scalar result from a full "
                    f"microbatch and shape {last.shape} from the last one."
                )
            rows = 1
        else:
            if last is not None and (last.ndim == 0 or last.shape[1:] != shape.shape[1:]):
                raise ValueError(
                    f"{owner}: accumulator 'concat' joins results along axis 0, so they "
                    f"must agree on the other axes, but an output leaf has shape "
                    f"{shape.shape} for a microbatch of {plan.block_size} examples and "
                    f"{last.shape} for the last microbatch of {plan.remainder}."
                )
            rows = shape.shape[0]
        total = rows * plan.num_full_blocks
        if last is not None:
            total += last.shape[0] if last.ndim else 1
        return jnp.zeros((total, *shape.shape[1:]), shape.dtype)

    def update(buffer, value, index):
        piece = jnp.reshape(value, (-1, *buffer.shape[1:])).astype(buffer.dtype)
        rows = piece.shape[0]
        start = index * rows
        if plan.remainder:
            # The smaller last microbatch fills the end of the buffer.
            start = jnp.where(index < plan.num_full_blocks, start, buffer.shape[0] - rows)
        return jax.lax.dynamic_update_slice_in_dim(buffer, piece, start.astype(jnp.int32), 0)

    return Accumulator(init, update, lambda buffer: buffer, lambda values: values)


def _built_in(
    kind: AccumulationType | Accumulator, plan: BlockPlan | None, last: Any, owner: str
) -> Any:
    match kind:
        case Accumulator():
            return kind
        case AccumulationType.SUM:
            return lift(_sum(plan, owner), last)
        case AccumulationType.MEAN:
            return lift(_mean(plan, owner), last)
        case AccumulationType.RUNNING_MEAN:
            return lift(_running_mean(plan, owner), last)
        case AccumulationType.CONCAT:
            return lift(_concat(plan, owner), last)


def accumulator_for(
    tree: Any, plan: BlockPlan | None = None, last: Any = None, *, owner: str
) -> Accumulator:
    """The one accumulator that an `accumulator` option stands for.

    - `tree`: the option, a pytree of names, `AccumulationType` members and
      `Accumulator`s, a prefix of the results.
    - `plan`: the plan of the microbatches to combine (not needed for `aggregate`).
    - `last`: the shapes of the last microbatch's result when it is smaller than the
      others, else None.
    - `owner`: the name its messages give, the transform's.
    """
    kinds, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_accumulator_leaf)
    lasts = [None] * len(kinds) if last is None else treedef.flatten_up_to(last)
    parts = [
        _built_in(resolve(k, owner=owner), plan, s, owner)
        for k, s in zip(kinds, lasts, strict=True)
    ]
    return compose(treedef.unflatten(parts), owner=owner)


def aggregate_stacked(accumulator: Any, values: Any, *, owner: str = "Microbatcher") -> Any:
    """Combine results stacked along axis 0 in one go, the way `accumulator` combines
    the results of microbatches: `"sum"` sums axis 0, `"mean"` and `"running_mean"`
    average it, `"concat"` keeps it, an `Accumulator` applies its `aggregate`. `owner`
    names the call in messages: by default the `Microbatcher` that the functions of
    `zodmem.compat.optax` stand for."""
    return accumulator_for(accumulator, owner=owner).aggregate(values)
