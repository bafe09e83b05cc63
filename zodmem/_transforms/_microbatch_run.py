"""The computation of a `Microbatcher` call, behind the hooks it fills of the transform
base: its batch arguments found and checked (`batch_of`), how the call is spread over the
devices its batch lies on (`split_of_batch`, `batch_specs`), and one device's share
(`reduce_share`): the reduction of the batch microbatch by microbatch through the block
engine (`reduce_blocks`) with the call's accumulators, then across devices."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._engine._block_plans import plan_blocks
from .._engine._blocks import reduce_blocks
from .._engine._progress import label
from .._engine._sharding import Split, batch_split, check_divides, everywhere
from ._accumulate import AccumulationType, accumulator_for, is_accumulator_leaf, resolve
from ._microbatch_checks import common_batch_size, describe_position, leaf_batch_axes

if TYPE_CHECKING:
    from ._microbatch import Microbatcher

__all__ = [
    "batch_of",
    "batch_split_of",
    "batch_specs",
    "reduce_share",
    "split_of_batch",
]


def batch_of(transform: Microbatcher, args: tuple, kwargs: dict) -> list:
    """`(where, value, axes)` for each batch argument of the call, checked."""
    positions: list[int | str] = [*transform.batch_argnums, *transform.batch_argnames]
    batch = []
    for position, axis in zip(positions, transform.batch_in_axes, strict=True):
        if isinstance(position, int) and position >= len(args):
            raise ValueError(
                f"{transform._owner}: argnums={transform.argnums!r} names positional argument "
                f"{position}, but the call passed {len(args)} positional argument(s)."
            )
        if isinstance(position, str) and position not in kwargs:
            raise ValueError(
                f"{transform._owner}: argnames={transform.argnames!r} names keyword argument "
                f"{position!r}, but the call passed keyword arguments {sorted(kwargs)}."
            )
        value = args[position] if isinstance(position, int) else kwargs[position]
        where = describe_position(position)
        batch.append((where, value, leaf_batch_axes(value, axis, where, owner=transform._owner)))

    return batch


def batch_split_of(batch: list, planned: bool = False) -> Split | None:
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
        per_leaf.extend(
            [resolve(kind, owner=transform._owner)] * len(jax.tree_util.tree_leaves(subtree))
        )
    return per_leaf


def split_of_batch(transform: Microbatcher, batch: list) -> Split | None:
    """How the call is spread over devices: the batch's own split where each device can
    reduce its part, every device reducing the whole batch where it cannot, `None` for a
    batch that is not split."""
    split = batch_split_of(batch)
    if split is None:
        return None
    check_divides(
        common_batch_size(batch, owner=transform._owner),
        split,
        owner=transform._owner,
        what="examples of the batch",
    )
    local = common_batch_size(batch, owner=transform._owner) // split.count
    size = transform.microbatch_size
    # Each device reduces its own part of the batch, then the parts are combined once;
    # that gives the same result when the accumulators are built in and each device's
    # microbatches are the batch's own: `fn` need not be additive over examples (a mean
    # per microbatch changes with how the examples are grouped).
    options = [
        resolve(kind, owner=transform._owner)
        for kind in jax.tree_util.tree_leaves(transform.accumulator, is_leaf=is_accumulator_leaf)
    ]
    local_ok = (
        all(isinstance(kind, AccumulationType) for kind in options)
        and transform.num_real_microbatches is None
        and size is not None
        and local % size == 0
    )
    # Otherwise every device reduces the whole batch, in order, as one device would.
    return split if local_ok else everywhere(split.mesh)


def batch_specs(transform: Microbatcher, split: Split, args: tuple, kwargs: dict) -> tuple:
    """`(in_specs, out_specs)` of a batch reduced where it lies: each device reads its own
    part of the batch arguments; a `"concat"` result stays split along axis 0, every
    other is whole on each device. Over devices that each reduce the whole batch, every
    input and result whole."""
    if split.dim is None:
        return None, PartitionSpec()
    batch = batch_of(transform, args, kwargs)
    positions = [*transform.batch_argnums, *transform.batch_argnames]

    def specs_of(value, axes):
        return jax.tree_util.tree_map(lambda leaf, a: split.spec(jnp.ndim(leaf), a), value, axes)

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

    return in_specs, out_specs


def reduce_share(transform: Microbatcher, split: Split | None, args: tuple, kwargs: dict) -> Any:
    """The reduction of the batch as this device holds it; where each device holds its
    own part (`split` along the batch), the devices' results combined once, by one
    all-reduce for `"sum"`, `"mean"` and `"running_mean"` (`"concat"`'s rows stay)."""
    result = _microbatch_local(transform, args, kwargs)
    if split is None or split.dim is None:
        return result
    leaves, treedef = jax.tree_util.tree_flatten(result)
    combined = [
        leaf if _ACROSS_DEVICES[kind] is None else _ACROSS_DEVICES[kind](leaf, split.axes)
        for leaf, kind in zip(leaves, _kinds_per_leaf(transform, result), strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, combined)


def _microbatch_local(transform: Microbatcher, args: tuple, kwargs: dict) -> Any:
    """The reduction of the batch as this device holds it, microbatch by microbatch."""
    batch = batch_of(transform, args, kwargs)
    positions: list[int | str] = [*transform.batch_argnums, *transform.batch_argnames]
    plan = plan_blocks(
        common_batch_size(batch, owner=transform._owner),
        batch_size=transform.microbatch_size,
        batch_size_name="microbatch_size",
    )
    num_blocks = transform.num_real_microbatches
    if isinstance(num_blocks, int) and num_blocks > plan.num_blocks:
        raise ValueError(
            f"{transform._owner}: num_real_microbatches={num_blocks} is more than the "
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
            f"{transform._owner}: `accumulator` must be a pytree prefix of the output of `fn`, but "
            f"the accumulator has structure {acc_def} and the output has structure "
            f"{jax.tree_util.tree_structure(full)}."
        ) from error

    accumulator = accumulator_for(transform.accumulator, plan, last, owner=transform._owner)

    def update(carry, result, index, size):
        return accumulator.update(carry, result, index)

    init = accumulator.init(full)
    carry = reduce_blocks(
        block_fn, plan, init, update, num_blocks=num_blocks, read=read, progress=label(transform)
    )
    return accumulator.finalize(carry)
