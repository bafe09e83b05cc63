"""`AbstractTransform`, the base of every zodmem transform, and `AbstractDerivative`,
the configuration and the checks that `BatchedJacobian` and `BatchedHessian` share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ._checks import as_index, check_block_options, check_bool, check_callable, check_choice
from ._pytree import Variables
from ._traceback import public

__all__ = ["AbstractTransform", "AbstractDerivative", "split_aux"]


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
    nbatches: int | None = eqx.field(default=None, static=True, kw_only=True, converter=as_index)
    batch_size: int | None = eqx.field(default=None, static=True, kw_only=True, converter=as_index)
    mode: Literal["auto", "fwd", "rev"] = eqx.field(default="auto", static=True, kw_only=True)
    holomorphic: bool = eqx.field(default=False, static=True, kw_only=True)
    has_aux: bool = eqx.field(default=False, static=True, kw_only=True)
    jit: bool = eqx.field(default=True, static=True, kw_only=True)
    checkpoint: bool = eqx.field(default=False, static=True, kw_only=True)

    @public
    def __check_init__(self):
        owner = type(self).__name__
        check_callable(self.fn, "fn", owner=owner)
        check_block_options(self.nbatches, self.batch_size, owner=owner)
        check_choice(self.mode, "mode", ("auto", "fwd", "rev"), owner=owner)
        for name in ("holomorphic", "has_aux", "jit", "checkpoint"):
            check_bool(getattr(self, name), name, owner=owner)

    def check_variables(self, variables: Variables) -> None:
        """Refuse complex variables unless `holomorphic`, and real ones with it, as
        `jax.jacfwd`/`jax.jacrev`/`jax.hessian` do."""
        owner = type(self).__name__
        for name, dtype in zip(variables.names, variables.dtypes, strict=True):
            is_complex = jnp.issubdtype(dtype, jnp.complexfloating)
            if self.holomorphic and not is_complex:
                raise TypeError(
                    f"{owner}: with holomorphic=True every variable must be complex, as in "
                    f"jax.jacfwd(holomorphic=True), but x{name} has dtype {dtype}. Cast it "
                    "to a complex dtype, or leave holomorphic=False."
                )
            if not self.holomorphic and is_complex:
                raise TypeError(
                    f"{owner}: x{name} has the complex dtype {dtype}. As in jax.jacfwd and "
                    "jax.jacrev, complex variables are differentiated only with "
                    "holomorphic=True (for holomorphic functions); for a function that is "
                    "not holomorphic, split the variables into real and imaginary parts."
                )

    def output_shapes(self, fn_of_flat: Callable[[Any], Any], flat: Any, what: str) -> Any:
        """The shapes of what `fn` returns (without `aux`), checking that it returns a pair
        `(what, aux)` when `has_aux`. Leaves that are not arrays are kept as they are."""
        shapes = eqx.filter_eval_shape(fn_of_flat, flat)
        if self.has_aux:
            if not (isinstance(shapes, tuple) and len(shapes) == 2):
                raise TypeError(
                    f"{type(self).__name__}: with has_aux=True, `fn` must return a pair "
                    f"({what}, aux), but it returned {shapes}."
                )
            shapes = shapes[0]
        return shapes

    def check_outputs(self, outputs: Any, what: str) -> None:
        """Refuse outputs that cannot be differentiated: integer ones, and real ones with
        `holomorphic=True` (as `jax.jacfwd(holomorphic=True)` does)."""
        owner = type(self).__name__
        paths_leaves = jax.tree_util.tree_flatten_with_path(outputs)[0]
        for path, leaf in paths_leaves:
            where = f"{what}{jax.tree_util.keystr(path)}"
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise TypeError(
                    f"{owner}: `fn` must return floating-point (or complex) arrays to be "
                    f"differentiated, but one output leaf has dtype {leaf.dtype} and shape "
                    f"{leaf.shape} ({where})."
                )
            if self.holomorphic and not jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                raise TypeError(
                    f"{owner}: with holomorphic=True `fn` must return complex arrays, as in "
                    f"jax.jacfwd(holomorphic=True), but {where} has dtype {leaf.dtype}."
                )


def split_aux(fn: Callable[[Any], tuple[Any, Any]]) -> tuple[Callable, Callable]:
    """`fn` returning `(out, aux)`, as a function whose `aux` holds only arrays, and a
    function that puts the other leaves of the last `aux` traced back.

    JAX's transforms and loops carry arrays only; a string, an int or `None` in `aux`
    is kept aside while `fn` is traced and returned unchanged, as `jax.jacrev` does.
    """
    kept: list[Any] = []

    def arrays_only(z):
        result = fn(z)
        if not (isinstance(result, tuple) and len(result) == 2):
            return result  # not a pair: refused by the caller, with what it returned
        out, aux = result
        arrays, others = eqx.partition(aux, eqx.is_array)
        kept.append(others)
        return out, arrays

    def restore(arrays: Any) -> Any:
        return eqx.combine(arrays, kept[-1])

    return arrays_only, restore
