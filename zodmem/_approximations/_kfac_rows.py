"""The rows of the layers' uses: the traced program evaluated so that it returns each
use's input and adds a perturbation to each use's output (the gradients with respect to
the perturbations are those with respect to the outputs), and those arrays laid out as
rows `(rows..., in)` and `(rows..., out)`.

The program is evaluated as `jax.core.eval_jaxpr` would, by the one interpreter
(`zodmem._jaxpr`). Calls (`jit`, `checkpoint`, custom derivatives) that hold a use are
evaluated equation by equation; a `lax.scan` that holds one is unrolled, its body
evaluated once a step, so that each step's input is kept and each step's output
perturbed; others are bound whole.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp

from .._jaxpr import bind, evaluate
from ._kfac_trace import Layer, Program, call_program

__all__ = ["input_rows", "output_rows", "output_shape", "rows_shape", "run", "second_moment"]


def _unrolled(eqn: Any, values: list, rule: Any, here: tuple, steps: list) -> list:
    """A `lax.scan` equation evaluated step by step, its body by `rule`; `steps` holds
    the index of the step under way, for the uses inside."""
    params = eqn.params
    body, count, carried = params["jaxpr"], params["num_consts"], params["num_carry"]
    consts, carry, xs = values[:count], values[count : count + carried], values[count + carried :]
    length = params["length"]
    ys: list = [None] * length
    order = range(length - 1, -1, -1) if params["reverse"] else range(length)
    for t in order:
        steps.append(t)
        outs = evaluate(body.jaxpr, body.consts, consts + carry + [x[t] for x in xs], rule, here)
        steps.pop()
        carry, ys[t] = list(outs[:carried]), outs[carried:]
    if length == 0:
        return carry + [jnp.zeros(var.aval.shape, var.aval.dtype) for var in eqn.outvars[carried:]]
    return carry + [jnp.stack(column) for column in zip(*ys, strict=True)]


def run(jaxpr: Any, consts: list, args: list, program: Program, perturbations: list) -> tuple:
    """Evaluate `jaxpr` on `args`: returns its outputs and each use's input, in the order
    of `program.layers`, with `perturbations[k]` added to use `k`'s output. A use inside
    scans has its inputs stacked over the steps `(steps..., *input)`, and its
    perturbation is laid out so too."""
    at = {layer.output_path: (k, layer) for k, layer in enumerate(program.layers)}
    kept: list[dict] = [{} for _ in program.layers]
    steps: list[int] = []

    def rule(eqn: Any, values: list, here: tuple) -> list | None:
        if here in program.calls:  # a call or a scan holding uses: into its program
            if eqn.primitive.name == "scan":
                return _unrolled(eqn, values, rule, here, steps)
            inner, inner_consts = call_program(eqn)
            return evaluate(inner, inner_consts, values, rule, here)
        if here not in at:
            return None
        k, layer = at[here]
        step = tuple(steps)
        answers = bind(eqn, values)
        if layer.positions is None:
            kept[k][step] = values[1 - layer.weight_operand]
        else:
            kept[k][step] = _position_indices(layer, answers[0].shape)
        perturbation = perturbations[k][step] if step else perturbations[k]
        return [answer + perturbation for answer in answers]

    outputs = evaluate(jaxpr, consts, args, rule)
    inputs = []
    for layer, values in zip(program.layers, kept, strict=True):
        if not layer.steps:
            inputs.append(values[()])
            continue
        every = [values[step] for step in itertools.product(*map(range, layer.steps))]
        stacked = jnp.stack(every)
        inputs.append(stacked.reshape(layer.steps + stacked.shape[1:]))
    return outputs, inputs


def _position_indices(layer: Layer, shape: tuple) -> jax.Array:
    """The rows' positions of a table added by position whose output has `shape`."""
    rows = tuple(shape[d] for d in layer.output_axes[: layer.num_rows])
    axis, start, stride = layer.positions
    if axis < 0:
        return jnp.full(rows, start, jnp.int32)
    return start + stride * jax.lax.broadcasted_iota(jnp.int32, rows, axis)


def output_shape(jaxpr: Any, layer: Layer) -> tuple[int, ...]:
    """The shape of a use's output in the program `jaxpr`, its steps in front."""
    path = layer.output_path
    for index in path[:-1]:
        jaxpr = call_program(jaxpr.eqns[index])[0]
    return layer.steps + tuple(jaxpr.eqns[path[-1]].outvars[0].aval.shape)


def rows_shape(jaxpr: Any, layer: Layer) -> tuple[int, ...]:
    """The shape of a use's rows (steps, examples, positions) in the program `jaxpr`."""
    shape = output_shape(jaxpr, layer)
    lead = len(layer.steps)
    return shape[:lead] + tuple(shape[lead + d] for d in layer.output_axes[: layer.num_rows])


def input_rows(layer: Layer, value: jax.Array, dtype: Any) -> jax.Array:
    """A use's input as `(rows..., in)`, its steps first: for a convolution, its patches;
    for a lookup, the one-hot rows of its indices (none for an index out of bounds,
    where the lookup drops it)."""
    if layer.steps:
        lead = len(layer.steps)
        flat = value.reshape((-1,) + value.shape[lead:])
        rows = jax.vmap(lambda one: input_rows(layer._replace(steps=()), one, dtype))(flat)
        return rows.reshape(layer.steps + rows.shape[1:])
    if layer.positions is not None:  # the rows' positions, kept by `run`
        value = jax.nn.one_hot(value, layer.in_size, dtype=dtype)
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
    """Something shaped like a use's output (its gradient), as `(rows..., out)`; leading
    axes (columns, then the steps) are kept in front."""
    lead = value.ndim - len(layer.output_axes)
    axes = tuple(range(lead)) + tuple(lead + d for d in layer.output_axes)
    value = jnp.transpose(value, axes)
    return value.reshape(value.shape[: lead + layer.num_rows] + (layer.out_size,))


def second_moment(rows: jax.Array) -> jax.Array:
    """`sum(r r^T)` over the rows `(..., size)`; replicated, as the type must say, where
    the rows are sharded over Explicit mesh axes (a batch split over devices)."""
    mesh = jax.typeof(rows).sharding.mesh
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    layout = jax.sharding.PartitionSpec() if explicit and not mesh.empty else None
    return jnp.einsum("...i,...j->ij", rows, rows, out_sharding=layout)
