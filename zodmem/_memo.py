"""What a live object has worked out once and reuses on each call (the structure of an
operator's vectors, the programs of its products), kept beside the object rather than in
it: Equinox modules are frozen, and what is kept here is no part of the pytree. An
entry goes when its object is collected."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["BoundedCache", "memo_of", "signature_of"]

_MEMOS: dict[int, tuple[weakref.ref, dict[Any, Any]]] = {}


def memo_of(owner: Any) -> dict[Any, Any]:
    """The dictionary kept for `owner` (empty at first), for as long as `owner` lives."""
    key = id(owner)
    entry = _MEMOS.get(key)
    if entry is not None and entry[0]() is owner:
        return entry[1]

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _MEMOS.get(key, (None,))[0] is ref:
            del _MEMOS[key]

    memo: dict[Any, Any] = {}
    _MEMOS[key] = (weakref.ref(owner, forget), memo)
    return memo


def signature_of(array: Any) -> Any:
    """What a compiled program needs to know of a concrete `jax.Array` (its shape, dtype
    and placement), as a key; `None` for anything else (a tracer, a NumPy array)."""
    import jax

    if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer):
        return None
    return (array.shape, str(array.dtype), array.sharding)


class BoundedCache:
    """What a process has worked out once for a key (a plan, an executable), at most
    `most` entries: the oldest goes when a new one comes. A key of `None` (a call that
    cannot be keyed) is never kept."""

    def __init__(self, most: int):
        self.most = most
        self.entries: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return None if key is None else self.entries.get(key)

    def put(self, key: Any, value: Any) -> None:
        if key is None:
            return
        if len(self.entries) >= self.most:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = value

    def clear(self) -> None:
        self.entries.clear()
