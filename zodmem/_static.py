"""`Static`: a hashable value carried through JAX transforms as a pytree with no leaves."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import equinox as eqx

from ._traceback import public

__all__ = ["Static"]

T = TypeVar("T")


class Static(eqx.Module, Generic[T]):
    """Wrap a hashable value so that JAX treats it as part of the pytree's structure.

    A `Static` is a pytree with no leaves: its `value` lives in the tree definition.
    Pass one through `jax.jit`, `jax.vmap`, `zm.ChunkedVmap` or a `lax.scan` carry
    to hand a Python value (a string, a tuple of ints, a flag) to the function
    unchanged: it is never traced, never batched, never differentiated. Two `Static`s
    are equal, and hash alike, when their values are equal *and of the same types*
    (inside tuples and frozensets too), so `jax.jit` compiles once per distinct
    value: `Static(1)`, `Static(1.0)` and `Static(True)` are three values, although
    `1 == 1.0 == True` in Python.

    **Arguments:**

    - `value`: the value to carry. It must be hashable, since JAX hashes tree
      definitions to look up compiled functions.

    **Returns:**

    A pytree with no leaves; read the value back as `.value`.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import zodmem as zm

        @jax.jit
        def scale(x, how):
            return 2 * x if how.value == "double" else x

        scale(jnp.arange(3.0), zm.Static("double"))  # Array([0., 2., 4.])
        jax.tree_util.tree_leaves(zm.Static("double"))  # []
        ```

    !!! warning

        An unhashable value (a list, a dict, a NumPy or JAX array) is refused with a
        `TypeError` when the `Static` is built: use a tuple instead of a list, and
        pass arrays as ordinary arguments.
    """

    value: T = eqx.field(static=True)
    # Part of the tree definition beside `value`: JAX compares and hashes both, so
    # values that Python calls equal but that have other types stay apart.
    types: Any = eqx.field(static=True, repr=False)

    def __init__(self, value: T):
        self.value = value
        self.types = _types_of(value)

    @public
    def __check_init__(self):
        try:
            hash(self.value)
        except TypeError as error:
            raise TypeError(
                f"Static: `value` must be hashable, got {self.value!r} of type "
                f"{type(self.value).__name__} ({error}). Wrap an immutable value instead, "
                "e.g. a tuple rather than a list, or pass arrays as ordinary arguments."
            ) from None


def _types_of(value: Any) -> Any:
    """The type of `value`, and of its items when it is a tuple or a frozenset, as a
    hashable signature: equal values with equal signatures are interchangeable."""
    if isinstance(value, tuple):
        return (type(value), tuple(_types_of(item) for item in value))
    if isinstance(value, frozenset):
        # Pair each item with its signature: a set's items have no order to align them by.
        return (frozenset, frozenset((item, _types_of(item)) for item in value))
    return type(value)
