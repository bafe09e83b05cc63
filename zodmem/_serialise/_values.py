"""Static configuration values as JSON, each tagged with its type so that it reads back
as the same value of the same type (`1`, `1.0` and `True` stay apart).

Any static field is described the same way, whatever its name: a new option of a
transform needs nothing here as long as its values are among the kinds below.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._error import SerialisationError
from ._import_path import import_path, resolve, resolve_class

__all__ = ["decode", "encode_faithfully"]


class _Refusal(Exception):
    """A value that cannot be described; `where` locates it inside the field."""

    def __init__(self, value: Any, where: str, reason: str):
        super().__init__(reason)
        self.value = value
        self.where = where
        self.reason = reason


def encode_faithfully(value: Any, name: str, where: str) -> dict:
    """Encode `value`, checking that reading it back gives the same value; `name` is how
    the encoding refers to the value's root, `where` how messages refer to the field."""
    try:
        encoded = _encode(value, name)
    except _Refusal as refusal:
        inner = "" if refusal.where == name else f" (at `{refusal.where}`)"
        raise SerialisationError(
            f"zodmem.save cannot save {where}: its value {refusal.value!r}{inner} cannot be "
            f"written, because {refusal.reason}."
        ) from None
    try:
        decoded = decode(json.loads(json.dumps(encoded)), f"`{name}`")
    except SerialisationError as error:
        raise SerialisationError(
            f"zodmem.save cannot save {where}: its value {value!r} cannot be rebuilt from "
            f"its description ({error})"
        ) from error
    if not _same(decoded, value):
        raise SerialisationError(
            f"zodmem.save cannot save {where}: its value {value!r} is not described "
            f"faithfully (rebuilding it gives {decoded!r})."
        )
    return encoded


def decode(data: Any, where: str) -> Any:
    """The value that `data` (from `encode_faithfully`) describes; `where` names it in
    messages, with its own backticks around the path, as in `encode_faithfully`."""
    try:
        return _decode(data, where)
    except SerialisationError:
        raise
    except Exception as error:
        raise SerialisationError(
            f"The file's value for {where} cannot be rebuilt ({type(error).__name__}: {error})."
        ) from error


def _encode(value: Any, where: str) -> dict:
    if value is None:
        return {"type": "none"}
    if isinstance(value, enum.Enum):
        path = _class_path(value, where, "enum class")
        return {"type": "enum", "class": path, "name": value.name}
    kind = type(value)
    if kind in _SCALARS:
        return _SCALARS[kind](value)
    if kind in _CONTAINERS:
        return _CONTAINERS[kind](value, where)
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return _encode_namedtuple(value, where)
    if isinstance(value, np.dtype):
        return {"type": "dtype", "name": value.name}
    if isinstance(value, jax.sharding.NamedSharding):
        return _encode_sharding(value)
    if isinstance(value, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        raise _Refusal(
            value,
            where,
            "it is an array; static configuration holds Python values only, and arrays "
            "belong in a model passed as `fn`",
        )
    path, why = import_path(value)
    if path is not None:
        return {"type": "import", "path": path}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, where)
    raise _Refusal(value, where, why)


def _encode_items(value: tuple | list, where: str) -> dict:
    return {
        "type": type(value).__name__,
        "items": [_encode(item, f"{where}[{i}]") for i, item in enumerate(value)],
    }


def _encode_dict(value: dict, where: str) -> dict:
    return {
        "type": "dict",
        "items": [
            [_encode(key, f"{where} (key {key!r})"), _encode(item, f"{where}[{key!r}]")]
            for key, item in value.items()
        ],
    }


def _encode_partial(value: functools.partial, where: str) -> dict:
    return {
        "type": "partial",
        "func": _encode(value.func, f"{where}.func"),
        "args": [_encode(arg, f"{where}.args[{i}]") for i, arg in enumerate(value.args)],
        "keywords": [
            [name, _encode(arg, f"{where}.keywords[{name!r}]")]
            for name, arg in value.keywords.items()
        ],
    }


def _encode_namedtuple(value: tuple, where: str) -> dict:
    return {
        "type": "namedtuple",
        "class": _class_path(value, where, "named-tuple class"),
        "items": [
            _encode(item, f"{where}.{name}")
            for name, item in zip(type(value)._fields, value, strict=True)
        ],
    }


def _encode_sharding(value: jax.sharding.NamedSharding) -> dict:
    # The mesh's axes and the spec; the devices are those present when it is loaded.
    mesh = value.mesh
    return {
        "type": "sharding",
        "axis_names": list(mesh.axis_names),
        "axis_sizes": [int(size) for size in mesh.axis_sizes],
        "axis_types": [t.name for t in mesh.axis_types],
        "spec": [_spec_entry(entry) for entry in value.spec],
    }


def _encode_dataclass(value: Any, where: str) -> dict:
    # Described by its class and constructor arguments, e.g. `eqx.if_array(0)`.
    return {
        "type": "dataclass",
        "class": _class_path(value, where, "dataclass"),
        "fields": [
            [name, _encode(getattr(value, name), f"{where}.{name}")]
            for name in _constructor_fields(value)
        ],
    }


