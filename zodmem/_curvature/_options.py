"""What the operator code reads of the transform behind an operator, through the
transforms' declared types: a derivative (`AbstractDerivative`: `BatchedJacobian`,
`BatchedHessian`, `BatchedGGN`) states its options as fields, and a `Microbatcher`
around one cuts the batch by its own options and its products' blocks by the
derivative's.

The transforms import this package, so their classes are imported inside the functions
that test for them."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jax.sharding import NamedSharding

__all__ = ["TransformOptions", "options_of", "unblocked", "with_strategy"]


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


def _derivative() -> type:
    from .._transforms._derivative import AbstractDerivative

    return AbstractDerivative


def _microbatcher() -> type:
    from .._transforms._microbatch import Microbatcher

    return Microbatcher


def options_of(transform: Any) -> TransformOptions:
    """The options of the transform that made an operator (the defaults for `None`,
    the transform of no operator)."""
    if isinstance(transform, _derivative()):
        return TransformOptions(
            has_aux=transform.has_aux,
            jit=transform.jit,
            strategy=transform.strategy,
            nbatches=transform.nbatches,
            batch_size=transform.batch_size,
            max_memory=transform.max_memory,
            sharding=transform.sharding,
            progress=transform.progress,
        )
    if isinstance(transform, _microbatcher()):
        wrapped = options_of(transform.fn)
        # Its own options cut the batch, not the vectors: the blocks of products are
        # those of the derivative it wraps (none for another Microbatcher).
        blocks = wrapped if isinstance(transform.fn, _derivative()) else TransformOptions()
        return blocks._replace(
            has_aux=wrapped.has_aux,
            jit=True,
            strategy=None,
            sharding=None,
            progress=transform.progress,
        )
    return TransformOptions()


def unblocked(transform: Any) -> Any:
    """`transform` with none of the options that only say how its call is cut into
    blocks, for one product. With `strategy="auto"` the product evaluates `fn` in place:
    a linearisation kept pays only where blocks share it, and JAX's partial evaluation
    of a loop in `fn` (a `scan`, an ODE solver's `while`) keeps the whole loop on the
    linear side, which then costs more than the product evaluated afresh."""
    if isinstance(transform, _derivative()):
        strategy = "recompute" if transform.strategy == "auto" else transform.strategy
        return dataclasses.replace(
            transform,
            nbatches=None,
            batch_size=None,
            max_memory=None,
            progress=False,
            sharding=None,
            strategy=strategy,
        )
    if isinstance(transform, _microbatcher()):
        return dataclasses.replace(transform, max_memory=None, progress=False)
    return transform


def with_strategy(transform: Any, strategy: Any) -> Any:
    """`transform` computing its products by `strategy` (`None`, or a transform that
    has no such choice: as it is)."""
    if strategy is not None and isinstance(transform, _derivative()):
        return dataclasses.replace(transform, strategy=strategy)
    return transform
