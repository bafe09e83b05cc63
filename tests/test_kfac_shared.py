"""`KFAC` and `EKFAC` of weights used more than once: a tied embedding (a row lookup and
the head's `h @ emb.T`), a layer applied twice, and a recurrent cell inside `lax.scan`,
against references that read each use's inputs and output gradients, against the exact
Gauss-Newton matrix where KFAC is exact, and against curvlinops' `KFACLinearOperator`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import built_kfac_factors

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

_SQUARED = zm.losses.SquaredError()  # half the squared error: its Hessian's root is I


def normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def factors_of(F, name):
    """The input and gradient factors of the block whose first leaf is `name`."""
    (k,) = [k for k, block in enumerate(F.blocks) if block.names[0] == name]
    return np.asarray(F.input_factors[k]), np.asarray(F.gradient_factors[k])


# -- a tied embedding: a lookup and the head ------------------------------------------------


def tied(params, tokens, targets, lookup=0.0, head=0.0):
    """Tokens `(N, T)` to logits `(N, T, V)` through one table `(V, D)`; `lookup` and
    `head` are added to the two uses' outputs (the reference reads their gradients)."""
    hidden = jnp.tanh(params["emb"][tokens] + lookup)
    return hidden @ params["emb"].T + head


def tied_problem():
    V, D, N, T = 7, 3, 4, 2
    params = {"emb": normal(0, (V, D))}
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (N, T)))
    return params, tokens, normal(2, (N, T, V))


def tied_reference(params, tokens, targets):
    """The expand factors of each use in its own layout: the lookup reads the table as
    `(out=D, in=V)`, the head as `(out=V, in=D)`; in the lookup's layout the head's
    Kronecker product is `(its inputs' moment) ⊗ (its gradients' moment)`. The layer's
    product is the one nearest their sum in the Frobenius norm, from the SVD of the sum
    rearranged (Van Loan and Pitsianis), returned as the `(D·V, D·V)` matrix `B ⊗ A`."""
    V, D = params["emb"].shape

    @jax.jit  # one program rather than one per operation
    def use_gradients(params, tokens, targets):
        zeros = (jnp.zeros(tokens.shape + (D,)), jnp.zeros(tokens.shape + (V,)))
        outputs, pullback = jax.vjp(lambda p, q: tied(params, tokens, targets, p, q), *zeros)
        columns = jnp.eye(V)  # the squared error's Hessian's root, per position
        return jax.vmap(lambda c: pullback(jnp.broadcast_to(c, outputs.shape)))(columns)

    g_lookup, g_head = use_gradients(params, tokens, targets)
    onehot = np.asarray(jax.nn.one_hot(tokens, V)).reshape(-1, V)
    hidden = np.tanh(np.asarray(params["emb"])[np.asarray(tokens)]).reshape(-1, D)
    g_lookup = np.asarray(g_lookup).reshape(V, -1, D)
    g_head = np.asarray(g_head).reshape(V, -1, V)
    R = onehot.shape[0]
    A1, B1 = onehot.T @ onehot / R, np.einsum("cri,crj->ij", g_lookup, g_lookup)
    A2, B2 = np.einsum("cri,crj->ij", g_head, g_head), hidden.T @ hidden / R
    rearranged = np.outer(B1.ravel(), A1.ravel()) + np.outer(B2.ravel(), A2.ravel())
    u, sigma, vt = np.linalg.svd(rearranged)
    B, A = sigma[0] * u[:, 0].reshape(D, D), vt[0].reshape(V, V)
    return np.kron(B, A), np.kron(B1, A1), np.kron(B2, A2)


def test_a_tied_embedding_is_one_layer_the_kronecker_product_nearest_its_uses():
    params, tokens, targets = tied_problem()
    F = zm.KFAC(tied, _SQUARED)(params, tokens, targets)
    assert [block.names for block in F.blocks] == [("['emb']",)]
    A, B = factors_of(F, "['emb']")
    nearest, lookup, head = tied_reference(params, tokens, targets)
    np.testing.assert_allclose(np.kron(B, A), nearest, rtol=1e-9, atol=1e-12)
    # Both factors positive semi-definite, and the product no further from the uses'
    # sum than either use's product alone.
    assert np.linalg.eigvalsh(A).min() > -1e-12 and np.linalg.eigvalsh(B).min() > -1e-12
    error = np.linalg.norm(np.kron(B, A) - (lookup + head))
    assert error <= min(np.linalg.norm(lookup), np.linalg.norm(head))


