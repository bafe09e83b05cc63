"""`KFAC` and `EKFAC` of a table added by position (a learned positional embedding,
`h + pos[:T]`): a lookup of each row's position, one row per example and position,
against a reference that reads the gradients at the sum and against the exact
Gauss-Newton block where KFAC is exact."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

_SQUARED = zm.losses.SquaredError()  # half the squared error: its Hessian's root is I
V, P, D, OUT = 6, 9, 3, 2  # vocabulary, table's positions, width, outputs


def normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def factors_of(F, name):
    (k,) = [k for k, block in enumerate(F.blocks) if block.names[0] == name]
    return np.asarray(F.input_factors[k]), np.asarray(F.gradient_factors[k])


def params_of():
    return {"emb": normal(0, (V, D)), "pos": normal(1, (P, D)), "w": normal(2, (D, OUT))}


def sequences(n, t, seed=3):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (n, t)))


def _rows(tokens, which):
    """The table's rows used at each position: `[:T]`, or every other from the second."""
    T = tokens.shape[-1]
    return slice(0, T) if which == "first" else slice(1, 1 + 2 * T, 2)


def batched(params, tokens, targets, which="first", added=0.0):
    """`(N, T)` tokens to `(N, T, OUT)`; `added` is added where the table is."""
    table = params["pos"][_rows(tokens, which)]
    hidden = jnp.tanh(params["emb"][tokens] + table + added)
    return hidden @ params["w"]


def per_sequence(params, tokens, targets, which="first"):
    """The same model written for one sequence and mapped over the batch, as an
    `eqx.Module`'s `__call__` is: the table is broadcast over the sequences by `vmap`."""
    return jax.vmap(lambda ids: batched(params, ids, None, which))(tokens)


def reference(params, tokens, which):
    """The expand factors of the table: inputs the one-hot rows of each position's row,
    gradients those at the sum, each `(n, t)` a row."""
    N, T = tokens.shape
    zero = jnp.zeros((N, T, D))
    outputs, pullback = jax.vjp(lambda a: batched(params, tokens, None, which, a), zero)
    columns = jnp.eye(OUT)
    (g,) = jax.vmap(lambda c: pullback(jnp.broadcast_to(c, outputs.shape)))(columns)
    g = np.asarray(g).reshape(OUT, -1, D)
    rows = np.arange(P)[_rows(tokens, which)]
    onehot = np.eye(P)[np.broadcast_to(rows, (N, T)).reshape(-1)]
    return onehot.T @ onehot / (N * T), np.einsum("cri,crj->ij", g, g)


