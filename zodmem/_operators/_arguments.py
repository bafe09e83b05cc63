"""The checks of what the estimators and the structured operators are given: real
numbers (traced ones let through, for the caller to check as the program runs),
positive tolerances, keys, batch shapes, entries that must be finite and `>= 0`, and
vectors that must be in the operator's dtype.
Every message starts with its owner, names the argument and says what is allowed."""

from __future__ import annotations

import math
import numbers
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import as_index, check_key, described
from .._pytree import is_traced

__all__ = [
    "check_dtype",
    "check_entries",
    "check_positive",
    "check_real",
    "check_shape",
    "is_traced",
    "key_or_default",
]


def check_real(value: Any, name: str, *, owner: str, minimum: float | None = 0.0) -> Any:
    """A real number: a Python or NumPy scalar (at least `minimum`), or a 0-d real JAX
    array, which may be traced and is then checked by the caller at run time."""
    if eqx.is_array(value) and not isinstance(value, np.ndarray):
        real = jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)
        if jnp.ndim(value) != 0 or not real:
            raise TypeError(
                f"{owner}: `{name}` must be a real number, got an array of dtype "
                f"{value.dtype} and shape {jnp.shape(value)}."
            )
        if is_traced(value):
            return value
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{owner}: `{name}` must be a real number, got {described(value)}.")
    value = float(value)
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        allowed = "a finite real number" if minimum is None else f"a finite number >= {minimum}"
        raise ValueError(f"{owner}: `{name}` must be {allowed}, got {name}={value}.")
    return value


def check_positive(value: Any, name: str, owner: str, *, optional: bool = False) -> Any:
    """A positive finite real number (or None when `optional`), as a Python float."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        allowed = "a positive number" + (" or None" if optional else "")
        raise TypeError(f"{owner}: `{name}` must be {allowed}, got {described(value)}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: `{name}` must be a positive finite number, got {value!r}.")
    return float(value)


def key_or_default(key: Any, owner: str) -> jax.Array:
    """`key` checked, `jax.random.key(0)` where it is `None`."""
    key = check_key(key, owner=owner, optional=True)
    return jax.random.key(0) if key is None else key


def check_shape(shape: Any, owner: str) -> tuple[int, ...]:
    """`shape` (a tuple of ints, or one int) as a tuple of Python ints, each `>= 0`."""
    allowed = "a tuple of non-negative ints or an int"
    dims = tuple(as_index(dim) for dim in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if not all(isinstance(dim, int) and not isinstance(dim, bool) for dim in dims):
        raise TypeError(f"{owner}: `shape` must be {allowed}, got {described(shape)}.")
    if any(dim < 0 for dim in dims):
        raise ValueError(f"{owner}: `shape` must be {allowed}, got shape={shape!r}.")
    return dims


def check_entries(value: jax.Array, name: str, what: str, *, owner: str) -> None:
    """Refuse a concrete `value` with an entry below zero or not finite; `what` says
    what the entries are."""
    if is_traced(value):
        return
    entries = np.asarray(value)
    if not np.all(np.isfinite(entries)):
        raise ValueError(
            f"{owner}: `{name}` must be finite and >= 0 ({what}), but "
            f"{_first(entries.tolist(), ~np.isfinite(entries), name)}."
        )
    if np.any(entries < 0):
        raise ValueError(
            f"{owner}: `{name}` must be >= 0 ({what}), but "
            f"{_first(entries.tolist(), entries < 0, name)}; clip it, e.g. "
            f"jnp.maximum({name}, 0)."
        )


def _first(values: list, bad: np.ndarray, name: str) -> str:
    """`name[i] = value` for the first entry that `bad` marks."""
    index = int(np.flatnonzero(bad)[0])
    return f"{name}[{index}] = {values[index]!r}"


def check_dtype(
    vector: Any,
    name: str,
    dtype: Any,
    *,
    owner: str,
    expected: str = "the operator is",
    given: str = "has dtype",
) -> None:
    """Refuse the array `vector` unless its dtype is `dtype`, the operator's, with the
    cast that mends it; `given` and `expected` word the message for the caller."""
    if jnp.dtype(vector.dtype) != dtype:
        raise TypeError(
            f"{owner}: `{name}` {given} {vector.dtype}, but {expected} {dtype}; cast it, e.g. "
            f"{name}.astype({dtype})."
        )