def test_a_weight_used_on_two_independent_terms_is_exact():
    # Two uses, each its own loss term: as one product over two positions, exact.
    def twice(params, inputs, targets):
        first, second = inputs[:, 0] @ params["w"], inputs[:, 1] @ params["w"]
        return jnp.stack([first, second], axis=1)

    params = {"w": normal(0, (3, 2))}
    inputs, targets = normal(1, (5, 2, 3)), normal(2, (5, 2, 2))
    F = zm.KFAC(twice, _SQUARED)(params, inputs, targets)
    G = zm.BatchedGGN(twice, _SQUARED)(params, inputs, targets)
    np.testing.assert_allclose(F.as_matrix(), G, rtol=1e-10, atol=1e-12)


def test_ekfac_of_a_tied_model_is_never_further_from_the_exact_matrix_than_kfac():
    def model(params, tokens, targets):
        hidden = jnp.tanh(params["emb"][tokens] @ params["w"] + params["b"])
        return hidden @ params["emb"].T

    V, D = 5, 3
    params = {"emb": normal(0, (V, D)), "w": normal(1, (D, D)), "b": normal(2, (D,))}
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, V, (6,)))
    targets = normal(4, (6, V))
    exact = zm.BatchedGGN(model, _SQUARED)(params, tokens, targets)
    kfac = zm.KFAC(model, _SQUARED)(params, tokens, targets)
    ekfac = zm.EKFAC(model, _SQUARED)(params, tokens, targets)
    assert [block.names for block in kfac.blocks] == [("['emb']",), ("['w']", "['b']")]
    for F in (kfac, ekfac):
        matrix = F.as_matrix()
        np.testing.assert_allclose(matrix, matrix.T, atol=1e-12)
        assert np.linalg.eigvalsh(matrix).min() > -1e-10
    far = np.linalg.norm(kfac.as_matrix() - exact)
    assert np.linalg.norm(ekfac.as_matrix() - exact) <= far * (1 + 1e-10)


# -- a recurrent cell in lax.scan ------------------------------------------------------------


def gru_predict(cell, inputs, targets):
    """Sequences `(N, T, 4)` to the last hidden state `(N, 8)` of a GRU scanned over T."""

    def sequence(xs):
        last, _ = jax.lax.scan(lambda h, x: (cell(x, h), None), jnp.zeros(8), xs)
        return last

    return jax.vmap(sequence)(inputs)


@eqx.filter_jit
def gru_rows(cell, inputs):
    """Each step's hidden state read by the cell, and the gradients of the last state's
    columns with respect to the two products' outputs each step, read with `jax.vjp`
    through the cell written step by step with perturbations at the products."""
    N, T, _ = inputs.shape

    def unrolled(p_ih, p_hh):
        hidden, seen = jnp.zeros((N, 8)), []
        for t in range(T):
            seen.append(hidden)
            i = jnp.split(inputs[:, t] @ cell.weight_ih.T + cell.bias + p_ih[t], 3, axis=1)
            h = jnp.split(hidden @ cell.weight_hh.T + p_hh[t], 3, axis=1)
            reset, update = jax.nn.sigmoid(i[0] + h[0]), jax.nn.sigmoid(i[1] + h[1])
            new = jnp.tanh(i[2] + reset * (h[2] + cell.bias_n))
            hidden = new + update * (hidden - new)
        return hidden, jnp.stack(seen)

    zeros = (jnp.zeros((T, N, 24)), jnp.zeros((T, N, 24)))
    outputs, pullback, states = jax.vjp(unrolled, *zeros, has_aux=True)
    columns = jnp.eye(8)  # the squared error's Hessian's root
    g_ih, g_hh = jax.vmap(lambda c: pullback(jnp.broadcast_to(c, outputs.shape)))(columns)
    return states, g_ih, g_hh


def gru_reference(cell, inputs, approx):
    """The two weights' factors from each step's rows, in NumPy."""
    N, T, _ = inputs.shape
    states, g_ih, g_hh = (np.asarray(value) for value in gru_rows(cell, inputs))
    x = np.concatenate([np.moveaxis(np.asarray(inputs), 1, 0), np.ones((T, N, 1))], axis=-1)
    result = {}
    for name, a, g in (("ih", x, g_ih), ("hh", states, g_hh)):
        if approx == "expand":  # every step's rows are rows
            A = np.einsum("tni,tnj->ij", a, a) / (T * N)
            B = np.einsum("ctni,ctnj->ij", g, g)
        else:  # per example, the inputs' mean and the gradients' sum over the steps
            mean, total = a.mean(0), g.sum(1)
            A, B = mean.T @ mean / N, np.einsum("cni,cnj->ij", total, total)
        result[name] = (A, B)
    return result


