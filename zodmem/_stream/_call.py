"""The streamed call of `to_host` and `to_file`: the layout of its result, its planning
from the transform's budget, and its run with a sink that hands each block to the host."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from .._engine._block_plans import OutputSink
from .._engine._progress import closing_bars
from .._pytree import is_traced

__all__ = [
    "Layout",
    "block_view",
    "check_arrays",
    "check_concrete",
    "keep_nothing",
    "planned_block_size",
    "planned_for_streaming",
    "result_layout",
    "returned_leaves",
    "run_streamed",
    "streamed_call",
]


def check_concrete(args: tuple, kwargs: dict, name: str) -> None:
    if is_traced((args, kwargs)):
        raise TypeError(
            f"zm.{name}: the arguments hold traced values; zm.{name} moves the result off "
            "the device as it is made, so call it outside jax.jit, jax.vmap and jax.grad."
        )


class Layout(NamedTuple):
    """The result's leaves (shapes and dtypes, or non-array values) and structure,
    without the auxiliary value, and the traced program of the call."""

    treedef: Any
    leaves: list
    paths: list[str]
    has_aux: bool
    program: Any


def result_layout(transform: Any, args: tuple, kwargs: dict) -> Layout:
    if transform.max_memory is not None:
        # Any block size gives the same result; the one the count options would give.
        size = max(transform.work(*args, **kwargs).block_size, 1)
        transform = transform.with_block_size(size, transform.strategies[0])
    program, dynamic, static = eqx.filter_make_jaxpr(lambda t, a, k: t.run(*a, **k))(
        transform, args, kwargs
    )
    shapes = eqx.combine(dynamic, static)
    has_aux = bool(transform.config.get("has_aux", False))
    out = shapes[0] if has_aux else shapes
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(out)
    paths = [jax.tree_util.keystr(path) for path, _ in paths_leaves]
    return Layout(treedef, [leaf for _, leaf in paths_leaves], paths, has_aux, program)


def streamed_call(transform: Any, args: tuple, kwargs: dict) -> Any:
    """The streamed call with a sink that keeps nothing: what the planner compiles."""
    return transform.streamed(OutputSink(keep_nothing, 0), *args, **kwargs)


def keep_nothing(*_: Any) -> None:
    pass


def planned_for_streaming(transform: Any, args: tuple, kwargs: dict) -> Any:
    """The transform with the block size its budget allows for the streamed call."""
    return transform.planned(args, kwargs, call=streamed_call).transform


def planned_block_size(planned: Any, args: tuple, kwargs: dict) -> tuple[int, Any]:
    work = planned.work(*args, **kwargs)
    return work.block_size, planned.config.get("strategy")


def run_streamed(
    transform: Any, args: tuple, kwargs: dict, write: Any, first_block: int
) -> tuple[Any, set[int]]:
    """Run the streamed call from `first_block`: returns what it returned (`None` at the
    leaves handed to `write`) and the indices of those leaves."""

    @eqx.filter_jit
    def call(transform, args, kwargs, first):
        sink = OutputSink(write, first)
        out = transform.streamed(sink, *args, **kwargs)
        return out, tuple(sink.leaves)  # not arrays: returned as they are

    with closing_bars():
        first = np.asarray(first_block, np.int32)  # NumPy: no program compiled to make it
        returned, streamed = call(transform, args, kwargs, first)
        jax.effects_barrier()  # every block handed over before the caller reads them
    return returned, set(streamed)


def returned_leaves(layout: Layout, returned: Any) -> list:
    """The leaves of what the streamed call returned (`None` at the streamed ones)."""
    if returned is None:
        return [None] * layout.treedef.num_leaves  # every leaf was streamed
    return layout.treedef.flatten_up_to(returned)


def block_view(array: np.ndarray, piece_shape: tuple, axis: int, start: int) -> Any:
    """The part of a C-ordered `array` that a block of `piece_shape`, starting at `start`
    along `axis` of the engine's view of it, fills."""
    others = math.prod(piece_shape) // piece_shape[axis] if piece_shape[axis] else 1
    total = array.size // others
    view = array.reshape(piece_shape[:axis] + (total,) + piece_shape[axis + 1 :])
    return view[(slice(None),) * axis + (slice(start, start + piece_shape[axis]),)]


def check_arrays(layout: Layout, name: str, why: str) -> None:
    """Refuse a result with a leaf that is not an array (`why`: what takes arrays only,
    and the way out)."""
    for key, leaf in zip(layout.paths, layout.leaves, strict=True):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(f"zm.{name}: the result{key} is {leaf!r}, not an array; {why}")
