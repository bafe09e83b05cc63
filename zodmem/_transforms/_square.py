"""`AbstractSquare`, the base of the derivatives whose result is a square matrix over the
variables: `BatchedHessian` and `BatchedGGN`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lineax as lx
from jaxtyping import Array, Float, Inexact, PyTree

from .._checks import checked_annotations
from .._operators._block_diagonal import BlockDiagonal
from .._operators._operator import BlockedOperator, make_operator
from .._traceback import public
from ._derivative import AbstractDerivative
from ._leaf_blocks import leaf_blocks

__all__ = ["AbstractSquare"]


class AbstractSquare(AbstractDerivative):
    """A derivative whose result is an `(n, n)` matrix over the variables, symmetric: the
    whole matrix, or with `blocks="leaf"` its diagonal blocks, one per variable leaf, each
    made by a call of its own. A concrete one fills `_prepare` and `compute_share` as
    every derivative does, and builds its operator with `_square_operator`."""

    @public
    @checked_annotations
    def __call__(
        self, x: PyTree, *args: Any, **kwargs: Any
    ) -> (
        Inexact[Array, "n n"]
        | tuple[Inexact[Array, "n n"], Any]
        | tuple[Float[Array, "_ _"], ...]
        | tuple[tuple[Float[Array, "_ _"], ...], Any]
    ):
        if self.blocks == "leaf":
            return leaf_blocks(self, (x, *args), kwargs)
        return super().__call__(x, *args, **kwargs)

    def _square_operator(
        self,
        products: Callable[..., tuple],
        x: PyTree,
        args: tuple,
        kwargs: dict,
        *,
        positive_semidefinite: bool = False,
    ) -> BlockedOperator | BlockDiagonal:
        """The matrix at `(x, *args, **kwargs)` as an operator: the blocks per leaf with
        `blocks="leaf"`, else the blocked operator of the products `products(self, x,
        args, kwargs)` makes, tagged symmetric, and positive semi-definite where the
        matrix is."""
        if self.blocks == "leaf":
            return self._leaf_operator(
                (x, *args), kwargs, positive_semidefinite=positive_semidefinite
            )
        tags = (lx.symmetric_tag,)
        if positive_semidefinite:
            tags += (lx.positive_semidefinite_tag,)
        return make_operator(self, products, x, args, kwargs, square=True, tags=tags)