@pytest.fixture
def gru(float64):
    cell = jax.tree_util.tree_map(
        lambda leaf: leaf.astype(jnp.float64) if eqx.is_inexact_array(leaf) else leaf,
        eqx.nn.GRUCell(4, 8, key=jax.random.key(0)),
    )
    return cell, normal(1, (3, 5, 4)), normal(2, (3, 8))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_a_gru_in_a_scan_has_its_steps_as_positions(gru, approx):
    cell, inputs, targets = gru
    F = zm.KFAC(gru_predict, _SQUARED, kfac_approx=approx)(cell, inputs, targets)
    names = [block.names for block in F.blocks]
    assert names == [(".weight_ih", ".bias"), (".weight_hh",), (".bias_n",)]
    expected = gru_reference(cell, inputs, approx)
    for name in ("ih", "hh"):
        A, B = factors_of(F, f".weight_{name}")
        for factor in (A, B):  # symmetric PSD factors: a symmetric PSD block
            np.testing.assert_allclose(factor, factor.T, atol=1e-12)
            assert np.linalg.eigvalsh(factor).min() > -1e-10
        np.testing.assert_allclose(A, expected[name][0], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(B, expected[name][1], rtol=1e-9, atol=1e-12)


def test_ekfac_runs_through_a_scan(gru):
    cell, inputs, targets = gru
    exact = zm.BatchedGGN(gru_predict, _SQUARED)(cell, inputs, targets)
    kfac = zm.KFAC(gru_predict, _SQUARED)(cell, inputs, targets).as_matrix()
    ekfac = zm.EKFAC(gru_predict, _SQUARED)(cell, inputs, targets).as_matrix()
    assert np.linalg.eigvalsh(ekfac).min() > -1e-10
    assert np.linalg.norm(ekfac - exact) <= np.linalg.norm(kfac - exact) * (1 + 1e-10)


def test_a_fori_loop_is_its_steps_written_out():
    # A scan's steps are uses like those of the same layer written out three times.
    def looped(params, inputs, targets):
        def step(i, h):
            return jnp.tanh(h @ params["w"] + params["b"])

        return jax.lax.fori_loop(0, 3, step, inputs)

    def written(params, inputs, targets):
        for _ in range(3):
            inputs = jnp.tanh(inputs @ params["w"] + params["b"])
        return inputs

    params = {"w": normal(0, (3, 3)), "b": normal(1, (3,))}
    inputs, targets = normal(2, (4, 3)), normal(3, (4, 3))
    for approx in ("expand", "reduce"):
        F = zm.KFAC(looped, _SQUARED, kfac_approx=approx)(params, inputs, targets)
        G = zm.KFAC(written, _SQUARED, kfac_approx=approx)(params, inputs, targets)
        assert [block.names for block in F.blocks] == [("['w']", "['b']")]
        np.testing.assert_allclose(F.as_matrix(), G.as_matrix(), rtol=1e-10, atol=1e-12)


def test_uses_whose_layouts_cannot_agree_are_refused_by_name():
    # Read as (out=(0, 1), in=2) and as (out=0, in=(1, 2)): no one matrix for both.
    def model(params, inputs, targets):
        first = jnp.tanh(jnp.einsum("abc,nc->nab", params["w"], inputs)).mean(1)
        return jnp.einsum("abc,nbc->na", params["w"], first[:, :, None] * inputs[:, None, :])

    params = {"w": normal(0, (16, 16, 17))}
    inputs, targets = normal(1, (2, 17)), normal(2, (2, 16))
    with pytest.raises(ValueError, match=r"x\['w'\] of shape \(16, 16, 17\) is a weight used"):
        zm.KFAC(model, _SQUARED)(params, inputs, targets)


# -- against curvlinops ---------------------------------------------------------------------


def as64(tree):
    return jax.tree_util.tree_map(
        lambda leaf: leaf.astype(jnp.float64) if eqx.is_inexact_array(leaf) else leaf, tree
    )


def curvlinops_factors(torch_model, inputs, targets, approx):
    """curvlinops' factors per layer (in order) and dense matrix, in float64, of the
    summed squared error (`torch.nn.MSELoss(reduction="sum")`, `SquaredError(weights=2.0)`)."""
    torch = pytest.importorskip("torch")
    curvlinops = pytest.importorskip("curvlinops")
    params = [p for p in torch_model.parameters()]
    data = [(torch.tensor(np.asarray(inputs)), torch.tensor(np.asarray(targets)))]
    operator = curvlinops.KFACLinearOperator(
        torch_model,
        torch.nn.MSELoss(reduction="sum"),
        params,
        data,
        fisher_type="type-2",
        kfac_approx=approx,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    return built_kfac_factors(operator, params)


def torch_copy(ours):
    """A `torch.nn.Linear` holding an `eqx.nn.Linear`'s weight and bias, in float64."""
    torch = pytest.importorskip("torch")
    theirs = torch.nn.Linear(ours.in_features, ours.out_features).double()
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(np.asarray(ours.weight)))
        theirs.bias.copy_(torch.tensor(np.asarray(ours.bias)))
    return theirs


def two_linears():
    keys = jax.random.split(jax.random.key(5))
    return as64((eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.Linear(4, 2, key=keys[1])))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_a_linear_applied_to_two_positions_matches_curvlinops_over_the_positions(approx):
    # Ours applies the inner layer twice; curvlinops' once to a sequence of the two
    # positions, its weight-sharing axis: the same factors, for "expand" and "reduce".
    torch = pytest.importorskip("torch")

    def twice(model, inputs, targets):
        inner, head = model
        first, second = jax.vmap(inner)(inputs[:, 0]), jax.vmap(inner)(inputs[:, 1])
        hidden = jnp.tanh(jnp.stack([first, second], axis=1))
        return jax.vmap(jax.vmap(head))(hidden)

    def once(model, inputs, targets):  # the positions in one product each
        inner, head = model
        return jax.vmap(jax.vmap(lambda x: head(jnp.tanh(inner(x)))))(inputs)

    model, inputs, targets = two_linears(), normal(0, (5, 2, 3)), normal(1, (5, 2, 2))
    torch_model = torch.nn.Sequential(torch_copy(model[0]), torch.nn.Tanh(), torch_copy(model[1]))
    A, B, matrix = curvlinops_factors(torch_model, inputs, targets, approx)
    for fn in (twice, once):
        kfac = zm.KFAC(fn, zm.losses.SquaredError(weights=2.0), kfac_approx=approx)
        F = kfac(model, inputs, targets)
        for ours, theirs in zip(F.input_factors, A, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-9)
        for ours, theirs in zip(F.gradient_factors, B, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(F.as_matrix(), matrix, rtol=1e-6, atol=1e-9)


def test_a_linear_applied_twice_in_a_row_is_curvlinops_with_its_uses_as_rows():
    # curvlinops adds the two calls' factors, each input factor a mean over its call's
    # rows; ours is the mean over the rows of both uses: half its input factor.
    torch = pytest.importorskip("torch")

    def again(model, inputs, targets):
        inner, head = model
        return jax.vmap(lambda x: head(jnp.tanh(inner(jnp.tanh(inner(x))))))(inputs)

    keys = jax.random.split(jax.random.key(6))
    model = as64((eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 2, key=keys[1])))
    inputs, targets = normal(0, (6, 3)), normal(1, (6, 2))
    F = zm.KFAC(again, zm.losses.SquaredError(weights=2.0))(model, inputs, targets)
    inner, head = torch_copy(model[0]), torch_copy(model[1])
    torch_model = torch.nn.Sequential(inner, torch.nn.Tanh(), inner, torch.nn.Tanh(), head)
    A, B, _ = curvlinops_factors(torch_model, inputs, targets, "expand")
    np.testing.assert_allclose(2 * F.input_factors[0], A[0], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(F.input_factors[1], A[1], rtol=1e-6, atol=1e-9)
    for ours, theirs in zip(F.gradient_factors, B, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-9)


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [zm.KFAC, zm.EKFAC])
def test_a_bad_kfac_approx_is_refused_in_words(cls):
    with pytest.raises((TypeError, ValueError), match="kfac_approx.*'expand', 'reduce'"):
        cls(gru_predict, _SQUARED, kfac_approx="average")


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_a_tied_embedding_of_a_mean_loss_in_microbatches_is_the_whole_batch(approx):
    params, tokens, targets = tied_problem()
    loss = zm.losses.SquaredError(reduction="mean")
    whole = zm.KFAC(tied, loss, kfac_approx=approx)(params, tokens, targets)
    parts = zm.KFAC(tied, loss, kfac_approx=approx, microbatch_size=3)(params, tokens, targets)
    np.testing.assert_allclose(parts.as_matrix(), whole.as_matrix(), rtol=1e-10, atol=1e-12)
    summed = zm.KFAC(tied, _SQUARED, kfac_approx=approx)(params, tokens, targets)
    np.testing.assert_allclose(whole.as_matrix(), summed.as_matrix() / 4, rtol=1e-10)


def test_kfac_approx_is_saved_and_loaded(tmp_path):
    kfac = zm.KFAC(tied, _SQUARED, kfac_approx="reduce")
    assert kfac.config["kfac_approx"] == "reduce"
    zm.save(tmp_path / "kfac.zm", kfac)
    assert zm.load(tmp_path / "kfac.zm").config == kfac.config
