"""`KFAC`, `EKFAC` and `KroneckerFactored`: layers found in the traced program, factors
against the exact Gauss-Newton matrix where KFAC is exact and against curvlinops'
`KFACLinearOperator` on the same weights and data, EKFAC's eigenvalues against the exact
matrix in its eigenbasis, and the operator's solves and log-determinant against the dense
matrix's."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import built_kfac_factors, close

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")


def as64(tree):
    return jax.tree_util.tree_map(
        lambda leaf: leaf.astype(jnp.float64) if eqx.is_inexact_array(leaf) else leaf, tree
    )


def predict(model, inputs, targets):
    return jax.vmap(model)(inputs)


def normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    linear: eqx.nn.Linear

    def __call__(self, image):
        return self.linear(jnp.tanh(self.conv(image)).reshape(-1))


@functools.cache
def mlp():
    """A float64 MLP, built once: the tests only read it."""
    return as64(eqx.nn.MLP(3, 4, 5, 2, activation=jnp.tanh, key=jax.random.key(0)))


def cnn():
    keys = jax.random.split(jax.random.key(1))
    conv = eqx.nn.Conv2d(2, 3, 3, stride=2, padding=1, key=keys[0])
    return as64(CNN(conv, eqx.nn.Linear(3 * 3 * 3, 4, key=keys[1])))


LABELS = jnp.asarray([0, 1, 2, 3, 0, 1, 2])


# -- where KFAC is exact --------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_linear_layer_with_squared_error_is_its_gauss_newton_matrix(reduction):
    layer = as64(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
    inputs, targets = normal(0, (7, 3)), normal(1, (7, 2))
    loss = zm.losses.SquaredError(weights=jnp.asarray([1.0, 3.0]), reduction=reduction)
    F = zm.KFAC(predict, loss)(layer, inputs, targets)
    assert [block.names for block in F.blocks] == [(".weight", ".bias")]
    close(F.as_matrix(), zm.BatchedGGN(predict, loss)(layer, inputs, targets))


def test_shared_weights_written_by_hand_through_jit_and_checkpoint():
    # `a @ w + b` over positions (weight sharing), the weight (in, out), under jit and remat.
    def fn(params, inputs, targets):
        layer = jax.checkpoint(jax.jit(lambda w, b, a: a @ w + b))
        return layer(params["w"], params["b"], inputs)

    params = {"w": normal(0, (3, 2)), "b": normal(1, (2,))}
    inputs, targets = normal(2, (5, 4, 3)), normal(3, (5, 4, 2))
    loss = zm.losses.SquaredError()
    F = zm.KFAC(fn, loss)(params, inputs, targets)
    assert [block.names for block in F.blocks] == [("['w']", "['b']")]
    G = zm.BatchedGGN(fn, loss)(params, inputs, targets)
    close(F.as_matrix(), G)
    # Each position a loss term of its own: EKFAC takes each row as an example, exactly.
    close(zm.EKFAC(fn, loss)(params, inputs, targets).as_matrix(), G, atol=1e-12)


def test_a_leaf_in_no_layer_is_its_exact_gauss_newton_block():
    def fn(params, inputs, labels):
        return params["scale"] * jnp.tanh(inputs @ params["w"].T)

    params = {"scale": jnp.asarray([1.5, 0.5, 2.0]), "w": normal(0, (3, 4))}
    inputs = normal(1, (6, 4))
    loss = zm.losses.SoftmaxCrossEntropy()
    F = zm.KFAC(fn, loss)(params, inputs, LABELS[:6] % 3)
    G = np.asarray(zm.BatchedGGN(fn, loss)(params, inputs, LABELS[:6] % 3))
    assert [block.names for block in F.blocks] == [("['scale']",), ("['w']",)]
    M = np.asarray(F.as_matrix())
    close(M[:3, :3], G[:3, :3])
    close(M[:3, 3:], np.zeros((3, 12)))


def test_an_embedding_is_a_layer_of_one_hot_rows():
    # With a squared error on the looked-up rows, KFAC of the lookup is exact.
    embedding = as64(eqx.nn.Embedding(10, 4, key=jax.random.key(0)))
    tokens, loss = jnp.asarray([1, 3, 3, 7, 0, 9, 1]), zm.losses.SquaredError()
    F = zm.KFAC(predict, loss)(embedding, tokens, jnp.zeros((7, 4)))
    assert [(block.names, block.in_size) for block in F.blocks] == [((".weight",), 10)]
    close(F.as_matrix(), zm.BatchedGGN(predict, loss)(embedding, tokens, jnp.zeros((7, 4))))


def test_a_large_leaf_in_no_layer_is_refused_by_name():
    def fn(params, inputs, targets):
        return inputs * jnp.sum(params["table"] ** 2)

    params = {"table": jnp.ones((65, 64))}
    with pytest.raises(ValueError, match=r"x\['table'\] of shape \(65, 64\) is in no layer"):
        zm.KFAC(fn, zm.losses.SquaredError())(params, jnp.ones((3, 2)), jnp.zeros((3, 2)))


# -- EKFAC ----------------------------------------------------------------------------------


def test_ekfac_eigenvalues_are_the_exact_matrix_in_its_eigenbasis_and_beat_kfac():
    layer = as64(eqx.nn.Linear(4, 3, key=jax.random.key(2)))
    inputs, loss = normal(0, (9, 4)), zm.losses.SoftmaxCrossEntropy()
    labels = jnp.asarray([0, 1, 2, 0, 1, 2, 0, 1, 2])
    G = np.asarray(zm.BatchedGGN(predict, loss)(layer, inputs, labels))
    kfac = zm.KFAC(predict, loss)(layer, inputs, labels)
    ekfac = zm.EKFAC(predict, loss)(layer, inputs, labels)
    (eigen,) = ekfac.eigh()
    eigenvalues = np.asarray(eigen.eigenvalues)
    gradient_basis, input_basis = np.asarray(eigen.gradient_basis), np.asarray(eigen.input_basis)
    # Each eigenvector outer(q_b, q_a) in the flat order: the correction is u^T G u.
    for i, j in [(0, 0), (1, 3), (2, 4)]:
        outer = jnp.asarray(np.outer(gradient_basis[:, i], input_basis[:, j]))
        u = np.asarray(ekfac._vector([outer]))
        close(eigenvalues[i, j], u @ G @ u, rtol=1e-10, atol=1e-12)
    kfac_error = np.linalg.norm(np.asarray(kfac.as_matrix()) - G)
    ekfac_error = np.linalg.norm(np.asarray(ekfac.as_matrix()) - G)
    assert ekfac_error < 0.9 * kfac_error


def test_ekfac_over_positions_sums_each_examples_gradient():
    # Rows are (example, position): the correction squares per-example gradients.
    def fn(params, inputs, targets):
        return jnp.tanh(inputs @ params["w"]).sum(axis=1)

    params, inputs = {"w": normal(0, (3, 2))}, normal(1, (6, 4, 3))
    loss = zm.losses.SquaredError()
    G = np.asarray(zm.BatchedGGN(fn, loss)(params, inputs, jnp.zeros((6, 2))))
    (eigen,) = zm.EKFAC(fn, loss)(params, inputs, jnp.zeros((6, 2))).eigh()
    q = np.kron(eigen.input_basis, eigen.gradient_basis)  # the weight is (in, out)
    eigenvalues = np.asarray(eigen.eigenvalues)
    close(eigenvalues.T.ravel(), np.diag(q.T @ G @ q), rtol=1e-10, atol=1e-12)


# -- the operator ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["KFAC", "EKFAC"])
def test_solve_logdet_diagonal_and_eigh_equal_the_dense_matrix(kind):
    F = getattr(zm, kind)(predict, zm.losses.SoftmaxCrossEntropy())(
        mlp(), normal(0, (7, 3)), LABELS
    )
    M = np.asarray(F.as_matrix())
    n, damping = M.shape[0], 0.3
    B = np.random.default_rng(1).normal(size=(n, 2))
    b = B[:, 0]
    dense = M + damping * np.eye(n)
    close(F.solve(jnp.asarray(B), damping=damping), np.linalg.solve(dense, B), rtol=1e-9)
    close(F.solve(jnp.asarray(b), damping=damping), np.linalg.solve(dense, b), rtol=1e-9)
    close(F.logdet(damping=damping), np.linalg.slogdet(dense)[1], rtol=1e-10)
    close(F.diagonal(), np.diag(M), atol=1e-12)
    close(F.mv(jnp.asarray(b)), M @ b, atol=1e-12)
    spectrum = np.sort(np.concatenate([np.ravel(e.eigenvalues) for e in F.eigh()]))
    close(jnp.asarray(spectrum), jnp.asarray(np.linalg.eigvalsh(M)), atol=1e-10)
    assert F.transpose() is F and lx.is_symmetric(F) and lx.is_positive_semidefinite(F)
    assert F.in_structure() == jax.ShapeDtypeStruct((n,), jnp.float64)


def test_microbatches_give_the_whole_batch():
    # EKFAC's two passes: the factors', then the eigenvalues', each over microbatches.
    loss = zm.losses.SoftmaxCrossEntropy(reduction="mean")
    inputs = normal(0, (7, 3))
    whole = zm.EKFAC(predict, loss)(mlp(), inputs, LABELS)
    parts = zm.EKFAC(predict, loss, microbatch_size=3)(mlp(), inputs, LABELS)
    close(parts.input_factors, whole.input_factors, atol=1e-13)
    close(parts.gradient_factors, whole.gradient_factors, atol=1e-13)
    close(parts.eigenvalues, whole.eigenvalues, atol=1e-13)


def test_monte_carlo_targets_approach_the_type_2_factors():
    # A fixed seed, so the test is deterministic; 400 draws an example put the factors
    # within a few percent of their expectation, the type-2 factors.
    inputs, loss = normal(0, (7, 3)), zm.losses.SoftmaxCrossEntropy()
    exact = zm.KFAC(predict, loss)(mlp(), inputs, LABELS)
    sampled = zm.KFAC(predict, loss, fisher="mc", mc_samples=400, key=jax.random.key(3))(
        mlp(), inputs, LABELS
    )
    for b, b_mc in zip(exact.gradient_factors, sampled.gradient_factors, strict=True):
        b, b_mc = np.asarray(b), np.asarray(b_mc)
        assert np.linalg.norm(b_mc - b) < 0.1 * np.linalg.norm(b)


def test_approximation_error_measures_products_and_top_eigenvalues():
    inputs, loss = normal(0, (7, 3)), zm.losses.SoftmaxCrossEntropy()
    exact = zm.BatchedGGN(predict, loss).operator(mlp(), inputs, LABELS)  # a pytree's
    F = zm.KFAC(predict, loss)(mlp(), inputs, LABELS)
    error = zm.approximation_error(F, exact, key=jax.random.key(0), num_vectors=3, k=0)
    G, M = np.asarray(zm.BatchedGGN(predict, loss)(mlp(), inputs, LABELS)), F.as_matrix()
    v = np.asarray(jax.random.normal(jax.random.split(jax.random.key(0), 3)[0], (3, G.shape[0])))
    M = np.asarray(M)
    expected = np.linalg.norm(v @ (M - G), axis=1) / np.linalg.norm(v @ G, axis=1)
    close(error.products, expected, rtol=1e-8)
    assert error.eigenvalues.shape == (0,)
    # The top eigenvalues, on operators whose spectra are known.
    exact = lx.MatrixLinearOperator(jnp.asarray(np.diag([5.0, 3.0, 2.0, 1.0])), lx.symmetric_tag)
    approx = lx.MatrixLinearOperator(jnp.asarray(np.diag([4.0, 3.0, 3.0, 0.0])), lx.symmetric_tag)
    error = zm.approximation_error(approx, exact, key=jax.random.key(1), num_vectors=2, k=2)
    close(error.exact_eigenvalues, jnp.asarray([5.0, 3.0]), rtol=1e-8)
    close(error.approx_eigenvalues, jnp.asarray([4.0, 3.0]), rtol=1e-8)
    close(error.eigenvalues, jnp.asarray([0.2, 0.0]), atol=1e-8)


# -- against curvlinops --------------------------------------------------------------------


def curvlinops_kfac(torch_model, params, loss, inputs, targets, fisher):
    """curvlinops' KFAC of the same network, its factors (per layer, in order) and its
    dense matrix, in float64."""
    torch = pytest.importorskip("torch")
    curvlinops = pytest.importorskip("curvlinops")
    targets = torch.tensor(np.asarray(targets))
    if not targets.is_floating_point():
        targets = targets.long()
    data = [(torch.tensor(np.asarray(inputs)), targets)]
    operator = curvlinops.KFACLinearOperator(
        torch_model.double(),
        loss,
        params,
        data,
        fisher_type=fisher,
        kfac_approx="expand",
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    return built_kfac_factors(operator, params)


def copy_into(torch_layers, eqx_layers):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        for theirs, ours in zip(torch_layers, eqx_layers, strict=True):
            theirs.double()
            theirs.weight.copy_(torch.tensor(np.asarray(ours.weight)))
            theirs.bias.copy_(torch.tensor(np.asarray(ours.bias).ravel()))
    return [p for layer in torch_layers for p in (layer.weight, layer.bias)]


def assert_same_kfac(F, theirs, scale=1.0):
    """`F`'s factors and matrix are curvlinops', its gradient factors `scale` times less."""
    inputs_, gradients, matrix = theirs
    for ours, expected in zip(F.input_factors, inputs_, strict=True):
        np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-9)
    for ours, expected in zip(F.gradient_factors, gradients, strict=True):
        np.testing.assert_allclose(scale * ours, expected, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(scale * F.as_matrix(), matrix, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "fisher, kind, reduction",
    [
        ("type-2", "cross-entropy", "sum"),
        ("type-2", "mse", "mean"),
        ("empirical", "cross-entropy", "mean"),
        ("empirical", "mse", "mean"),
    ],
)
def test_an_mlp_matches_curvlinops(fisher, kind, reduction):
    torch = pytest.importorskip("torch")
    model, inputs = mlp(), normal(0, (7, 3))
    layers = [torch.nn.Linear(3, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 4)]
    torch_model = torch.nn.Sequential(
        layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(), layers[2]
    )
    params = copy_into(layers, model.layers)
    if kind == "mse":  # torch's mean is over every entry, without the half
        targets = normal(1, (7, 4))
        loss = zm.losses.SquaredError(weights=2 / 4, reduction=reduction)
        theirs = torch.nn.MSELoss(reduction=reduction)
    else:
        targets = LABELS
        loss = zm.losses.SoftmaxCrossEntropy(reduction=reduction)
        theirs = torch.nn.CrossEntropyLoss(reduction=reduction)
    F = zm.KFAC(predict, loss, fisher=fisher)(model, inputs, targets)
    # curvlinops scales MSELoss(reduction="mean") by sqrt(C) before its empirical backward.
    scale = 4.0 if (fisher, kind, reduction) == ("empirical", "mse", "mean") else 1.0
    theirs = curvlinops_kfac(torch_model, params, theirs, inputs, targets, fisher)
    assert_same_kfac(F, theirs, scale)


def test_a_cnn_matches_curvlinops():
    torch = pytest.importorskip("torch")
    model, images = cnn(), normal(0, (6, 2, 5, 5))
    layers = [torch.nn.Conv2d(2, 3, 3, stride=2, padding=1), torch.nn.Linear(27, 4)]
    torch_model = torch.nn.Sequential(layers[0], torch.nn.Tanh(), torch.nn.Flatten(), layers[1])
    params = copy_into(layers, [model.conv, model.linear])
    loss = zm.losses.SoftmaxCrossEntropy(reduction="mean")
    F = zm.KFAC(predict, loss)(model, images, LABELS[:6])
    assert [block.names for block in F.blocks] == [
        (".conv.weight", ".conv.bias"),
        (".linear.weight", ".linear.bias"),
    ]
    theirs = torch.nn.CrossEntropyLoss(reduction="mean")
    assert_same_kfac(F, curvlinops_kfac(torch_model, params, theirs, images, LABELS[:6], "type-2"))


# -- the losses' square roots and draws -----------------------------------------------------


@pytest.mark.parametrize(
    "loss, outputs, targets",
    [
        (zm.losses.SquaredError(weights=jnp.asarray([1.0, 2.0, 3.0])), (4, 3), (4, 3)),
        (zm.losses.SquaredError(reduction="mean"), (4,), (4,)),
        (zm.losses.SquaredError(covariance=jnp.asarray([[2.0, 0.5], [0.5, 1.0]])), (4, 2), (4, 2)),
        (zm.losses.PoissonNLL(reduction="mean"), (4, 3), (4, 3)),
        (zm.losses.SoftmaxCrossEntropy(reduction="mean"), (4, 3), None),
    ],
)
def test_hessian_square_roots_give_each_terms_hessian(loss, outputs, targets):
    @jax.jit
    def blocks(out, data):
        """Each term's block of the Hessian, from the square root and from products."""
        S = loss.hessian_sqrt(out, data)
        H = jax.vmap(lambda u: loss.hessian_product(out, u.reshape(out.shape), data))(
            jnp.eye(out.size)
        )
        columns = S.reshape(S.shape[0], -1, out.shape[-1] if out.ndim > 1 else 1)
        terms = H.reshape(columns.shape[1:] * 2)
        return jnp.einsum("kti,ktj->tij", columns, columns), jnp.einsum("titj->tij", terms)

    data = LABELS[:4] % 3 if targets is None else normal(1, targets)
    from_root, from_products = blocks(normal(0, outputs), data)
    close(from_root, from_products, atol=1e-12)


