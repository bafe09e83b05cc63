"""What a program adds to a layer's output: a bias, or a table of rows by position.

A bias leaf joins a layer when the layer's output reaches, through layout operations
only (transpose, reshape, squeeze, unit axes, a change of dtype) and no other use, an
`add` whose other operand is the bias broadcast along the output's features: checked
entry by entry on index arrays, so that any layout of the features is found as long as
it is the same.

A matrix leaf `(positions, features)` whose rows, all of them or a slice `w[a:b:s]`, are
broadcast over the examples and added to an activation (a learned positional embedding,
`h + pos.weight[:T]`) is a lookup whose indices are the positions: a layer whose input
rows are one-hot, its output the `add`'s, so that each example's position is a row of
its own with its own gradient.
"""

from __future__ import annotations

import math
from typing import Any

import jax.extend.core as jcore
import numpy as np

__all__ = ["LAYOUT", "apply_layout", "bias_of", "is_layout", "position_layer"]

# Operations that only move entries or change their dtype (a float32 bias beside float64
# data is converted first): a layer's output, and its bias, may pass through them.
LAYOUT = frozenset(
    {
        "transpose",
        "reshape",
        "squeeze",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "convert_element_type",
    }
)


def apply_layout(eqn: Any, array: np.ndarray) -> np.ndarray:
    """`array` through the layout operation `eqn`, in NumPy."""
    name, params = eqn.primitive.name, eqn.params
    if name == "transpose":
        return np.transpose(array, params["permutation"])
    if name == "reshape":
        return np.reshape(array, params["new_sizes"])
    if name == "squeeze":
        return np.squeeze(array, axis=tuple(params["dimensions"]))
    if name == "broadcast_in_dim":
        shape = [1] * len(params["shape"])
        for axis, size in zip(params["broadcast_dimensions"], array.shape, strict=True):
            shape[axis] = size
        return np.broadcast_to(array.reshape(shape), params["shape"])
    return array


def is_layout(eqn: Any, *, moves_only: bool) -> bool:
    """Whether `eqn` is a layout operation (with `moves_only`, one that neither copies
    entries nor drops them)."""
    if eqn.primitive.name not in LAYOUT:
        return False
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
        return False
    if moves_only and eqn.primitive.name == "broadcast_in_dim":
        return math.prod(eqn.params["shape"]) == math.prod(eqn.invars[0].aval.shape)
    return True


def bias_of(jaxpr: Any, index: int, layer: Any, leaf_of: dict, uses: dict) -> tuple | None:
    """`(bias leaf, index of the equation where the bias is first used)` where the output
    of the layer's equation `index` reaches a bias's `add`, else None."""
    eqns = jaxpr.eqns
    var, chain = eqns[index].outvars[0], []
    while len(uses[var]) == 1 and uses[var][0][0] >= 0:
        user = eqns[uses[var][0][0]]
        if not is_layout(user, moves_only=True):
            break
        chain.append(user)
        var = user.outvars[0]
    if len(uses[var]) != 1 or uses[var][0][0] < 0 or eqns[uses[var][0][0]].primitive.name != "add":
        return None
    add_index, side = uses[var][0]
    add = eqns[add_index]
    if tuple(var.aval.shape) != tuple(add.outvars[0].aval.shape):
        return None  # the output itself is broadcast: the add is not a bias's
    producers = {out: (i, e) for i, e in enumerate(eqns) for out in e.outvars}
    other, bias_chain, first = add.invars[1 - side], [], add_index
    while isinstance(other, jcore.Var) and other not in leaf_of:
        if other not in producers or len(uses[other]) != 1:
            return None
        first, producer = producers[other]
        if not is_layout(producer, moves_only=False):
            return None
        bias_chain.append(producer)
        other = producer.invars[0]
    if not isinstance(other, jcore.Var) or other not in leaf_of:
        return None
    # The layer's output as out-feature indices, and the bias as its own indices.
    rows_shape = tuple(
        eqns[index].outvars[0].aval.shape[d] for d in layer.output_axes[: layer.num_rows]
    )
    features = np.arange(layer.out_size).reshape(layer.out_shape)
    canonical = np.broadcast_to(features, rows_shape + layer.out_shape)
    output = np.transpose(canonical, np.argsort(layer.output_axes))
    for eqn in chain:
        output = apply_layout(eqn, output)
    bias_shape = tuple(other.aval.shape)
    if math.prod(bias_shape) != layer.out_size:
        return None
    bias = np.arange(layer.out_size).reshape(bias_shape)
    for eqn in reversed(bias_chain):
        bias = apply_layout(eqn, bias)
    shape = tuple(add.outvars[0].aval.shape)
    try:
        bias = np.broadcast_to(bias, shape)
    except ValueError:
        return None
    if not np.array_equal(np.broadcast_to(output, shape), bias):
        return None
    return leaf_of[other], first


