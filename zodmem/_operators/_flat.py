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

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from .._pytree import ravel_leaves, split_leaves
from .._sharding import is_explicit, leaf_sharding, pinned
from ._base import AbstractOperator
from ._operator import BlockedOperator
from ._vectors import check_symmetric, square_input

__all__ = ["FlatView", "flat_view", "symmetric_view"]


class FlatView(eqx.Module):
    """A square operator as a map of flat vectors.

    - `operator`: the operator itself.
    - `size`, `dtype`: the length and dtype of its flat vectors.
    - `linear()`: one product as a function of flat vectors (traceable, unchecked),
      built once: inside a loop, take it outside the loop and call it there.
    - `unflatten(v)`: a flat vector as a pytree shaped like the input structure (for a
      zodmem operator, like the variables of `x`); `laid_out(v)` the same, each leaf
      laid out like its variable where those are spread over devices.
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
            # A lineax operator's leaves laid out as its function was traced for.
            tree = self.laid_out(vector) if self.is_lineax else self.unflatten(vector)
            return ravel_leaves(jax.tree_util.tree_leaves(operator.mv(tree)), self.dtype)

        return product

    @property
    def is_lineax(self) -> bool:
        """Whether the operator is lineax's rather than zodmem's. Its function was traced
        for its input structure, each leaf laid out as the structure says, and runs only
        so: outside a `shard_map`, on vectors laid out like the structure."""
        return not isinstance(self.operator, AbstractOperator)

    @property
    def lineax_on_explicit_axes(self) -> bool:
        """Whether the operator is lineax's and its input structure lies over Explicit
        mesh axes: its products then run only on whole vectors in that layout, neither
        on one device's share inside a `shard_map` nor in lineax's own solvers."""
        if not self.is_lineax:
            return False
        shardings = map(leaf_sharding, jax.tree_util.tree_leaves(self.structure))
        return any(s is not None and is_explicit(s) for s in shardings)

    def unflatten(self, vector: jax.Array) -> Any:
        """A flat vector (or `(..., size)` stack of them) as a pytree like the input."""
        leaves, treedef = jax.tree_util.tree_flatten(self.structure)
        shapes, dtypes = [leaf.shape for leaf in leaves], [leaf.dtype for leaf in leaves]
        return jax.tree_util.tree_unflatten(treedef, split_leaves(vector, shapes, dtypes))

    def laid_out(self, vector: jax.Array) -> Any:
        """`unflatten(vector)` (a flat vector, or a `(k, size)` block of them), each leaf
        laid out as its variable is where the operator's variables are spread over
        devices (a zodmem operator of a sharded model): an estimator's result in the
        variables' structure, split like the weights rather than whole on each device."""
        tree = self.unflatten(vector)
        if vector.ndim > 2:
            return tree
        if isinstance(self.operator, AbstractOperator):
            shardings = self.operator.variable_shardings()
        else:  # a lineax operator's input structure may say its leaves' shardings
            shardings = tuple(map(leaf_sharding, jax.tree_util.tree_leaves(self.structure)))
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if len(shardings) != len(leaves) or all(s is None for s in shardings):
            return tree
        block = vector.ndim == 2
        return jax.tree_util.tree_unflatten(
            treedef, [pinned(leaf, s, block) for leaf, s in zip(leaves, shardings, strict=True)]
        )


def flat_view(operator: Any, owner: str) -> FlatView:
    """`operator` as a `FlatView`; `owner` (say `"zm.eigsh"`) names the caller in the
    error raised for anything that is not a square linear operator."""
    structure, size, dtype = square_input(operator, owner)
    return FlatView(operator, size, dtype, structure)


def symmetric_view(operator: Any, owner: str) -> FlatView:
    """`flat_view(operator, owner)`, refused unless the operator is real and symmetric."""
    view = flat_view(operator, owner)
    check_symmetric(operator, view.dtype, owner)
    return view
