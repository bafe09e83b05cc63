"""Text and hashes of calls that are the same in every process running the same script:
what a result file's journal compares to resume a call (`_stream/_fingerprint.py`) and
what a plan kept on disk is known by (`_plan/_stored.py`). Nothing here names an object by
its memory address."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend
import numpy as np

__all__ = ["ADDRESS", "array_bytes", "as_text", "program_digest"]

# A memory address in a repr (`<function f at 0x7f...>`): different in every process.
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def as_text(value: Any) -> str:
    """A value as text that is the same in every process: a function by its module and
    qualified name, anything else by its repr without memory addresses."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return ADDRESS.sub("", repr(value))


def array_bytes(value: Any) -> tuple[str, Any]:
    """An array's dtype and shape as text (`float32[3, 4]`), and its bytes in C order."""
    array = np.ascontiguousarray(np.asarray(value))
    return f"{array.dtype}{list(array.shape)}", (
        array.view(np.uint8).reshape(-1).data if array.size else b""
    )


def program_digest(program: Any) -> str:
    """A sha256 of a traced call: the text of its program, at every level of nesting, and
    the values of the constants it holds (the arrays a function closes over). Two
    functions of the same name that compute different things differ here."""
    digest = hashlib.sha256(ADDRESS.sub("", str(program)).encode())
    for constant in _constants(program):
        described, data = array_bytes(constant)
        digest.update(described.encode())
        digest.update(data)
    return digest.hexdigest()


def _constants(program: Any) -> Iterator[Any]:
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
