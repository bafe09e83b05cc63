"""`one_program`: a helper of plain array operations run as one compiled program where
it is called eagerly, and inline where it is traced.

Called eagerly, each `jnp` operation is a program of its own, compiled the first time
it meets its shapes: a helper of ten operations costs ten compilations, on every new
shape, before its first result. Compiled as a whole it costs one, and XLA fuses it.
Inside an outer transform's program (traced arguments) the helper runs inline, so the
programs it is part of are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["one_program"]


def one_program(*, static: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Decorate a function of arrays (its arguments named in `static` hashable options:
    shapes, dtypes, flags) so that an eager call runs it as one `jax.jit` program."""

    def decorate(fn: Callable) -> Callable:
        compiled = jax.jit(fn, static_argnames=tuple(static))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            traced = any(
                isinstance(leaf, jax.core.Tracer)
                for leaf in jax.tree_util.tree_leaves((args, kwargs))
            )
            return (fn if traced else compiled)(*args, **kwargs)

        return call

    return decorate
