"""KFAC's blocks of the leaves in no layer (a normalisation's scale and offset) are their
exact Gauss-Newton blocks, taken from each example's gradients where each example's
outputs are one loss term and from the Hessian's products otherwise, against
`zm.BatchedGGN` in float64."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")


class Normed(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(jnp.tanh(self.norm(x)))


def normed():
    model = Normed(eqx.nn.LayerNorm(4), eqx.nn.Linear(4, 3, key=jax.random.key(0)))
    scale = jnp.asarray([1.5, 0.5, 2.0, 1.0])
    model = eqx.tree_at(lambda m: (m.norm.weight, m.norm.bias), model, (scale, 0.1 * scale))
    return jax.tree_util.tree_map(
        lambda leaf: leaf.astype(jnp.float64) if eqx.is_inexact_array(leaf) else leaf, model
    )


def normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def dense_part(F, G, size):
    """The leaves in no layer are the model's first: their blocks, KFAC's and exact."""
    return np.asarray(F.as_matrix())[:size, :size], np.asarray(G)[:size, :size]


def per_example(model, inputs, labels):
    return jax.vmap(model)(inputs)


def per_position(model, inputs, labels):
    return jax.vmap(jax.vmap(model))(inputs)


@pytest.mark.parametrize("options", [{}, {"microbatch_size": 3}, {"max_memory": "1GB"}])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_each_examples_gradients_give_the_exact_blocks(options, reduction):
    loss = zm.losses.SoftmaxCrossEntropy(reduction=reduction)
    inputs, labels = normal(1, (7, 4)), jnp.arange(7) % 3
    F = zm.KFAC(per_example, loss, **options)(normed(), inputs, labels)
    G = zm.BatchedGGN(per_example, loss)(normed(), inputs, labels)
    assert [block.names for block in F.blocks][:2] == [(".norm.weight",), (".norm.bias",)]
    ours, exact = dense_part(F, G, 8)
    close(ours[:4, :4], exact[:4, :4])
    close(ours[4:, 4:], exact[4:, 4:])
    close(ours[:4, 4:], np.zeros((4, 4)))  # blocks of different leaves are not coupled


@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
def test_several_terms_an_example_take_the_products(fisher):
    # Outputs (N, T, C): every position a loss term, whose columns the square root shares.
    loss = zm.losses.SoftmaxCrossEntropy()
    inputs, labels = normal(1, (5, 3, 4)), jnp.arange(15).reshape(5, 3) % 3
    key = jax.random.key(2) if fisher == "mc" else None
    F = zm.KFAC(per_position, loss, fisher=fisher, key=key)(normed(), inputs, labels)
    G = zm.BatchedGGN(per_position, loss)(normed(), inputs, labels)
    ours, exact = dense_part(F, G, 8)
    close(ours[:4, :4], exact[:4, :4])  # exact, whatever `fisher` says
    close(ours[4:, 4:], exact[4:, 4:])


def test_arrays_of_another_length_pass_whole_and_a_program_of_fixed_batch_takes_products():
    loss = zm.losses.SquaredError()
    inputs, targets, shift = normal(1, (6, 4)), normal(2, (6, 3)), normal(3, (4,))

    def shifted(model, inputs, shift, targets):
        return jax.vmap(model)(inputs + shift)

    def fixed(model, inputs, shift, targets):  # fails on one example: (6, 4) read from it
        return jax.vmap(model)(inputs.reshape(6, 4) + shift)

    G = zm.BatchedGGN(shifted, loss)(normed(), inputs, shift, targets)
    for fn in (shifted, fixed):
        F = zm.KFAC(fn, loss)(normed(), inputs, shift, targets)
        ours, exact = dense_part(F, G, 8)
        close(ours[:4, :4], exact[:4, :4])
        close(ours[4:, 4:], exact[4:, 4:])