@pytest.mark.parametrize("which", ["first", "strided"])
@pytest.mark.parametrize("fn", [batched, per_sequence], ids=["batched", "per-sequence"])
def test_a_table_added_by_position_is_a_lookup_of_each_rows_position(fn, which):
    params, tokens = params_of(), sequences(4, 3)
    targets = normal(4, (4, 3, OUT))
    F = zm.KFAC(lambda p, x, y: fn(p, x, y, which), _SQUARED)(params, tokens, targets)
    assert ("['pos']",) in [block.names for block in F.blocks]
    A, B = factors_of(F, "['pos']")
    A_expected, B_expected = reference(params, tokens, which)
    np.testing.assert_allclose(A, A_expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(B, B_expected, rtol=1e-10, atol=1e-12)


def test_kfac_of_a_table_is_its_exact_block_where_the_model_is_linear_in_it():
    # out[n, t] = x[n, t] @ w + pos[t]: each position's Jacobian is the identity, every
    # example's loss Hessian the same, so B ⊗ A is the exact block.
    def model(params, inputs, targets):
        return inputs @ params["w"] + params["pos"][: inputs.shape[1]]

    params = {"w": normal(0, (3, OUT)), "pos": normal(1, (5, OUT))}
    inputs, targets = normal(2, (4, 3, 3)), normal(3, (4, 3, OUT))
    F = zm.KFAC(model, _SQUARED)(params, inputs, targets)
    exact = np.asarray(zm.BatchedGGN(model, _SQUARED)(params, inputs, targets))
    ours = np.asarray(F.as_matrix())
    names = [block.names for block in F.blocks]
    assert names == [("['pos']",), ("['w']",)]
    block = slice(0, 5 * OUT)  # the table's leaf is first in the variables' order
    np.testing.assert_allclose(ours[block, block], exact[block, block], atol=1e-10)


def test_ekfac_finds_the_examples_of_a_table_added_by_position():
    params, tokens = params_of(), sequences(5, 4)
    targets = normal(4, (5, 4, OUT))
    exact = np.asarray(zm.BatchedGGN(per_sequence, _SQUARED)(params, tokens, targets))
    kfac = zm.KFAC(per_sequence, _SQUARED)(params, tokens, targets)
    ekfac = zm.EKFAC(per_sequence, _SQUARED)(params, tokens, targets)
    for F in (kfac, ekfac):
        matrix = np.asarray(F.as_matrix())
        np.testing.assert_allclose(matrix, matrix.T, atol=1e-12)
        assert np.linalg.eigvalsh(matrix).min() > -1e-10
    far = np.linalg.norm(np.asarray(kfac.as_matrix()) - exact)
    assert np.linalg.norm(np.asarray(ekfac.as_matrix()) - exact) <= far * (1 + 1e-10)


def test_a_positional_embedding_module_is_read_as_a_layer():
    class Tiny(eqx.Module):
        tokens: eqx.nn.Embedding
        positions: eqx.nn.Embedding
        head: eqx.nn.Linear

        def __call__(self, ids):
            h = self.tokens.weight[ids] + self.positions.weight[: ids.shape[0]]
            return jax.vmap(self.head)(jnp.tanh(h))

    keys = jax.random.split(jax.random.key(0), 3)
    model = Tiny(
        eqx.nn.Embedding(V, D, key=keys[0]),
        eqx.nn.Embedding(P, D, key=keys[1]),
        eqx.nn.Linear(D, OUT, key=keys[2]),
    )
    tokens, targets = sequences(3, 4), normal(5, (3, 4, OUT))
    F = zm.KFAC(lambda m, x, y: jax.vmap(m)(x), _SQUARED)(model, tokens, targets)
    names = [block.names for block in F.blocks]
    assert names == [(".tokens.weight",), (".positions.weight",), (".head.weight", ".head.bias")]
    A, _ = factors_of(F, ".positions.weight")
    np.testing.assert_allclose(np.diag(A), [0.25] * 4 + [0.0] * (P - 4), atol=1e-12)


def test_two_tables_added_at_once_keep_their_exact_blocks():
    def model(params, inputs, targets):
        return inputs @ params["w"] + (params["a"] + params["b"])

    params = {"a": normal(0, (3, OUT)), "b": normal(1, (3, OUT)), "w": normal(2, (4, OUT))}
    inputs, targets = normal(3, (5, 3, 4)), normal(4, (5, 3, OUT))
    F = zm.KFAC(model, _SQUARED)(params, inputs, targets)
    exact = np.asarray(zm.BatchedGGN(model, _SQUARED)(params, inputs, targets))
    ours = np.asarray(F.as_matrix())
    for block in (slice(0, 3 * OUT), slice(3 * OUT, 6 * OUT)):  # `a`'s and `b`'s: exact
        np.testing.assert_allclose(ours[block, block], exact[block, block], atol=1e-10)
    a_and_b = exact[: 3 * OUT, 3 * OUT : 6 * OUT]
    assert np.abs(a_and_b).max() > 0.1  # KFAC leaves their coupling out
    np.testing.assert_allclose(ours[: 3 * OUT, 3 * OUT : 6 * OUT], 0.0)


class _RunningSum(eqx.Module):
    """A linear layer, then each position the sum of those before it and itself: the
    output at position `t`, one loss term, is reached from every position `p <= t`."""

    weight: jax.Array

    def __call__(self, x):
        return jnp.cumsum(x @ self.weight.T, axis=0)


@pytest.mark.parametrize("cls", [zm.KFAC, zm.EKFAC])
def test_type_2_keeps_no_products_between_the_loss_terms_a_position_reaches(cls):
    """Type-2's columns go back for all the loss terms at once. With a sign of its own
    for each term and column, a position's gradient factor sums each term's own outer
    products (what the Gauss-Newton matrix holds), not the products between the terms
    that reach it: here, against a twin whose terms each reach one position, the
    gradient factor's diagonal is `(T + 1) / 2` times larger on average (the terms a
    position reaches, counted per term), where one backward pass without signs makes it
    `(T + 1)(2T + 1) / 6` (the square of that count: 93.5 against 8.5 here). The signs
    are fixed (hashed from the indices), so the test is deterministic; for signs drawn
    at random, the mean over 8 columns of 64 sequences of 16 positions deviates from
    its expectation by 4.8% (one standard deviation), and in 20,000 simulated draws
    never by the quarter this test allows (at most 19%)."""
    n, T, width, out = 64, 16, 3, 8
    x = normal(5, (n, T, width))
    targets = jnp.zeros((n * T, out))

    def predict(model, x, targets):
        return jax.vmap(model)(x).reshape(-1, out)

    def twin(model, x, targets):
        return jax.vmap(lambda s: s @ model.weight.T)(x).reshape(-1, out)

    model = _RunningSum(normal(6, (out, width)))
    mixing = np.asarray(cls(predict, _SQUARED)(model, x, targets).gradient_factors[0])
    alone = np.asarray(cls(twin, _SQUARED)(model, x, targets).gradient_factors[0])
    ratio = np.mean(np.diag(mixing) / np.diag(alone))
    np.testing.assert_allclose(ratio, (T + 1) / 2, rtol=1 / 4)
    np.testing.assert_allclose(mixing - np.diag(np.diag(mixing)), 0, atol=1e-12)
