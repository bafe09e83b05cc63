"""The layers of a traced program, for Kronecker-factored curvature.

A layer is a weight leaf of the variables used as one operand of a `dot_general`
(`eqx.nn.Linear`, `w @ a`, attention's projections, under `vmap` too), directly or
through a transpose used by nothing else (PyTorch's layout `a @ w.T`), as the kernel of
a `conv_general_dilated` (`eqx.nn.Conv2d`) or as the matrix whose rows a `gather` looks up
(`eqx.nn.Embedding`: a product with one-hot rows), the layer's input being the other
operand. A bias leaf joins the layer when the layer's output reaches, through layout
operations only (transpose, reshape, squeeze, unit axes, a change of dtype) and no
other use, an `add` whose other operand is the bias broadcast along the output's
features: checked entry by entry on index arrays, so that any layout of the features is
found as long as it is the same.

`find_layers` reads the program; `run` evaluates it as `jax.core.eval_jaxpr` would, but
returns each layer's input and adds a perturbation to each layer's output, so that the
gradients with respect to the perturbations are the gradients with respect to the
layers' outputs. Calls (`jit`, `checkpoint`, custom derivatives) that hold a layer are
evaluated equation by equation; others are bound whole.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from .._jaxpr import bind, evaluate

__all__ = [
    "Layer",
    "Program",
    "find_layers",
    "input_rows",
    "output_rows",
    "output_shape",
    "rows_shape",
    "run",
]

# Calls whose program is read through: a layer may be inside.
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
    }
)
# Operations that only move entries or change their dtype (a float32 bias beside float64
# data is converted first): a layer's output, and its bias, may pass through them.
_LAYOUT = frozenset(
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


class Layer(NamedTuple):
    """A layer found in the program: where it is and how its arrays are laid out.

    The weight leaf, transposed by `weight_axes`, is the matrix `(out..., in...)`; the
    layer's input, transposed by `input_axes` (after patches are taken, for a
    convolution), is `(rows..., in...)`; its output, transposed by `output_axes`, is
    `(rows..., out...)`, with the same rows in the same order."""

    path: tuple[int, ...]  # the equation: its index in the program and in each call within
    weight: int  # the weight's leaf index
    bias: int | None  # the joined bias's leaf index
    weight_operand: int  # which operand of the equation the weight is
    weight_axes: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    input_axes: tuple[int, ...]
    output_axes: tuple[int, ...]
    num_rows: int  # how many leading axes of the transposed input and output are rows
    patches: tuple | None  # a convolution's options, to take its input's patches
    lookup: tuple | None = None  # a row lookup's: (index position, clipped, row axis kept)

    @property
    def out_size(self) -> int:
        return math.prod(self.out_shape)

    @property
    def in_size(self) -> int:
        return math.prod(self.in_shape)


class Program(NamedTuple):
    """What `find_layers` found: the layers, and the leaves in none (in leaf order)."""

    layers: tuple[Layer, ...]
    others: tuple[int, ...]
    calls: frozenset  # the paths of calls evaluated equation by equation


def _inner(eqn: Any) -> tuple[Any, list]:
    """The program of a call and its constants."""
    for name in ("jaxpr", "call_jaxpr"):
        program = eqn.params.get(name)
        if isinstance(program, jcore.ClosedJaxpr):
            return program.jaxpr, list(program.consts)
        if isinstance(program, jcore.Jaxpr):
            return program, []
    return None, []


def _consumers(jaxpr: Any) -> dict:
    """Each variable's uses: `(equation index, operand position)`; the program's outputs
    count as a use at index -1."""
    uses = defaultdict(list)
    for i, eqn in enumerate(jaxpr.eqns):
        for position, var in enumerate(eqn.invars):
            if isinstance(var, jcore.Var):
                uses[var].append((i, position))
    for var in jaxpr.outvars:
        if isinstance(var, jcore.Var):
            uses[var].append((-1, 0))
    return uses


def _layout(eqn: Any, array: np.ndarray) -> np.ndarray:
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


def _is_layout(eqn: Any, *, moves_only: bool) -> bool:
    """Whether `eqn` is a layout operation (with `moves_only`, one that neither copies
    entries nor drops them)."""
    if eqn.primitive.name not in _LAYOUT:
        return False
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
        return False
    if moves_only and eqn.primitive.name == "broadcast_in_dim":
        return math.prod(eqn.params["shape"]) == math.prod(eqn.invars[0].aval.shape)
    return True


def _dot_layer(
    eqn: Any, leaf: int, operand: int, path: tuple, permutation: tuple | None = None
) -> Layer | None:
    """The layer of a `dot_general` whose operand `operand` is the weight, or None;
    `permutation` that of a transpose of the weight leaf into that operand (`x @ w.T`)."""
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    if batch_l or batch_r:
        return None  # a batched product, such as per-head weights, is not one matrix
    w_aval, x_aval = eqn.invars[operand].aval, eqn.invars[1 - operand].aval
    w_contract, x_contract = (contract_l, contract_r) if operand == 0 else (contract_r, contract_l)
    pairs = sorted(zip(w_contract, x_contract, strict=True))
    w_in = tuple(w for w, _ in pairs)
    w_out = tuple(d for d in range(len(w_aval.shape)) if d not in w_in)
    x_in = tuple(x for _, x in pairs)
    x_rows = tuple(d for d in range(len(x_aval.shape)) if d not in x_in)
    num_out, num_rows = len(w_out), len(x_rows)
    # The output's axes are the left operand's free axes, then the right's.
    if operand == 0:
        output_axes = tuple(range(num_out, num_out + num_rows)) + tuple(range(num_out))
    else:
        output_axes = tuple(range(num_rows + num_out))
    return Layer(
        path=path,
        weight=leaf,
        bias=None,
        weight_operand=operand,
        # The operand's axis d is the leaf's axis permutation[d].
        weight_axes=tuple(permutation[d] for d in w_out + w_in)
        if permutation is not None
        else w_out + w_in,
        out_shape=tuple(w_aval.shape[d] for d in w_out),
        in_shape=tuple(w_aval.shape[d] for d in w_in),
        input_axes=x_rows + x_in,
        output_axes=output_axes,
        num_rows=num_rows,
        patches=None,
    )


def _conv_layer(eqn: Any, leaf: int, path: tuple) -> Layer | None:
    """The layer of a `conv_general_dilated` whose kernel is the weight, or None."""
    params = eqn.params
    plain = params["feature_group_count"] == 1 and params["batch_group_count"] == 1
    if not plain or any(d != 1 for d in params["lhs_dilation"]):
        return None  # grouped and transposed convolutions are not one matrix of patches
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    kernel = eqn.invars[1].aval.shape
    spatial = tuple(kernel[d] for d in rhs_spec[2:])
    patches = (
        spatial,
        tuple(params["window_strides"]),
        tuple(tuple(p) for p in params["padding"]),
        tuple(params["rhs_dilation"]),
        (tuple(lhs_spec), tuple(rhs_spec), tuple(out_spec)),
        params.get("precision"),
    )
    rows = (out_spec[0],) + tuple(out_spec[2:])
    return Layer(
        path=path,
        weight=leaf,
        bias=None,
        weight_operand=1,
        weight_axes=(rhs_spec[0], rhs_spec[1]) + tuple(rhs_spec[2:]),
        out_shape=(kernel[rhs_spec[0]],),
        in_shape=(kernel[rhs_spec[1]],) + spatial,
        input_axes=rows + (out_spec[1],),
        output_axes=rows + (out_spec[1],),
        num_rows=len(rows),
        patches=patches,
    )


def _lookup_layer(eqn: Any, leaf: int, path: tuple) -> Layer | None:
    """The layer of a `gather` of whole rows of a matrix weight (`eqx.nn.Embedding`,
    `w[tokens]`): a product with the one-hot rows of the indices, or None."""
    numbers, sizes = eqn.params["dimension_numbers"], tuple(eqn.params["slice_sizes"])
    shape = eqn.invars[0].aval.shape
    whole_rows = (
        len(shape) == 2 and sizes == (1, shape[1]) and 1 not in numbers.collapsed_slice_dims
    )
    if not whole_rows or numbers.operand_batching_dims or 0 not in numbers.start_index_map:
        return None
    kept = 0 not in numbers.collapsed_slice_dims
    offsets = tuple(numbers.offset_dims)
    batch = tuple(d for d in range(len(eqn.outvars[0].aval.shape)) if d not in offsets)
    rows = batch + ((offsets[0],) if kept else ())
    clip = "CLIP" in str(eqn.params.get("mode"))
    return Layer(
        path=path,
        weight=leaf,
        bias=None,
        weight_operand=0,
        weight_axes=(1, 0),
        out_shape=(shape[1],),
        in_shape=(shape[0],),
        input_axes=tuple(range(len(rows) + 1)),
        output_axes=rows + (offsets[-1],),
        num_rows=len(rows),
        patches=None,
        lookup=(numbers.start_index_map.index(0), clip, kept),
    )


def _candidate(eqn: Any, leaf_of: dict, path: tuple, transposed: dict) -> Layer | None:
    """The layer of `eqn` if it is one: exactly one operand is a leaf, the weight (for a
    `dot_general`, a leaf or its transpose in `transposed`: var -> (leaf, permutation))."""
    name = eqn.primitive.name
    operands = [leaf_of.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
    if name == "dot_general" and len(operands) == 2:
        views = [transposed.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
        operands = [
            leaf if view is None else view[0] for leaf, view in zip(operands, views, strict=True)
        ]
        if (operands[0] is None) == (operands[1] is None):
            return None
        operand = 0 if operands[0] is not None else 1
        permutation = None if views[operand] is None else views[operand][1]
        return _dot_layer(eqn, operands[operand], operand, path, permutation)
    if name == "conv_general_dilated" and operands[1] is not None and operands[0] is None:
        return _conv_layer(eqn, operands[1], path)
    if name == "gather" and operands[0] is not None and operands[1] is None:
        return _lookup_layer(eqn, operands[0], path)
    return None


def _bias(jaxpr: Any, index: int, layer: Layer, leaf_of: dict, uses: dict) -> tuple | None:
    """`(bias leaf, index of the equation where the bias is first used)` where the output
    of the layer's equation `index` reaches a bias's `add`, else None."""
    eqns = jaxpr.eqns
    var, chain = eqns[index].outvars[0], []
    while len(uses[var]) == 1 and uses[var][0][0] >= 0:
        user = eqns[uses[var][0][0]]
        if not _is_layout(user, moves_only=True):
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
        if not _is_layout(producer, moves_only=False):
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
        output = _layout(eqn, output)
    bias_shape = tuple(other.aval.shape)
    if math.prod(bias_shape) != layer.out_size:
        return None
    bias = np.arange(layer.out_size).reshape(bias_shape)
    for eqn in reversed(bias_chain):
        bias = _layout(eqn, bias)
    shape = tuple(add.outvars[0].aval.shape)
    try:
        bias = np.broadcast_to(bias, shape)
    except ValueError:
        return None
    if not np.array_equal(np.broadcast_to(output, shape), bias):
        return None
    return leaf_of[other], first


def _transposed(jaxpr: Any, leaf_of: dict, uses: dict) -> dict:
    """The transposes of a leaf whose only use is a `dot_general` (PyTorch's layout
    `x @ w.T`): their outputs, each as `(leaf, permutation)`."""
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "transpose":
            continue
        source, out = eqn.invars[0], eqn.outvars[0]
        if not isinstance(source, jcore.Var) or source not in leaf_of or len(uses[out]) != 1:
            continue
        user = uses[out][0][0]
        if user >= 0 and jaxpr.eqns[user].primitive.name == "dot_general":
            found[out] = (leaf_of[source], tuple(eqn.params["permutation"]))
    return found


def _walk(jaxpr: Any, leaf_of: dict, path: tuple, found: list, used: dict, calls: set) -> None:
    """Record the candidate layers in `found` and every leaf's uses in `used` (leaf ->
    paths of the equations that take it), reading through calls."""
    uses = _consumers(jaxpr)
    for var, leaf in leaf_of.items():
        if any(i < 0 for i, _ in uses[var]):
            used[leaf].append(path + (-1,))  # a leaf among the program's outputs
    transposed = _transposed(jaxpr, leaf_of, uses)
    for i, eqn in enumerate(jaxpr.eqns):
        here = path + (i,)
        if eqn.outvars and eqn.outvars[0] in transposed:
            continue  # the leaf's use is the product the transpose feeds
        taken = [
            (p, leaf_of[v] if v in leaf_of else transposed[v][0])
            for p, v in enumerate(eqn.invars)
            if isinstance(v, jcore.Var) and (v in leaf_of or v in transposed)
        ]
        if not taken:
            continue
        inner, _ = _inner(eqn) if eqn.primitive.name in _CALLS else (None, [])
        if inner is not None and len(inner.invars) == len(eqn.invars):
            before = len(found)
            _walk(inner, {inner.invars[p]: leaf for p, leaf in taken}, here, found, used, calls)
            if len(found) > before:
                calls.add(here)
            continue
        for _, leaf in taken:
            used[leaf].append(here)
        layer = _candidate(eqn, leaf_of, here, transposed)
        if layer is None:
            continue
        bias = _bias(jaxpr, i, layer, leaf_of, uses)
        claim = (path + (bias[1],), bias[0]) if bias is not None else None
        found.append((layer, claim))


def find_layers(jaxpr: Any, num_leaves: int) -> Program:
    """The layers of `jaxpr`, whose first `num_leaves` inputs are the variables' leaves.

    A weight is in a layer when that layer's equation is its only use; a bias joins when
    its `add` is its only use and its layer's weight is in the layer. Every other leaf is
    in `others`."""
    leaf_of = {var: leaf for leaf, var in enumerate(jaxpr.invars[:num_leaves])}
    found, used, calls = [], defaultdict(list), set()
    _walk(jaxpr, leaf_of, (), found, used, calls)
    layers, placed = [], set()
    for layer, claim in found:
        if used[layer.weight] != [layer.path] or layer.weight in placed:
            continue
        placed.add(layer.weight)
        if claim is not None and used[claim[1]] == [claim[0]] and claim[1] not in placed:
            layer = layer._replace(bias=claim[1])
            placed.add(claim[1])
        layers.append(layer)
    # Calls that hold a dropped candidate only need no reading through.
    kept = {layer.path[:depth] for layer in layers for depth in range(1, len(layer.path))}
    others = tuple(leaf for leaf in range(num_leaves) if leaf not in placed)
    return Program(tuple(layers), others, frozenset(kept & calls))


def run(jaxpr: Any, consts: list, args: list, program: Program, perturbations: list) -> tuple:
    """Evaluate `jaxpr` on `args`: returns its outputs and each layer's input, in the order
    of `program.layers`, with `perturbations[k]` added to layer `k`'s output."""
    at = {layer.path: (k, layer) for k, layer in enumerate(program.layers)}
    inputs = [None] * len(program.layers)

    def rule(eqn: Any, values: list, here: tuple) -> list | None:
        if here in program.calls:  # a call holding layers: into its program
            inner, inner_consts = _inner(eqn)
            return evaluate(inner, inner_consts, values, rule, here)
        if here not in at:
            return None
        k, layer = at[here]
        inputs[k] = values[1 - layer.weight_operand]
        return [answer + perturbations[k] for answer in bind(eqn, values)]

    return evaluate(jaxpr, consts, args, rule), inputs


