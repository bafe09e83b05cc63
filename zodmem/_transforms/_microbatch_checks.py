"""The checks of `Microbatcher`'s options and of the batch a call is given: converters
that read the options as written, refusals that name the option and what is allowed, and
the one batch size of the batch arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Int

from .._checks import Integer, as_index, check_int, common_size

# The converters carry the option's type, which Equinox gives the constructor's parameter;
# they pass on what they are given, for the checks below to refuse in words.


@no_type_check
def as_tuple(value: str | Sequence[str]) -> Any:
    """Turn a list (or other non-string sequence) into a tuple; leave the rest as is."""
    if isinstance(value, Sequence) and not isinstance(value, (str, tuple)):
        return tuple(value)
    return value


@no_type_check
def as_indices(value: Integer | Sequence[Integer]) -> Any:
    """An integer, or each entry of a sequence of them, as Python ints (in a tuple)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(as_index(item) for item in value)
    return as_index(value)


@no_type_check
def as_count(value: Integer | Int[ArrayLike, ""] | None) -> Any:
    """An integer as a Python int; a JAX array (maybe traced) stays an array."""
    return value if isinstance(value, jax.Array) else as_index(value)


def _check_ints(value: Any, name: str, allowed: str, owner: str) -> tuple[int, ...]:
    """Refuse anything but an int or a tuple of ints; return the ints as a tuple."""
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        check_int(item, name, owner=owner, allowed=allowed)
    return items


def check_argnums(value: Any, *, owner: str) -> None:
    allowed = "an int or a sequence of ints (positional argument indices)"
    items = _check_ints(value, "argnums", allowed, owner)
    if any(i < 0 for i in items):
        raise ValueError(
            f"{owner}: `argnums` must hold non-negative indices, got argnums={value!r}."
        )
    if len(set(items)) != len(items):
        raise ValueError(f"{owner}: `argnums` has repeated indices: argnums={value!r}.")


def check_argnames(value: Any, *, owner: str) -> None:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, tuple) or not all(isinstance(n, str) for n in items):
        raise TypeError(
            f"{owner}: `argnames` must be a string or a sequence of strings (keyword "
            f"argument names), got {value!r}."
        )
    if len(set(items)) != len(items):
        raise ValueError(f"{owner}: `argnames` has repeated names: argnames={value!r}.")


def check_in_axes(value: Any, count: int, *, owner: str) -> None:
    allowed = "an int or a sequence of ints (one per batch argument)"
    _check_ints(value, "in_axes", allowed, owner)
    if isinstance(value, tuple) and len(value) != count:
        raise ValueError(
            f"{owner}: `in_axes` must have one entry per batch argument (argnums, then "
            f"argnames): {count} expected, got in_axes={value!r}."
        )


def check_num_real_microbatches(value: Any, *, owner: str) -> None:
    if not hasattr(value, "dtype"):
        check_int(
            value,
            "num_real_microbatches",
            owner=owner,
            minimum=0,
            optional=True,
            allowed="None, a non-negative int or an integer scalar array",
        )
        return
    if not jnp.issubdtype(value.dtype, jnp.integer) or getattr(value, "shape", None) != ():
        raise TypeError(
            f"{owner}: `num_real_microbatches` must be None, an int or an integer scalar "
            f"array, got {value!r}."
        )


def describe_position(position: int | str) -> str:
    if isinstance(position, int):
        return f"positional argument {position}"
    return f"keyword argument {position!r}"


def leaf_batch_axes(value: Any, axis: int, where: str, *, owner: str) -> Any:
    """The normalised batch axis of every leaf of one batch argument."""

    def leaf_axis(leaf):
        if not hasattr(leaf, "shape"):
            raise TypeError(
                f"{owner}: every leaf of a batch argument must be an array with a batch "
                f"axis, but {where} has a leaf {leaf!r} of type {type(leaf).__name__}."
            )
        ndim = len(leaf.shape)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{owner}: {where} has batch axis {axis} (from in_axes), but one of its "
                f"leaves has shape {tuple(leaf.shape)}, with no axis {axis}."
            )
        return axis % ndim

    return jax.tree_util.tree_map(leaf_axis, value)


def common_batch_size(batch: list[tuple[str, Any, Any]], *, owner: str) -> int:
    """The one batch size that every leaf of every batch argument has."""
    sizes = {}
    for where, value, axes in batch:
        leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        for (path, leaf), axis in zip(leaves, jax.tree_util.tree_leaves(axes), strict=True):
            sizes[f"{where}{jax.tree_util.keystr(path)} (axis {axis})"] = leaf.shape[axis]
    size = common_size(
        sizes, owner=owner, subject="the batch arguments", what="batch axes (from in_axes)"
    )
    if size is None:
        raise ValueError(
            f"{owner}: the batch arguments ({', '.join(w for w, _, _ in batch)}) hold no "
            "arrays, so there is no batch to cut into microbatches."
        )
    if size == 0:
        raise ValueError(f"{owner}: the batch is empty (batch size 0); there is nothing to do.")
    return size
