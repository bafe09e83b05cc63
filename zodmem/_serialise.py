"""`save` and `load`: a transform stack, and the arrays of every model inside it, in one file.

The file is a signed header followed by the arrays:

```
zodmem <sha256 of the header line, 64 hex digits>\\n
<header: one line of JSON>\\n
<payload: the array leaves of the stack, as written by eqx.tree_serialise_leaves>
```

The header records the format (`"format": "zodmem.transform"`, `"version": 1`), the
versions of zodmem, JAX and Equinox that wrote it, the stack (each transform's class
and static configuration, and what each `fn` is), a table of the array leaves
(path, shape and dtype) and the payload's length and sha256.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import inspect
import io
import json
import math
import os
import secrets
import sys
from collections.abc import Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._transform import AbstractTransform

__all__ = ["SerialisationError", "load", "save"]

FORMAT_NAME = "zodmem.transform"
FORMAT_VERSION = 1
_SIGNATURE = b"zodmem "
_DIGEST_LINE_LENGTH = len(_SIGNATURE) + 64 + 1


class SerialisationError(ValueError):
    """A transform could not be saved, or a file could not be loaded.

    Raised by [`zodmem.save`][] when the stack holds something that cannot be
    written faithfully (a lambda, a locally defined function, an object with no
    import path), and by [`zodmem.load`][] when the file is truncated or corrupted,
    was written by an unknown format version, names a class or function that cannot
    be imported, or disagrees with `like`. The message names the field and the
    reason; the underlying exception, if any, is chained as `__cause__`.

    It subclasses `ValueError`, since in every case a value handed to zodmem (the
    transform, the file's contents or `like`) is unacceptable, so code that already
    catches `ValueError` around loading keeps working. `load` never returns a
    partly built transform: it either returns the whole stack or raises.
    """


# --------------------------------------------------------------------------------------
# Import paths
# --------------------------------------------------------------------------------------


def _walk_attributes(root: Any, qualname: str) -> Any:
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _same_object(found: Any, obj: Any) -> bool:
    if found is obj:
        return True
    # A method bound to a class is a new object on every attribute access.
    return inspect.ismethod(obj) and inspect.ismethod(found) and found == obj


def _import_path(obj: Any) -> tuple[str | None, str]:
    """`("module:qualname", "")` if `obj` can be found again by import, else `(None, why)`."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None, (
            f"it is an instance of {type(obj).__module__}.{type(obj).__qualname__}, which "
            "is neither a plain value zodmem can describe nor something with an import path"
        )
    if "<lambda>" in qualname:
        return None, (
            "it is a lambda, which cannot be found by import when the file is loaded; "
            "define it with `def` at the top level of a module instead"
        )
    if "<locals>" in qualname:
        return None, (
            "it is defined inside a function (a closure or local definition), so it cannot "
            "be found by import when the file is loaded; define it at the top level of a "
            "module instead"
        )
    if inspect.ismethod(obj) and not isinstance(obj.__self__, type):
        return None, (
            f"it is a method bound to an instance of {type(obj.__self__).__qualname__}; "
            "pass the instance itself (an Equinox module is callable), so that its arrays "
            "are saved with it"
        )
    # Prefer the shortest public path (`zodmem:BatchedHessian` rather than
    # `zodmem._hessian:BatchedHessian`), which survives moves between private files.
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        candidate = ".".join(parts[:end])
        root = sys.modules.get(candidate)
        if root is None:
            continue
        try:
            found = _walk_attributes(root, qualname)
        except AttributeError:
            continue
        if _same_object(found, obj):
            return f"{candidate}:{qualname}", ""
    # A wrapper keeps the wrapped function's name (`jitted = jax.jit(f)` is called `f`):
    # look for the top-level name it was assigned to instead.
    home = sys.modules.get(module)
    for name, value in list(vars(home).items()) if home is not None else []:
        if value is obj:
            return f"{module}:{name}", ""
    return None, (
        f"looking up `{module}:{qualname}` does not give this object back, so it cannot "
        "be found by import when the file is loaded (it may be a wrapper such as "
        "`jax.grad(f)` made inside a function call, or the name was redefined); assign it "
        "to a name at the top level of a module, e.g. `grad_loss = jax.grad(loss)`"
    )


