"""`ChunkedVmap`: `eqx.filter_vmap`, computed at most `chunk_size` elements at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

from .._checks import (
    check_bool,
    check_callable,
    checked_annotations,
    int_option,
    memory_option,
    typechecked_constructor,
)
from .._engine._block_plans import OutputSink, plan_blocks
from .._engine._blocks import map_blocks
from .._engine._progress import label, progress_bar
from .._engine._sharding import Split, batch_split, check_divides
from .._jaxpr import largest_made_from
from .._plan._memory import check_size_or_memory
from .._plan._plans import Work
from .._traceback import public
from ._base import AbstractBlocked
from ._vmap_axes import (
    AxisSpec,
    axis_spec,
    check_axis_spec,
    element_leaves,
    is_none,
    mapped_inputs,
    output_axes,
)

__all__ = ["ChunkedVmap"]


@typechecked_constructor
class ChunkedVmap(AbstractBlocked):
    """Vectorise `fn` like `eqx.filter_vmap`, but at most `chunk_size` elements at a time.

    Use it where `jax.vmap` / `eqx.filter_vmap` of a function with large
    intermediates runs out of memory: the batch is cut into blocks of `chunk_size`
    consecutive elements, each block is vectorised, and its results are written
    straight into the preallocated outputs. Peak memory is the outputs plus one
    block's working set, instead of the whole batch's. The results -- values and
    dtypes -- are those of `eqx.filter_vmap(fn, in_axes=in_axes, out_axes=out_axes)`.

    When `chunk_size` does not divide the batch, the last block is moved back to end
    at the last element, so that it overlaps the block before it; no padding is
    added and no partial block is compiled.

    **Arguments:**

    - `fn`: the function to vectorise, called as `fn(*args, **kwargs)`. It may be an
      Equinox module (a model, or another zodmem transform); its arrays are then
      leaves of this transform and are not mapped.
    - `chunk_size`: the most elements vectorised at once, a positive int.
    - `max_memory`: instead of `chunk_size`, a budget for the call's memory: an int
      (bytes), a string with a unit (`"500MB"`, `"2GiB"`) or `"auto"`. The chunk size is
      then planned, before anything runs, as the fastest whose compiled call fits (see
      the "Memory budgets" page). Give exactly one of `chunk_size` and `max_memory`.
    - `in_axes`: which axis of each input is mapped, as in `eqx.filter_vmap`: a
      pytree prefix of the positional arguments (a tuple, or a list as `jax.vmap`
      takes it) whose leaves are an int (that axis),
      `None` (not mapped: passed whole to every call) or a callable `leaf -> int |
      None` such as `eqx.if_array(0)`; or a dict from argument names to such specs,
      every argument not named taking `eqx.if_array(0)`. Keyword arguments are
      mapped with `eqx.if_array(0)` unless a dict `in_axes` names them (as
      `jax.vmap` maps every keyword argument over its leading axis).
    - `out_axes`: where the mapped axis goes in each output, as in
      `eqx.filter_vmap`: a pytree prefix of the output of ints, `None` and callables.
      An output given `None` (by default, every non-array output) must not depend
      on the mapped inputs, and is returned once.
    - `progress`: show a progress bar on stderr (chunks done of the total, rate, time
      left), updated from inside the compiled loop after each chunk. Off by default,
      and then nothing is added to the compiled program.

    **Returns:**

    Calling `ChunkedVmap(fn, chunk_size=...)(*args, **kwargs)` returns what
    `eqx.filter_vmap(fn, in_axes=in_axes, out_axes=out_axes)` would return for the
    same arguments.

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import zodmem as zm

        def distance(x, y):
            return jnp.sqrt(jnp.sum((x - y) ** 2))

        xs = jnp.ones((1000, 3))
        y = jnp.zeros(3)
        batched = zm.ChunkedVmap(distance, chunk_size=128, in_axes=(0, None))
        batched(xs, y)  # shape (1000,), 128 distances at a time

        # Map the second axis of `xs`, and put the mapped axis last in the output.
        outer = zm.ChunkedVmap(jnp.outer, chunk_size=2, in_axes=(1, None), out_axes=-1)
        outer(jnp.ones((4, 5)), jnp.arange(3.0))  # shape (4, 3, 5)
        ```

    !!! note "Sharded batches"

        A batch sharded along its mapped axis (`jax.device_put(xs, NamedSharding(mesh,
        PartitionSpec("d")))`) is mapped where it lies, as `jax.jit` would: each device
        maps its own part, `chunk_size` elements at a time, and the output comes back
        sharded along `out_axes` over the same mesh axes. With `max_memory`, the budget is
        per device (planned per device for meshes with explicit axes, the default of
        `jax.make_mesh`). Inside `jax.jit`, the sharding is seen for explicit axes only.

    !!! tip

        Give `in_axes` and `out_axes` as ints, `None`, callables and tuples to keep
        the transform hashable, which `jax.jit` needs when the transform is passed as
        an argument. A dict works as well when the transform is closed over.
    """

    fn: Callable[..., Any]
    chunk_size: int | None = eqx.field(
        default=None, static=True, kw_only=True, converter=int_option
    )
    max_memory: int | str | None = eqx.field(
        default=None, static=True, kw_only=True, converter=memory_option
    )
    in_axes: AxisSpec = eqx.field(
        default=eqx.if_array(0), static=True, kw_only=True, converter=axis_spec
    )
    out_axes: AxisSpec = eqx.field(
        default=eqx.if_array(0), static=True, kw_only=True, converter=axis_spec
    )
    progress: bool = eqx.field(default=False, static=True, kw_only=True)

    @public
    def __check_init__(self):
        check_callable(self.fn, "fn", owner=self._owner)
        check_size_or_memory(self, "chunk_size", "the elements mapped at once", "chunks")
        if isinstance(self.in_axes, dict):
            for name in self.in_axes:
                if not isinstance(name, str):
                    raise TypeError(
                        f"{self._owner}: a dict `in_axes` maps argument names to axes, but it has "
                        f"the key {name!r} of type {type(name).__name__}; got "
                        f"in_axes={self.in_axes!r}."
                    )
        check_axis_spec(self.in_axes, "in_axes", owner=self._owner)
        check_axis_spec(self.out_axes, "out_axes", owner=self._owner)
        check_bool(self.progress, "progress", owner=self._owner)

    @public
    @checked_annotations
    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        return super().__call__(*args, **kwargs)

    def split(self, *args: Any, **kwargs: Any) -> Split | None:
        # A batch sharded along its mapped axis is mapped where it lies.
        mapped = mapped_inputs(self.fn, self.in_axes, args, kwargs, owner=self._owner)
        return batch_split(mapped.leaves, mapped.axes) if mapped.total else None

    def specs(self, split: Split, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        # Each device maps its own part of the batch, chunk by chunk, and keeps its results.
        mapped = mapped_inputs(self.fn, self.in_axes, args, kwargs, owner=self._owner)
        check_divides(mapped.total, split, owner=self._owner, what="elements of the batch")
        leaf_specs = [
            PartitionSpec() if axis is None else split.spec(jnp.ndim(leaf), axis)
            for leaf, axis in zip(mapped.leaves, mapped.axes, strict=True)
        ]
        axes_of_output = output_axes(self.fn, self.out_axes, mapped, owner=self._owner)

        def in_specs(arrays):
            leaves = mapped.input_def.flatten_up_to(arrays)
            specs = [
                None if leaf is None else spec
                for leaf, spec in zip(leaves, leaf_specs, strict=True)
            ]
            return mapped.input_def.unflatten(specs)

        def out_specs(shapes):
            leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=is_none)
            specs = [
                PartitionSpec() if leaf is None or axis is None else split.spec(leaf.ndim, axis)
                for leaf, axis in zip(leaves, treedef.flatten_up_to(axes_of_output), strict=True)
            ]
            return jax.tree_util.tree_unflatten(treedef, specs)

        return in_specs, out_specs

    def compute_share(
        self, sink: OutputSink | None, share: Any, split: Any, *args: Any, **kwargs: Any
    ) -> Any:
        # The batch as this device holds it: whole, or its own part of a sharded batch.
        return _chunked_vmap_local(self, args, kwargs, sink)

    def work(self, *args: Any, **kwargs: Any) -> Work:
        mapped = mapped_inputs(self.fn, self.in_axes, args, kwargs, owner=self._owner)
        total = mapped.total or 0
        size = total if self.chunk_size is None else min(self.chunk_size, total)
        split = batch_split(mapped.leaves, mapped.axes, planned=True)
        return Work(total, "elements", "output", size).per_device(split)

    def item_bytes(self, *args: Any, **kwargs: Any) -> int | None:
        mapped = mapped_inputs(self.fn, self.in_axes, args, kwargs, owner=self._owner)
        if not mapped.total:
            return None

        element = element_leaves(mapped)
        is_array = [
            eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct) for leaf in element
        ]
        arrays = [leaf for leaf, a in zip(element, is_array, strict=True) if a]
        made_from = [axis is not None for axis, a in zip(mapped.axes, is_array, strict=True) if a]

        def one_element(arrays):
            it = iter(arrays)
            leaves = [next(it) if a else leaf for leaf, a in zip(element, is_array, strict=True)]
            element_args, element_kwargs = jax.tree_util.tree_unflatten(mapped.input_def, leaves)
            return self.fn(*element_args, **element_kwargs)

        try:
            traced = jax.make_jaxpr(one_element)(arrays)
        except Exception:  # noqa: BLE001  (the call itself reports the error, if any)
            return None
        return largest_made_from(traced.jaxpr, made_from)

    def with_block_size(self, size: int, strategy: str | None) -> ChunkedVmap:
        return dataclasses.replace(self, chunk_size=size, max_memory=None)


def _chunked_vmap_local(
    transform: ChunkedVmap,
    args: tuple,
    kwargs: dict,
    sink: OutputSink | None = None,
) -> Any:
    """The chunked map of the batch on this device."""
    fn, out_axes, progress = transform.fn, transform.out_axes, label(transform)
    inputs = (args, kwargs)
    mapped = mapped_inputs(fn, transform.in_axes, args, kwargs, owner=transform._owner)
    input_axes, input_def, leaves, axes, total = mapped
    # Checked before any map is traced.
    axes_of_output = output_axes(fn, out_axes, mapped, owner=transform._owner)

    def one_element(inputs):
        element_args, element_kwargs = inputs
        return fn(*element_args, **element_kwargs)

    vectorised = eqx.filter_vmap(one_element, in_axes=(input_axes,), out_axes=out_axes)
    if total is None or total == 0:
        return vectorised(inputs)
    # No chunk size (a budget whose plan found nothing to cut): every element at once.
    plan = plan_blocks(total, batch_size=transform.chunk_size, what="elements")
    if plan.num_blocks == 1 and sink is None:
        bar = progress_bar(progress, 1)  # one chunk, no loop: still a bar that shows 1/1
        bar.start()
        result = vectorised(inputs)
        bar.done(1, result)
        return result

    mapped_leaves = [i for i, a in enumerate(axes) if a is not None]

    def read(start):
        """The block's slices of the mapped inputs."""
        return [
            jax.lax.dynamic_slice_in_dim(leaves[i], start, plan.block_size, axes[i])
            for i in mapped_leaves
        ]

    def block(pieces):
        block_inputs = list(leaves)
        for i, piece in zip(mapped_leaves, pieces, strict=True):
            block_inputs[i] = piece
        return vectorised(jax.tree_util.tree_unflatten(input_def, block_inputs))

    first = jnp.asarray(0, jnp.int32)
    shapes = eqx.filter_eval_shape(lambda start: block(read(start)), first)
    out_leaves, out_def = jax.tree_util.tree_flatten(shapes)
    out_axes_per_leaf = out_def.flatten_up_to(axes_of_output)
    mapped = [i for i, a in enumerate(out_axes_per_leaf) if a is not None]
    unmapped_arrays = [
        i
        for i, (leaf, a) in enumerate(zip(out_leaves, out_axes_per_leaf, strict=True))
        if a is None and isinstance(leaf, jax.ShapeDtypeStruct)
    ]

    def mapped_block(start, pieces):
        block_leaves = jax.tree_util.tree_leaves(block(pieces))
        return [block_leaves[i] for i in mapped]

    results = list(out_leaves)  # non-array outputs are kept as `fn` returned them
    if mapped:
        mapped_axes = [out_axes_per_leaf[i] for i in mapped]
        part = None if sink is None else sink.part(mapped, plan)
        blocks = map_blocks(
            mapped_block, plan, axis=mapped_axes, read=read, sink=part, progress=progress
        )
        for i, value in zip(mapped, blocks or [None] * len(mapped), strict=True):
            results[i] = value
    if unmapped_arrays:
        # Unmapped outputs are the same for every block: read them from one more call,
        # whose mapped part is unused and so dropped by the compiler.
        block_leaves = jax.tree_util.tree_leaves(block(read(first)))
        for i in unmapped_arrays:
            results[i] = block_leaves[i]
    return jax.tree_util.tree_unflatten(out_def, results)
