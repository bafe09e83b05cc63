"""The exact Gauss-Newton blocks `J^T H J` of the leaves in no layer of a Kronecker-
factored curvature, held dense.

Where each example's outputs are one loss term (every output `(N,)` or `(N, C)`) and
`fn` can be evaluated on one example at a time, a leaf's block is

    sum_n sum_k g_nk g_nk^T,

`g_nk` example `n`'s gradient of the leaf back-propagated from the `k`-th column of the
square root of the loss's Hessian on its outputs (`loss.hessian_sqrt`): one backward
pass a column, for all those leaves at once, `fn` vmapped over the examples (its data
arguments whose leading axis has the examples' length cut, the others passed whole).
Otherwise (several terms an example, whose columns the square root shares, or `fn` that
does not take one example), each block is taken column by column from the Hessian's
products (`loss.hessian_product`) with the outputs' tangents of the leaves' unit
directions: a forward and a backward pass an entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._sharding import laid_out_like
from ._kfac_rows import second_moment

__all__ = ["dense_blocks"]


def dense_blocks(
    program: Callable, loss: Any, leaves: list, args: tuple, kwargs: dict, others: tuple
) -> list:
    """Per leaf of `others` (indices into `leaves`), its exact Gauss-Newton block in the
    leaf's raveled entries, `program(leaves, args)` the model's outputs and `loss`
    called with `args` and `kwargs`."""
    if not others:
        return []
    outputs = jax.eval_shape(program, leaves, args)
    examples = _examples_of(program, leaves, args, outputs)
    if examples is not None:
        return _from_examples(program, loss, leaves, args, kwargs, others, examples)
    return _from_products(program, loss, leaves, args, kwargs, others)


def _examples_of(program: Callable, leaves: list, args: tuple, outputs: Any) -> Any:
    """`(sliced, whole)`: the data arguments split into the arrays cut into examples
    and the rest, where each example's outputs are one loss term and `program` on one
    example gives that example's outputs' shapes; else `None`."""
    shapes = jax.tree_util.tree_leaves(outputs)
    if not shapes or any(shape.ndim not in (1, 2) for shape in shapes):
        return None
    count = shapes[0].shape[0]
    if any(shape.shape[0] != count for shape in shapes):
        return None

    def is_cut(leaf: Any) -> bool:
        return eqx.is_array(leaf) and jnp.ndim(leaf) > 0 and jnp.shape(leaf)[0] == count

    sliced, whole = eqx.partition(args, is_cut)
    if not jax.tree_util.tree_leaves(sliced):
        return None
    try:
        one = jax.eval_shape(
            lambda example: program(leaves, _one_example(example, whole)),
            jax.tree_util.tree_map(lambda leaf: leaf[0], sliced),
        )
    except Exception:  # not a program of one example: the products serve
        return None
    expected = [(1,) + shape.shape[1:] for shape in shapes]
    if [tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(one)] != expected:
        return None
    return sliced, whole


def _one_example(example: Any, whole: Any) -> tuple:
    """The data arguments of one example, each cut array with a leading axis of one."""
    return eqx.combine(jax.tree_util.tree_map(lambda leaf: leaf[None], example), whole)


def _from_examples(
    program: Callable,
    loss: Any,
    leaves: list,
    args: tuple,
    kwargs: dict,
    others: tuple,
    examples: tuple,
) -> list:
    """The blocks from each example's gradients of the leaves, one a column of the
    square root of the loss's Hessian on the example's outputs."""
    sliced, whole = examples
    outputs = program(leaves, args)
    # Columns `(K, N, ...)` as `(N, K, ...)`: each example's own.
    columns = jax.tree_util.tree_map(
        lambda column, out: jnp.moveaxis(column, 1, 0).astype(out.dtype),
        loss.hessian_sqrt(outputs, *args, **kwargs),
        outputs,
    )
    chosen = tuple(leaves[index] for index in others)

    def gradients(example: Any, own_columns: Any) -> tuple:
        data = _one_example(example, whole)

        def outputs_of(values: tuple) -> Any:
            return program(_replaced(leaves, others, values), data)

        _, pullback = jax.vjp(outputs_of, chosen)

        def one_column(column: Any) -> tuple:
            return pullback(jax.tree_util.tree_map(lambda entry: entry[None], column))[0]

        return jax.vmap(one_column)(own_columns)

    grads = jax.vmap(gradients)(sliced, columns)
    return [
        second_moment(g.reshape(g.shape[:2] + (leaf.size,))).astype(leaf.dtype)
        for g, leaf in zip(grads, chosen, strict=True)
    ]


def _from_products(
    program: Callable, loss: Any, leaves: list, args: tuple, kwargs: dict, others: tuple
) -> list:
    """The blocks from as many products as the leaves have entries: leaf `k`'s columns
    `J^T H J e_i`, each from the outputs' tangent of a unit direction."""

    def outputs_of(chosen: tuple) -> Any:
        return program(_replaced(leaves, others, chosen), args)

    chosen = tuple(leaves[index] for index in others)
    outputs, tangent = jax.linearize(outputs_of, chosen)
    cotangent = jax.linear_transpose(tangent, chosen)
    zeros = [jnp.zeros_like(leaf) for leaf in chosen]

    def block(k: int) -> jax.Array:
        def column(unit: jax.Array) -> jax.Array:
            direction = list(zeros)
            direction[k] = laid_out_like(unit.reshape(chosen[k].shape), chosen[k])
            tangents = tangent(tuple(direction))
            product = loss.hessian_product(outputs, tangents, *args, **kwargs)
            return jnp.ravel(cotangent(product)[0][k])

        units = jnp.eye(chosen[k].size, dtype=chosen[k].dtype)
        return jax.vmap(column)(units)

    return [block(k) for k in range(len(chosen))]


def _replaced(leaves: list, others: tuple, values: tuple) -> list:
    """`leaves` with the leaves at the indices `others` replaced by `values`."""
    every = list(leaves)
    for index, value in zip(others, values, strict=True):
        every[index] = value
    return every
