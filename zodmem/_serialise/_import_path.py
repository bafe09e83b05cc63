"""Finding a function or class again by import: its `module:qualname` path, and back."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

from ._error import SerialisationError

__all__ = ["import_path", "resolve", "resolve_class"]


def import_path(obj: Any) -> tuple[str | None, str]:
    """`("module:qualname", "")` if `obj` can be found again by import, else `(None, why)`.

    The path is `obj.__module__` (its shortest package prefix that gives `obj` back,
    so `zodmem:BatchedHessian` rather than `zodmem._hessian:BatchedHessian`) and
    `obj.__qualname__`; failing that, a top-level name of the module `obj.__module__`
    that is bound to this very object (a wrapper such as `jitted = jax.jit(f)` keeps
    the name `f`, but is found as `jitted`).
    """
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
