"""Where arrays lie over devices, read and set the same way everywhere: an array's
sharding over several devices, a value pinned to a layout, made whole, or typed like
another (on Explicit mesh axes, a sharding is part of an array's type)."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

__all__ = ["is_explicit", "laid_out_like", "leaf_sharding", "pinned", "whole"]


def leaf_sharding(leaf: Any) -> Any:
    """The `NamedSharding` of an array over more than one device, else `None`: of a
    concrete array, its own; of a traced one, what its type says (on Explicit axes)."""
    try:
        sharding = leaf.sharding if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) else None
    except (AttributeError, TypeError, ValueError):  # a tracer's, on Auto axes
        sharding = None
    if sharding is None and not isinstance(leaf, jax.ShapeDtypeStruct):
        try:
            sharding = jax.typeof(leaf).sharding
        except (AttributeError, TypeError):
            return None
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    if sharding.mesh.size <= 1 or sharding.mesh.empty:
        return None
    return sharding


def is_explicit(sharding: jax.sharding.NamedSharding) -> bool:
    """Whether `sharding`'s mesh has Explicit axes."""
    types = getattr(sharding.mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def pinned(leaf: jax.Array, sharding: Any, block: bool = False) -> jax.Array:
    """`leaf` laid out as `sharding` (with an unsharded block axis first if `block`)."""
    if sharding is None:
        return leaf
    spec = tuple(sharding.spec) + (None,) * (leaf.ndim - block - len(sharding.spec))
    spec = jax.sharding.PartitionSpec(*((None,) if block else ()), *spec)
    if is_explicit(sharding):
        return jax.sharding.reshard(leaf, spec)
    return lax.with_sharding_constraint(leaf, jax.sharding.NamedSharding(sharding.mesh, spec))


def laid_out_like(value: Any, leaf: Any) -> Any:
    """`value`, of `leaf`'s shape, split over Explicit mesh axes as `leaf` is (a tangent or
    a cotangent must be typed like its primal there); as it is elsewhere."""
    sharding = _explicit_split(leaf)
    if sharding is None:
        return value
    return jax.sharding.reshard(value, sharding.spec)


def _explicit_split(leaf: Any) -> Any:
    """`leaf`'s `NamedSharding` where it is split over Explicit mesh axes, else `None`."""
    try:
        sharding = jax.typeof(leaf).sharding
    except (AttributeError, TypeError):
        return None
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.empty:
        return None
    split = any(axis is not None for axis in sharding.spec)
    return sharding if split and is_explicit(sharding) else None


def whole(leaf: Any) -> Any:
    """`leaf`, made whole on every device where it is split over Explicit mesh axes: a
    flat vector is one array, which such a split leaf cannot be reshaped into in place."""
    if _explicit_split(leaf) is None:
        return leaf
    return jax.sharding.reshard(leaf, jax.sharding.PartitionSpec())
