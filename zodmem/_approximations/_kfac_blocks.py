"""The blocks of a Kronecker-factored operator: one per layer (its weight and joined
bias, its two factors) and one per leaf in no layer (its exact block, held dense), and
the refusal of a leaf in no layer too large to hold so."""

from __future__ import annotations

import jax.numpy as jnp

from .._operators._kronecker import KroneckerBlock
from .._pytree import Variables
from . import _kfac_trace as trace

__all__ = ["DENSE_LIMIT", "check_others", "layer_blocks", "nearest_kronecker"]

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
        inputs, rows, gradients = sums["inputs"][k], sums["rows"][k], sums["gradients"][k]
        if isinstance(inputs, tuple):  # uses laid out both ways: the exchanged ones' inputs
            # are on the layer's output side, their gradients on its input side
            (a_same, a_other), (r_same, r_other), (g_same, g_other) = inputs, rows, gradients
            factors = nearest_kronecker((a_same / r_same, g_same), (g_other, a_other / r_other))
        else:
            factors = (inputs / rows, gradients)
        entries.append((block, factors))
    for leaf, dense in zip(found.others, sums["dense"], strict=True):
        ndim = len(variables.shapes[leaf])
        block = KroneckerBlock((variables.names[leaf],), (leaf,), tuple(range(ndim)), len(dense), 1)
        entries.append((block, (jnp.ones((1, 1), dense.dtype), dense)))
    entries.sort(key=lambda entry: entry[0].leaves[0])
    return tuple(entry[0] for entry in entries), [entry[1] for entry in entries]


def nearest_kronecker(first: tuple, second: tuple) -> tuple:
    """The Kronecker product `B ⊗ A` nearest in the Frobenius norm to the sum of two,
    `B_1 ⊗ A_1 + B_2 ⊗ A_2` (each given as `(A, B)`), as `(A, B)` (Van Loan and
    Pitsianis, 1993): the sum rearranged is the rank-two matrix `[a_1 a_2] [b_1 b_2]^T`
    of the factors' entries, whose best rank-one part is `A = a_1 α_1 + a_2 α_2`,
    `B = b_1 β_1 + b_2 β_2`, `β` the leading eigenvector of `G_A G_B` (the 2 × 2 Gram
    matrices of the two `A`s and the two `B`s) and `α = G_B β / (β^T G_B β)`. For
    positive semi-definite factors the Gram matrices' entries are non-negative, so are
    `α` and `β`, and the result is positive semi-definite."""
    (a1, b1), (a2, b2) = first, second
    gram_a = jnp.array([[jnp.vdot(x, y) for y in (a1, a2)] for x in (a1, a2)])
    gram_b = jnp.array([[jnp.vdot(x, y) for y in (b1, b2)] for x in (b1, b2)])
    (p, q), (r, t) = gram_a @ gram_b
    # The larger eigenvalue of [[p, q], [r, t]] (q, r >= 0) and its eigenvector.
    top = (p + t) / 2 + jnp.sqrt(((p - t) / 2) ** 2 + q * r)
    beta = jnp.where(
        q > 0,
        jnp.stack([q, top - p]),
        jnp.where(r > 0, jnp.stack([top - t, r]), jnp.stack([p >= t, p < t]).astype(p.dtype)),
    )
    scale = beta @ gram_b @ beta
    alpha = jnp.where(scale > 0, gram_b @ beta / jnp.where(scale > 0, scale, 1), 0)
    return a1 * alpha[0] + a2 * alpha[1], b1 * beta[0] + b2 * beta[1]


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
                "of a dot_general, a convolution's kernel, a row lookup or a table added "
                "by position, in the program, its calls or the bodies of its lax.scans)"
            )
        raise ValueError(
            f"{where}{why}, and its exact block would hold {size}^2 numbers; leaves in no "
            f"layer may have at most {DENSE_LIMIT} entries. Hold it fixed (outside `x`), or "
            "use it as a layer's weight."
        )
