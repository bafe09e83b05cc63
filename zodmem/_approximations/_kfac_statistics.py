"""What Kronecker-factored curvature takes from each microbatch: its layers' inputs and
output gradients, over every use of each layer's weight, as sums of outer products (the
factors), as moments in the factors' eigenbasis (EKFAC's eigenvalues), and the exact
Gauss-Newton blocks of the leaves in no layer.

Each use gives rows for the two sides of its layer's weight `(out, in)`: its output's
gradients for `out` and its inputs for `in`, or the two exchanged where the use lays the
weight out the other way (a tied embedding's lookup beside its head). Gradients come
with a leading axis of columns (the loss's Hessian's square root's, or the draws); a side
without one counts once a column, so that every term `(column, row)` of the sum is one
outer product on both sides."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .._operators._vectors import hashed_words
from .._pytree import Variables
from .._sharding import is_explicit, leaf_sharding
from . import _kfac_rows as rows_of, _kfac_trace as trace
from ._kfac_dense import dense_blocks
from ._kfac_examples import leading_array
from ._kfac_rows import second_moment

__all__ = ["Settings", "Statistics", "examples_split", "traced", "variable_leaves"]

# The stream of the type-2 columns' signs (`_term_signed`).
_SIGNS = 0x5EED


class Settings(eqx.Module):
    """What the microbatches' statistics need to know, all static."""

    fisher: str = eqx.field(static=True)
    mc_samples: int = eqx.field(static=True)
    mean: bool = eqx.field(static=True)
    program: trace.Program = eqx.field(static=True)
    examples: tuple = eqx.field(static=True)  # per use, its rows' examples axis or None
    approx: str = eqx.field(default="expand", static=True)
    reduced: tuple = eqx.field(default=(), static=True)  # per use, for "reduce": as examples
    owner: str = eqx.field(static=True, kw_only=True)  # the transform, for messages


def traced(fn: Any, variables: Variables, kwargs: dict) -> Callable:
    """`(leaves, args) -> fn(x, *args, **kwargs)`, `x` rebuilt from its variables' leaves."""

    def program(leaves: list, args: tuple) -> Any:
        return fn(variables.fill(leaves), *args, **kwargs)

    return program


def variable_leaves(x: Any, variables: Variables) -> list:
    flat = jax.tree_util.tree_leaves(x)
    return [leaf for leaf, is_var in zip(flat, variables.is_variable, strict=True) if is_var]


def _columns(loss: Any, outputs: Any, args: tuple, kwargs: dict, settings: Settings, key: Any):
    """The cotangents of the outputs to back-propagate, each leaf with a leading axis of
    columns, and the factor their moments are scaled by."""
    if settings.fisher == "type-2":
        return _term_signed(loss.hessian_sqrt(outputs, *args, **kwargs)), 1.0
    # A mean's gradients carry 1/N: N times their moments is the mean of the examples'.
    examples = jax.tree_util.tree_leaves(outputs)[0].shape[0] if settings.mean else 1
    if settings.fisher == "empirical":
        gradient = jax.grad(lambda out: loss(out, *args, **kwargs))(outputs)
        return jax.tree_util.tree_map(lambda leaf: leaf[None], gradient), float(examples)

    def sampled(key: Any) -> Any:
        targets = jax.lax.stop_gradient(loss.sample(outputs, key))
        data, named = _with_targets(loss, targets, args, kwargs)
        return jax.grad(lambda out: loss(out, *data, **named))(outputs)

    keys = jax.random.split(key, settings.mc_samples)
    return jax.vmap(sampled)(keys), examples / settings.mc_samples


def _term_signed(columns: Any) -> Any:
    """The type-2 Fisher's columns (the loss's Hessian's square root's), each loss term's
    entries (an output's leading index) times a sign of its own in each column, hashed
    from the two indices.

    Every column is back-propagated for all the terms at once. A row that one term
    alone reaches (an example's, in a network that keeps examples apart) gets its
    sign squared in every sum of outer products: nothing changes there. A row that
    several terms reach (a sequence's position, through attention, reaches the loss
    terms of the positions after it) would hold products between the terms, which
    the Gauss-Newton matrix lacks; with signs independent between the terms those
    products cancel on average, as the Monte Carlo Fisher's drawn targets make them,
    while each term keeps its exact columns."""

    def signed(leaf: jax.Array) -> jax.Array:
        if leaf.ndim < 2:
            return leaf
        count, terms = leaf.shape[:2]
        top = jax.lax.shift_right_logical(hashed_words((count, terms), 0, _SIGNS, 0), np.uint32(31))
        sign = (1 - 2 * top.astype(jnp.int32)).astype(leaf.dtype)
        return leaf * sign.reshape((count, terms) + (1,) * (leaf.ndim - 2))

    return jax.tree_util.tree_map(signed, columns)


