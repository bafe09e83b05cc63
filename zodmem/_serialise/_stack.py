"""A transform stack in the file's header: described at `save`, rebuilt at `load`.

The description is a tree with one node per value held in a transform's fields that
are not configuration (its `fn`, mostly):

- `{"kind": "transform", "class": path, "config": {name: value}, "children": {name: node}}`:
  a zodmem transform, its static configuration encoded by `_values`;
- `{"kind": "module", "class": path}`: an Equinox module, whose skeleton `like` gives;
- `{"kind": "value", "value": value}`: a function or other value, encoded by `_values`;
- `{"kind": "array", "array": "jax" | "numpy", "shape": ..., "dtype": ..., "scalar": ...}`:
  an array held directly by a transform.

Beside it the header holds the table of the stack's array leaves (path, shape and
dtype), in the order in which the payload holds them.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._transforms._base import AbstractTransform
from ._error import SerialisationError
from ._file import corrupt
from ._import_path import class_name, import_path, resolve_class
from ._values import decode, encode_faithfully

__all__ = ["build", "describe", "leaf_table", "read_arrays", "skeleton_of", "write_arrays"]

_KINDS = ("transform", "module", "value", "array")


# --------------------------------------------------------------------------------------
# Saving


def describe(value: Any, location: str) -> dict:
    """The header's node for `value`, held at `location` (`transform.fn`, ...)."""
    if isinstance(value, AbstractTransform):
        return _describe_transform(value, location)
    if _is_key(value):
        # A typed key is written as its raw data, and read back with its generator's name.
        return {
            "kind": "array",
            "array": "jax",
            "shape": list(np.shape(value)),
            "dtype": str(value.dtype),
            "scalar": False,
            "key": str(jax.random.key_impl(value)),
        }
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return {
            "kind": "array",
            "array": "jax" if isinstance(value, jax.Array) else "numpy",
            "shape": list(np.shape(value)),
            "dtype": str(value.dtype),
            "scalar": isinstance(value, np.generic),
        }
    if isinstance(value, eqx.Module):
        path, _ = import_path(value)
        if path is not None:  # e.g. a module-level `eqx.filter_jit` function
            return {"kind": "value", "value": {"type": "import", "path": path}}
        if not any(eqx.is_array(leaf) for leaf in jax.tree_util.tree_leaves(value)):
            # No arrays, e.g. `zm.losses.SoftmaxCrossEntropy()`: its class and fields say
            # it all, where they can be written, and its configuration is the file's.
            try:
                return {"kind": "value", "value": encode_faithfully(value, location, "")}
            except SerialisationError:
                pass
        # `like` rebuilds it, so its class need not be importable: the name checks `like`.
        return {"kind": "module", "class": class_name(type(value))}
    return {"kind": "value", "value": encode_faithfully(value, location, f"`{location}`")}


def _describe_transform(transform: AbstractTransform, location: str) -> dict:
    cls = type(transform)
    class_path, why = import_path(cls)
    if class_path is None:
        raise SerialisationError(
            f"zodmem.save cannot save `{location}`: its class {cls.__qualname__} cannot be "
            f"found by import ({why})."
        )
    # The constructor's arguments: the configuration, and the fields that hold `fn` and arrays.
    arguments = {
        field.name: getattr(transform, field.name)
        for field in dataclasses.fields(transform)
        if field.init
    }
    config = {
        name: encode_faithfully(value, name, f"`{name}` of {cls.__name__} at `{location}`")
        for name, value in transform.config.items()
        if name in arguments
    }
    children = {
        name: describe(value, f"{location}.{name}")
        for name, value in arguments.items()
        if name not in config
    }
    # `load` calls the constructor with these arguments: it must give this transform back.
    try:
        rebuilt = cls(**arguments)
    except Exception as error:
        raise SerialisationError(
            f"zodmem.save cannot save `{location}`: {cls.__name__} cannot be rebuilt from its "
            f"fields ({type(error).__name__}: {error})."
        ) from error
    if jax.tree_util.tree_structure(rebuilt) != jax.tree_util.tree_structure(transform):
        raise SerialisationError(
            f"zodmem.save cannot save `{location}`: calling {cls.__name__} with its own "
            "fields builds a different transform, so it could not be rebuilt at load time."
        )
    return {"kind": "transform", "class": class_path, "config": config, "children": children}


def leaf_table(tree: Any) -> list[dict]:
    """The leaves that `eqx.tree_serialise_leaves` writes, in its order: each one's path,
    and its shape and dtype (or, for a Python scalar, its type)."""
    table = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            entry = {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
        elif eqx.is_array_like(leaf):
            entry = {"scalar": type(leaf).__name__}
        else:
            continue
        table.append({"path": jax.tree_util.keystr(path), **entry})
    return table


def write_arrays(transform: AbstractTransform) -> bytes:
    """Every array leaf of the stack, as `eqx.tree_serialise_leaves` writes them."""
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, transform, filter_spec=_write_leaf)
    return buffer.getvalue()


