"""What Kronecker-factored curvature takes from each microbatch: its layers' inputs and
output gradients, as sums of outer products (the factors), as moments in the factors'
eigenbasis (EKFAC's eigenvalues), and the exact Gauss-Newton blocks of the leaves in no
layer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._pytree import Variables
from .._sharding import laid_out_like
from . import _kfac_trace as trace

__all__ = ["Settings", "Statistics", "traced", "variable_leaves"]


class Settings(eqx.Module):
    """What the microbatches' statistics need to know, all static."""

    fisher: str = eqx.field(static=True)
    mc_samples: int = eqx.field(static=True)
    mean: bool = eqx.field(static=True)
    program: trace.Program = eqx.field(static=True)
    examples: tuple = eqx.field(static=True)  # per layer, its rows' examples axis or None


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
        return loss.hessian_sqrt(outputs, *args, **kwargs), 1.0
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


def _with_targets(loss: Any, targets: Any, args: tuple, kwargs: dict) -> tuple:
    """The data arguments with the loss's targets replaced by `targets`."""
    where = loss.targets
    if isinstance(where, str):
        return args, {**kwargs, where: targets}
    args = list(args)
    args[where] = targets
    return tuple(args), kwargs


def _layer_rows(layer: trace.Layer, value: Any, gradients: Any) -> tuple:
    """A layer's inputs `(rows..., in)` (a one appended for a bias) and its output's
    gradients `(columns, rows..., out)`."""
    inputs = trace.input_rows(layer, value, gradients.dtype)
    if layer.bias is not None:
        # A padded one keeps the rows' layout (a batch sharded over Explicit axes).
        inputs = jnp.pad(inputs, [(0, 0)] * (inputs.ndim - 1) + [(0, 1)], constant_values=1)
    return inputs, trace.output_rows(layer, gradients)


def _second_moment(rows: jax.Array) -> jax.Array:
    """`sum(r r^T)` over the rows; replicated, as the type must say, where the rows are
    sharded over Explicit mesh axes (a batch split over devices)."""
    mesh = jax.typeof(rows).sharding.mesh
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    layout = jax.sharding.PartitionSpec() if explicit and not mesh.empty else None
    return jnp.einsum("...i,...j->ij", rows, rows, out_sharding=layout)


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

    def __call__(self, leaves: list, keys: Any, *args: Any) -> dict:
        dtype = self.variables.dtype
        program = traced(self.fn, self.variables, self.kwargs)
        closed, shape = jax.make_jaxpr(program, return_shape=True)(leaves, args)
        found = trace.find_layers(closed.jaxpr, len(leaves))
        if found != self.settings.program:
            raise ValueError(
                "zm.KFAC: `fn` is a different program on a microbatch than on the whole "
                "batch (its layers differ); it must not depend on the batch's size."
            )
        perturbations = [
            jnp.zeros(trace.output_shape(closed.jaxpr, layer), dtype) for layer in found.layers
        ]
        flat = jax.tree_util.tree_leaves((leaves, args))

        def forward(perturbations: list) -> tuple:
            outputs, inputs = trace.run(closed.jaxpr, closed.consts, flat, found, perturbations)
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(shape), outputs
            ), inputs

        outputs, pullback, inputs = jax.vjp(forward, perturbations, has_aux=True)
        key = None if keys is None else keys[0]
        columns, scale = _columns(self.loss, outputs, args, self.kwargs, self.settings, key)
        gradients = jax.vmap(pullback)(columns)[0]
        rows = [
            _layer_rows(layer, value, gradient)
            for layer, value, gradient in zip(found.layers, inputs, gradients, strict=True)
        ]
        if self.bases is not None:
            return {"eigenvalues": self._corrections(rows, scale)}
        return {
            "inputs": [_second_moment(a) for a, _ in rows],
            "rows": [jnp.asarray(math.prod(a.shape[:-1]), dtype) for a, _ in rows],
            "gradients": [scale * _second_moment(g) for _, g in rows],
            "dense": self._dense(leaves, args),
        }

    def _corrections(self, rows: list, scale: float) -> list:
        """Per layer, the per-example gradients' squares in the Kronecker eigenbasis."""
        eigenvalues = []
        for (a, g), (input_basis, gradient_basis), axis in zip(
            rows, self.bases, self.settings.examples, strict=True
        ):
            a, g = a @ input_basis, g @ gradient_basis
            if axis is None:  # every row its own example
                a, g = a.reshape(-1, 1, a.shape[-1]), g.reshape(g.shape[0], -1, 1, g.shape[-1])
            else:
                a = jnp.moveaxis(a, axis, 0)
                a = a.reshape(a.shape[0], -1, a.shape[-1])
                g = jnp.moveaxis(g, axis + 1, 1)
                g = g.reshape(g.shape[:2] + (-1, g.shape[-1]))
            if a.shape[1] == 1:
                moments = jnp.einsum("keo,ei->oi", g[:, :, 0] ** 2, a[:, 0] ** 2)
            else:
                moments = jnp.sum(jnp.einsum("keto,eti->keoi", g, a) ** 2, axis=(0, 1))
            eigenvalues.append(scale * moments)
        return eigenvalues

    def _dense(self, leaves: list, args: tuple) -> list:
        """The exact Gauss-Newton block `J^T H J` of each leaf in no layer, from as many
        products as the leaf has entries."""
        others = self.settings.program.others
        if not others:
            return []
        program = traced(self.fn, self.variables, self.kwargs)

        def outputs_of(chosen: tuple) -> Any:
            values = list(leaves)
            for index, value in zip(others, chosen, strict=True):
                values[index] = value
            return program(values, args)

        chosen = tuple(leaves[index] for index in others)
        outputs, tangent = jax.linearize(outputs_of, chosen)
        cotangent = jax.linear_transpose(tangent, chosen)
        zeros = [jnp.zeros_like(leaf) for leaf in chosen]

        def block(k: int) -> jax.Array:
            def column(unit: jax.Array) -> jax.Array:
                direction = list(zeros)
                direction[k] = laid_out_like(unit.reshape(chosen[k].shape), chosen[k])
                tangents = tangent(tuple(direction))
                product = self.loss.hessian_product(outputs, tangents, *args, **self.kwargs)
                return jnp.ravel(cotangent(product)[0][k])

            units = jnp.eye(chosen[k].size, dtype=chosen[k].dtype)
            return jax.vmap(column)(units).astype(self.variables.dtype)

        return [block(k) for k in range(len(chosen))]