def _with_targets(loss: Any, targets: Any, args: tuple, kwargs: dict) -> tuple:
    """The data arguments with the loss's targets replaced by `targets`."""
    where = loss.targets
    if isinstance(where, str):
        return args, {**kwargs, where: targets}
    args = list(args)
    args[where] = targets
    return tuple(args), kwargs


def _sides(layer: trace.Layer, value: Any, gradients: Any) -> tuple:
    """A use's rows as its layer lays its weight out, `(in side, out side)`, each
    `(columns, rows..., size)` (one column for the inputs): its inputs (a one appended
    for a bias) and its output's gradients, or the two exchanged."""
    inputs = rows_of.input_rows(layer, value, gradients.dtype)
    if layer.bias is not None:
        # A padded one keeps the rows' layout (a batch sharded over Explicit axes).
        inputs = jnp.pad(inputs, [(0, 0)] * (inputs.ndim - 1) + [(0, 1)], constant_values=1)
    outputs = rows_of.output_rows(layer, gradients)
    return (outputs, inputs[None]) if layer.swapped else (inputs[None], outputs)


def examples_split(args: tuple) -> NamedSharding | None:
    """How the data split their examples over devices: where the first array of `args`
    lies over Auto mesh axes with its leading axis split, a sharding of that axis alone;
    else `None` (read where the data are concrete arrays: a traced array on Auto axes
    does not say its layout)."""
    leading = leading_array(args)
    sharding = None if leading is None else leaf_sharding(leading)
    if sharding is None or is_explicit(sharding) or not sharding.spec:
        return None
    first = sharding.spec[0]
    return None if first is None else NamedSharding(sharding.mesh, P(first))


def _rows_split(side: jax.Array, split: NamedSharding | None, examples: int) -> jax.Array:
    """`side` `(columns, rows..., size)` kept split over the devices as the data split
    their examples, where its first rows axis runs over the examples (its length a
    multiple of theirs, `examples` a multiple of the devices). Without this, weights
    split over devices (FSDP- or tensor-parallel) lead XLA's sharding propagation to
    split the rows' features instead and hold every device's rows whole: the type-2
    Fisher's columns of gradients for the whole batch on every device."""
    if split is None or side.ndim < 3:
        return side
    axes = split.spec[0] if isinstance(split.spec[0], tuple) else (split.spec[0],)
    count = math.prod(split.mesh.shape[axis] for axis in axes)
    if examples % count or side.shape[1] % examples:
        return side
    spec = P(None, split.spec[0], *([None] * (side.ndim - 2)))
    return jax.lax.with_sharding_constraint(side, NamedSharding(split.mesh, spec))


def _per_example(side: jax.Array, axis: int | None) -> jax.Array:
    """A side `(columns, rows..., size)` as `(columns, examples, positions, size)`."""
    if axis is None:  # every row its own example
        return side.reshape(side.shape[0], -1, 1, side.shape[-1])
    side = jnp.moveaxis(side, axis + 1, 1)
    return side.reshape(side.shape[:2] + (-1, side.shape[-1]))