def output_shape(jaxpr: Any, layer: Layer) -> tuple[int, ...]:
    """The shape of a layer's output in the program `jaxpr`."""
    for index in layer.path[:-1]:
        jaxpr = _inner(jaxpr.eqns[index])[0]
    return tuple(jaxpr.eqns[layer.path[-1]].outvars[0].aval.shape)


def rows_shape(jaxpr: Any, layer: Layer) -> tuple[int, ...]:
    """The shape of a layer's rows (examples, positions) in the program `jaxpr`."""
    shape = output_shape(jaxpr, layer)
    return tuple(shape[d] for d in layer.output_axes[: layer.num_rows])


def input_rows(layer: Layer, value: jax.Array, dtype: Any) -> jax.Array:
    """A layer's input as `(rows..., in)`: for a convolution, its patches; for a lookup,
    the one-hot rows of its indices (none for an index out of bounds, where the lookup
    drops it)."""
    if layer.lookup is not None:
        position, clip, kept = layer.lookup
        rows = value[..., position]
        rows = jnp.clip(rows, 0, layer.in_size - 1) if clip else rows
        value = jax.nn.one_hot(rows, layer.in_size, dtype=dtype)
        value = value[..., None, :] if kept else value
    if layer.patches is not None:
        spatial, strides, padding, dilation, numbers, precision = layer.patches
        value = jax.lax.conv_general_dilated_patches(
            value,
            spatial,
            strides,
            padding,
            rhs_dilation=dilation,
            dimension_numbers=jax.lax.ConvDimensionNumbers(*numbers),
            precision=precision,
        )
    value = jnp.transpose(value, layer.input_axes)
    return value.reshape(value.shape[: layer.num_rows] + (layer.in_size,))


def output_rows(layer: Layer, value: jax.Array) -> jax.Array:
    """Something shaped like a layer's output (its gradient), as `(rows..., out)`; a
    leading axis of columns is kept in front."""
    lead = value.ndim - len(layer.output_axes)
    axes = tuple(range(lead)) + tuple(lead + d for d in layer.output_axes)
    value = jnp.transpose(value, axes)
    return value.reshape(value.shape[: lead + layer.num_rows] + (layer.out_size,))