def _resolve(path: Any, what: str) -> Any:
    if not isinstance(path, str) or path.count(":") != 1:
        raise SerialisationError(f"The file is malformed: {what} has import path {path!r}.")
    module_name, qualname = path.split(":")
    hint = ""
    if module_name == "__main__":
        hint = (
            " It was defined in the script or notebook that saved the file (module "
            "`__main__`), so it can only be loaded where the main module defines it too; "
            "move it to an importable module and save again."
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise SerialisationError(
            f"The file names {what} `{path}`, but module `{module_name}` cannot be imported "
            f"({type(error).__name__}: {error}).{hint}"
        ) from error
    try:
        return _walk_attributes(module, qualname)
    except AttributeError as error:
        raise SerialisationError(
            f"The file names {what} `{path}`, but module `{module_name}` has no `{qualname}`.{hint}"
        ) from error


def _resolve_class(path: Any, base: type, what: str) -> type:
    cls = _resolve(path, what)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise SerialisationError(
            f"The file names {what} `{path}`, which is not a subclass of "
            f"{base.__module__}.{base.__qualname__}."
        )
    return cls


# --------------------------------------------------------------------------------------
# Static values <-> JSON with type tags
# --------------------------------------------------------------------------------------


class _Refusal(Exception):
    """A value that cannot be described; `where` locates it inside the field."""

    def __init__(self, value: Any, where: str, reason: str):
        super().__init__(reason)
        self.value = value
        self.where = where
        self.reason = reason


def _encode(value: Any, where: str) -> dict:
    if value is None:
        return {"type": "none"}
    if isinstance(value, enum.Enum):
        path, why = _import_path(type(value))
        if path is None:
            raise _Refusal(value, where, f"its enum class cannot be imported: {why}")
        return {"type": "enum", "class": path, "name": value.name}
    kind = type(value)
    if kind is bool:
        return {"type": "bool", "value": value}
    if kind is int:
        return {"type": "int", "value": str(value)}
    if kind is float:
        return {"type": "float", "value": value.hex()}
    if kind is complex:
        return {"type": "complex", "real": value.real.hex(), "imag": value.imag.hex()}
    if kind is str:
        return {"type": "str", "value": value}
    if kind is tuple or kind is list:
        return {
            "type": kind.__name__,
            "items": [_encode(item, f"{where}[{i}]") for i, item in enumerate(value)],
        }
    if kind is dict:
        return {
            "type": "dict",
            "items": [
                [_encode(key, f"{where} (key {key!r})"), _encode(item, f"{where}[{key!r}]")]
                for key, item in value.items()
            ],
        }
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        path, why = _import_path(kind)
        if path is None:
            raise _Refusal(value, where, f"its named-tuple class cannot be imported: {why}")
        return {
            "type": "namedtuple",
            "class": path,
            "items": [
                _encode(item, f"{where}.{name}")
                for name, item in zip(kind._fields, value, strict=True)
            ],
        }
    if kind is functools.partial:
        return {
            "type": "partial",
            "func": _encode(value.func, f"{where}.func"),
            "args": [_encode(arg, f"{where}.args[{i}]") for i, arg in enumerate(value.args)],
            "keywords": [
                [name, _encode(arg, f"{where}.keywords[{name!r}]")]
                for name, arg in value.keywords.items()
            ],
        }
    if isinstance(value, np.dtype):
        return {"type": "dtype", "name": value.name}
    if isinstance(value, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        raise _Refusal(
            value,
            where,
            "it is an array; static configuration holds Python values only, and arrays "
            "belong in a model passed as `fn`",
        )
    path, why = _import_path(value)
    if path is not None:
        return {"type": "import", "path": path}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Described by its class and constructor arguments, e.g. `eqx.if_array(0)`.
        class_path, class_why = _import_path(kind)
        if class_path is None:
            raise _Refusal(value, where, f"its dataclass cannot be imported: {class_why}")
        return {
            "type": "dataclass",
            "class": class_path,
            "fields": [
                [field.name, _encode(getattr(value, field.name), f"{where}.{field.name}")]
                for field in dataclasses.fields(value)
                if field.init
            ],
        }
    raise _Refusal(value, where, why)


def _decode(data: Any, where: str) -> Any:
    try:
        return _decode_tagged(data, where)
    except SerialisationError:
        raise
    except Exception as error:
        raise SerialisationError(
            f"The file's value for `{where}` cannot be rebuilt ({type(error).__name__}: {error})."
        ) from error


def _decode_tagged(data: Any, where: str) -> Any:
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
        items = [_decode_tagged(item, where) for item in data["items"]]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict":
        return {
            _decode_tagged(key, where): _decode_tagged(item, where) for key, item in data["items"]
        }
    if tag == "namedtuple":
        cls = _resolve_class(data["class"], tuple, f"the named tuple at `{where}`")
        return cls(*[_decode_tagged(item, where) for item in data["items"]])
    if tag == "enum":
        cls = _resolve_class(data["class"], enum.Enum, f"the enum at `{where}`")
        return cls[data["name"]]
    if tag == "partial":
        return functools.partial(
            _decode_tagged(data["func"], where),
            *[_decode_tagged(arg, where) for arg in data["args"]],
            **{name: _decode_tagged(arg, where) for name, arg in data["keywords"]},
        )
    if tag == "dtype":
        return jnp.dtype(data["name"])
    if tag == "import":
        return _resolve(data["path"], f"the value of `{where}`")
    if tag == "dataclass":
        cls = _resolve_class(data["class"], object, f"the dataclass at `{where}`")
        if not dataclasses.is_dataclass(cls):
            raise SerialisationError(
                f"The file names `{data['class']}` as the dataclass at `{where}`, but it is "
                "not a dataclass."
            )
        return cls(**{name: _decode_tagged(item, where) for name, item in data["fields"]})
    raise SerialisationError(f"The file's value for `{where}` has unknown type tag {tag!r}.")


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


def _encode_faithfully(value: Any, name: str, where: str) -> dict:
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
    # Check the description is faithful: reading it back must give the same value.
    try:
        decoded = _decode(json.loads(json.dumps(encoded)), name)
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


# --------------------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------------------


def _describe(obj: Any, location: str) -> dict:
    """The header's description of a value held in a transform's `fn` (or other field)."""
    if isinstance(obj, AbstractTransform):
        return _describe_transform(obj, location)
    if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
        # An array field of a transform (e.g. a count held as a traced value).
        return {
            "kind": "array",
            "array": "jax" if isinstance(obj, jax.Array) else "numpy",
            "shape": list(np.shape(obj)),
            "dtype": str(obj.dtype),
            "scalar": isinstance(obj, np.generic),
        }
    if isinstance(obj, eqx.Module):
        path, _ = _import_path(obj)
        if path is not None:  # e.g. a module-level `eqx.filter_jit` function
            return {"kind": "value", "value": {"type": "import", "path": path}}
        class_path, why = _import_path(type(obj))
        if class_path is None:
            raise SerialisationError(
                f"zodmem.save cannot save `{location}`: it is an instance of "
                f"{type(obj).__qualname__}, whose class cannot be found by import ({why})."
            )
        return {"kind": "module", "class": class_path}
    return {"kind": "value", "value": _encode_faithfully(obj, location, f"`{location}`")}


def _describe_transform(transform: AbstractTransform, location: str) -> dict:
    cls = type(transform)
    class_path, why = _import_path(cls)
    if class_path is None:
        raise SerialisationError(
            f"zodmem.save cannot save `{location}`: its class {cls.__qualname__} cannot be "
            f"found by import ({why})."
        )
    config: dict[str, Any] = {}
    children: dict[str, Any] = {}
    arguments: dict[str, Any] = {}
    for field in dataclasses.fields(transform):
        if not field.init:
            continue  # derived by the constructor
        value = getattr(transform, field.name)
        arguments[field.name] = value
        if field.metadata.get("static", False):
            config[field.name] = _encode_faithfully(
                value, field.name, f"`{field.name}` of {cls.__name__} at `{location}`"
            )
        else:
            children[field.name] = _describe(value, f"{location}.{field.name}")
    # The constructor must give back this very transform from its fields.
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


def _leaf_table(tree: Any) -> list[dict]:
    """The leaves that `eqx.tree_serialise_leaves` writes, in its order."""
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


_KINDS = ("transform", "module", "value", "array")


def _placeholder_array(node: dict) -> Any:
    """An array of the saved shape and dtype; the file's values replace it."""
    dtype = jnp.dtype(node["dtype"])
    shape = tuple(int(size) for size in node["shape"])
    if node["scalar"]:
        return dtype.type(0)
    return jnp.zeros(shape, dtype) if node["array"] == "jax" else np.zeros(shape, dtype)


def _build(node: Any, location: str, like: Any, skeleton: Any) -> Any:
    """Rebuild a node through its class's constructor; module skeletons come from
    `like` (mirroring the stack) or are the single `skeleton`."""
    if not isinstance(node, dict) or node.get("kind") not in _KINDS:
        raise SerialisationError(f"The file is malformed: the entry for `{location}` is damaged.")
    kind = node["kind"]
    if kind == "value":
        if "value" not in node:
            raise SerialisationError(f"The file is malformed: `{location}` has no value.")
        return _decode(node["value"], location)
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
        cls = _resolve_class(class_path, eqx.Module, f"the model class at `{location}`")
        model = skeleton if skeleton is not None else like
        if model is None:
            raise SerialisationError(f"`like` gives no skeleton for `{location}`.")
        if type(model) is not cls:
            raise SerialisationError(
                f"`like` disagrees with the file at `{location}`: the file holds a "
                f"{class_path}, `like` a {_describe_like(model)}."
            )
        return model

    cls = _resolve_class(class_path, AbstractTransform, f"the transform class at `{location}`")
    if skeleton is None and like is not None and type(like) is not cls:
        raise SerialisationError(
            f"`like` disagrees with the file at `{location}`: the file holds a {class_path}, "
            f"`like` a {_describe_like(like)}."
        )
    owner = cls.__name__
    arguments = {
        name: _decode(value, f"{owner}.{name} at `{location}`") for name, value in config.items()
    }
    for name, child in children.items():
        child_like = None
        if skeleton is None and like is not None:
            if not hasattr(like, name):
                raise SerialisationError(
                    f"`like` disagrees with the file: it has no field `{location}.{name}`."
                )
            child_like = getattr(like, name)
        arguments[name] = _build(child, f"{location}.{name}", child_like, skeleton)
    return _construct(cls, arguments, location)


def _construct(cls: type, arguments: dict, location: str) -> Any:
    try:
        return cls(**arguments)
    except Exception as error:
        raise SerialisationError(
            f"The file's {cls.__name__} at `{location}` is rejected by its constructor "
            f"({type(error).__name__}: {error})"
        ) from error


def _rebuild_through_constructors(transform: AbstractTransform, location: str) -> Any:
    arguments = {}
    for field in dataclasses.fields(transform):
        if field.init:
            value = getattr(transform, field.name)
            if isinstance(value, AbstractTransform):
                value = _rebuild_through_constructors(value, f"{location}.{field.name}")
            arguments[field.name] = value
    return _construct(type(transform), arguments, location)


# --------------------------------------------------------------------------------------
# Bytes on disk
# --------------------------------------------------------------------------------------


def _write_atomically(path: str, chunks: Iterable[bytes]) -> None:
    """Write a whole file or nothing: a temporary file beside `path` is filled, flushed
    to disk and renamed over `path`, so a crash leaves the previous file as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    # 0o666 lets the umask decide the permissions, as for any new file.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        if os.path.exists(path):
            os.chmod(temporary, os.stat(path).st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        directory_descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory_descriptor)
    except OSError:
        pass
    finally:
        os.close(directory_descriptor)


def _corrupt(reason: str) -> SerialisationError:
    return SerialisationError(
        f"The file is truncated or corrupted: {reason}. It cannot be loaded; save the "
        "transform again."
    )


def _read_header(data: bytes) -> tuple[dict, bytes]:
    if not data.startswith(_SIGNATURE):
        if len(data) < len(_SIGNATURE) and _SIGNATURE.startswith(data):
            raise _corrupt(f"it holds only {len(data)} bytes")
        raise SerialisationError(
            "This is not a zodmem file (it does not begin with the zodmem signature), or "
            "its first bytes are corrupted."
        )
    if len(data) < _DIGEST_LINE_LENGTH:
        raise _corrupt("it ends inside the checksum line")
    expected = data[len(_SIGNATURE) : _DIGEST_LINE_LENGTH - 1]
    if data[_DIGEST_LINE_LENGTH - 1 : _DIGEST_LINE_LENGTH] != b"\n" or not all(
        c in b"0123456789abcdef" for c in expected
    ):
        raise _corrupt("the checksum line is damaged")
    end = data.find(b"\n", _DIGEST_LINE_LENGTH)
    if end < 0:
        raise _corrupt("it ends inside the header")
    header_bytes = data[_DIGEST_LINE_LENGTH:end]
    if hashlib.sha256(header_bytes).hexdigest().encode() != expected:
        raise _corrupt("the header does not match its sha256 checksum")
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(f"the header is not valid JSON ({error})") from error
    if not isinstance(header, dict):
        raise _corrupt("the header is not a JSON object")
    if header.get("format") != FORMAT_NAME:
        raise SerialisationError(
            f"The file's format is {header.get('format')!r}, not {FORMAT_NAME!r}: it was not "
            "written by zodmem.save."
        )
    version = header.get("version")
    written_by = header.get("written_by")
    writer = written_by.get("zodmem") if isinstance(written_by, dict) else None
    if version != FORMAT_VERSION or type(version) is not int:
        raise SerialisationError(
            f"The file uses format version {version!r} of {FORMAT_NAME}, but this zodmem "
            f"({_zodmem_version()}) reads version {FORMAT_VERSION} only. It was written by "
            f"zodmem {writer or '(unknown)'}; load it with "
            "a matching version of zodmem."
        )
    payload = data[end + 1 :]
    try:
        expected_length = header["payload"]["bytes"]
        expected_digest = header["payload"]["sha256"]
    except (KeyError, TypeError) as error:
        raise _corrupt("the header has no payload entry") from error
    if len(payload) < expected_length:
        raise _corrupt(f"its arrays hold {len(payload)} bytes of the {expected_length} written")
    if len(payload) > expected_length:
        raise _corrupt(
            f"it has {len(payload) - expected_length} bytes after the {expected_length} "
            "bytes of arrays written"
        )
    if hashlib.sha256(payload).hexdigest() != expected_digest:
        raise _corrupt("the arrays do not match their sha256 checksum")
    return header, payload


def _zodmem_version() -> str:
    return getattr(sys.modules.get("zodmem"), "__version__", "unknown")


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def save(path: str | os.PathLike, transform: AbstractTransform) -> None:
    """Save a transform stack, and the arrays of every model inside it, to one file.

    Each transform's class and static configuration are written as a JSON header, and
    every array in the stack (the parameters of a model passed as `fn`, at any depth
    of nesting) after it with `eqx.tree_serialise_leaves`. Checksums of both guard
    against truncation and corruption. The file is replaced atomically: it is written
    beside `path` under a temporary name, flushed to disk and renamed, so a crash
    while saving leaves any previous file at `path` as it was.

    What `fn` may be:

    - a function defined with `def` at the top level of a module (or any other object
      found again by import, such as `jnp.sin` or a module-level `jax.jit` function):
      its import path `module:qualname` is written;
    - another zodmem transform: it is described in turn;
    - any other Equinox module, e.g. a model such as `eqx.nn.MLP`: its arrays are
      written, and its skeleton comes from `like` at [`zodmem.load`][].

    Static configuration may hold `None`, `bool`, `int`, `float`, `complex`, `str`,
    tuples, lists, dicts and named tuples of these, enum members, dtypes, importable
    functions and classes, `functools.partial` of these, and dataclass instances
    rebuilt from their fields (such as `eqx.if_array(0)`). Each value is read back
    while saving, and only values that come back equal are accepted.

    **Arguments:**

    - `path`: the file to write. No suffix is added.
    - `transform`: a zodmem transform (which may wrap other transforms and models).

    **Returns:**

    Nothing.

    **Raises:**

    `zodmem.SerialisationError` if anything in the stack cannot be written faithfully
    (a lambda or locally defined function, an array in static configuration, an object
    with no import path); the message names the field and the value, and no file is
    touched. `OSError` if the file cannot be written; any previous file is kept.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import zodmem as zm

        model = eqx.nn.MLP(2, 3, 8, 2, key=jax.random.key(0))
        jacobian = zm.BatchedJacobian(model, nbatches=2)
        zm.save("jacobian.zm", jacobian)

        # Shapes and dtypes only: the weights come from the file.
        skeleton = eqx.filter_eval_shape(eqx.nn.MLP, 2, 3, 8, 2, key=jax.random.key(1))
        loaded = zm.load("jacobian.zm", like=skeleton)
        loaded(jnp.ones(2))   # the (3, 2) Jacobian, as jacobian(jnp.ones(2))
        ```

    !!! warning

        Functions are saved by name, not by code: loading imports them again, so a
        function defined in a script or notebook (module `__main__`) can be loaded
        only where the main module defines it too. Put functions you want to load
        elsewhere in an importable module.
    """
    if not isinstance(transform, AbstractTransform):
        raise SerialisationError(
            "zodmem.save saves zodmem transforms, got "
            f"{type(transform).__module__}.{type(transform).__qualname__}. To save a bare "
            "Equinox model use eqx.tree_serialise_leaves."
        )
    stack = _describe(transform, "transform")
    payload_file = io.BytesIO()
    eqx.tree_serialise_leaves(payload_file, transform)
    payload = payload_file.getvalue()
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "written_by": {
            "zodmem": _zodmem_version(),
            "jax": jax.__version__,
            "equinox": getattr(eqx, "__version__", "unknown"),
        },
        "stack": stack,
        "leaves": _leaf_table(transform),
        "payload": {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
    }
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("ascii")
    digest_line = _SIGNATURE + hashlib.sha256(header_bytes).hexdigest().encode() + b"\n"
    _write_atomically(os.fspath(path), [digest_line, header_bytes, b"\n", payload])


def load(path: str | os.PathLike, like: Any = None) -> AbstractTransform:
    """Load a transform stack written by [`zodmem.save`][].

    The stack is rebuilt through each transform's constructor, so its configuration
    is validated exactly as when it was first built, and every array is restored from
    the file. Functions and classes are imported by the paths the file names.

    **Arguments:**

    - `path`: the file to read.
    - `like`: the skeletons of the Equinox modules held in the stack (models passed as
      `fn`), which the file cannot rebuild alone. Their arrays are replaced by the
      file's; only their structure, shapes and dtypes matter, so a skeleton from
      `eqx.filter_eval_shape` costs no memory. Three forms:

        - `None` (the default): the stack holds no such module.
        - A single Equinox module (not a transform), when the stack holds exactly
          one: e.g. the skeleton `eqx.nn.MLP` of `zm.BatchedJacobian(model)`.
        - A transform stack of the same shape as the saved one: the same transform
          classes at every level, with skeletons wherever the saved stack holds a
          module. Its configuration and functions are ignored; the file's are used.

    **Returns:**

    The transform, equal to the one saved.

    **Raises:**

    `zodmem.SerialisationError`, with the reason, if the file is truncated or corrupted
    (a checksum covers the header and another the arrays, so a flipped byte anywhere is
    found), was written by an unknown format version, names a class or function that
    cannot be imported, or holds configuration its class rejects, or if `like` is
    missing or disagrees with the file (other classes, shapes or dtypes). Nothing is
    returned in these cases, never a partly built transform. `OSError` if the file
    cannot be read.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm
        from mypackage.losses import loss   # importable: defined with `def` in a module

        zm.save("hessian.zm", zm.BatchedHessian(loss, nbatches=4))
        hessian = zm.load("hessian.zm")
        hessian.nbatches     # 4
        ```

    !!! warning

        Like `pickle`, loading imports the modules a file names and calls the
        constructors of the classes it names. Load only files you trust.
    """
    with open(os.fspath(path), "rb") as file:
        data = file.read()
    header, payload = _read_header(data)
    stack = header.get("stack")
    table = header.get("leaves")
    if not isinstance(stack, dict) or not isinstance(table, list):
        raise _corrupt("the header has no description of the stack")

    try:
        slots = _module_slots(stack, "transform")
    except (KeyError, TypeError, AttributeError) as error:
        raise SerialisationError(
            "The file is malformed: its stack description is incomplete."
        ) from error
    skeleton = None
    if like is None:
        if slots:
            listed = ", ".join(f"`{where}` ({cls})" for where, cls in slots)
            raise SerialisationError(
                f"The file holds Equinox modules at {listed}, whose skeletons must be passed "
                "as `like`: the module itself when there is one, or a transform stack of "
                "the same shape."
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
        skeleton = like
    else:
        raise SerialisationError(
            f"`like` must be None, an Equinox module or a zodmem transform, got "
            f"{_describe_like(like)}."
        )

    skeleton_stack = _build(stack, "transform", like, skeleton)
    _check_leaves(table, _leaf_table(skeleton_stack))
    payload_file = io.BytesIO(payload)
    try:
        filled = eqx.tree_deserialise_leaves(payload_file, skeleton_stack)
    except Exception as error:
        raise SerialisationError(
            f"The file's arrays do not fit the skeletons given by `like` ({error})."
        ) from error
    if payload_file.tell() != len(payload):
        raise SerialisationError(
            "The file's arrays do not fit the skeletons given by `like`: "
            f"{len(payload) - payload_file.tell()} bytes were left unread."
        )
    return _rebuild_through_constructors(filled, "transform")


def _check_leaves(saved: list, expected: list) -> None:
    def show(entry: dict) -> str:
        if "scalar" in entry:
            return f"a Python {entry.get('scalar')}"
        return f"an array of shape {tuple(entry.get('shape', ()))} and dtype {entry.get('dtype')}"

    for saved_entry, like_entry in zip(saved, expected, strict=False):
        if not isinstance(saved_entry, dict):
            raise _corrupt("the table of arrays is malformed")
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
