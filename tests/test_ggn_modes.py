"""`BatchedGGN`'s modes on a model that forward mode refuses: a `jax.custom_vjp` function
inside `fn` is taken by reverse mode, and `mode="fwd"` refuses it in words."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

REFUSAL = (
    r"BatchedGGN: mode='fwd' takes forward-mode derivatives \(JVPs\) of `fn`, but `fn` calls "
    r"a function with a `jax\.custom_vjp` rule.*Pass mode='rev'"
)


@jax.custom_vjp
def squash(z):
    return jnp.tanh(z)


def _squash_fwd(z):
    return jnp.tanh(z), jnp.tanh(z)


def _squash_bwd(t, g):
    return (g * (1 - t**2),)


squash.defvjp(_squash_fwd, _squash_bwd)


def model(params, inputs, targets):
    return squash(inputs @ params["w"] + params["b"])


def point(b_dtype=jnp.float64):
    params = {"w": jnp.asarray([0.5, -0.25, 1.0]), "b": jnp.asarray(0.1, b_dtype)}
    inputs = jnp.asarray(np.cos(np.arange(12.0).reshape(4, 3)))
    return params, inputs, jnp.zeros(4)


@pytest.mark.parametrize("strategy", ["linearize", "recompute"])
@pytest.mark.parametrize("how", ["call", "filter_jit", "operator"])
def test_fwd_mode_refuses_a_custom_vjp_function_in_words(strategy, how):
    G = zm.BatchedGGN(model, zm.losses.SquaredError(), mode="fwd", strategy=strategy)
    params, inputs, targets = point()
    with pytest.raises(TypeError, match=REFUSAL):
        if how == "operator":
            G.operator(params, inputs, targets).mv(jnp.ones(4))
        else:
            (eqx.filter_jit(G) if how == "filter_jit" else G)(params, inputs, targets)


def test_auto_mode_takes_a_custom_vjp_function_by_reverse_mode():
    loss = zm.losses.SquaredError()
    # Leaves of one dtype, and of two (where "auto" tries forward mode first).
    for b_dtype in (jnp.float64, jnp.float32):
        params, inputs, targets = point(b_dtype)
        expected = zm.BatchedGGN(model, loss, mode="rev")(params, inputs, targets)
        close(zm.BatchedGGN(model, loss, batch_size=2)(params, inputs, targets), expected)