def _expanded(sides: list, columns: int) -> tuple:
    """`kfac_approx="expand"`: every use's every row a term: the input side's and the
    output side's sums of outer products, and the number of terms."""
    mixed = any(a.shape[0] != 1 for a, _ in sides)
    inputs = sum(second_moment(a) * (columns // a.shape[0] if mixed else 1) for a, _ in sides)
    gradients = sum(second_moment(b) * (columns // b.shape[0]) for _, b in sides)
    count = sum(math.prod(a.shape[1:-1]) for a, _ in sides) * (columns if mixed else 1)
    return inputs, gradients, count


def _reduced(sides: list, axes: tuple, columns: int) -> tuple:
    """`kfac_approx="reduce"`: per example, the input side averaged and the output side
    summed over its positions in every use, then their outer products."""
    a_sum, b_sum, positions = 0, 0, 0
    for (a, b), axis in zip(sides, axes, strict=True):
        a, b = _per_example(a, axis), _per_example(b, axis)
        a_sum, b_sum, positions = a_sum + a.sum(2), b_sum + b.sum(2), positions + a.shape[2]
    mean = a_sum / positions
    count = mean.shape[1] * mean.shape[0]
    return second_moment(mean), second_moment(b_sum) * (columns // b_sum.shape[0]), count


class Statistics(eqx.Module):
    """One microbatch's sums: `__call__(leaves, keys, *args, **kwargs)`.

    Without `bases`: per layer `sum(a a^T)`, the number of rows and `sum(g g^T)`, and the
    exact Gauss-Newton blocks of the other leaves. With `bases` (per layer the input's and
    the gradients' eigenvectors): per layer the per-example gradients' second moments in
    that basis, EKFAC's eigenvalues."""

    fn: Any
    loss: Any
    variables: Variables
    settings: Settings
    kwargs: dict
    bases: Any = None
    # How the data split their examples over devices (`examples_split`): each layer's
    # sides are kept split so.
    split: NamedSharding | None = eqx.field(default=None, static=True)

    def __call__(self, leaves: list, keys: Any, *args: Any) -> dict:
        dtype = self.variables.dtype
        program = traced(self.fn, self.variables, self.kwargs)
        closed, shape = jax.make_jaxpr(program, return_shape=True)(leaves, args)
        found = trace.find_layers(closed.jaxpr, len(leaves))
        if found != self.settings.program:
            raise ValueError(
                f"{self.settings.owner}: `fn` is a different program on a microbatch than on "
                "the whole batch (its layers differ); it must not depend on the batch's size."
            )
        perturbations = [
            jnp.zeros(rows_of.output_shape(closed.jaxpr, layer), dtype) for layer in found.layers
        ]
        flat = jax.tree_util.tree_leaves((leaves, args))

        def forward(perturbations: list) -> tuple:
            outputs, inputs = rows_of.run(closed.jaxpr, closed.consts, flat, found, perturbations)
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(shape), outputs
            ), inputs

        outputs, pullback, inputs = jax.vjp(forward, perturbations, has_aux=True)
        key = None if keys is None else keys[0]
        columns, scale = _columns(self.loss, outputs, args, self.kwargs, self.settings, key)
        # The moments' scale is carried by the gradients, whichever side they are on; a
        # mean's gradients, which carry 1/n, are taken as a sum's and the gradients'
        # factor divided by n, which the microbatches' weighted mean brings to 1/N.
        n = jax.tree_util.tree_leaves(outputs)[0].shape[0] if self.settings.mean else 1
        gradients = [math.sqrt(scale * n) * g for g in jax.vmap(pullback)(columns)[0]]
        leading = leading_array(args)
        examples = 1 if leading is None else leading.shape[0]
        sides = [
            tuple(
                _rows_split(side, self.split, examples) for side in _sides(layer, value, gradient)
            )
            for layer, value, gradient in zip(found.layers, inputs, gradients, strict=True)
        ]
        num_columns = max((g.shape[0] for g in gradients), default=1)
        groups = [[sides[k] for k in group] for group in found.groups]
        if self.bases is not None:
            return {"eigenvalues": [e / n for e in self._corrections(groups, num_columns)]}
        factors = [self._factors(found, group, sides, num_columns) for group in found.groups]
        return {
            "inputs": [a for a, _, _ in factors],
            "rows": [r for _, _, r in factors],
            "gradients": [jax.tree_util.tree_map(lambda b: b / n, b) for _, b, _ in factors],
            "dense": [
                block.astype(dtype)
                for block in dense_blocks(
                    program, self.loss, leaves, args, self.kwargs, self.settings.program.others
                )
            ],
        }

    def _factors(self, found: trace.Program, group: tuple, sides: list, columns: int) -> tuple:
        """A layer's sums `(inputs, gradients, rows)`, each one array where its uses lay
        its weight out one way; where some lay it out exchanged, each a pair: the sums of
        the uses laid out as the layer, then those of the others in their own layout
        (`_kfac_blocks.layer_blocks` joins the two Kronecker products)."""
        layouts = []
        for swapped in (False, True):
            uses = [k for k in group if found.layers[k].swapped == swapped]
            if not uses:
                continue
            own = [sides[k][::-1] if swapped else sides[k] for k in uses]
            if self.settings.approx == "reduce":
                axes = tuple(self.settings.reduced[k] for k in uses)
                a, b, rows = _reduced(own, axes, columns)
            else:
                a, b, rows = _expanded(own, columns)
            layouts.append((a, b, jnp.asarray(rows, self.variables.dtype)))
        if len(layouts) == 1:
            return layouts[0]
        return tuple(zip(*layouts, strict=True))

    def _corrections(self, groups: list, num_columns: int) -> list:
        """Per layer, the per-example gradients of its weight (summed over its uses)
        squared in the Kronecker eigenbasis."""
        eigenvalues = []
        for group, (input_basis, gradient_basis), indices in zip(
            groups, self.bases, self.settings.program.groups, strict=True
        ):
            axes = [self.settings.examples[k] for k in indices]
            moments, summed = 0, None
            for (a, b), axis in zip(group, axes, strict=True):
                a = _per_example(a @ input_basis, axis)
                b = _per_example(b @ gradient_basis, axis)
                a = jnp.broadcast_to(a, (num_columns,) + a.shape[1:])
                b = jnp.broadcast_to(b, (num_columns,) + b.shape[1:])
                if axis is None:  # every row its own example, in no other use
                    moments = moments + jnp.einsum("keo,kei->oi", b[:, :, 0] ** 2, a[:, :, 0] ** 2)
                elif len(group) == 1 and a.shape[2] == 1:
                    moments = jnp.einsum("keo,kei->oi", b[:, :, 0] ** 2, a[:, :, 0] ** 2)
                else:
                    term = jnp.einsum("keto,keti->keoi", b, a)
                    summed = term if summed is None else summed + term
            if summed is not None:
                moments = moments + jnp.sum(summed**2, axis=(0, 1))
            eigenvalues.append(moments)
        return eigenvalues