def _is_key(value: Any) -> bool:
    """Whether `value` is an array of typed `jax.random` keys."""
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _write_leaf(file: Any, leaf: Any) -> Any:
    """Equinox's writer of a leaf, a typed key written as its raw data."""
    if _is_key(leaf):
        leaf = jax.random.key_data(leaf)
    return eqx.default_serialise_filter_spec(file, leaf)


def _read_leaf(file: Any, leaf: Any) -> Any:
    """Equinox's reader of a leaf, a typed key read as raw data and wrapped again."""
    if _is_key(leaf):
        data = eqx.default_deserialise_filter_spec(file, jax.random.key_data(leaf))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
    return eqx.default_deserialise_filter_spec(file, leaf)


# --------------------------------------------------------------------------------------
# Loading: a skeleton of the stack, its arrays read into it, then each constructor once


@dataclasses.dataclass(frozen=True, eq=False)
class _Recipe:
    """How to build one transform. Compared by identity: its configuration may hold NaN."""

    cls: type
    config: dict[str, Any]
    location: str


@jax.tree_util.register_pytree_with_keys_class
class _Unbuilt:
    """A transform before its constructor runs. Its fields other than configuration are
    the children of this pytree node, in the order in which the transform flattens them,
    so that the file's arrays are read into them before the constructor sees them."""

    def __init__(self, recipe: _Recipe, fields: dict[str, Any]):
        self.recipe = recipe
        self.fields = fields

    def tree_flatten_with_keys(self) -> tuple[list, tuple]:
        keyed = [(jax.tree_util.GetAttrKey(name), value) for name, value in self.fields.items()]
        return keyed, (self.recipe, tuple(self.fields))

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Any) -> _Unbuilt:
        recipe, names = aux
        return cls(recipe, dict(zip(names, children, strict=True)))


def skeleton_of(stack: dict, like: Any) -> _Unbuilt:
    """The stack described by `stack` with every class resolved and every configuration
    value decoded, but no constructor run; `like` gives the skeletons of its modules."""
    if stack.get("kind") != "transform":
        raise SerialisationError("The file is malformed: its stack is not a transform.")
    try:
        slots = _module_slots(stack, "transform")
    except (KeyError, TypeError, AttributeError) as error:
        raise SerialisationError(
            "The file is malformed: its stack description is incomplete."
        ) from error
    single = None
    if like is None:
        if slots:
            listed = ", ".join(f"`{where}` ({cls})" for where, cls in slots)
            raise SerialisationError(
                f"The file holds Equinox modules at {listed}, whose skeletons must be passed "
                "as `like`: the module itself when there is one, or a transform stack of "
                "the same shape. A skeleton is an instance of the same class whose arrays "
                "have the saved shapes and dtypes; `eqx.filter_eval_shape` builds one "
                "without allocating them."
            )
    elif isinstance(like, AbstractTransform):
        pass
    elif isinstance(like, eqx.Module):
        if len(slots) != 1:
            raise SerialisationError(
                f"`like` is a single {_describe_like(like)}, but the file holds {len(slots)} "
                "Equinox modules "
                + ("" if not slots else "(" + ", ".join(f"`{w}`" for w, _ in slots) + ") ")
                + "that need skeletons; pass a transform stack of the same shape as `like`"
                + (" or no `like` at all." if not slots else ".")
            )
        single = like
    else:
        raise SerialisationError(
            f"`like` must be None, an Equinox module or a zodmem transform, got "
            f"{_describe_like(like)}."
        )
    return _skeleton(stack, "transform", like, single)


def read_arrays(skeleton: _Unbuilt, payload: bytes, table: list) -> _Unbuilt:
    """`skeleton` with the payload's arrays in place of its own, checked against `table`,
    the file's table of leaves."""
    buffer = io.BytesIO(payload)
    try:
        filled = eqx.tree_deserialise_leaves(buffer, skeleton, filter_spec=_read_leaf)
    except Exception as error:
        # Equinox refuses an array of another shape, dtype or type; the table says where.
        _check_leaves(table, leaf_table(skeleton))
        raise SerialisationError(
            f"The file's arrays do not fit the skeletons given by `like` ({error})."
        ) from error
    # What Equinox leaves to us: the number of leaves, and the types of Python scalars.
    _check_leaves(table, leaf_table(filled))
    if buffer.tell() != len(payload):
        raise SerialisationError(
            "The file's arrays do not fit the skeletons given by `like`: "
            f"{len(payload) - buffer.tell()} bytes were left unread."
        )
    return filled


def build(node: Any) -> Any:
    """Run the constructors of a skeleton's transforms, innermost first, once each."""
    if not isinstance(node, _Unbuilt):
        return node
    recipe = node.recipe
    fields = {name: build(value) for name, value in node.fields.items()}
    try:
        return recipe.cls(**recipe.config, **fields)
    except Exception as error:
        raise SerialisationError(
            f"The file's {recipe.cls.__name__} at `{recipe.location}` is rejected by its "
            f"constructor ({type(error).__name__}: {error})"
        ) from error


