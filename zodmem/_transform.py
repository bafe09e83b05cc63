"""`AbstractTransform`, the base of every zodmem transform, and its validation helpers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Literal

import equinox as eqx

from ._blocks import check_block_options

__all__ = [
    "AbstractTransform",
    "AbstractDerivative",
    "check_bool",
    "check_choice",
    "check_callable",
]


class AbstractTransform(eqx.Module):
    """A memory-bounded JAX transform of a function `fn`.

    `fn` is an ordinary field, so when it is a module (an Equinox model or another
    transform) its arrays are leaves of the transform. Every other field is static
    configuration, validated when the transform is built.
    """

    fn: eqx.AbstractVar[Callable[..., Any]]

    @property
    def config(self) -> dict[str, Any]:
        """The static configuration, field name to value (everything but `fn`)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.metadata.get("static", False)
        }


class AbstractDerivative(AbstractTransform):
    """The configuration shared by `BatchedJacobian` and `BatchedHessian`.

    Both differentiate `fn` with respect to its first argument, in blocks of
    products planned from `nbatches` or `batch_size`, in forward or reverse mode.
    """

    fn: Callable[..., Any]
    nbatches: int | None = eqx.field(default=None, static=True, kw_only=True)
    batch_size: int | None = eqx.field(default=None, static=True, kw_only=True)
    mode: Literal["auto", "fwd", "rev"] = eqx.field(default="auto", static=True, kw_only=True)
    has_aux: bool = eqx.field(default=False, static=True, kw_only=True)
    jit: bool = eqx.field(default=True, static=True, kw_only=True)
    checkpoint: bool = eqx.field(default=False, static=True, kw_only=True)

    def __check_init__(self):
        owner = type(self).__name__
        check_callable(self.fn, "fn", owner=owner)
        check_block_options(self.nbatches, self.batch_size, owner=owner)
        check_choice(self.mode, "mode", ("auto", "fwd", "rev"), owner=owner)
        check_bool(self.has_aux, "has_aux", owner=owner)
        check_bool(self.jit, "jit", owner=owner)
        check_bool(self.checkpoint, "checkpoint", owner=owner)


def check_callable(value: Any, name: str, *, owner: str) -> None:
    if not callable(value):
        raise TypeError(
            f"{owner}: `{name}` must be callable (a function or a module with __call__), "
            f"got {value!r} of type {type(value).__name__}."
        )


def check_bool(value: Any, name: str, *, owner: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner}: `{name}` must be True or False, got {value!r} of type "
            f"{type(value).__name__}."
        )


def check_choice(value: Any, name: str, choices: Iterable[Any], *, owner: str) -> None:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: `{name}` must be one of {allowed}; got {value!r}.")
