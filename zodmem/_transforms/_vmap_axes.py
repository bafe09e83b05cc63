"""The axes of `ChunkedVmap`: its `in_axes` and `out_axes` read and checked, and which
axis of each input leaf and of each output leaf is mapped, resolved as
`eqx.filter_vmap` resolves them."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias, no_type_check

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._checks import Integer, as_index, common_size

__all__ = [
    "AxisSpec",
    "Mapped",
    "axis_spec",
    "check_axis_spec",
    "element_leaves",
    "is_none",
    "mapped_inputs",
    "output_axes",
]

AxisSpec: TypeAlias = PyTree[Integer | Callable[..., Any] | None]
"""The axes of `in_axes` or `out_axes`: a pytree of ints, `None` and callables (such as
`eqx.if_array(0)`), as `eqx.filter_vmap` takes them."""


@no_type_check  # the option's type, for the constructor; the checks refuse the rest
def axis_spec(spec: AxisSpec) -> Any:
    """An axis spec as `jax.vmap` reads it: a list at the top is a tuple of per-argument
    specs, and integer axes (NumPy's too) are Python ints, so that the spec hashes."""
    if isinstance(spec, list):
        spec = tuple(spec)
    return jax.tree_util.tree_map(as_index, spec, is_leaf=is_none)


def is_none(x: Any) -> bool:
    return x is None


def _is_axis(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def check_axis_spec(spec: Any, name: str, *, owner: str) -> None:
    for leaf in jax.tree_util.tree_leaves(spec, is_leaf=is_none):
        if not (_is_axis(leaf) or callable(leaf)):
            raise TypeError(
                f"{owner}: `{name}` must be a pytree of ints, None and callables "
                f"(such as eqx.if_array(0)), but it holds {leaf!r} of type "
                f"{type(leaf).__name__}; got {name}={spec!r}."
            )


_WHAT = {
    "in_axes": "the positional arguments (a tuple)",
    "out_axes": "the output of `fn`",
}


def _axes_per_leaf(spec: Any, tree: Any, name: str, *, owner: str) -> Any:
    """One axis (an int or None) per leaf of `tree`, from the prefix `spec`."""

    def resolve_subtree(leaf_spec, subtree):
        if _is_axis(leaf_spec):
            return jax.tree_util.tree_map(lambda _: leaf_spec, subtree)
        return jax.tree_util.tree_map(leaf_spec, subtree)

    try:
        resolved = jax.tree_util.tree_map(resolve_subtree, spec, tree, is_leaf=is_none)
    except ValueError as error:
        raise ValueError(
            f"{owner}: `{name}` must be a pytree prefix of {_WHAT[name]}, but "
            f"{name}={spec!r} does not match its structure "
            f"{jax.tree_util.tree_structure(tree)}: {error}"
        ) from None
    for axis in jax.tree_util.tree_leaves(resolved, is_leaf=is_none):
        if not _is_axis(axis):
            raise TypeError(
                f"{owner}: a callable in `{name}` must return an int or None, "
                f"but it returned {axis!r} of type {type(axis).__name__}; got {name}={spec!r}."
            )
    return resolved


def _split_in_axes(
    fn: Any, in_axes: Any, args: tuple, kwargs: dict, *, owner: str
) -> tuple[Any, dict]:
    """The axis specs of the positional and of the keyword arguments."""
    default = eqx.if_array(0)
    if not isinstance(in_axes, dict):
        return in_axes, {name: default for name in kwargs}
    named = dict(in_axes)
    arg_axes = []
    if args:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            raise ValueError(
                f"{owner}: a dict `in_axes` names arguments, but the signature of "
                f"`fn`={fn!r} cannot be read to match names to positional arguments. "
                "Give `in_axes` as a tuple instead."
            ) from None
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = [p.name for p in params if p.kind in positional]
        for index in range(len(args)):
            name = names[index] if index < len(names) else None
            arg_axes.append(named.pop(name, default) if name is not None else default)
    kwarg_axes = {name: named.pop(name, default) for name in kwargs}
    if named:
        raise ValueError(
            f"{owner}: `in_axes` names {sorted(named)}, which match no argument passed "
            f"(positional arguments: {len(args)}, keyword arguments: {sorted(kwargs)}); "
            f"got in_axes={in_axes!r}."
        )
    return tuple(arg_axes), kwarg_axes


def _input_name(path: tuple) -> str:
    """`args[1]['w']` or `kwargs['y']`, from a path into `(args, kwargs)`."""
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))