def _module_slots(node: Any, location: str) -> list[tuple[str, Any]]:
    if node["kind"] == "module":
        return [(location, node["class"])]
    if node["kind"] == "transform":
        slots = []
        for name, child in node["children"].items():
            slots.extend(_module_slots(child, f"{location}.{name}"))
        return slots
    return []


def _describe_like(like: Any) -> str:
    return f"{type(like).__module__}.{type(like).__qualname__}"


def _placeholder_array(node: dict) -> Any:
    """An array of the saved shape and dtype; the file's values replace it."""
    shape = tuple(int(size) for size in node["shape"])
    if "key" in node:
        zeros = jax.random.key_data(jax.random.key(0, impl=node["key"]))
        data = jnp.zeros(shape + zeros.shape, zeros.dtype)
        return jax.random.wrap_key_data(data, impl=node["key"])
    dtype = jnp.dtype(node["dtype"])
    if node["scalar"]:
        return dtype.type(0)
    return jnp.zeros(shape, dtype) if node["array"] == "jax" else np.zeros(shape, dtype)


def _skeleton(node: Any, location: str, like: Any, single: Any) -> Any:
    """The skeleton of a node; module skeletons come from `like` (mirroring the stack)
    or are the `single` one."""
    if not isinstance(node, dict) or node.get("kind") not in _KINDS:
        raise SerialisationError(f"The file is malformed: the entry for `{location}` is damaged.")
    kind = node["kind"]
    if kind == "value":
        if "value" not in node:
            raise SerialisationError(f"The file is malformed: `{location}` has no value.")
        return decode(node["value"], f"`{location}`")
    try:
        if kind == "array":
            return _placeholder_array(node)
        class_path = node["class"]
        if kind == "transform":
            config, children = node["config"], node["children"]
            if not (isinstance(config, dict) and isinstance(children, dict)):
                raise TypeError("config and children must be JSON objects")
    except (KeyError, TypeError, ValueError) as error:
        raise SerialisationError(
            f"The file is malformed: the entry for `{location}` is incomplete ({error})."
        ) from error

    if kind == "module":
        return _module_skeleton(class_path, single if single is not None else like, location)

    cls = resolve_class(class_path, AbstractTransform, f"the transform class at `{location}`")
    if single is None and like is not None and type(like) is not cls:
        raise SerialisationError(
            f"`like` disagrees with the file at `{location}`: the file holds a {class_path}, "
            f"`like` a {_describe_like(like)}."
        )
    owner = cls.__name__
    recipe = _Recipe(
        cls,
        {
            name: decode(value, f"`{location}.{name}` (of {owner})")
            for name, value in config.items()
        },
        location,
    )
    fields = {}
    for name, child in children.items():
        child_like = None
        if single is None and like is not None:
            if not hasattr(like, name):
                raise SerialisationError(
                    f"`like` disagrees with the file: it has no field `{location}.{name}`."
                )
            child_like = getattr(like, name)
        fields[name] = _skeleton(child, f"{location}.{name}", child_like, single)
    return _Unbuilt(recipe, fields)


def _module_skeleton(class_path: Any, model: Any, location: str) -> Any:
    """`model`, the skeleton `like` gives at `location`, once its class is checked to be
    the file's. A class defined inside a function or in a script (`__main__`) may not be
    importable where the file is loaded: then `model`'s class must have its name."""
    try:
        cls = resolve_class(class_path, eqx.Module, f"the model class at `{location}`")
    except SerialisationError:
        if model is not None and class_name(type(model)) == class_path:
            return model
        # A class that was never importable is best explained by `like`'s other class.
        if model is None or not ("<locals>" in class_path or class_path.startswith("__main__:")):
            raise
        cls = None
    if model is None:
        raise SerialisationError(f"`like` gives no skeleton for `{location}`.")
    if type(model) is not cls:
        raise SerialisationError(
            f"`like` disagrees with the file at `{location}`: the file holds a "
            f"{class_path}, `like` a {_describe_like(model)}."
        )
    return model


def _check_leaves(saved: list, expected: list) -> None:
    """Raise, naming the first leaf where the file's table and `expected` disagree."""

    def show(entry: dict) -> str:
        if "scalar" in entry:
            return f"a Python {entry.get('scalar')}"
        return f"an array of shape {tuple(entry.get('shape', ()))} and dtype {entry.get('dtype')}"

    for saved_entry, like_entry in zip(saved, expected, strict=False):
        if not isinstance(saved_entry, dict):
            raise corrupt("the table of arrays is malformed")
        if {k: v for k, v in saved_entry.items() if k != "path"} != {
            k: v for k, v in like_entry.items() if k != "path"
        }:
            raise SerialisationError(
                f"`like` disagrees with the file at `{like_entry['path']}`: the file holds "
                f"{show(saved_entry)}, `like` {show(like_entry)}."
            )
    if len(saved) != len(expected):
        longer, what = (saved, "file") if len(saved) > len(expected) else (expected, "`like`")
        first = longer[min(len(saved), len(expected))]
        raise SerialisationError(
            f"`like` disagrees with the file: the file holds {len(saved)} arrays and `like` "
            f"{len(expected)}; the first unmatched one is at `{first.get('path')}` in the {what}."
        )
