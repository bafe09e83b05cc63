"""Programs compiled lean: `jax.jit` with the platform's lean options
(`Policy.lean_options`; a CPU's: XLA's older fusion emitters, the backend's
optimisations kept), for programs whose compile, not their run, sets their peak.

On a CPU the older emitters need about half the compiler's heap of the default ones.
They generate slower code for some fusions (a block of products made by `vmap`), so the
planned calls and products keep XLA's defaults; the programs that take the lean options
are named where they are made (KFAC's builds, `eigsh`'s iteration).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax._src import core

from .._engine._sharding import Kept
from ._budget import policy_of

__all__ = ["lean_jit", "lean_options"]


def lean_options() -> dict[str, Any] | None:
    """The default platform's lean options (`None`: XLA's defaults)."""
    return policy_of(jax.default_backend()).lean_options


def lean_jit(function: Callable[..., Any]) -> Callable[..., Any]:
    """`eqx.filter_jit(function)`, compiled with the platform's lean options: its array
    arguments traced, every other leaf static, and the result's leaves that are not
    arrays returned as they were made."""

    def call(*args: Any) -> Any:
        dynamic, static = eqx.partition(args, eqx.is_array)
        leaves, treedef = jax.tree_util.tree_flatten(static)
        # Under an outer trace the call is traced into the outer program, which JAX
        # compiles with that program's options: none may be given here.
        jitted = _jitted(jax.default_backend() if _top_level() else None)
        arrays, kept = jitted(dynamic, (function, treedef, tuple(leaves)))
        return eqx.combine(arrays, kept.value)

    return call


def _top_level() -> bool:
    """Whether no transformation is tracing the caller."""
    return core.trace_state_clean()


@functools.cache
def _jitted(platform: str | None) -> Callable[..., Any]:
    """The jitted call, with the lean options of `platform` (`None`: no options)."""
    options = None if platform is None else policy_of(platform).lean_options
    return jax.jit(_of_arrays, static_argnums=1, compiler_options=options)


def _of_arrays(dynamic: Any, static: tuple) -> tuple[Any, Kept]:
    function, treedef, leaves = static
    result = function(*eqx.combine(dynamic, jax.tree_util.tree_unflatten(treedef, leaves)))
    arrays, rest = eqx.partition(result, eqx.is_array)
    return arrays, Kept(rest)
