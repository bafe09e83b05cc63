"""Any square linear operator seen through flat vectors: what the estimators need of it.

The estimators (`zm.diagonal`, `zm.trace`, `zm.eigsh`, `zm.spectral_density`, `zm.solve`)
work on flat vectors of the operator's input space. `flat_view(operator, name)` gives
them its size, dtype, one product as a function of flat vectors, and the way back from
a flat vector to a pytree shaped like the input structure, for a zodmem operator
(`transform.operator(...)`) and for any square `lineax` operator alike;
`symmetric_view(operator, name)` the same, for the estimators that take real symmetric
operators only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx

from .._checks import described
from ._operator import BlockedOperator

__all__ = ["FlatView", "flat_view", "symmetric_view"]


class FlatView(eqx.Module):
    """A square operator as a map of flat vectors.

    - `operator`: the operator itself.
    - `size`, `dtype`: the length and dtype of its flat vectors.
    - `linear()`: one product as a function of flat vectors (traceable, unchecked),
      built once: inside a loop, take it outside the loop and call it there.
    - `unflatten(v)`: a flat vector as a pytree shaped like the input structure (for a
      zodmem operator, like the variables of `x`).
    """

    operator: Any
    size: int = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    structure: Any = eqx.field(static=True)

    def linear(self, strategy: Any = None) -> Callable[[jax.Array], jax.Array]:
        """The product as a function of flat vectors, built once: for a zodmem operator
        whose transform keeps one linearisation (the default), `fn` is linearised here
        and its residuals serve every product made with the function returned.
        `strategy` (`"linearize"` or `"recompute"`) overrides the transform's."""
        operator = self.operator
        if isinstance(operator, BlockedOperator):
            return operator.with_strategy(strategy)._map()

        def product(vector):
            out = operator.mv(self.unflatten(vector))
            leaves = jax.tree_util.tree_leaves(out)
            return jnp.concatenate([jnp.ravel(leaf).astype(self.dtype) for leaf in leaves])

        return product

    def unflatten(self, vector: jax.Array) -> Any:
        """A flat vector (or `(..., size)` stack of them) as a pytree like the input."""
        leaves, treedef = jax.tree_util.tree_flatten(self.structure)
        batch = vector.shape[:-1]
        pieces, start = [], 0
        for leaf in leaves:
            width = math.prod(leaf.shape)
            piece = vector[..., start : start + width].reshape(batch + leaf.shape)
            pieces.append(piece.astype(leaf.dtype))
            start += width
        return jax.tree_util.tree_unflatten(treedef, pieces)


def flat_view(operator: Any, owner: str) -> FlatView:
    """`operator` as a `FlatView`; `owner` (say `"zm.eigsh"`) names the caller in the
    error raised for anything that is not a square linear operator."""
    if not isinstance(operator, lx.AbstractLinearOperator):
        raise TypeError(
            f"{owner}: `operator` must be a linear operator, such as "
            f"`zm.BatchedHessian(f).operator(x)` or a `lineax` operator, got "
            f"{described(operator)}."
        )
    structure = operator.in_structure()
    leaves = jax.tree_util.tree_leaves(structure)
    out_leaves = jax.tree_util.tree_leaves(operator.out_structure())
    size = sum(math.prod(leaf.shape) for leaf in leaves)
    out_size = sum(math.prod(leaf.shape) for leaf in out_leaves)
    if size != out_size:
        raise ValueError(
            f"{owner}: `operator` must be square, but it maps vectors of size {size} to "
            f"vectors of size {out_size} (a Jacobian's operator is not square; use a "
            f"Hessian's or a Gauss-Newton matrix's)."
        )
    dtype = jnp.result_type(*leaves, *out_leaves)
    return FlatView(operator, size, dtype, structure)


def symmetric_view(operator: Any, owner: str) -> FlatView:
    """`flat_view(operator, owner)`, refused unless the operator is real and symmetric."""
    view = flat_view(operator, owner)
    if jnp.issubdtype(view.dtype, jnp.complexfloating):
        raise TypeError(
            f"{owner}: `operator` has the complex dtype {view.dtype}; only real symmetric "
            "operators are supported (float32 or float64)."
        )
    if not jnp.issubdtype(view.dtype, jnp.floating):
        raise TypeError(
            f"{owner}: `operator` has dtype {view.dtype}; only real floating operators "
            "(float32 or float64) are supported."
        )
    if not lx.is_symmetric(operator):
        raise ValueError(
            f"{owner}: `operator` must be symmetric, but {type(operator).__name__} does not "
            "say it is. If it is, tag it: `lx.TaggedLinearOperator(operator, "
            "lx.symmetric_tag)` (or build it with `lx.symmetric_tag`, as in "
            "`lx.MatrixLinearOperator(A, lx.symmetric_tag)`)."
        )
    return view