def _batch_size(paths: list, leaves: list, axes: list, *, owner: str) -> int | None:
    """The size of the mapped axis, checked to be the same for every mapped input."""
    sizes = {}
    for path, leaf, axis in zip(paths, leaves, axes, strict=True):
        if axis is None:
            continue
        name = _input_name(path)
        ndim = jnp.ndim(leaf)
        if ndim == 0:
            raise ValueError(
                f"{owner}: input {name} is mapped over axis {axis} by `in_axes`, but it is "
                f"zero-dimensional: {leaf!r}. Only arrays with at least one dimension can "
                "be mapped; give it the axis None to pass it whole to every call."
            )
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{owner}: input {name} has shape {jnp.shape(leaf)}, so `in_axes` cannot map "
                f"its axis {axis}; choose an axis in [{-ndim}, {ndim - 1}]."
            )
        sizes[f"{name} (axis {axis})"] = jnp.shape(leaf)[axis]
    return common_size(sizes, owner=owner, what="mapped axes")


def _check_out_axes(out: Any, resolved: Any, *, owner: str) -> None:
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(out)
    for (path, leaf), axis in zip(paths_leaves, treedef.flatten_up_to(resolved), strict=True):
        if axis is None:
            continue
        ndim = jnp.ndim(leaf)
        if not -ndim - 1 <= axis <= ndim:
            raise ValueError(
                f"{owner}: output{jax.tree_util.keystr(path)} of `fn` has shape "
                f"{jnp.shape(leaf)}, so `out_axes` cannot put the mapped axis at {axis}; "
                f"choose an axis in [{-ndim - 1}, {ndim}]."
            )


class Mapped(NamedTuple):
    input_axes: Any  # one axis (or None) per leaf of (args, kwargs), as a pytree
    input_def: Any
    leaves: list
    axes: list  # the same, flat, normalised to non-negative
    total: int | None  # the size of the mapped axes (None: nothing is mapped)


def mapped_inputs(fn: Any, in_axes: Any, args: tuple, kwargs: dict, *, owner: str) -> Mapped:
    """Which axis of each input leaf is mapped, and the size they share."""
    arg_spec, kwarg_spec = _split_in_axes(fn, in_axes, args, kwargs, owner=owner)
    input_axes = (
        _axes_per_leaf(arg_spec, args, "in_axes", owner=owner),
        _axes_per_leaf(kwarg_spec, kwargs, "in_axes", owner=owner),
    )
    paths_leaves, input_def = jax.tree_util.tree_flatten_with_path((args, kwargs))
    paths = [path for path, _ in paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]
    axes = input_def.flatten_up_to(input_axes)
    total = _batch_size(paths, leaves, axes, owner=owner)
    axes = [None if a is None else a % jnp.ndim(leaf) for leaf, a in zip(leaves, axes, strict=True)]
    return Mapped(input_axes, input_def, leaves, axes, total)


def element_leaves(mapped: Mapped) -> list:
    """The input leaves of one element: each mapped array as a `jax.ShapeDtypeStruct`
    without its mapped axis, every other leaf as it is."""

    def element_of(leaf, axis):
        if axis is None or not eqx.is_array(leaf):
            return leaf
        shape = tuple(d for i, d in enumerate(jnp.shape(leaf)) if i != axis)
        return jax.ShapeDtypeStruct(shape, leaf.dtype)

    return [element_of(leaf, axis) for leaf, axis in zip(mapped.leaves, mapped.axes, strict=True)]


def output_axes(fn: Callable[..., Any], out_axes: Any, mapped: Mapped, *, owner: str) -> Any:
    """The output axis of each leaf of `fn`'s output (`None`: unmapped), resolved on one
    element's output as `eqx.filter_vmap` does, and made non-negative for the mapped
    output (which has one more axis); as a pytree like the output."""

    element = mapped.input_def.unflatten(element_leaves(mapped))

    def resolve(inputs):
        element_args, element_kwargs = inputs
        out = fn(*element_args, **element_kwargs)
        resolved = _axes_per_leaf(out_axes, out, "out_axes", owner=owner)
        _check_out_axes(out, resolved, owner=owner)
        # Axes are ints and Nones: returned as they are, not as shapes.
        return jax.tree_util.tree_map(
            lambda leaf, a: None if a is None else a % (jnp.ndim(leaf) + 1),
            out,
            resolved,
            is_leaf=is_none,
        )

    return eqx.filter_eval_shape(resolve, element)
