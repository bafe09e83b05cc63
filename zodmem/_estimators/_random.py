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

__all__ = ["hashed_bits", "key_seed", "sign_probes"]

# The golden ratio's fraction of 2**32: consecutive multiples of it are spread evenly.
_GOLDEN = np.uint32(0x9E3779B9)


def _mix(x: jax.Array) -> jax.Array:
    """A bijection of 32-bit words in which every output bit depends on every input bit
    (an xorshift-multiply finaliser), in `lax`'s operations: tracing it under `vmap` or
    in a long program costs little."""
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 0x2C1B3C6D)):
        x = lax.mul(
            lax.bitwise_xor(x, lax.shift_right_logical(x, np.uint32(shift))), np.uint32(factor)
        )
    return lax.bitwise_xor(x, lax.shift_right_logical(x, np.uint32(16)))


def _words(value: Any) -> jax.Array:
    return lax.convert_element_type(jnp.asarray(value), jnp.uint32)


def hashed_bits(n: int, stream: Any, seed: Any = 0) -> jax.Array:
    """`n` pseudo-random 32-bit words, an integer hash of (index, stream, seed)."""
    x = lax.mul(lax.iota(jnp.uint32, n), _GOLDEN)
    x = lax.add(x, lax.mul(_words(stream), np.uint32(0x85EBCA6B)))
    x = lax.add(x, lax.add(lax.mul(_words(seed), np.uint32(0xC2B2AE35)), np.uint32(0x27D4EB2F)))
    return _mix(x)


def key_seed(key: jax.Array) -> jax.Array:
    """One 32-bit word that depends on every word of `key` (a typed `jax.random.key` or
    a raw `PRNGKey`)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = _words(jnp.ravel(key))
    seed = jnp.asarray(np.uint32(0x165667B1))
    for k in range(words.shape[0]):
        seed = _mix(lax.bitwise_xor(seed, words[k]))
    return seed


def sign_probes(key: jax.Array, indices: Any, n: int, dtype: Any) -> jax.Array:
    """Probes `indices` of `key` (an array of probe numbers, any shape), each `n` random
    signs (+1 or -1, each with probability 1/2) in `dtype`, along a last axis of `n`.
    Distinct indices of one key have distinct seeds, and an entry is the top bit of a
    hash of its position and its probe's seed, mixed twice."""
    indices = _words(indices)
    seeds = _mix(lax.bitwise_xor(key_seed(key), _mix(lax.add(indices, _GOLDEN))))
    shape = (*indices.shape, n)
    seeds = lax.broadcast_in_dim(seeds, shape, tuple(range(indices.ndim)))
    positions = lax.mul(lax.broadcasted_iota(jnp.uint32, shape, indices.ndim), _GOLDEN)
    bits = _mix(lax.add(_mix(lax.bitwise_xor(positions, seeds)), seeds))
    top = lax.shift_right_logical(bits, np.uint32(31))  # 0 or 1
    return lax.convert_element_type(1 - 2 * lax.convert_element_type(top, jnp.int32), dtype)
