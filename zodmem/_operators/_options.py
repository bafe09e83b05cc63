"""What the operator code reads of the transform behind an operator, through a declared
base: a transform that makes operators (the derivatives, and a `Microbatcher` around one)
is an `OperatorSource`, which says the options its operator follows, itself for one
product, and itself with another strategy of products."""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import equinox as eqx
from jax.sharding import NamedSharding

__all__ = ["OperatorSource", "TransformOptions", "options_of", "unblocked", "with_strategy"]


class TransformOptions(NamedTuple):
    """The options of the transform behind an operator that the operator follows.

    - `has_aux`: the transform's call returns `(result, aux)`.
    - `jit`: its work is compiled.
    - `strategy`: how its products evaluate `fn` (`"auto"`, `"linearize"` or
      `"recompute"`); `None` for a transform that has no such choice.
    - `nbatches`, `batch_size`, `max_memory`: the blocks of many products.
    - `sharding`: the devices its result is spread over.
    - `progress`: a bar of its blocks.
    """

    has_aux: bool = False
    jit: bool = True
    strategy: str | None = None
    nbatches: int | None = None
    batch_size: int | None = None
    max_memory: int | str | None = None
    sharding: NamedSharding | None = None
    progress: bool = False


class OperatorSource(eqx.Module):
    """A transform whose `.operator(...)` makes an operator: the transforms declare here
    what the operator code reads of them, so that curvature never imports them."""

    @abc.abstractmethod
    def _operator_options(self) -> TransformOptions:
        """The options the operator's products follow."""

    @abc.abstractmethod
    def _unblocked(self) -> Any:
        """This transform with none of the options that only cut its call into blocks,
        for one product."""

    def _with_strategy(self, strategy: Any) -> Any:
        """This transform computing its products by `strategy` (`None`: as it is)."""
        return self


def options_of(transform: Any) -> TransformOptions:
    """The options of the transform that made an operator (the defaults for anything
    else, or `None`: the transform of no operator)."""
    if isinstance(transform, OperatorSource):
        return transform._operator_options()
    return TransformOptions()


def unblocked(transform: Any) -> Any:
    """`transform` for one product (see `OperatorSource._unblocked`)."""
    return transform._unblocked() if isinstance(transform, OperatorSource) else transform


def with_strategy(transform: Any, strategy: Any) -> Any:
    """`transform` computing its products by `strategy`."""
    if strategy is None or not isinstance(transform, OperatorSource):
        return transform
    return transform._with_strategy(strategy)
