"""The checks of what the influence functions are given: examples as tuples of arrays
with the examples on axis 0, a damping, a model with variables, and a curvature whose
vectors are the model's variables. Each message starts with its owner, names the
argument, shows the value and says what is allowed."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import lineax as lx
import numpy as np

from .._checks import common_size, described
from .._operators._arguments import check_real
from .._operators._operator import BlockedOperator
from .._operators._vectors import VectorSpace, leaf_sharding

__all__ = ["check_damping", "check_examples", "curvature_form", "variable_space"]


def check_examples(value: Any, name: str, *, owner: str) -> int:
    """The number of examples in `value`, a tuple of arrays with the examples on axis 0
    (one example's slices are what `loss(model, *example)` takes)."""
    if not isinstance(value, tuple):
        raise TypeError(
            f"{owner}: `{name}` must be a tuple of arrays with the examples on axis 0, as "
            f"`loss(model, *example)` takes one example's slices (say `{name}=(inputs, "
            f"labels)`, or `{name}=(inputs,)` for one array), got {described(value)}."
        )
    if not value:
        raise ValueError(
            f"{owner}: `{name}` is an empty tuple; give the arrays that `loss(model, "
            f"*example)` takes one example's slices of, such as `{name}=(inputs, labels)`."
        )
    sizes = {}
    for index, array in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(array, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{owner}: `{where}` must be an array (JAX or NumPy) with the examples on "
                f"axis 0, got {described(array)}."
            )
        if array.ndim == 0:
            raise ValueError(
                f"{owner}: `{where}` is a 0-d array, but the examples lie along its axis 0; "
                f"give it an axis of examples (`{where}[None]` for a single example)."
            )
        sizes[f"`{where}`"] = array.shape[0]
    return common_size(
        sizes, owner=owner, what="axis 0 (the examples)", subject=f"the arrays of `{name}`"
    )


def check_damping(damping: Any, *, owner: str) -> Any:
    """`damping`, a finite real number `>= 0` (a 0-d array traced under `jax.jit` is let
    through: the curvature's solve checks it as the program runs)."""
    return check_real(damping, "damping", owner=owner, minimum=0.0)


def variable_space(model: Any, *, owner: str) -> VectorSpace:
    """The space of the model's variables (its inexact-array leaves), each leaf with the
    layout of its variable where the variables are sharded over several devices."""
    variables = [leaf for leaf in jax.tree_util.tree_leaves(model) if eqx.is_inexact_array(leaf)]
    if not variables:
        raise ValueError(
            f"{owner}: `model` has no floating-point array leaves, so there is no gradient "
            f"to score: the variables are the model's inexact arrays, got {described(model)}."
        )
    treedef = jax.tree_util.tree_structure(eqx.filter(model, eqx.is_inexact_array))
    shapes = tuple(tuple(leaf.shape) for leaf in variables)
    dtypes = tuple(leaf.dtype for leaf in variables)
    size = sum(math.prod(shape) for shape in shapes)
    shardings = tuple(leaf_sharding(leaf) for leaf in variables)
    return VectorSpace(size, jax.numpy.result_type(*dtypes), shapes, dtypes, shardings, treedef)


def curvature_form(curvature: Any, space: VectorSpace, *, owner: str) -> str:
    """How the curvature's solves take the model's gradients: `"flat"` (its own solve of
    flat `(n,)` vectors), `"tree"` (its own solve of vectors in the variables' structure)
    or `"iterative"` (`zm.solve`, on flat vectors: for a transform's operator, and for an
    operator with no solve of its own)."""
    if not isinstance(curvature, lx.AbstractLinearOperator):
        raise TypeError(
            f"{owner}: `curvature` must be a curvature operator: one with a damped `solve` "
            f"of its own (`zm.KFAC`'s or `zm.EKFAC`'s result, a `zm.BlockDiagonal`, a "
            f"`zm.LowRankDiagonal`), or a square lineax operator that `zm.solve` solves "
            f"(`zm.BatchedGGN(...).operator(...)`); got {described(curvature)}. A dense "
            f"matrix `C` is `lx.MatrixLinearOperator(C, lx.positive_semidefinite_tag)`."
        )
    leaves, _ = jax.tree_util.tree_flatten(curvature.in_structure())
    out_leaves = jax.tree_util.tree_leaves(curvature.out_structure())
    size = sum(math.prod(leaf.shape) for leaf in leaves)
    out_size = sum(math.prod(leaf.shape) for leaf in out_leaves)
    if size != space.size or out_size != space.size:
        raise ValueError(
            f"{owner}: `curvature` must be a square operator on the model's {space.size} "
            f"variables (its inexact-array leaves, of shapes {list(space.shapes)}), but it "
            f"maps vectors of {size} entries to vectors of {out_size}. Build it at the same "
            f"model."
        )
    # A transform's operator (an exact Hessian or Gauss-Newton matrix) is solved from its
    # products, never densely; a structured operator exactly, by its own solve.
    if isinstance(curvature, BlockedOperator) or not callable(getattr(curvature, "solve", None)):
        return "iterative"
    if len(leaves) == 1 and tuple(leaves[0].shape) == (space.size,):
        return "flat"
    if [tuple(leaf.shape) for leaf in leaves] == list(space.shapes):
        return "tree"
    raise ValueError(
        f"{owner}: `curvature` takes vectors of shapes {[leaf.shape for leaf in leaves]}, "
        f"neither one flat vector of the model's {space.size} variables nor their shapes "
        f"{list(space.shapes)} in leaf order."
    )
