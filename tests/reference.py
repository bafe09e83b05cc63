"""Reference computations shared by the derivative tests."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


def close(actual, expected, rtol=1e-12, atol=1e-12):
    """Compare pytrees leaf by leaf: same structure, shapes and values."""
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def raveled(fn, x, *args, **kwargs):
    """The reference: `fn` as a function of the flat inexact leaves of `x`, and that vector."""
    params, fixed = eqx.partition(x, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)

    def fn_of_flat(z):
        return fn(eqx.combine(unravel(z), fixed), *args, **kwargs)

    return fn_of_flat, flat


def make_mlp(in_size, out_size, width, depth, seed=0):
    """An `eqx.nn.MLP` in float64 with random weights, built without tracing its init."""
    shapes = eqx.filter_eval_shape(
        eqx.nn.MLP, in_size, out_size, width, depth, key=jax.random.key(0), dtype=jnp.float64
    )
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jnp.asarray(rng.uniform(-1, 1, leaf.shape), leaf.dtype)
        return leaf

    return jax.tree_util.tree_map(fill, shapes)
