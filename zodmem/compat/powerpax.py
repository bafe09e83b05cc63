"""`powerpax` 0.2.1, on zodmem's transforms.

The functions here take the same arguments, return the same results (values and
dtypes) and raise the same exception types as their `powerpax` namesakes, so a
powerpax user changes only the import::

    from zodmem.compat.powerpax import chunked_vmap   # was: from powerpax import chunked_vmap

As in powerpax, `chunked_vmap` maps every argument over its leading axis. For
`in_axes` and `out_axes`, use `zm.ChunkedVmap`, which this module is a thin layer
over. What differs, deliberately: the remainder chunk is computed by moving the
last chunk back to overlap the one before it, and every chunk is written straight
into the preallocated results, with no stacking or concatenation of chunks.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, Generic, SupportsIndex, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._vmap import ChunkedVmap

__all__ = ["chunked_vmap", "Static"]

C = TypeVar("C", bound=Callable[..., Any])
T = TypeVar("T")


def _check_leading_axes(args: tuple, kwargs: dict) -> None:
    """Every leaf is mapped over its leading axis: check that they agree."""
    sizes = []
    for leaf in jax.tree_util.tree_leaves((args, list(kwargs.values()))):
        if jnp.ndim(leaf) < 1:
            raise ValueError(
                "chunked_vmap maps every argument over its leading axis, but one of them is "
                f"zero-dimensional: {leaf!r}. Pass it through functools.partial or a "
                "closure instead, or wrap it in Static."
            )
        sizes.append(jnp.shape(leaf)[0])
    if not sizes:
        raise ValueError(
            "chunked_vmap needs at least one array argument to map over, but the arguments "
            "hold no arrays."
        )
    if len(set(sizes)) > 1:
        listed = ", ".join(str(size) for size in dict.fromkeys(sizes))
        raise ValueError(
            f"chunked_vmap maps every argument over its leading axis, so their leading "
            f"sizes must agree, but they are {listed}."
        )


def chunked_vmap(fun: C, chunk_size: SupportsIndex) -> C:
    """`jax.vmap(fun)`, computed at most `chunk_size` elements at a time.

    Every positional and keyword argument is mapped over its leading axis, and every
    output gets the mapped axis first. For other axes, see `zm.ChunkedVmap`.

    **Arguments:**

    - `fun`: the function to vectorise.
    - `chunk_size`: the most elements vectorised at once, a positive int (anything
      with `__index__`).

    **Returns:**

    A function with the arguments of `fun` that returns `jax.vmap(fun)`'s results.

    !!! example

        ```python
        import jax.numpy as jnp
        from zodmem.compat.powerpax import chunked_vmap

        chunked_vmap(jnp.sin, chunk_size=4)(jnp.arange(10.0))  # shape (10,)
        ```
    """
    chunk_size = operator.index(chunk_size)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got chunk_size={chunk_size}.")

    @functools.wraps(fun)
    def vectorised(*args: Any, **kwargs: Any) -> Any:
        _check_leading_axes(args, kwargs)
        transform = ChunkedVmap(fun, chunk_size=chunk_size, in_axes=0, out_axes=0)
        return transform(*args, **kwargs)

    return vectorised  # type: ignore[return-value]


class Static(eqx.Module, Generic[T]):
    """A value held as part of a pytree's structure: a pytree with no leaves.

    As in powerpax, any value is accepted; it must be hashable for the `Static` to
    be hashed. `zm.Static` is the same, but refuses an unhashable value when built.

    **Arguments:**

    - `value`: the value to carry, read back as `.value`.

    !!! example

        ```python
        import jax.numpy as jnp
        from zodmem.compat.powerpax import Static, chunked_vmap

        def scale(x, how):
            return 2 * x if how.value == "double" else x

        chunked_vmap(scale, 4)(jnp.arange(10.0), Static("double"))
        ```
    """

    value: T = eqx.field(static=True)