def test_samples_have_the_likelihoods_shapes_and_means():
    @jax.jit
    def draws(key, out):
        weights = jnp.asarray([4.0, 0.0])
        return (
            zm.losses.SquaredError(weights=weights).sample(out, key),
            zm.losses.SoftmaxCrossEntropy().sample(out, key),
            zm.losses.GaussianNLL().sample((out[:, 0], out[:, 1]), key),
            zm.losses.PoissonNLL().sample(out, key),
        )

    out = normal(0, (4000, 2))
    squared, labels, gaussian, counts = map(np.asarray, draws(jax.random.key(0), out))
    out = np.asarray(out)
    assert squared.shape == out.shape and bool(np.all(squared[:, 1] == out[:, 1]))
    # 4000 draws of variance 1/4: the standard error of their variance is about 0.006.
    assert abs(float(np.var(squared[:, 0] - out[:, 0])) - 0.25) < 0.03
    assert labels.shape == (4000,) and jnp.issubdtype(labels.dtype, jnp.integer)
    assert gaussian.shape == (4000,) and gaussian.dtype == out.dtype
    assert counts.dtype == out.dtype and bool(np.all(counts == np.round(counts)))


# -- the checks -----------------------------------------------------------------------------


def test_bad_options_are_refused_by_name():
    loss = zm.losses.SquaredError()
    with pytest.raises(ValueError, match=r"`fisher` must be one of .*'type-2'.*; got 'type-3'"):
        zm.KFAC(predict, loss, fisher="type-3")
    with pytest.raises(ValueError, match=r"fisher='mc'.* needs a `key`"):
        zm.KFAC(predict, loss, fisher="mc")
    with pytest.raises(ValueError, match=r"`mc_samples`.* must be 1, got mc_samples=4"):
        zm.EKFAC(predict, loss, mc_samples=4)
    with pytest.raises(TypeError, match=r"`loss` must be a zm.losses.AbstractLoss"):
        zm.KFAC(predict, lambda outputs, targets: 0.0)
    with pytest.raises(ValueError, match=r"at most one of `microbatch_size` and `max_memory`"):
        zm.KFAC(predict, loss, microbatch_size=2, max_memory="1GB")
    with pytest.raises(TypeError, match=r"`microbatch_size` must be a positive int or None"):
        zm.KFAC(predict, loss, microbatch_size=2.0)
    with pytest.raises(ValueError, match=r"^KFAC: `max_memory` must be .* got 'lots'"):
        zm.KFAC(predict, loss, max_memory="lots")
    with pytest.raises(TypeError, match=r"SquaredError: targets=None .* no targets to draw"):
        zm.losses.SquaredError(targets=None).sample(jnp.zeros(3), jax.random.key(0))


