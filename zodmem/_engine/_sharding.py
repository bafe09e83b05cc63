"""Work spread over devices: each device computes and holds its own share of a result.

Scaling out is JAX's own SPMD: a transform's whole computation runs inside one
`jax.shard_map` over the mesh of the result's (or the batch's) sharding, and each device
runs the block engine over its own share of the items, at the offset its position along
the split mesh axes gives. Nothing but the inputs is replicated, so a device holds its
share of the result and one block, never the whole; across processes under
`jax.distributed` the mesh spans every process's devices and each process computes its
own devices' shares.

- Derivatives (`sharding=` on `BatchedJacobian`/`BatchedHessian`): `split_of` reads which
  axis of the result is split and over how many devices, `run_sharded` runs the
  computation once per share (`Share`) and assembles the global array.
- Maps and reductions (`ChunkedVmap`, `Microbatcher`): `batch_split` reads the split of
  the batch arguments along their mapped axes, and the same `run_sharded` runs the
  chunked map or the reduction on each device's part of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._block_plans import plan_blocks

__all__ = [
    "Share",
    "Split",
    "check_sharding",
    "share_of",
    "split_of",
    "batch_split",
    "run_sharded",
    "dispatch",
    "to_mesh",
    "replicate",
    "is_explicit",
    "explicit_mesh",
    "everywhere",
    "placement",
    "Kept",
]


# The spec of an array whole on every device.
_WHOLE = PartitionSpec()


def _has_explicit_axes(mesh: Any) -> bool:
    """Whether `mesh` has explicit axes, whose arrays carry their sharding in their type."""
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


class Split(NamedTuple):
    """How a result (or a batch) is spread: `dim`, its split axis (`None`: not split);
    `axes`, the mesh axes that split it (when it is not split, every axis of the mesh,
    along which the first device draws the progress bars); `count`, the shares."""

    mesh: Any
    dim: int | None
    axes: tuple[str, ...]
    count: int

    @property
    def explicit(self) -> bool:
        """Whether the mesh's axes are explicit, so that traced arrays show the split."""
        return _has_explicit_axes(self.mesh)

    def spec(self, ndim: int, dim: int) -> PartitionSpec:
        """The spec of an `ndim`-dimensional array split over these mesh axes along `dim`."""
        entries: list[Any] = [None] * ndim
        if self.axes:
            entries[dim] = self.axes[0] if len(self.axes) == 1 else self.axes
        return PartitionSpec(*entries)


