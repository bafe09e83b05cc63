"""`Static`: a hashable value carried through JAX transforms as a pytree with no leaves."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from ._checks import described
from ._traceback import public

__all__ = ["Static"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class Static(Generic[T]):
    """Wrap a hashable value so that JAX treats it as part of the pytree's structure.

    A `Static` is a pytree with no leaves: its `value` lives in the tree definition.
    Pass one through `jax.jit`, `jax.vmap`, `zm.ChunkedVmap` or a `lax.scan` carry
    to hand a Python value (a string, a tuple of ints, a flag) to the function
    unchanged: it is never traced, never batched, never differentiated. Two `Static`s
    are equal, and hash alike, when their values are equal *and of the same types*
    (inside tuples, frozensets and the fields of dataclasses too), so `jax.jit`
    compiles once per distinct value: `Static(1)`, `Static(1.0)` and `Static(True)`
    are three values, although `1 == 1.0 == True` in Python. Floats compare by their
    bits: `Static(0.0)` and `Static(-0.0)` differ, and `Static(nan)` equals itself, so
    it compiles once. A NumPy scalar is kept as it is, a value of its own type:
    `Static(np.int64(1))` is not `Static(1)`.

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

    value: T
    # What equality and hashing read: the value's types, and floats by their bits.
    _identity: Any = dataclasses.field(init=False, repr=False)

    @public
    def __post_init__(self):
        try:
            hash(self.value)
        except TypeError as error:
            raise TypeError(
                f"Static: `value` must be hashable, got {described(self.value)} ({error}). "
                "Wrap an immutable value instead, e.g. a tuple rather than a list, or pass "
                "arrays as ordinary arguments."
            ) from None
        object.__setattr__(self, "_identity", _identity_of(self.value))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Static):
            return NotImplemented
        return self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)


# Its own tree definition, so that JAX compares it by `_identity`, never by the value's `==`.
jax.tree_util.register_pytree_node(Static, lambda static: ((), static), lambda static, _: static)


def _identity_of(value: Any) -> Any:
    """`(type, contents)` of `value`, recursively through tuples (named ones too),
    frozensets and dataclasses compared by their fields: equal identities mean values
    that behave alike. Floats are read by their bits, so 0.0 and -0.0 differ and a NaN
    equals itself."""
    kind = type(value)
    if isinstance(value, np.generic):
        return (kind, value.tobytes())
    if isinstance(value, float):
        return (kind, struct.pack("<d", value))
    if isinstance(value, complex):
        return (kind, struct.pack("<dd", value.real, value.imag))
    if isinstance(value, tuple):
        return (kind, tuple(_identity_of(item) for item in value))
    if isinstance(value, frozenset):
        return (kind, frozenset(_identity_of(item) for item in value))
    params = getattr(kind, "__dataclass_params__", None)
    if params is not None and params.eq and not isinstance(value, type):
        # The fields its own `==` compares, each by its identity.
        fields = dataclasses.fields(value)
        return (kind, tuple(_identity_of(getattr(value, f.name)) for f in fields if f.compare))
    return (kind, value)
