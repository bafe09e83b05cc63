"""Finding a function or class again by import: its `module:qualname` path, and back."""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from typing import Any

from ._error import SerialisationError

__all__ = ["class_name", "import_path", "resolve", "resolve_class"]

_MODULE_NAMESPACE = types.ModuleType.__dict__["__dict__"]

# zodmem's public modules: a class or function they export is saved by its public path,
# which survives moves between private files.
_PUBLIC = ("zodmem", "zodmem.losses", "zodmem.contract")


def import_path(obj: Any) -> tuple[str | None, str]:
    """`("module:qualname", "")` if `obj` can be found again by import, else `(None, why)`.

    The path is the first of:

    1. `obj.__module__` and `obj.__qualname__`, when looking them up gives `obj` back,
       with zodmem's public modules first, then the shortest package prefix that does
       (`zodmem:BatchedHessian`, `zodmem.losses:SquaredError` rather than their private
       modules' paths, which survives moves between private files);
    2. a top-level name bound to this very object, in the module `obj.__module__`
       names, else in any other loaded module: the shortest module name first (fewest
       dots, then alphabetically), `__main__` last, and in a module its first such name.

    The second finds what the first cannot: a wrapper keeps the name and module of
    the function it wraps (`grad_loss = jax.grad(loss)` claims to be `loss`, of the
    module that defines `loss`), and a lambda has no name of its own. It is sound
    because a name bound at the top level of a module is bound again by importing
    that module, wherever the file is loaded; names bound in `__main__` only where the
    same script runs, hence last. A method bound to an instance is refused whatever
    its name, since the instance's arrays would not be saved with it.
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None, (
            f"it is an instance of {type(obj).__module__}.{type(obj).__qualname__}, which "
            "is neither a plain value zodmem can describe nor something with an import path"
        )
    if not (inspect.ismethod(obj) and not isinstance(obj.__self__, type)):
        path = _qualified_path(obj, module, qualname) or _bound_name(obj, module)
        if path is not None:
            return path, ""
    return None, _why_not_found(obj, module, qualname)


def _qualified_path(obj: Any, module: str, qualname: str) -> str | None:
    parts = module.split(".")
    public = _PUBLIC if parts[0] == "zodmem" else ()
    for candidate in (*public, *(".".join(parts[:end]) for end in range(1, len(parts) + 1))):
        root = sys.modules.get(candidate)
        if root is None:
            continue
        try:
            found = _walk_attributes(root, qualname)
        except AttributeError:
            continue
        if _same_object(found, obj):
            return f"{candidate}:{qualname}"
    return None


def _bound_name(obj: Any, home: str) -> str | None:
    def preference(name: str) -> tuple:
        return (name != home, name == "__main__", name.count("."), name)

    loaded = [
        (name, module)
        for name, module in list(sys.modules.items())
        if isinstance(module, types.ModuleType)
    ]
    for name, module in sorted(loaded, key=lambda item: preference(item[0])):
        # Read through ModuleType itself: a lazily loaded module imports on attribute access.
        namespace = _MODULE_NAMESPACE.__get__(module)
        for attribute, value in list(namespace.items()):
            if value is obj:
                return f"{name}:{attribute}"
    return None


def _why_not_found(obj: Any, module: str, qualname: str) -> str:
    if "<lambda>" in qualname:
        return (
            "it is a lambda, which cannot be found by import when the file is loaded; "
            "define it with `def` at the top level of a module instead"
        )
    if "<locals>" in qualname:
        return (
            "it is defined inside a function (a closure or local definition), so it cannot "
            "be found by import when the file is loaded; define it at the top level of a "
            "module instead"
        )
    if inspect.ismethod(obj) and not isinstance(obj.__self__, type):
        return (
            f"it is a method bound to an instance of {type(obj.__self__).__qualname__}; "
            "pass the instance itself (an Equinox module is callable), so that its arrays "
            "are saved with it"
        )
    return (
        f"looking up `{module}:{qualname}` does not give this object back, and no loaded "
        "module binds it to a top-level name, so it cannot be found by import when the "
        "file is loaded (it may be a wrapper such as `jax.grad(f)` made inside a function "
        "call, or the name was redefined); assign it to a name at the top level of a "
        "module, e.g. `grad_loss = jax.grad(loss)`"
    )


def class_name(cls: type) -> str:
    """The import path of `cls`, or `module:qualname` when it has none (a class defined
    inside a function): how the file names the class of a module held in a stack."""
    path, _ = import_path(cls)
    return path if path is not None else f"{cls.__module__}:{cls.__qualname__}"


def resolve(path: Any, what: str) -> Any:
    """The object that the import path `path` names; `what` says what it is, for messages."""
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


def resolve_class(path: Any, base: type, what: str) -> type:
    """`resolve`, for a path that must name a subclass of `base`."""
    cls = resolve(path, what)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise SerialisationError(
            f"The file names {what} `{path}`, which is not a subclass of "
            f"{base.__module__}.{base.__qualname__}."
        )
    return cls


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