# Values of exactly these types are written as they are (`1`, `1.0` and `True` apart).
_SCALARS: dict[type, Callable[[Any], dict]] = {
    bool: lambda value: {"type": "bool", "value": value},
    int: lambda value: {"type": "int", "value": str(value)},
    float: lambda value: {"type": "float", "value": value.hex()},
    complex: lambda value: {"type": "complex", "real": value.real.hex(), "imag": value.imag.hex()},
    str: lambda value: {"type": "str", "value": value},
}
# Containers of exactly these types: each item described in turn, `where` locating it.
_CONTAINERS: dict[type, Callable[[Any, str], dict]] = {
    tuple: _encode_items,
    list: _encode_items,
    dict: _encode_dict,
    functools.partial: _encode_partial,
}


def _class_path(value: Any, where: str, what: str) -> str:
    """The import path of `value`'s class (`what` it is), or the refusal of `value`."""
    path, why = import_path(type(value))
    if path is None:
        raise _Refusal(value, where, f"its {what} cannot be imported: {why}")
    return path


def _constructor_fields(value: Any) -> list[str]:
    """The fields of a dataclass instance that its constructor takes back by name: a field
    that the class derives itself (as `zm.Static` derives `_identity`) is left out."""
    names = [field.name for field in dataclasses.fields(value) if field.init]
    try:
        parameters = inspect.signature(type(value)).parameters.values()
    except (TypeError, ValueError):
        return names
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return names
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {parameter.name for parameter in parameters if parameter.kind in by_name}
    return [name for name in names if name in accepted]


def _decode(data: Any, where: str) -> Any:
    tag = data["type"]
    if tag == "none":
        return None
    if tag == "bool":
        if not isinstance(data["value"], bool):
            raise TypeError(f"expected a JSON boolean, got {data['value']!r}")
        return data["value"]
    if tag == "int":
        return int(data["value"])
    if tag == "float":
        return float.fromhex(data["value"])
    if tag == "complex":
        return complex(float.fromhex(data["real"]), float.fromhex(data["imag"]))
    if tag == "str":
        if not isinstance(data["value"], str):
            raise TypeError(f"expected a JSON string, got {data['value']!r}")
        return data["value"]
    if tag in ("tuple", "list"):
        items = [_decode(item, where) for item in data["items"]]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict":
        return {_decode(key, where): _decode(item, where) for key, item in data["items"]}
    if tag == "namedtuple":
        cls = resolve_class(data["class"], tuple, f"the named tuple in {where}")
        return cls(*[_decode(item, where) for item in data["items"]])
    if tag == "enum":
        cls = resolve_class(data["class"], enum.Enum, f"the enum in {where}")
        return cls[data["name"]]
    if tag == "partial":
        return functools.partial(
            _decode(data["func"], where),
            *[_decode(arg, where) for arg in data["args"]],
            **{name: _decode(arg, where) for name, arg in data["keywords"]},
        )
    if tag == "dtype":
        return jnp.dtype(data["name"])
    if tag == "sharding":
        return _rebuild_sharding(data, where)
    if tag == "import":
        return resolve(data["path"], f"the value of {where}")
    if tag == "dataclass":
        cls = resolve_class(data["class"], object, f"the dataclass in {where}")
        if not dataclasses.is_dataclass(cls):
            raise SerialisationError(
                f"The file names `{data['class']}` as the dataclass in {where}, but it is "
                "not a dataclass."
            )
        return cls(**{name: _decode(item, where) for name, item in data["fields"]})
    raise SerialisationError(f"The file's value for {where} has unknown type tag {tag!r}.")


def _spec_entry(entry: Any) -> Any:
    """A `PartitionSpec` entry as JSON: `None`, a mesh axis name, or a list of names."""
    if entry is None or isinstance(entry, str):
        return entry
    return list(entry)


def _rebuild_sharding(data: dict, where: str) -> jax.sharding.NamedSharding:
    """The sharding a file describes, on a mesh of the devices present (`jax.make_mesh`)."""
    names, sizes = tuple(data["axis_names"]), tuple(data["axis_sizes"])
    types = tuple(getattr(jax.sharding.AxisType, name) for name in data["axis_types"])
    needed = int(np.prod(sizes))
    present = len(jax.devices())
    if needed > present:
        shape = ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes, strict=True))
        only = f"only {present} device is" if present == 1 else f"only {present} devices are"
        raise SerialisationError(
            f"The file's {where} is a sharding over a mesh of {needed} devices ({shape}), "
            f"but {only} present, and the mesh is rebuilt with `jax.make_mesh` on the "
            f"devices present. Load it where at least {needed} devices are present."
        )
    mesh = jax.make_mesh(sizes, names, axis_types=types, devices=jax.devices()[:needed])
    spec = [
        entry if entry is None or isinstance(entry, str) else tuple(entry) for entry in data["spec"]
    ]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _same(a: Any, b: Any) -> bool:
    """Whether a decoded value is the value that was encoded (NaN equals NaN here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, functools.partial):
        return (
            _same(a.func, b.func)
            and _same(a.args, b.args)
            and _same(dict(a.keywords), dict(b.keywords))
        )
    try:
        return bool(a == b)
    except Exception:
        return False