def test_damping_that_leaves_an_eigenvalue_below_zero_is_refused():
    layer = as64(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
    F = zm.KFAC(predict, zm.losses.SquaredError())(layer, normal(0, (2, 3)), jnp.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"plus `damping` must be > 0.* damping=-100.0"):
        F.logdet(damping=-100.0)
    with pytest.raises(TypeError, match=r"`damping` must be a real number, got 'a'"):
        F.solve(jnp.zeros(8), damping="a")
    with pytest.raises(ValueError, match=r"`b` must be an array of shape \(8,\) or \(8, k\)"):
        F.solve(jnp.zeros(3), damping=1.0)
    with pytest.raises(ValueError, match=r"`approx` takes vectors of size 8 and `exact` of size 3"):
        zm.approximation_error(F, lx.MatrixLinearOperator(jnp.eye(3)), key=jax.random.key(0))


def test_microbatches_refuse_data_of_different_lengths_in_kfacs_words():
    layer = eqx.nn.Linear(3, 5, key=jax.random.key(0))
    inputs, labels = jnp.ones((2, 4, 3)), jnp.zeros(8, int)

    def predict(model, x, y):
        return jax.vmap(jax.vmap(model))(x).reshape(-1, 5)

    loss = zm.losses.SoftmaxCrossEntropy(reduction="mean")
    zm.KFAC(predict, loss)(layer, inputs, labels)  # one batch: the lengths never meet
    with pytest.raises(ValueError, match=r"^KFAC: .*args\[0\]: 2, args\[1\]: 8"):
        zm.KFAC(predict, loss, microbatch_size=1)(layer, inputs, labels)
