"""Where the examples of a call to `KFAC` or `EKFAC` are: how many there are (the first
data argument's leading axis), the checks that the data arguments hold some and, for
microbatches, one count along every leading axis, and each layer's axis of examples in
its rows, which EKFAC's per-example moments need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from .._pytree import Variables
from . import _kfac_trace as trace
from ._kfac_rows import rows_shape

__all__ = ["batch_size", "check_examples", "check_not_empty", "example_axes", "leading_array"]


def example_axes(
    program: Callable,
    leaves: list,
    args: tuple,
    found: trace.Program,
    jaxpr: Any,
    variables: Variables,
    owner: str,
    *,
    terms: bool = False,
) -> tuple:
    """Per use of a layer, which axis of its rows holds the examples, or None (each row
    then counts as an example): the one axis that grows by one when the data arguments
    whose leading axis is the first one's, the number of examples, grow by one, where
    each example's outputs are one loss term (outputs `(N,)` or `(N, C)`), or with
    `terms` whatever the outputs (`kfac_approx="reduce"` reduces over each example's
    positions). An axis that cannot be found is refused."""
    none = (None,) * len(found.layers)
    outputs = jax.tree_util.tree_leaves(jax.eval_shape(program, leaves, args))
    # With several terms an example, the square root's columns are shared by them, and
    # an example's gradient would hold products of its terms that the matrix lacks.
    if not outputs or any(leaf.ndim == 0 or (leaf.ndim > 2 and not terms) for leaf in outputs):
        return none
    paths = jax.tree_util.tree_flatten_with_path(args)[0]
    arrays = [(path, leaf) for path, leaf in paths if eqx.is_array(leaf) and leaf.ndim > 0]
    if not arrays:
        return tuple(
            _rows_are_examples(jaxpr, layer, outputs[0].shape[0], variables, owner)
            for layer in found.layers
        )
    # The examples are counted as `batch_size` counts them; an array of another length
    # (shared by every example) is passed as it is.
    count = arrays[0][1].shape[0]
    grown = {path for path, leaf in arrays if leaf.shape[0] == count}
    names = ", ".join(
        f"args{jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)}"
        for path, leaf in arrays
        if path in grown
    )
    how = (
        f"{owner}: the examples' axis of each layer's rows is found by tracing `fn` again "
        f"with one more example, the data arguments whose leading axis has the first "
        f"one's length {count} grown by one ({names})"
    )
    advice = (
        "Pass an array shared by every example (one whose leading axis does not index the "
        "examples) as a keyword argument, which is passed whole, or close over it in `fn`."
    )

    def bigger(path: Any, leaf: Any) -> Any:
        if path not in grown:
            return leaf
        return jax.ShapeDtypeStruct((leaf.shape[0] + 1,) + leaf.shape[1:], leaf.dtype)

    try:
        more = jax.tree_util.tree_map_with_path(bigger, args)
        larger = jax.make_jaxpr(program)(leaves, more).jaxpr
    except Exception as error:
        raise ValueError(
            f"{how}, and that trace failed: {type(error).__name__}: {error}. {advice}"
        ) from None
    if trace.find_layers(larger, len(leaves)) != found:
        raise ValueError(f"{how}, and then `fn`'s layers differ. {advice}")
    axes = []
    for layer in found.layers:
        before, after = rows_shape(jaxpr, layer), rows_shape(larger, layer)
        moved = [d for d, (m, n) in enumerate(zip(before, after, strict=True)) if m != n]
        if len(moved) != 1 or after[moved[0]] != before[moved[0]] + 1:
            raise ValueError(
                f"{how}; the rows of the layer of x{variables.names[layer.weight]} have "
                f"shape {before}, then {after}: no one axis of them grows by one example. "
                "Keep the examples on an axis of their own in each layer's input (a `vmap` "
                "over them, not a reshape that merges them with positions), or use zm.KFAC "
                "with kfac_approx='expand', which needs no examples' axis."
            )
        axes.append(moved[0])
    return tuple(axes)


def _rows_are_examples(
    jaxpr: Any, layer: trace.Layer, count: int, variables: Variables, owner: str
) -> int:
    """With no data arguments to grow, a layer whose rows are `(N,)`, `N` the outputs'
    examples, has a row per example; any other is refused."""
    rows = rows_shape(jaxpr, layer)
    if rows != (count,):
        raise ValueError(
            f"{owner}: the call has no data arguments (after `x`) whose leading axis holds "
            "the examples, so each layer's rows must be one per example, but the rows of "
            f"the layer of x{variables.names[layer.weight]} have shape {rows} for {count} "
            "examples. Pass the examples' data as arguments after `x`, the examples on "
            "their leading axis."
        )
    return 0


def check_not_empty(args: tuple, owner: str) -> None:
    """Refuse a batch of no examples, whose factors are undefined, by the argument
    that shows it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        if eqx.is_array(leaf) and leaf.ndim > 0 and leaf.shape[0] == 0:
            raise ValueError(
                f"{owner}: the batch is empty: the data argument "
                f"args{jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)} holds no "
                "examples along its leading axis, and the factors of no examples are "
                "undefined (the input factor is a mean over the rows). Give at least one "
                "example."
            )


def check_examples(args: tuple, owner: str) -> None:
    """Refuse data arguments whose leading axes are not one count of examples, named as
    the user passed them, before microbatches are cut along those axes."""
    paths = jax.tree_util.tree_flatten_with_path(args)[0]
    lengths = {
        f"args{jax.tree_util.keystr(path)}": leaf.shape[0]
        for path, leaf in paths
        if eqx.is_array(leaf) and leaf.ndim > 0
    }
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name}: {length}" for name, length in lengths.items())
        raise ValueError(
            f"{owner}: `microbatch_size` and `max_memory` cut the data arguments (those after "
            "`x`) into microbatches along their leading axis, the examples', which must then "
            f"have one length in every argument, but they have {shown}. Give every data "
            "argument the examples on its leading axis, or leave out `microbatch_size` and "
            "`max_memory`."
        )


def leading_array(data: Any) -> Any:
    """The first array of `data` (data arguments, or one of them) with a leading axis,
    the axis of the examples; `None` where it has none."""
    for leaf in jax.tree_util.tree_leaves(data):
        if eqx.is_array(leaf) and leaf.ndim > 0:
            return leaf
    return None


def batch_size(args: tuple, owner: str) -> int:
    """The number of examples: the length of the data arguments' leading axis."""
    leading = leading_array(args)
    if leading is not None:
        return leading.shape[0]
    raise ValueError(
        f"{owner}: fisher='mc' draws targets per example, counted along the leading axis of "
        "the data arguments (those after `x`), but the call has no array among them."
    )
