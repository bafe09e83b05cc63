"""`KFAC` and `EKFAC` at their corners: a data argument shared by every example, damping
that is not a finite real number, an empty batch, a float32 model fed float64 data,
PyTorch's layout `x @ w.T`, the empirical Fisher of a mean squared error against
curvlinops' scaling, and where KFAC of a linear layer is exact."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import close

import zodmem as zm


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        request.getfixturevalue("float64")
    return jnp.dtype(request.param)


def normal(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def predict(model, inputs, targets):
    return jax.vmap(model)(inputs)


def tolerance(dtype):
    return {"rtol": 1e-10, "atol": 1e-12} if dtype == jnp.float64 else {"rtol": 2e-4, "atol": 1e-5}


# -- a data argument shared by every example ------------------------------------------------


def with_positions(params, inputs, positions, targets):
    return jnp.tanh((inputs + positions) @ params["w"] + params["b"]).sum(axis=1)


def test_ekfac_passes_a_data_argument_of_another_length_whole(dtype):
    # Inputs (N, T, D) beside positions (T, D): only the inputs and targets hold examples.
    params = {"w": normal(0, (4, 2), dtype), "b": normal(1, (2,), dtype)}
    inputs, positions = normal(2, (6, 3, 4), dtype), normal(3, (3, 4), dtype)
    targets, loss = normal(4, (6, 2), dtype), zm.losses.SquaredError()

    def closed(params, inputs, targets):
        return with_positions(params, inputs, positions, targets)

    passed = zm.EKFAC(with_positions, loss)(params, inputs, positions, targets)
    closed_over = zm.EKFAC(closed, loss)(params, inputs, targets)
    close(passed.eigenvalues, closed_over.eigenvalues, **tolerance(dtype))
    keyword = zm.EKFAC(lambda p, x, y, *, positions: with_positions(p, x, positions, y), loss)
    close(keyword(params, inputs, targets, positions=positions).eigenvalues, passed.eigenvalues)
    # The examples are the rows' first axis: the eigenvalues are the exact block's
    # diagonal in the Kronecker eigenbasis.
    G = zm.BatchedGGN(closed, loss)(params, inputs, targets)
    (eigen,) = passed.eigh()
    for i, j in [(0, 0), (1, 2), (0, 4)]:
        u = passed._vector([jnp.outer(eigen.gradient_basis[:, i], eigen.input_basis[:, j])])
        close(eigen.eigenvalues[i, j], u @ G @ u, **tolerance(dtype))


def test_ekfac_refuses_in_words_an_examples_axis_it_cannot_find(dtype):
    # Positions whose length is the batch's are grown with it, and the model then fails;
    # as a keyword argument they are passed whole.
    params = {"w": normal(0, (4, 2), dtype), "b": normal(1, (2,), dtype)}
    inputs, positions = normal(2, (3, 3, 4), dtype), normal(3, (3, 4), dtype)
    targets, loss = normal(4, (3, 2), dtype), zm.losses.SquaredError()
    zm.KFAC(with_positions, loss)(params, inputs, positions, targets)  # KFAC needs no axis
    keyword = zm.EKFAC(lambda p, x, y, *, positions: with_positions(p, x, positions, y), loss)
    keyword(params, inputs, targets, positions=positions)
    with pytest.raises(ValueError, match=r"^EKFAC: .*args\[1\] of shape \(3, 4\).* failed"):
        zm.EKFAC(with_positions, loss)(params, inputs, positions, targets)

    # Rows that mix the examples (flattened with the positions) have no examples axis.
    def flattened(params, inputs, targets):
        rows = inputs.reshape(-1, 4) @ params["w"]
        return jnp.tanh(rows).reshape(inputs.shape[0], -1, 2).sum(axis=1)

    with pytest.raises(ValueError, match=r"x\['w'\] have shape \(9,\), then \(12,\)"):
        zm.EKFAC(flattened, loss)(params, inputs, targets)


# -- damping --------------------------------------------------------------------------------


def a_layer(dtype):
    layer = eqx.nn.Linear(3, 2, key=jax.random.key(0), dtype=dtype)
    inputs, targets = normal(0, (5, 3), dtype), normal(1, (5, 2), dtype)
    return zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, targets)


@pytest.mark.parametrize("method", ["solve", "logdet"])
def test_damping_must_be_a_finite_real_number(dtype, method):
    F = a_layer(dtype)

    def call(damping):
        if method == "solve":
            return F.solve(jnp.ones(8, dtype), damping=damping)
        return F.logdet(damping=damping)

    owner = rf"KroneckerFactored\.{method}"
    for nan in [float("nan"), jnp.asarray(jnp.nan, dtype), np.float32("nan")]:
        with pytest.raises(ValueError, match=rf"{owner}: `damping` must be a finite real number"):
            call(nan)
    with pytest.raises(
        ValueError, match=r"`damping` must be a finite real number, got damping=inf"
    ):
        call(float("inf"))
    for complex_ in [1 + 1j, np.complex64(1), jnp.asarray(1 + 1j)]:
        with pytest.raises(TypeError, match=rf"{owner}: `damping` must be a real number, got"):
            call(complex_)
    with pytest.raises(TypeError, match=r"`damping` must be a real number, got \[0.1\]"):
        call([0.1])
    # Traced, a NaN fails the call when it runs.
    with pytest.raises(Exception, match=r"plus `damping` must be > 0"):
        jax.block_until_ready(jax.jit(call)(jnp.asarray(jnp.nan, dtype)))
    assert call(0.1).dtype == dtype  # a finite damping is taken


# -- an empty batch -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, reduction", [("KFAC", "sum"), ("KFAC", "mean"), ("EKFAC", "sum"), ("EKFAC", "mean")]
)
def test_an_empty_batch_is_refused_by_name(dtype, kind, reduction):
    layer = eqx.nn.Linear(3, 2, key=jax.random.key(0), dtype=dtype)
    inputs, targets = jnp.zeros((0, 3), dtype), jnp.zeros((0, 2), dtype)
    transform = getattr(zm, kind)(predict, zm.losses.SquaredError(reduction=reduction))
    with pytest.raises(ValueError, match=rf"^{kind}: .*empty.*args\[0\] of shape \(0, 3\)"):
        transform(layer, inputs, targets)


# -- a float32 model on float64 data --------------------------------------------------------


@pytest.mark.parametrize("kind", ["KFAC", "EKFAC"])
def test_a_float32_model_on_float64_data_keeps_its_dtype_and_its_biases(float64, kind):
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jnp.tanh, key=jax.random.key(0), dtype=jnp.float32)
    inputs, targets = normal(0, (9, 3), jnp.float64), normal(1, (9, 2), jnp.float64)
    loss = zm.losses.SquaredError()
    F = getattr(zm, kind)(predict, loss)(model, inputs, targets)
    assert [block.names for block in F.blocks] == [
        (".layers[0].weight", ".layers[0].bias"),
        (".layers[1].weight", ".layers[1].bias"),
    ]
    n = F.in_structure().shape[0]
    assert F.in_structure() == jax.ShapeDtypeStruct((n,), jnp.float32)
    v = normal(2, (n,), jnp.float32)
    for value in [F.mv(v), F.solve(v, damping=0.1), F.diagonal(), F.as_matrix()]:
        assert value.dtype == jnp.float32
    assert F.logdet(damping=0.1).dtype == jnp.float32
    damped = F.solve(v, damping=0.1)
    solution = lx.linear_solve(F, F.mv(damped), lx.CG(rtol=1e-4, atol=1e-4), throw=False).value
    assert solution.dtype == jnp.float32
    # The same as on the data in float32.
    narrow = (inputs.astype(jnp.float32), targets.astype(jnp.float32))
    close(F.as_matrix(), getattr(zm, kind)(predict, loss)(model, *narrow).as_matrix(), rtol=1e-4)


# -- PyTorch's layout -----------------------------------------------------------------------


def torch_layout(params, inputs, targets):
    return jnp.tanh(inputs @ params["w"].T + params["b"])


def jax_layout(params, inputs, targets):
    return jnp.tanh(inputs @ params["w"] + params["b"])


def test_pytorchs_layout_x_at_w_transposed_is_a_layer(dtype):
    params = {"w": normal(0, (2, 3), dtype), "b": normal(1, (2,), dtype)}  # (out, in)
    inputs, labels = normal(2, (7, 3), dtype), jnp.asarray([0, 1, 1, 0, 1, 0, 0])
    loss = zm.losses.SoftmaxCrossEntropy()
    F = zm.KFAC(torch_layout, loss)(params, inputs, labels)
    assert [block.names for block in F.blocks] == [("['w']", "['b']")]
    # One example: the block of one dense layer is its exact Gauss-Newton block.
    one = zm.KFAC(torch_layout, loss)(params, inputs[:1], labels[:1])
    close(one.as_matrix(), zm.BatchedGGN(torch_layout, loss)(params, inputs[:1], labels[:1]))
    # The factors of `x @ w` with the weight transposed: the roles of its axes swap.
    flipped = {"w": params["w"].T, "b": params["b"]}
    G = zm.KFAC(jax_layout, loss)(flipped, inputs, labels)
    close(F.input_factors, G.input_factors, **tolerance(dtype))
    close(F.gradient_factors, G.gradient_factors, **tolerance(dtype))
    # The same matrix, once the flat order of the transposed weight is undone.
    order = np.concatenate([[0, 1], 2 + np.arange(6).reshape(3, 2).T.ravel()])  # b, then w
    M, N = np.asarray(F.as_matrix()), np.asarray(G.as_matrix())
    close(jnp.asarray(M), jnp.asarray(N[np.ix_(order, order)]), **tolerance(dtype))


def test_a_large_weight_in_pytorchs_layout_is_not_a_dense_block(dtype):
    params = {"w": normal(0, (70, 64), dtype), "b": normal(1, (70,), dtype)}
    inputs, targets = normal(2, (3, 64), dtype), normal(3, (3, 70), dtype)
    F = zm.KFAC(torch_layout, zm.losses.SquaredError())(params, inputs, targets)
    assert [(block.names, block.out_size, block.in_size) for block in F.blocks] == [
        (("['w']", "['b']"), 70, 64)
    ]


# -- the empirical Fisher of a mean squared error ------------------------------------------


def test_empirical_fisher_of_mse_is_c_times_smaller_than_curvlinops(dtype):
    # curvlinops scales `MSELoss(reduction="mean")` by sqrt(C) before its backward pass
    # for the empirical Fisher: the loss `SquaredError(weights=2 / sqrt(C))` here.
    model = eqx.nn.MLP(3, 4, 5, 1, activation=jnp.tanh, key=jax.random.key(0), dtype=dtype)
    inputs, targets = normal(0, (7, 3), dtype), normal(1, (7, 4), dtype)
    C = 4
    mse = zm.losses.SquaredError(weights=2 / C, reduction="mean")
    scaled = zm.losses.SquaredError(weights=2 / math.sqrt(C), reduction="mean")
    ours = zm.KFAC(predict, mse, fisher="empirical")(model, inputs, targets)
    theirs = zm.KFAC(predict, scaled, fisher="empirical")(model, inputs, targets)
    close(ours.input_factors, theirs.input_factors, **tolerance(dtype))
    close(tuple(C * b for b in ours.gradient_factors), theirs.gradient_factors, **tolerance(dtype))


# -- where KFAC of a linear layer is exact -------------------------------------------------


def test_a_linear_layer_is_exact_when_every_example_has_the_same_loss_hessian(dtype):
    layer = eqx.nn.Linear(3, 2, key=jax.random.key(0), dtype=dtype)
    inputs, targets = normal(0, (7, 3), dtype), normal(1, (7, 2), dtype)

    def error(loss):
        F = zm.KFAC(predict, loss)(layer, inputs, targets).as_matrix()
        G = zm.BatchedGGN(predict, loss)(layer, inputs, targets)
        return float(jnp.linalg.norm(F - G) / jnp.linalg.norm(G))

    same = jnp.asarray([1.0, 3.0], dtype)
    exact = 1e-12 if dtype == jnp.float64 else 1e-5
    # One precision per output, or per example but the same for every example: exact.
    assert error(zm.losses.SquaredError(weights=same)) < exact
    assert error(zm.losses.SquaredError(weights=jnp.tile(same, (7, 1)), reduction="mean")) < exact
    covariance = jnp.asarray([[2.0, 0.5], [0.5, 1.0]], dtype)
    assert error(zm.losses.SquaredError(covariance=covariance)) < exact
    # Precisions that differ between examples: B ⊗ A is no longer the sum over examples.
    varying = jnp.abs(normal(2, (7, 2), dtype)) + 0.1
    assert error(zm.losses.SquaredError(weights=varying)) > 0.05
    assert error(zm.losses.SquaredError(weights=varying[:, :1])) > 0.05


def test_each_layer_of_a_linear_network_is_exact_but_not_the_blocks_between(dtype):
    model = eqx.nn.MLP(3, 2, 4, 1, activation=lambda h: h, key=jax.random.key(0), dtype=dtype)
    inputs, targets = normal(0, (7, 3), dtype), normal(1, (7, 2), dtype)
    loss = zm.losses.SquaredError(weights=jnp.asarray([1.0, 3.0], dtype))
    F = zm.KFAC(predict, loss)(model, inputs, targets).as_matrix()
    G = zm.BatchedGGN(predict, loss)(model, inputs, targets)
    first = 4 * 3 + 4  # the first layer's weight and bias
    for block in [slice(0, first), slice(first, None)]:
        close(F[block, block], G[block, block], **tolerance(dtype))
    assert float(jnp.linalg.norm(F - G) / jnp.linalg.norm(G)) > 0.1


def test_ekfac_without_data_arguments_takes_a_row_per_example(dtype):
    layer = eqx.nn.Linear(3, 2, key=jax.random.key(0), dtype=dtype)
    inputs, loss = normal(0, (5, 3), dtype), zm.losses.SquaredError(targets=None)
    closed = zm.EKFAC(lambda model: jax.vmap(model)(inputs), loss)(layer)
    passed = zm.EKFAC(lambda model, inputs: jax.vmap(model)(inputs), loss)(layer, inputs)
    close(closed.eigenvalues, passed.eigenvalues, **tolerance(dtype))
    # Rows over positions cannot be told apart from examples without data to grow.
    sequences = normal(1, (5, 4, 3), dtype)
    with pytest.raises(ValueError, match=r"rows of the layer of x.weight have shape \(5, 4\)"):
        zm.EKFAC(lambda model: jax.vmap(jax.vmap(model))(sequences).sum(1), loss)(layer)
