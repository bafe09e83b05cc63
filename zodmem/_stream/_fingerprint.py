"""The fingerprint of a streamed call: what a result file's journal compares to resume it.

A call is known by its transform and configuration, the shapes, dtypes and values of
its inputs, and the program JAX traces from it with the constants that program holds;
each is text, or a sha256, that is the same in every process running the same script.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.extend
import numpy as np

if TYPE_CHECKING:
    from ._call import Layout

__all__ = ["call_fingerprint"]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def call_fingerprint(transform: Any, args: tuple, kwargs: dict, layout: Layout) -> dict[str, str]:
    """What a file's journal compares to resume it: the transform and its configuration,
    the result's and the inputs' shapes and dtypes, the other leaves (functions, numbers,
    static fields), a hash of every input value (the transform's arrays included) and a
    hash of what the call computes (its program and the constants it closes over)."""
    config = ", ".join(f"{k}={_describe(v)}" for k, v in transform.config.items())
    leaves, treedef = jax.tree_util.tree_flatten((transform, args, kwargs))
    digest = hashlib.sha256()
    shapes, constants = [], []
    for leaf in leaves:
        if eqx.is_array(leaf):
            described, data = _array_bytes(leaf)
            shapes.append(described)
            digest.update(data)
        else:
            constants.append(_describe(leaf))
    output = ", ".join(
        f"{key or 'result'}: {leaf.dtype}{list(leaf.shape)}"
        for key, leaf in zip(layout.paths, layout.leaves, strict=True)
    )
    return {
        "transform": f"{type(transform).__name__}({config})",
        "output shapes and dtypes": output,
        "input shapes and dtypes": ", ".join(shapes),
        "input structure and constants": _ADDRESS.sub("", str(treedef))
        + " | "
        + ", ".join(constants),
        "input values (sha256)": digest.hexdigest(),
        "computation (sha256 of its program and constants)": _program_digest(layout.program),
    }


def _describe(value: Any) -> str:
    """A value as text that is the same in every process (no memory addresses)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def _array_bytes(value: Any) -> tuple[str, Any]:
    """An array's dtype and shape as text (`float32[3, 4]`), and its bytes in C order."""
    array = np.ascontiguousarray(np.asarray(value))
    return f"{array.dtype}{list(array.shape)}", (
        array.view(np.uint8).reshape(-1).data if array.size else b""
    )


def _program_digest(program: Any) -> str:
    """A hash of a traced call: the text of its program, at every level of nesting, and
    the values of the constants it holds (the arrays a function closes over). Two
    functions of the same name that compute different things differ here; the text
    names nothing by its address, so the same script gives the same hash in every
    process."""
    digest = hashlib.sha256(_ADDRESS.sub("", str(program)).encode())
    for constant in _constants(program):
        described, data = _array_bytes(constant)
        digest.update(described.encode())
        digest.update(data)
    return digest.hexdigest()


def _constants(program: Any) -> Any:
    """The constants of a `ClosedJaxpr` or `Jaxpr` and of the programs in its equations'
    parameters (loop bodies, branches, inner `jit`s), literals included, in order."""
    if isinstance(program, jax.extend.core.ClosedJaxpr):
        yield from program.consts
        program = program.jaxpr
    for eqn in program.eqns:
        yield from (v.val for v in eqn.invars if isinstance(v, jax.extend.core.Literal))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    yield from _constants(item)
    yield from (v.val for v in program.outvars if isinstance(v, jax.extend.core.Literal))
