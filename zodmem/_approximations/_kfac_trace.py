"""The layers of a traced program, for Kronecker-factored curvature.

A use of a weight is the weight leaf of the variables used as one operand of a
`dot_general` (`eqx.nn.Linear`, `w @ a`, attention's projections, under `vmap` too),
directly or through a transpose used by nothing else (PyTorch's layout `a @ w.T`), as the
kernel of a `conv_general_dilated` (`eqx.nn.Conv2d`) or as the matrix whose rows a
`gather` looks up (`eqx.nn.Embedding`: a product with one-hot rows), the use's input
being the other operand. A layer is a weight every use of which is such a use, in the
program, in the calls it holds and in the bodies of the `lax.scan`s it holds (as a
constant of the scan: one use a step), with the uses' layouts `(out, in)` the same or
exchanged (a tied embedding's lookup and head). A bias leaf joins the layer when each
use's output reaches its `add`, and a matrix leaf whose rows are added by position to an
activation is a lookup of the positions (`_kfac_adds`).

`find_layers` reads the program; `_kfac_rows.run` evaluates it and keeps each use's
input and perturbs its output.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import jax.extend.core as jcore

from ._kfac_adds import bias_of, position_layer

__all__ = [
    "Layer",
    "Program",
    "call_program",
    "find_layers",
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


class Layer(NamedTuple):
    """A use of a layer's weight found in the program: where it is and how its arrays
    are laid out.

    The weight leaf, transposed by `weight_axes`, is the matrix `(out..., in...)`; the
    use's input, transposed by `input_axes` (after patches are taken, for a
    convolution), is `(rows..., in...)`; its output, transposed by `output_axes`, is
    `(rows..., out...)`, with the same rows in the same order. Inside scans, the steps
    `steps` (the scans' lengths, outermost first) are rows before those."""

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
    steps: tuple[int, ...] = ()  # the lengths of the scans the use is inside
    swapped: bool = False  # whether its `(out, in)` is the layer's `(in, out)`
    # A table added by position: `(rows axis, start, stride)` of the rows' indices.
    positions: tuple | None = None
    at: tuple[int, ...] | None = None  # where its output is, if not at `path`

    @property
    def output_path(self) -> tuple[int, ...]:
        """The equation whose output is the use's output."""
        return self.path if self.at is None else self.at

    @property
    def out_size(self) -> int:
        return math.prod(self.out_shape)

    @property
    def in_size(self) -> int:
        return math.prod(self.in_shape)


class Program(NamedTuple):
    """What `find_layers` found: every use of the layers' weights, the layers (each the
    indices of its uses, the first laid out as the layer), and the leaves in none (in
    leaf order)."""

    layers: tuple[Layer, ...]
    others: tuple[int, ...]
    calls: frozenset  # the paths of calls and scans evaluated equation by equation
    groups: tuple[tuple[int, ...], ...] = ()
    mixed: tuple[int, ...] = ()  # weights whose uses' layouts cannot be made to agree


def call_program(eqn: Any) -> tuple[Any, list]:
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


def _walk(
    jaxpr: Any,
    leaf_of: dict,
    path: tuple,
    found: list,
    used: dict,
    calls: set,
    steps: tuple = (),
) -> None:
    """Record the candidate uses in `found` and every leaf's uses in `used` (leaf ->
    paths of the equations that take it), reading through calls and into the bodies of
    scans that take a leaf as a constant (`steps` the lengths of the scans around)."""
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
        inner, _ = call_program(eqn) if eqn.primitive.name in _CALLS else (None, [])
        inside = steps
        if eqn.primitive.name == "scan":
            inner, count = eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"]
            inside = steps + (eqn.params["length"],)
            for _, leaf in [(p, leaf) for p, leaf in taken if p >= count]:
                used[leaf].append(here)  # a carry or a step's slice: no one weight a step
            taken = [(p, leaf) for p, leaf in taken if p < count]
        if inner is not None and len(inner.invars) == len(eqn.invars):
            before = len(found)
            leaves = {inner.invars[p]: leaf for p, leaf in taken}
            _walk(inner, leaves, here, found, used, calls, inside)
            if len(found) > before:
                calls.add(here)
            continue
        for _, leaf in taken:
            used[leaf].append(here)
        layer = _candidate(eqn, leaf_of, here, transposed)
        if layer is None and len(taken) == 1:
            var = next((v for v in eqn.invars if isinstance(v, jcore.Var) and v in leaf_of), None)
            fields = None if var is None else position_layer(jaxpr, i, var, uses, path)
            if fields is not None:
                layer = Layer(weight=taken[0][1], bias=None, steps=steps, **fields)
                found.append((layer, None))
            continue
        if layer is None:
            continue
        bias = bias_of(jaxpr, i, layer, leaf_of, uses)
        claim = (path + (bias[1],), bias[0]) if bias is not None else None
        found.append((layer._replace(steps=steps), claim))


def _agreed(uses: list) -> list | None:
    """The uses of one weight laid out as the first: each the same `(out, in)` or the
    two exchanged (`swapped`), else None."""
    first = uses[0]
    split = len(first.out_shape)
    exchanged = first.weight_axes[split:] + first.weight_axes[:split]
    agreed = []
    for use in uses:
        if use.weight_axes == first.weight_axes and use.out_shape == first.out_shape:
            agreed.append(use)
        elif use.weight_axes == exchanged and use.out_shape == first.in_shape:
            agreed.append(use._replace(swapped=True))
        else:
            return None
    return agreed


def _joined(claims: list, uses: list, used: dict, placed: set) -> int | None:
    """The bias that every use of a weight claims, where those adds are its only uses."""
    if any(claim is None for claim in claims) or any(use.swapped for use in uses):
        return None
    biases = {claim[1] for claim in claims}
    if len(biases) != 1:
        return None
    bias = biases.pop()
    if bias in placed or sorted(used[bias]) != sorted(claim[0] for claim in claims):
        return None
    return bias


def find_layers(jaxpr: Any, num_leaves: int) -> Program:
    """The layers of `jaxpr`, whose first `num_leaves` inputs are the variables' leaves.

    A weight is a layer when every one of its uses is a candidate use and their layouts
    agree; a bias joins when it is added to each use's output and nowhere else, and no
    use is exchanged. Every other leaf is in `others`."""
    leaf_of = {var: leaf for leaf, var in enumerate(jaxpr.invars[:num_leaves])}
    found, used, calls = [], defaultdict(list), set()
    _walk(jaxpr, leaf_of, (), found, used, calls)
    by_weight = defaultdict(list)
    for layer, claim in found:
        by_weight[layer.weight].append((layer, claim))
    layers, groups, placed, mixed, outputs = [], [], set(), [], set()
    # Tables added by position come last: a leaf that is a layer's bias is joined as one.
    ordered = sorted(by_weight.items(), key=lambda item: item[1][0][0].positions is not None)
    for weight, candidates in ordered:
        paths = sorted(layer.path for layer, _ in candidates)
        if sorted(used[weight]) != paths or weight in placed:
            continue
        if any(layer.output_path in outputs for layer, _ in candidates):
            continue  # two tables added at once: neither is a layer of its own
        outputs.update(layer.output_path for layer, _ in candidates)
        uses = _agreed([layer for layer, _ in candidates])
        if uses is None:
            mixed.append(weight)
            continue
        placed.add(weight)
        bias = _joined([claim for _, claim in candidates], uses, used, placed)
        if bias is not None:
            placed.add(bias)
            uses = [use._replace(bias=bias) for use in uses]
        groups.append(tuple(range(len(layers), len(layers) + len(uses))))
        layers.extend(uses)
    # Calls that hold a dropped candidate only need no reading through.
    kept = {layer.path[:depth] for layer in layers for depth in range(1, len(layer.path))}
    others = tuple(leaf for leaf in range(num_leaves) if leaf not in placed)
    return Program(tuple(layers), others, frozenset(kept & calls), tuple(groups), tuple(mixed))
