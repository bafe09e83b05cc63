"""`Static`: a hashable value carried through JAX transforms as a pytree with no leaves."""

from __future__ import annotations

from typing import Generic, TypeVar

import equinox as eqx

__all__ = ["Static"]

T = TypeVar("T")


class Static(eqx.Module, Generic[T]):
    """Wrap a hashable value so that JAX treats it as part of the pytree's structure.

    A `Static` is a pytree with no leaves: its `value` lives in the tree definition.
    Pass one through `jax.jit`, `jax.vmap`, `zm.ChunkedVmap` or a `lax.scan` carry
    to hand a Python value (a string, a tuple of ints, a flag) to the function
    unchanged: it is never traced, never batched, never differentiated. Two `Static`s
    are equal, and hash alike, when their values are equal, so `jax.jit` compiles
    once per distinct value.

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

    def __check_init__(self):
        try:
            hash(self.value)
        except TypeError as error:
            raise TypeError(
                f"Static: `value` must be hashable, got {self.value!r} of type "
                f"{type(self.value).__name__} ({error}). Wrap an immutable value instead, "
                "e.g. a tuple rather than a list, or pass arrays as ordinary arguments."
            ) from None
