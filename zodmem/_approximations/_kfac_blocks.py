"""The blocks of a Kronecker-factored operator: one per layer (its weight and joined
bias, its two factors) and one per leaf in no layer (its exact block, held dense), and
the refusal of a leaf in no layer too large to hold so."""

from __future__ import annotations

import jax.numpy as jnp

from .._operators._kronecker import KroneckerBlock
from .._pytree import Variables
from . import _kfac_trace as trace

__all__ = ["DENSE_LIMIT", "check_others", "layer_blocks"]

# The most entries a leaf in no layer may have: its dense block holds their square.
DENSE_LIMIT = 4096


def layer_blocks(found: trace.Program, variables: Variables, sums: dict) -> tuple:
    """The operator's blocks and factors, in the order of their first leaves."""
    entries = []
    for k, group in enumerate(found.groups):
        layer = found.layers[group[0]]
        leaves = (layer.weight,) if layer.bias is None else (layer.weight, layer.bias)
        names = tuple(variables.names[leaf] for leaf in leaves)
        block = KroneckerBlock(names, leaves, layer.weight_axes, layer.out_size, layer.in_size)
        factors = (sums["inputs"][k] / sums["rows"][k], sums["gradients"][k])
        entries.append((block, factors))
    for leaf, dense in zip(found.others, sums["dense"], strict=True):
        ndim = len(variables.shapes[leaf])
        block = KroneckerBlock((variables.names[leaf],), (leaf,), tuple(range(ndim)), len(dense), 1)
        entries.append((block, (jnp.ones((1, 1), dense.dtype), dense)))
    entries.sort(key=lambda entry: entry[0].leaves[0])
    return tuple(entry[0] for entry in entries), [entry[1] for entry in entries]


def check_others(found: trace.Program, variables: Variables, owner: str) -> None:
    """Refuse a leaf in no layer whose dense block would be too large to hold."""
    for leaf in found.others:
        size = variables.sizes[leaf]
        if size <= DENSE_LIMIT:
            continue
        where = f"{owner}: the leaf x{variables.names[leaf]} of shape {variables.shapes[leaf]} "
        if leaf in found.mixed:
            why = (
                "is a weight used several times with layouts that cannot be made to agree: "
                "no one `(out, in)` matrix is the weight of every use, read the same way or "
                "exchanged, so no Kronecker factorisation of its block is defined"
            )
        else:
            why = (
                "is in no layer KFAC recognises (a weight every use of which is an operand "
                "of a dot_general, a convolution's kernel or a row lookup, in the program, "
                "its calls or the bodies of its lax.scans)"
            )
        raise ValueError(
            f"{where}{why}, and its exact block would hold {size}^2 numbers; leaves in no "
            f"layer may have at most {DENSE_LIMIT} entries. Hold it fixed (outside `x`), or "
            "use it as a layer's weight."
        )
