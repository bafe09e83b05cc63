"""A function that `tests/serialise_wrapped.py` wraps from another module."""

import jax.numpy as jnp


def loss(x):
    return jnp.sum(jnp.sin(x) ** 2)
