"""What the operator code reads of the transform behind an operator: whether its call
returns `aux`, whether it compiles, its single product's transform without the options
that cut blocks, and its strategy."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["has_aux", "jit_of", "unblocked", "with_strategy", "recomputes"]


def has_aux(transform: Any) -> bool:
    """Whether `transform`'s call returns `(result, aux)` (through wrappers too)."""
    if hasattr(transform, "has_aux"):
        return bool(transform.has_aux)
    return has_aux(transform.fn) if hasattr(transform, "fn") else False


def jit_of(transform: Any) -> bool:
    return bool(getattr(transform, "jit", True))


def unblocked(transform: Any) -> Any:
    """`transform` with none of the options that only say how its call is cut into
    blocks, for one product. With `strategy="auto"` the product evaluates `fn` in place:
    a linearisation kept pays only where blocks share it, and JAX's partial evaluation
    of a loop in `fn` (a `scan`, an ODE solver's `while`) keeps the whole loop on the
    linear side, which then costs more than the product evaluated afresh."""
    options = {"nbatches": None, "batch_size": None, "max_memory": None, "progress": False}
    options = {name: value for name, value in options.items() if hasattr(transform, name)}
    if hasattr(transform, "sharding"):
        options["sharding"] = None
    if getattr(transform, "strategy", None) == "auto":
        options["strategy"] = "recompute"
    return dataclasses.replace(transform, **options) if options else transform


def with_strategy(transform: Any, strategy: Any) -> Any:
    """`transform` computing its products by `strategy` (`None`: as it is)."""
    if strategy is not None and hasattr(transform, "strategy"):
        return dataclasses.replace(transform, strategy=strategy)
    return transform


def recomputes(transform: Any) -> bool:
    """Whether every product of `transform`'s operator evaluates `fn` afresh."""
    return getattr(transform, "strategy", "recompute") == "recompute"