def _slice(eqn: Any, array: np.ndarray) -> np.ndarray:
    """`array` through the static `slice` equation `eqn`, in NumPy."""
    params = eqn.params
    strides = params["strides"] or (1,) * array.ndim
    index = tuple(
        slice(a, b, s)
        for a, b, s in zip(params["start_indices"], params["limit_indices"], strides, strict=True)
    )
    return array[index]


def _one_axis(values: np.ndarray, shape: tuple) -> tuple[int, int, int] | None:
    """`(axis, start, stride)` where `values`, of `shape`, is `start + stride * i` along
    one axis `i` and the same along every other (axis -1: one value), else None."""
    varying = [
        d for d in range(len(shape)) if shape[d] > 1 and not np.all(np.diff(values, axis=d) == 0)
    ]
    if len(varying) > 1:
        return None
    first = int(values.reshape(-1)[0])
    if not varying:
        return -1, first, 1
    axis = varying[0]
    along = np.moveaxis(values, axis, 0).reshape(shape[axis], -1)[:, 0]
    stride = int(along[1] - along[0])
    if not np.array_equal(along, first + stride * np.arange(shape[axis])):
        return None
    return axis, first, stride


def position_layer(jaxpr: Any, index: int, var: Any, uses: dict, path: tuple) -> dict | None:
    """The fields of a layer (`_kfac_trace.Layer`) for the matrix leaf `var` taken by
    equation `index` where its rows are added by position to an activation, else None.

    From the leaf, each value must have one use and pass only a static slice of rows or
    layout operations until an `add`, where it is broadcast to the other operand's
    shape; the `add`'s output is the layer's (`at`). Its features must lie along one
    axis of that output and its rows' indices vary along at most one other."""
    if len(var.aval.shape) != 2:
        return None
    positions, features = var.aval.shape
    rows = np.broadcast_to(np.arange(positions)[:, None], (positions, features))
    cols = np.broadcast_to(np.arange(features)[None, :], (positions, features))
    eqns, at = jaxpr.eqns, index
    while eqns[at].primitive.name != "add":
        eqn = eqns[at]
        if eqn.primitive.name == "slice":
            rows, cols = _slice(eqn, rows), _slice(eqn, cols)
        elif is_layout(eqn, moves_only=False):
            rows, cols = apply_layout(eqn, rows), apply_layout(eqn, cols)
        else:
            return None
        out = eqn.outvars[0]
        if len(uses[out]) != 1 or uses[out][0][0] < 0:
            return None
        at = uses[out][0][0]
    shape = tuple(eqns[at].outvars[0].aval.shape)
    try:
        rows, cols = np.broadcast_to(rows, shape), np.broadcast_to(cols, shape)
    except ValueError:
        return None
    feature = _one_axis(cols, shape)
    if feature is None or feature[0] < 0 or shape[feature[0]] != features or feature[1:] != (0, 1):
        return None
    axis = feature[0]
    kept = tuple(d for d in range(len(shape)) if d != axis)
    position = _one_axis(np.take(rows, 0, axis=axis), tuple(shape[d] for d in kept))
    if position is None:
        return None
    return {
        "path": path + (index,),
        "at": path + (at,),
        "weight_operand": 0,
        "weight_axes": (1, 0),
        "out_shape": (features,),
        "in_shape": (positions,),
        "input_axes": tuple(range(len(shape))),
        "output_axes": kept + (axis,),
        "num_rows": len(kept),
        "patches": None,
        "positions": position,
    }