class Share(NamedTuple):
    """One device's share of `count` equal shares: `index` (traced) is its position."""

    index: Any
    count: int

    def offset(self, total: int) -> Any:
        """The first of this share's `total // count` items."""
        return self.index * (total // self.count)


def check_sharding(sharding: Any, *, owner: str) -> None:
    """Refuse anything but `None` or a `jax.sharding.NamedSharding`, at construction."""
    if sharding is None or isinstance(sharding, NamedSharding):
        if sharding is not None:
            split_of(sharding, owner=owner)
        return
    raise TypeError(
        f"{owner}: `sharding` must be a jax.sharding.NamedSharding, e.g. "
        "NamedSharding(jax.make_mesh((4,), ('d',)), PartitionSpec('d', None)), or None, "
        f"but got {sharding!r} of type {type(sharding).__name__}."
    )


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def split_of(sharding: NamedSharding, *, owner: str) -> Split:
    """The split a result's `sharding` asks for; at most one axis may be split."""
    spec = tuple(sharding.spec)
    split = [(dim, _entry_axes(entry)) for dim, entry in enumerate(spec) if _entry_axes(entry)]
    if len(split) > 1:
        raise ValueError(
            f"{owner}: `sharding` may split one axis of the result, rows or columns, but "
            f"{sharding.spec} splits axes {[dim for dim, _ in split]}. Each device computes "
            "whole rows (or whole columns) of the result, so split one axis, e.g. "
            "PartitionSpec('d', None); for more devices, name several mesh axes on it, "
            "e.g. PartitionSpec(('x', 'y'), None)."
        )
    if not split:
        return everywhere(sharding.mesh)
    dim, axes = split[0]
    count = math.prod(sharding.mesh.shape[axis] for axis in axes)
    return Split(sharding.mesh, dim, axes, count)


def check_divides(total: int, split: Split, *, owner: str, what: str) -> None:
    """Refuse a split whose devices do not divide the `total` items of the split axis:
    JAX holds no array sharded unevenly."""
    if total % split.count:
        axes = ", ".join(repr(axis) for axis in split.axes)
        raise ValueError(
            f"{owner}: the sharding splits the {total} {what} over {split.count} devices "
            f"(mesh axes {axes}), which do not divide {total}; JAX holds only arrays whose "
            "split axes the devices divide. Use a mesh axis whose size divides "
            f"{total}, or split the other axis."
        )


def share_of(
    total: int, plan: Any, share: Share | None, split: Split | None, *, owner: str, what: str
) -> tuple[Any, Any]:
    """`(plan, offset)`: the blocks of one device's share of `total` items (the same block
    size as `plan`, over `total // split.count` items) and the first of its items; with no
    split axis, `plan` and 0. `what` names the items for the refusal of a split whose
    devices do not divide them."""
    if share is None or split is None or split.dim is None:
        return plan, 0
    check_divides(total, split, owner=owner, what=what)
    return plan_blocks(total // split.count, batch_size=plan.block_size), share.offset(total)


def sharding_of(leaf: Any) -> NamedSharding | None:
    """The `NamedSharding` of an array, concrete or traced (a traced one shows its
    sharding when its mesh axes are explicit), or `None`."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        sharding = leaf.sharding
        return sharding if isinstance(sharding, NamedSharding) else None
    try:
        sharding = jax.typeof(leaf).sharding
    except (AttributeError, TypeError):
        return None
    return sharding if isinstance(sharding, NamedSharding) else None


def placement(leaf: Any) -> Any:
    """Where an array lies, as far as a computation on it can tell: a concrete array's
    sharding, a traced array's when its mesh axes are explicit, else `None`."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        return leaf.sharding
    return sharding_of(leaf)


def batch_split(
    leaves: Sequence[Any], axes: Sequence[int | None], *, planned: bool = False
) -> Split | None:
    """The split of a batch: the mesh axes of the first leaf that is sharded along its
    mapped axis (`axes`, one per leaf, `None` for leaves not mapped), or `None` when
    none is.

    With `planned`, only a split that the planner's traced call sees, one over explicit
    mesh axes: a budget is planned per device there, and for the whole batch elsewhere.
    """
    for leaf, axis in zip(leaves, axes, strict=True):
        if axis is None:
            continue
        sharding = sharding_of(leaf)
        if sharding is None:
            continue
        spec = tuple(sharding.spec)
        names = _entry_axes(spec[axis]) if axis < len(spec) else ()
        if names:
            count = math.prod(sharding.mesh.shape[name] for name in names)
            if count > 1:
                split = Split(sharding.mesh, axis, names, count)
                return None if planned and not split.explicit else split
    return None


def is_explicit(sharding: Any) -> bool:
    """Whether `sharding` is a `NamedSharding` over a mesh with explicit axes, which a
    traced array shows in its type."""
    return isinstance(sharding, NamedSharding) and _has_explicit_axes(sharding.mesh)


def explicit_mesh(tree: Any) -> Any:
    """The mesh of the first array of `tree` placed over explicit mesh axes, or `None`.

    Such arrays carry their mesh in their type, and the block engine's preallocated
    outputs (made without one) cannot take their blocks; the work is then run inside a
    `shard_map` over that mesh (`everywhere`), where every array is a device's own."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if eqx.is_array(leaf):
            sharding = sharding_of(leaf)
            if is_explicit(sharding):
                return sharding.mesh
    return None


def everywhere(mesh: Any) -> Split:
    """Work not split at all: every device of `mesh` does all of it (the first draws its
    progress bars)."""
    return Split(mesh, None, tuple(mesh.axis_names), 1)


def replicate(tree: Any, mesh: Any) -> Any:
    """`tree` with every array that is sharded over explicit mesh axes made whole on every
    device (`jax.sharding.reshard`), as `shard_map` takes replicated inputs; other leaves
    as they are (`shard_map` reshards arrays over automatic axes itself)."""

    def whole(leaf):
        sharding = sharding_of(leaf)
        if sharding is None or not is_explicit(sharding):
            return leaf
        if all(entry is None for entry in sharding.spec):
            return leaf
        return jax.sharding.reshard(leaf, NamedSharding(mesh, PartitionSpec()))

    return jax.tree_util.tree_map(whole, tree, is_leaf=eqx.is_array)


def _placed(arrays: Any, specs: Any, mesh: Any) -> Any:
    """`arrays` placed as `specs` say, where they lie over explicit mesh axes: `shard_map`
    takes such arrays only as its `in_specs` give them (a batch argument replicated beside
    one split along the batch is split the same way here)."""

    def place(spec, leaf):
        sharding = sharding_of(leaf)
        if spec is None or not is_explicit(sharding):
            return leaf
        target = NamedSharding(mesh, spec)
        if sharding.is_equivalent_to(target, np.ndim(leaf)):
            return leaf
        return jax.sharding.reshard(leaf, target)

    def is_spec(node):
        return node is None or isinstance(node, PartitionSpec)

    return jax.tree_util.tree_map(place, specs, arrays, is_leaf=is_spec)


def to_mesh(tree: Any, mesh: Any) -> Any:
    """`tree` with its concrete arrays made global arrays replicated over `mesh` when the
    mesh spans several processes (under `jax.distributed`, a computation over such a mesh
    takes global arrays only); every process passes the same values, as every process
    runs the same script. On a mesh of one process, `tree` as it is."""
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.is_multi_process is False:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(leaf):
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            return leaf
        if not leaf.is_fully_addressable:
            return leaf  # already a global array
        return jax.make_array_from_process_local_data(replicated, np.asarray(leaf))

    return jax.tree_util.tree_map(place, tree, is_leaf=eqx.is_array)


def dispatch(
    compute: Callable[..., Any],
    inputs: Any,
    split: Split | None = None,
    *,
    here: bool = False,
    in_specs: Any = None,
    out_specs: Any = _WHOLE,
) -> Any:
    """Run `compute(share, split, inputs)` where its work lies; every blocked transform's
    computation goes through here.

    - With `split`, one share per device of its mesh (`run_sharded`, with `in_specs` and
      `out_specs`), `compute` getting each device's `Share` and the `split`.
    - Without, on a mesh with explicit axes that some input lies on (unless `here`): the
      whole work on every device of it (traced arrays there carry the mesh in their
      type, and the block engine's outputs, made without one, could not take them).
    - Otherwise here, as one device: `compute(None, None, inputs)`. `here` keeps the
      work here even on a mesh (a result streamed to the host, in order).
    """
    if split is None and not here:
        mesh = explicit_mesh(inputs)
        if mesh is not None:
            split, in_specs, out_specs = everywhere(mesh), None, _WHOLE
    if split is None:
        return compute(None, None, inputs)

    def with_split(share, inputs):
        return compute(share, split, inputs)

    return run_sharded(with_split, split, inputs, in_specs=in_specs, out_specs=out_specs)


class Kept(eqx.Module):
    """A value carried out of a traced function in its output's structure, not as a leaf
    (the leaves of a result that are not arrays, say)."""

    value: Any = eqx.field(static=True)


def run_sharded(
    compute: Callable[..., Any],
    split: Split,
    inputs: Any,
    *,
    in_specs: Any = None,
    out_specs: Any = _WHOLE,
) -> Any:
    """Run `compute(share, inputs)` once per device of `split.mesh` inside one `shard_map`.

    - `compute(share, inputs)`: the share's part of the result; the result's non-array
      leaves (such as those of an `aux`) are returned as the first trace made them.
    - `inputs`: a pytree; its arrays are passed replicated to every device (made whole
      first, when sharded over explicit axes), unless `in_specs` gives their specs.
    - `in_specs`: optionally, a function of the array part of `inputs` that returns its
      specs (for a batch each device reads its own part of).
    - `out_specs`: the specs of the array part of the result, a pytree prefix of it
      (by default every output whole on each device); or, where they depend on the
      outputs' ranks, a function of its shapes that returns them.

    The progress bars of the computation are drawn by the first device only (see
    `_progress`).
    """
    arrays, static = eqx.partition(inputs, eqx.is_array)
    if in_specs is None:
        arrays = replicate(arrays, split.mesh)
        specs_in = jax.tree_util.tree_map(lambda _: PartitionSpec(), arrays)
    else:
        specs_in = in_specs(arrays)
        arrays = _placed(arrays, specs_in, split.mesh)

    def body(arrays):
        index = jax.lax.axis_index(split.axes)
        out = compute(Share(index, split.count), eqx.combine(arrays, static))
        out_arrays, out_static = eqx.partition(out, eqx.is_array)
        # The leaves that are not arrays leave the trace in the output's structure.
        return out_arrays, Kept(out_static)

    def mapped(specs_out):
        return jax.shard_map(
            body,
            mesh=split.mesh,
            in_specs=(specs_in,),
            out_specs=(specs_out, _WHOLE),
            check_vma=False,
        )

    if callable(out_specs):
        # The specs depend on the outputs' ranks: trace once to learn them (every output
        # taken as whole on each device, which leaves its rank as it is).
        out_specs = out_specs(eqx.filter_eval_shape(mapped(_WHOLE), arrays)[0])
    out_arrays, kept = mapped(out_specs)(arrays)
    return eqx.combine(out_arrays, kept.value)
