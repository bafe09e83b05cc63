"""The fingerprint of a streamed call: what a result file's journal compares to resume it.

A call is known by its transform and configuration, the shapes, dtypes and values of
its inputs, and the program JAX traces from it with the constants that program holds;
each is text, or a sha256, that is the same in every process running the same script.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax

from .._digest import ADDRESS, array_bytes, as_text, program_digest

if TYPE_CHECKING:
    from ._call import Layout

__all__ = ["call_fingerprint"]


def call_fingerprint(transform: Any, args: tuple, kwargs: dict, layout: Layout) -> dict[str, str]:
    """What a file's journal compares to resume it: the transform and its configuration,
    the result's and the inputs' shapes and dtypes, the other leaves (functions, numbers,
    static fields), a hash of every input value (the transform's arrays included) and a
    hash of what the call computes (its program and the constants it closes over)."""
    config = ", ".join(f"{k}={as_text(v)}" for k, v in transform.config.items())
    leaves, treedef = jax.tree_util.tree_flatten((transform, args, kwargs))
    digest = hashlib.sha256()
    shapes, constants = [], []
    for leaf in leaves:
        if eqx.is_array(leaf):
            described, data = array_bytes(leaf)
            shapes.append(described)
            digest.update(data)
        else:
            constants.append(as_text(leaf))
    output = ", ".join(
        f"{key or 'result'}: {leaf.dtype}{list(leaf.shape)}"
        for key, leaf in zip(layout.paths, layout.leaves, strict=True)
    )
    return {
        "transform": f"{type(transform).__name__}({config})",
        "output shapes and dtypes": output,
        "input shapes and dtypes": ", ".join(shapes),
        "input structure and constants": ADDRESS.sub("", str(treedef))
        + " | "
        + ", ".join(constants),
        "input values (sha256)": digest.hexdigest(),
        "computation (sha256 of its program and constants)": program_digest(layout.program),
    }
