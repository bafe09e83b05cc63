"""KFAC's builds, compiled lean.

A KFAC or EKFAC build reduces its statistics over the data once per call, in a program
of many backward passes whose compile, not its run, sets the build's peak on a CPU. The
build's program (`lean_jit`) and its planned passes over the data (`StatisticsPass`) are
compiled with the platform's lean options (`Policy.lean_options`; a CPU's: XLA's older
fusion emitters, with the backend's optimisations kept). On the five models of
`benchmarks/models.py` this takes a fifth to a half off the build's peak above the
floor, its time within the noise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
from jax._src import core

from .._engine._sharding import Kept
from .._plan._budget import policy_of
from .._transforms._microbatch import Microbatcher

__all__ = ["StatisticsPass", "lean_jit"]


class StatisticsPass(Microbatcher):
    """`zm.Microbatcher` over KFAC's statistics, its planned call compiled lean; its
    messages are `zm.Microbatcher`'s."""

    compiled_lean: ClassVar[bool] = True

    @property
    def _owner(self) -> str:
        return "Microbatcher"


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
