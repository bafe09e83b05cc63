"""Pseudo-random vectors from integer hashes, for the estimators' probes.

`jax.random` compiles its generator (Threefry: twenty rounds of 32-bit arithmetic) into
every program that draws from it, a cost paid in compile time by an estimator's one-shot
call, twice where its blocks are planned. A probe vector needs
far less: the entries of one probe independent-looking and evenly spread, and no two
probes of one key alike. A 32-bit integer hash of (entry, probe, key) gives that in a
handful of elementwise operations. Probe `i` of a key is the same whatever the blocks,
devices or block sizes that draw it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._eager import one_program
from .._operators._vectors import GOLDEN, hashed_words, key_seed, mix_words, words

__all__ = ["hashed_bits", "key_seed", "probe_seeds", "sign_probes"]


def hashed_bits(n: int, stream: Any, seed: Any = 0) -> jax.Array:
    """`n` pseudo-random 32-bit words, an integer hash of (index, stream, seed)."""
    return hashed_words((n,), 0, stream, seed)


def probe_seeds(key: jax.Array, indices: Any) -> jax.Array:
    """The 32-bit seed of each probe number in `indices` of `key`: distinct for
    distinct indices (`VectorSpace.signs(probe_seeds(key, i))` are `sign_probes(key, i)`
    leaf by leaf)."""
    return mix_words(lax.bitwise_xor(key_seed(key), mix_words(lax.add(words(indices), GOLDEN))))


@one_program(static=("n", "dtype"))
def sign_probes(key: jax.Array, indices: Any, n: int, dtype: Any) -> jax.Array:
    """Probes `indices` of `key` (an array of probe numbers, any shape), each `n` random
    signs (+1 or -1, each with probability 1/2) in `dtype`, along a last axis of `n`.
    Distinct indices of one key have distinct seeds, and an entry is the top bit of a
    hash of its position and its probe's seed, mixed twice."""
    indices = words(indices)
    seeds = probe_seeds(key, indices)
    shape = (*indices.shape, n)
    seeds = lax.broadcast_in_dim(seeds, shape, tuple(range(indices.ndim)))
    positions = lax.mul(lax.broadcasted_iota(jnp.uint32, shape, indices.ndim), GOLDEN)
    bits = mix_words(lax.add(mix_words(lax.bitwise_xor(positions, seeds)), seeds))
    top = lax.shift_right_logical(bits, np.uint32(31))  # 0 or 1
    return lax.convert_element_type(1 - 2 * lax.convert_element_type(top, jnp.int32), dtype)
