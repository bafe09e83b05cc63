"""What the influence functions compute per example: the gradient of one example's loss,
the damped solve with a curvature, and the scores of one training example, against the
preconditioned queries (`QueryScores`) or against itself (`SelfScores`).

Each is an Equinox module, so that a `zm.ChunkedVmap` maps it over the examples in
planned blocks, and its arrays (the model's, the queries', the curvature's) are leaves
of that transform: `zm.to_file` knows a call by them.

Vectors are in the variables' structure, each leaf laid out like its variable where the
variables are sharded (`VectorSpace`); only a curvature that solves flat vectors sees
them gathered into one `(n,)` array, for its solve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx

from .._estimators._solve import solve
from .._operators._vectors import VectorSpace

__all__ = [
    "ExampleGradient",
    "QueryScores",
    "SelfScores",
    "pinned",
    "preconditioned",
    "solves_in_shard_map",
]


class ExampleGradient(eqx.Module):
    """The gradient of `loss(model, *example)` with respect to the model's variables (its
    inexact-array leaves), for one example: a pytree of the variables' structure."""

    loss: Callable[..., Any]
    model: Any
    owner: str = eqx.field(static=True)

    def __call__(self, *example: Any) -> Any:
        variables, others = eqx.partition(self.model, eqx.is_inexact_array)

        def loss_of(variables):
            value = self.loss(eqx.combine(variables, others), *example)
            if not (
                isinstance(value, jax.Array | jax.ShapeDtypeStruct)
                and value.shape == ()
                and jnp.issubdtype(value.dtype, jnp.floating)
            ):
                shown = (
                    f"an array of shape {value.shape} and dtype {value.dtype}"
                    if hasattr(value, "shape") and hasattr(value, "dtype")
                    else f"a value of type {type(value).__name__}"
                )
                raise ValueError(
                    f"{self.owner}: `loss` must return a real floating scalar for one example "
                    f"(`loss(model, *example)`, each array of the example without its axis "
                    f"of examples), but it returned {shown}. Sum or average a loss over an "
                    f"example's outputs inside `loss`."
                )
            return value

        return jax.grad(loss_of)(variables)


def _in_shard_map() -> bool:
    """Whether this is traced inside a `shard_map` (a `zm.ChunkedVmap` of training examples
    sharded over the devices, each device scoring its own): there each device holds its
    values whole, and layouts are not pinned."""
    axis_types = getattr(jax.sharding.get_abstract_mesh(), "axis_types", ())
    return any(kind == jax.sharding.AxisType.Manual for kind in axis_types)


def solves_in_shard_map(form: str) -> bool:
    """Whether the solves of a curvature of this form run inside a `shard_map`: an
    operator's own solve of flat vectors does; lineax's iterative solves and the solves of
    an operator held leaf by leaf, which pin their vectors' layout, do not."""
    return form == "flat"


def pinned(space: VectorSpace, vectors: Any, *, block: bool = False) -> Any:
    """`vectors` in the space's dtype, laid out like the variables (outside a `shard_map`)."""
    vectors = space.map(lambda leaf: leaf.astype(space.dtype), vectors)
    return vectors if _in_shard_map() else space.constrain(vectors, block=block)


def _in_form(curvature: Any, form: str, space: VectorSpace, vectors: Any) -> Any:
    """Vectors of the space (or a block of them) as the curvature's solve takes them: flat
    `(..., n)` in its dtype, or its own structure with each leaf in its dtype."""
    structure = curvature.in_structure()
    leaves, treedef = jax.tree_util.tree_flatten(structure)
    if form == "tree":
        pieces = [
            x.astype(leaf.dtype) for x, leaf in zip(space.leaves(vectors), leaves, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, pieces)
    return space.to_flat(vectors).astype(jnp.result_type(*leaves))


def _from_form(form: str, space: VectorSpace, solved: Any) -> Any:
    """The curvature's solutions back as vectors of the space."""
    if form == "tree":
        return space.tree(jax.tree_util.tree_leaves(solved))
    return space.from_flat(solved)


def _own_solve(curvature: Any, damping: Any) -> Callable[[Any], Any]:
    return lambda b: curvature.solve(b, damping=damping)


def preconditioned(
    curvature: Any,
    form: str,
    space: VectorSpace,
    vectors: Any,
    damping: Any,
    *,
    solver: lx.AbstractLinearSolver | None,
    block: bool,
    max_memory: Any = None,
) -> Any:
    """`(C + damping I)^{-1} v` for the vector `v` (with `block`, for each vector of a
    block, leaves `(k, *variable.shape)`), laid out like the variables: by the curvature's
    own `solve`, or by `zm.solve` (for a block, its `k` right-hand sides in blocks of
    columns planned from `max_memory`)."""
    given = _in_form(curvature, form, space, vectors)
    if form == "iterative":
        if block:
            solved = solve(
                curvature, given.T, damping=damping, solver=solver, max_memory=max_memory
            )
            solved = solved.T
        else:
            solved = solve(curvature, given, damping=damping, solver=solver)
    elif block:
        solved = jax.vmap(_own_solve(curvature, damping))(given)
    else:
        solved = _own_solve(curvature, damping)(given)
    return pinned(space, _from_form(form, space, solved), block=block)


class QueryScores(eqx.Module):
    """The scores of one training example against every query, `(num_query,)`: the
    preconditioned queries' inner products with its gradient, leaf by leaf (reduced over
    the shards where the variables are sharded)."""

    gradient: ExampleGradient
    queries: Any  # the variables' structure, leaves (num_query, *variable.shape)
    space: VectorSpace

    def __call__(self, *example: Any) -> jax.Array:
        gradient = pinned(self.space, self.gradient(*example))
        return self.space.block_dot(self.queries, gradient)


class SelfScores(eqx.Module):
    """The score of one training example against itself, `g^T (C + damping I)^{-1} g`."""

    gradient: ExampleGradient
    curvature: lx.AbstractLinearOperator
    damping: Any
    form: str = eqx.field(static=True)
    solver: lx.AbstractLinearSolver | None = eqx.field(static=True)
    space: VectorSpace

    def __call__(self, *example: Any) -> jax.Array:
        if not solves_in_shard_map(self.form) and _in_shard_map():
            raise ValueError(
                f"{self.gradient.owner}: self_influence=True with this curvature cannot "
                f"score training examples split over the devices: its solve (zm.solve's, or "
                f"one held leaf by leaf) does not run on a shard_map's devices. Give the "
                f"training arrays replicated, `jax.device_put(array, NamedSharding(mesh, "
                f"PartitionSpec()))`."
            )
        gradient = pinned(self.space, self.gradient(*example))
        solved = preconditioned(
            self.curvature,
            self.form,
            self.space,
            gradient,
            self.damping,
            solver=self.solver,
            block=False,
        )
        return self.space.dot(gradient, solved)
