"""`BatchedGGN` and the losses of `zm.losses` against `J^T H J` from `jax.jacfwd` and
`jax.hessian`, and against the known Fisher information of each likelihood."""

import math
import re
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import block_options, close, leaf_sizes, make_mlp, raveled
from hypothesis import given, settings, strategies as st
from jax.flatten_util import ravel_pytree

import zodmem as zm
from zodmem._transforms._ggn import ggn_products

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


@eqx.filter_jit
def _reference(fn, loss, x, args, kwargs):
    fn_of_flat, flat = raveled(fn, x, *args, **kwargs)
    out_flat, unravel_out = ravel_pytree(fn_of_flat(flat))
    jacobian = jax.jacfwd(lambda z: ravel_pytree(fn_of_flat(z))[0])(flat)
    hessian = jax.hessian(lambda o: loss(unravel_out(o), *args, **kwargs))(out_flat)
    return jacobian.T @ hessian @ jacobian


def reference_ggn(fn, loss, x, *args, **kwargs):
    """`J^T H J`: `J` by `jax.jacfwd` of `fn` of the raveled variables, `H` by
    `jax.hessian` of `loss` of the raveled outputs (compiled once per problem)."""
    return _reference(fn, loss, x, args, kwargs)


@eqx.filter_jit
def _together(transforms, x, args, kwargs):
    return [transform(x, *args, **kwargs) for transform in transforms]


def together(transforms, x, *args, **kwargs):
    """Call every transform on the same inputs inside one compiled function."""
    return _together(transforms, x, args, kwargs)


def mixing(rows, cols, seed=0.0):
    return np.cos(np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) * 0.7 + seed)


def model(params, inputs, targets, *, scale=1.0):
    """Outputs a pytree of mixed shapes: a (5, 2) array and a (5,) one."""
    hidden = jnp.tanh(inputs @ params["w"] + params["b"][0])
    return {"mean": scale * hidden @ params["v"], "spread": jnp.sum(hidden**2, axis=1)}


def plain_loss(outputs, inputs, targets, *, scale=1.0):
    """Not convex: the loss's Hessian on the outputs is dense and indefinite."""
    residual = outputs["mean"] - targets
    return jnp.sum(jnp.sin(residual) ** 2) + jnp.sum(outputs["spread"] ** 3) * scale


def make_params():
    return {
        "b": [jax.device_put(np.linspace(-0.5, 0.5, 4))],
        "v": jax.device_put(mixing(4, 2, 1.0)),
        "w": jax.device_put(mixing(3, 4) / 2),
    }


INPUTS = np.linspace(-1, 1, 15).reshape(5, 3)
TARGETS = np.cos(np.arange(10.0)).reshape(5, 2)


def test_every_mode_strategy_and_block_option():
    params = make_params()  # n = 4 + 8 + 12 = 24
    expected = reference_ggn(model, plain_loss, params, INPUTS, TARGETS, scale=0.5)
    assert expected.shape == (24, 24)
    # Blocks that divide n (3 of 8) and blocks that do not (5, 7; one block elsewhere), in each
    # mode and strategy; `together` compiles them all in one eqx.filter_jit.
    transforms = [
        zm.BatchedGGN(model, plain_loss, mode="fwd", nbatches=3),
        zm.BatchedGGN(model, plain_loss, mode="rev", batch_size=5),
        zm.BatchedGGN(model, plain_loss, mode="fwd", strategy="recompute", batch_size=5),
        zm.BatchedGGN(model, plain_loss, mode="rev", strategy="recompute", nbatches=3),
        zm.BatchedGGN(model, plain_loss, batch_size=7, checkpoint=True),
    ]
    for G in together(transforms, params, INPUTS, TARGETS, scale=0.5):
        assert G.dtype == jnp.float64
        close(G, expected)


def vector_model(x, inputs):
    v = jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree_util.tree_leaves(x)])
    return jnp.sin(mixing(4, v.size) @ v) * inputs


def vector_loss(outputs, inputs):
    return jnp.sum(outputs**4) / 4 + jnp.prod(outputs[:2])


@settings(max_examples=3)
@given(sizes=leaf_sizes(max_total=9), data=st.data())
def test_pytrees_and_block_options(sizes, data):
    x = {f"leaf{k}": jnp.linspace(-1, 1, size) for k, size in enumerate(sizes)}
    options = data.draw(block_options(sum(sizes)))
    inputs = jax.device_put(np.asarray([1.0, -0.5, 2.0, 0.25]))
    G = zm.BatchedGGN(vector_model, vector_loss, **options)(x, inputs)
    close(G, reference_ggn(vector_model, vector_loss, x, inputs))


def test_budget_and_plan():
    params = make_params()
    transform = zm.BatchedGGN(model, plain_loss, max_memory="200MB")
    plan = transform.plan(params, INPUTS, TARGETS)
    assert plan.fits and plan.total == 24 and plan.strategy == "linearize"
    assert plan.output_bytes == 24 * 24 * 8
    expected = reference_ggn(model, plain_loss, params, INPUTS, TARGETS)
    close(transform(params, INPUTS, TARGETS), expected)


def test_linear_fn_gives_the_hessian():
    """With `fn` linear in `x` the curvature of `fn` is zero: G is the Hessian."""
    x = {"a": jax.device_put(np.asarray([0.3, -0.2])), "b": jax.device_put(mixing(2, 2))}

    def linear(x, inputs):
        return inputs @ x["b"] + x["a"] * 2.0

    def loss(outputs, inputs):
        return jnp.sum(jnp.exp(outputs)) + jnp.sum(outputs) ** 2

    def composed(x, inputs):
        return loss(linear(x, inputs), inputs)

    inputs = jax.device_put(mixing(3, 2, 0.5))
    fn_of_flat, flat = raveled(composed, x, inputs)
    expected = jax.jit(jax.hessian(fn_of_flat))(flat)
    transforms = [zm.BatchedGGN(linear, loss, mode=mode, nbatches=2) for mode in ("fwd", "rev")]
    for G in together(transforms, x, inputs):
        close(G, expected)


def test_mixed_precision_and_an_equinox_model():
    params = {
        "single": jax.device_put(np.asarray([0.25, -0.5], np.float32)),
        "double": jax.device_put(np.asarray([1.5, 0.1])),
    }
    inputs = jax.device_put(mixing(3, 4))
    G = zm.BatchedGGN(vector_model, vector_loss, batch_size=3)(params, inputs[0])
    assert G.dtype == jnp.float64  # the raveled variables' dtype, as BatchedHessian gives
    close(G, reference_ggn(vector_model, vector_loss, params, inputs[0]), rtol=1e-5, atol=1e-6)
    # An MLP as x: its activation functions are leaves that are not variables.
    mlp = make_mlp(3, 2, 4, 1)

    def apply(mlp, inputs, targets):
        return jax.vmap(mlp)(inputs)

    def squared(outputs, inputs, targets):
        return 0.5 * jnp.sum((outputs - targets) ** 2)

    G = zm.BatchedGGN(apply, squared, nbatches=4)(mlp, INPUTS, TARGETS)
    assert G.shape == (26, 26) and G.dtype == jnp.float64
    close(G, reference_ggn(apply, squared, mlp, INPUTS, TARGETS))


def test_inside_jit_vmap_and_grad():
    """(Every `together` call runs the transforms inside `eqx.filter_jit`, as arguments.)"""
    params = make_params()
    inner = zm.BatchedGGN(model, plain_loss, nbatches=2, jit=False)

    def squared_norm(ggn, params, inputs, targets):
        return jnp.sum(ggn(params, inputs, targets) ** 2)

    @jax.jit
    def whole_per_example_and_gradient(params, inputs, targets):
        per_example = jax.vmap(inner, in_axes=(None, 0, 0))
        return (
            inner(params, inputs, targets),
            per_example(params, inputs[:, None], targets[:, None]),
            jax.grad(squared_norm, argnums=(1, 2))(inner, params, inputs, targets),
        )

    G, per_example, gradient = whole_per_example_and_gradient(params, INPUTS[:2], TARGETS[:2])
    for k in range(2):
        one = reference_ggn(model, plain_loss, params, INPUTS[k : k + 1], TARGETS[k : k + 1])
        close(per_example[k], one)
    close(G, per_example[0] + per_example[1])

    def reference(params, inputs, targets):
        return squared_norm(partial(reference_ggn, model, plain_loss), params, inputs, targets)

    expected = jax.jit(jax.grad(reference, argnums=(0, 1)))(params, INPUTS[:2], TARGETS[:2])
    close(gradient, expected)


def test_microbatched_over_a_dataset_equals_the_sum():
    params = make_params()
    inputs = np.linspace(-1, 1, 21).reshape(7, 3)
    targets = np.sin(np.arange(14.0)).reshape(7, 2)
    dataset = zm.Microbatcher(
        zm.BatchedGGN(model, plain_loss, batch_size=10), microbatch_size=3, argnums=(1, 2)
    )
    # The loss sums over examples, so its matrix over the dataset is the sum over them.
    close(
        dataset(params, inputs, targets), reference_ggn(model, plain_loss, params, inputs, targets)
    )


def test_has_aux():
    params = make_params()

    def with_aux(params, inputs, targets):
        outputs = model(params, inputs, targets)
        return outputs, {"count": 3, "name": "model", "spread": outputs["spread"]}

    transforms = [
        zm.BatchedGGN(with_aux, plain_loss, has_aux=True, nbatches=3, strategy=strategy)
        for strategy in ("linearize", "recompute")
    ]
    expected = reference_ggn(model, plain_loss, params, INPUTS, TARGETS)
    spread = jax.jit(model)(params, INPUTS, TARGETS)["spread"]  # one program, not one per op
    for G, aux in together(transforms, params, INPUTS, TARGETS):
        close(G, expected)
        close(aux, {"count": 3, "name": "model", "spread": spread})


def test_rev_mode_takes_custom_vjp_functions():
    @jax.custom_vjp
    def squash(z):
        return jnp.tanh(z)

    def squash_fwd(z):
        return jnp.tanh(z), jnp.tanh(z)

    def squash_bwd(t, g):
        return (g * (1 - t**2),)

    squash.defvjp(squash_fwd, squash_bwd)

    def fn(w, inputs):
        return squash(inputs @ w)

    w = jax.device_put(np.asarray([0.5, -0.25, 1.0]))
    inputs = jax.device_put(mixing(4, 3))
    expected = reference_ggn(lambda w, i: jnp.tanh(i @ w), vector_loss, w, inputs)
    transforms = [
        zm.BatchedGGN(fn, vector_loss, mode="rev", nbatches=2),
        zm.BatchedGGN(fn, vector_loss, batch_size=2),  # "auto" takes "rev" for it
    ]
    for G in together(transforms, w, inputs):
        close(G, expected)
    with pytest.raises(TypeError, match="forward-mode"):
        zm.BatchedGGN(fn, vector_loss, mode="fwd")(w, inputs)


def test_streamed_with_a_progress_bar_and_products(capfd):
    params = make_params()
    expected = reference_ggn(model, plain_loss, params, INPUTS, TARGETS)
    transform = zm.BatchedGGN(model, plain_loss, batch_size=5, progress=True)
    host = zm.to_host(transform, params, INPUTS, TARGETS)
    assert isinstance(host, np.ndarray)
    close(host, np.asarray(expected))
    bar = capfd.readouterr().err
    assert "BatchedGGN" in bar and "5/5" in bar, bar  # 24 rows in blocks of 5

    @eqx.filter_jit
    def products(transforms, params, vectors):
        results = []
        for transform in transforms:
            flat, variables, mv = ggn_products(transform, params, (INPUTS, TARGETS), {})
            results.append((flat, variables.size, jax.vmap(mv)(vectors), mv(vectors[0])))
        return results

    vectors = jax.device_put(mixing(3, 24, 2.0))
    # The references by NumPy: no programs to compile for them.
    expected, vectors_np = np.asarray(expected), np.asarray(vectors)
    raveled_params = np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(params)])
    for flat, size, block, one in products([zm.BatchedGGN(model, plain_loss)], params, vectors):
        assert size == 24
        close(flat, raveled_params)
        close(block, vectors_np @ expected.T)
        close(one, expected @ vectors_np[0])


def test_no_variables_of_size_above_zero():
    x = {"e": jnp.zeros((0, 2))}
    G = zm.BatchedGGN(lambda x: jnp.sum(x["e"], axis=0), lambda o: jnp.sum(o**2))(x)
    assert G.shape == (0, 0) and G.dtype == jnp.float64


# --- the losses of zm.losses -------------------------------------------------------------


def linear_model(w, inputs, targets):
    """Outputs (5, 3): a dense Jacobian of the 6 variables."""
    return jnp.tanh(inputs @ w.reshape(3, 2)).repeat(2, axis=1)[:, :3] + 0.1 * w[:3]


W = np.linspace(-0.6, 0.8, 6)
COUNTS = np.asarray([[0, 1, 2], [3, 0, 1], [1, 1, 0], [2, 5, 1], [0, 0, 4]], np.float64)


def per_row(matrix, jacobian_of_rows):
    """`sum_i J_i^T M_i J_i` for the Jacobians `(rows, k, n)` and `M` `(rows, k, k)`."""
    return jnp.einsum("rkn,rkl,rlm->nm", jacobian_of_rows, matrix, jacobian_of_rows)


jacobian_rows = jax.jit(jax.jacfwd(lambda w, inputs: linear_model(w, inputs, None)))  # (5, 3, 6)


def plain(loss):
    """The same loss as a plain callable, whose Hessian is taken by autodiff."""
    return lambda outputs, *args, **kwargs: loss(outputs, *args, **kwargs)


@jax.jit  # one program rather than one per operation
def squared_error_references(w, inputs, targets, weights, covariance_inverse):
    """The outputs, and the squared errors: of the outputs weighted, of the residuals
    against the covariance, and plain."""
    outputs = linear_model(w, inputs, targets)
    r = outputs - targets
    return (
        outputs,
        0.5 * jnp.sum(weights * outputs**2),
        0.5 * jnp.sum(r @ covariance_inverse * r),
        0.5 * jnp.sum(r**2),
    )


def test_squared_error_weights_and_covariance():
    inputs, targets = INPUTS, TARGETS[:, :1].repeat(3, axis=1)
    covariance = mixing(3, 3) @ mixing(3, 3).T + np.eye(3)
    weights = np.asarray([0.5, 2.0, 1.0])
    J = jacobian_rows(W, inputs)
    by_weights = zm.losses.SquaredError(weights=jax.device_put(weights))
    by_covariance = zm.losses.SquaredError(covariance=jax.device_put(covariance))
    # No targets: `fn` returns the residuals.
    residuals = zm.losses.SquaredError(weights=jax.device_put(weights), targets=None)
    transforms = [
        zm.BatchedGGN(linear_model, by_weights, nbatches=2),
        zm.BatchedGGN(linear_model, by_covariance, nbatches=2),
        zm.BatchedGGN(linear_model, plain(by_covariance)),
        zm.BatchedGGN(linear_model, residuals),
    ]
    results = together(transforms, W, inputs, targets)
    weighted = per_row(np.broadcast_to(np.diag(weights), (5, 3, 3)), J)
    fisher = per_row(np.broadcast_to(np.linalg.inv(covariance), (5, 3, 3)), J)  # J^T Σ^-1 J
    for G, expected in zip(results, [weighted, fisher, fisher, weighted], strict=True):
        close(G, expected)
    outputs, by_weights_loss, by_covariance_loss, plain_loss_value = squared_error_references(
        W, inputs, targets, weights, np.linalg.inv(covariance)
    )
    close(residuals(outputs), by_weights_loss)
    close(by_covariance(outputs, inputs, targets), by_covariance_loss)
    # No weights; the targets as a keyword argument.
    by_name = zm.losses.SquaredError(targets="y")
    close(by_name(outputs, inputs, y=targets), plain_loss_value)


@eqx.filter_jit
def _calls(calls):
    return [transform(*args) for transform, args in calls]


def calls(*pairs):
    """`transform(*args)` for each pair, compiled together in one eqx.filter_jit."""
    return _calls(list(pairs))


@jax.jit  # one program rather than one per operation
def softmax_references(w, inputs, indices):
    """The logits, the categorical Fisher information `J^T (diag(p) - p p^T) J`, the
    indices one-hot and their negative log-likelihood."""
    logits = linear_model(w, inputs, None)
    p = jax.nn.softmax(logits)
    fisher = per_row(jax.vmap(lambda p: jnp.diag(p) - jnp.outer(p, p))(p), jacobian_rows(w, inputs))
    one_hot = jax.nn.one_hot(indices, 3)
    return logits, fisher, one_hot, -jnp.sum(one_hot * jax.nn.log_softmax(logits))


def test_softmax_cross_entropy_is_the_categorical_fisher():
    indices = jax.device_put(np.asarray([0, 2, 1, 1, 0]))
    logits, fisher, one_hot, nll = softmax_references(W, INPUTS, indices)
    loss = zm.losses.SoftmaxCrossEntropy()
    probabilities = jax.jit(jax.nn.softmax)(jax.device_put(mixing(5, 3)))
    results = calls(
        (zm.BatchedGGN(linear_model, loss, batch_size=4), (W, INPUTS, indices)),
        (zm.BatchedGGN(linear_model, plain(loss)), (W, INPUTS, probabilities)),
    )
    for G in results:
        close(G, fisher)
    close(loss(logits, INPUTS, indices), loss(logits, INPUTS, one_hot))
    close(loss(logits, INPUTS, indices), nll)


def rates(w, inputs, counts):
    return jnp.exp(linear_model(w, inputs, counts))


@jax.jit  # one program rather than one per operation
def poisson_references(w, inputs, counts):
    """The log-rates and rates, the Fisher information of each parametrisation (see the
    test below) and the negative log-likelihood of the counts."""
    log_rates = linear_model(w, inputs, counts)
    rate = jnp.exp(log_rates)
    J = jacobian_rows(w, inputs)
    fisher = per_row(jax.vmap(jnp.diag)(rate), J)
    rates_fisher = per_row(jax.vmap(jnp.diag)(1 / rate), J * rate[..., None])
    nll = -jnp.sum(jax.scipy.stats.poisson.logpmf(counts, rate))
    return log_rates, rate, fisher, rates_fisher, nll


def test_poisson_fisher():
    log_rates, rate, fisher, rates_fisher, nll = poisson_references(W, INPUTS, COUNTS)
    log_rate_loss, rate_loss = zm.losses.PoissonNLL(), zm.losses.PoissonNLL(log_rate=False)
    results = calls(
        (zm.BatchedGGN(linear_model, log_rate_loss), (W, INPUTS, COUNTS)),
        (zm.BatchedGGN(linear_model, plain(log_rate_loss)), (W, INPUTS, COUNTS)),
        (zm.BatchedGGN(rates, rate_loss, nbatches=3), (W, INPUTS, COUNTS)),
        (zm.BatchedGGN(rates, plain(rate_loss)), (W, INPUTS, rate)),
    )
    # Log-rates: the Hessian, diag(rate), does not depend on the counts: it is the Fisher.
    close(results[0], fisher)
    close(results[1], fisher)
    # Rates: the Hessian, counts / rate**2, is linear in the counts, so its expectation is
    # the autodiff matrix at counts equal to the rates: diag(1 / rate) (with J_rates =
    # J * rate).
    close(results[2], rates_fisher)
    close(results[2], results[3])
    close(log_rate_loss(log_rates, INPUTS, COUNTS), nll)
    close(rate_loss(rate, INPUTS, COUNTS), nll)


def mean_and_log_variance(w, inputs, targets):
    outputs = linear_model(w, inputs, targets)
    return outputs[:, 0], outputs[:, 1] - outputs[:, 2]


@jax.jit  # one program rather than one per operation
def gaussian_references(w, inputs, targets):
    """The means and log-variances, the targets a standard deviation either side of the
    means, the Fisher information `J_m^T diag(exp(-log_variance)) J_m + J_v^T J_v / 2`
    and the negative log-likelihood."""
    mean, log_variance = mean_and_log_variance(w, inputs, targets)
    sigma = jnp.exp(log_variance / 2)
    J = jax.jacfwd(lambda w: linear_model(w, inputs, None))(w)
    J_mean, J_log_variance = J[:, 0], J[:, 1] - J[:, 2]
    fisher = (
        J_mean.T @ jnp.diag(jnp.exp(-log_variance)) @ J_mean
        + 0.5 * J_log_variance.T @ J_log_variance
    )
    nll = -jnp.sum(jax.scipy.stats.norm.logpdf(targets, mean, sigma))
    return mean, log_variance, jnp.stack([mean + sigma, mean - sigma]), fisher, nll


def test_gaussian_nll_is_the_expected_hessian():
    targets = jax.device_put(TARGETS[:, 0])
    mean, log_variance, either_side, fisher, nll = gaussian_references(W, INPUTS, targets)
    loss = zm.losses.GaussianNLL()
    by_autodiff = zm.BatchedGGN(mean_and_log_variance, plain(loss))
    shortcut = zm.BatchedGGN(mean_and_log_variance, loss, batch_size=4)
    at_both = jax.vmap(by_autodiff, in_axes=(None, None, 0))
    shortcut, above_and_below = calls(
        (shortcut, (W, INPUTS, targets)),
        (at_both, (W, INPUTS, either_side)),
    )
    # The Hessian is quadratic in the targets: its mean over mean ± sigma is its expectation.
    close(shortcut, np.mean(above_and_below, axis=0))
    close(shortcut, fisher)
    close(loss((mean, log_variance), INPUTS, targets), nll)


def test_custom_closed_form_loss():
    class Quartic(zm.losses.AbstractLoss):
        def __call__(self, outputs, *args):
            return jnp.sum(outputs**4) / 12

        def hessian_product(self, outputs, tangents, *args):
            return outputs**2 * tangents

    x = jax.device_put(np.asarray([0.5, -1.0, 2.0]))
    close(zm.BatchedGGN(lambda w: 2 * w, Quartic())(x), jnp.diag(4 * (2 * x) ** 2))

    class Summed(Quartic):
        def hessian_product(self, outputs, tangents, *args):
            return jnp.sum(outputs**2 * tangents)

    with pytest.raises(TypeError, match=r"`Summed.hessian_product` must return a tangent .*"):
        zm.BatchedGGN(lambda w: 2 * w, Summed())(x)


# --- refusals ---------------------------------------------------------------------------


def test_construction_errors():
    with pytest.raises(
        ValueError, match=r"`mode` must be one of 'auto', 'fwd', 'rev'; got 'jacfwd'"
    ):
        zm.BatchedGGN(model, plain_loss, mode="jacfwd")
    with pytest.raises(TypeError, match=r"loss"):
        zm.BatchedGGN(model, "loss")
    with pytest.raises(ValueError, match=r"holomorphic=True is not supported"):
        zm.BatchedGGN(model, plain_loss, holomorphic=True)
    with pytest.raises(
        ValueError, match=r"at most one of `nbatches`, `batch_size` and `max_memory`"
    ):
        zm.BatchedGGN(model, plain_loss, nbatches=2, max_memory="1GB")
    with pytest.raises(ValueError, match=r"at most one of `weights` and `covariance`"):
        zm.losses.SquaredError(weights=jnp.ones(3), covariance=jnp.eye(3))
    with pytest.raises(ValueError, match=r"square \(k, k\) matrix .* shape \(3,\)"):
        zm.losses.SquaredError(covariance=jnp.ones(3))
    # Under the tests' import hook the constructor's type check may refuse them first.
    with pytest.raises(TypeError, match=r"targets[\s\S]*1\.5"):
        zm.losses.SoftmaxCrossEntropy(targets=1.5)
    with pytest.raises(TypeError, match=r"log_rate[\s\S]*'yes'"):
        zm.losses.PoissonNLL(log_rate="yes")


def test_call_errors():
    w = jax.device_put(np.asarray([0.5, -0.25, 1.0]))
    inputs = jax.device_put(mixing(4, 3))

    def fn(w, inputs):
        return inputs @ w

    def refused(error, message, loss, fn=fn, x=w, **config):
        with pytest.raises(error, match=message):
            zm.BatchedGGN(fn, loss, **config)(x, inputs)

    refused(
        TypeError,
        r"^BatchedGGN: `loss` must return a scalar \(shape \(\)\), .* shape \(4,\)",
        lambda o, i: o,
    )
    refused(
        TypeError,
        r"real floating-point scalar, but it returned dtype int64",
        lambda o, i: jnp.sum(o > 0),
    )
    refused(TypeError, r"must return a scalar", lambda o, i: (jnp.sum(o), 1.0))
    refused(
        TypeError,
        r"^BatchedGGN: `loss` cannot take the outputs of `fn`, float64\[4\], .*: TypeError",
        lambda o, i: o["mean"],
    )
    refused(
        TypeError,
        r"`loss` cannot take .* SquaredError: the targets have shape \(4, 3\) and the "
        r"predictions .* shape \(4,\)",
        zm.losses.SquaredError(),
    )
    refused(
        TypeError,
        r"SoftmaxCrossEntropy: targets=3 .* the call has 1 of them",
        zm.losses.SoftmaxCrossEntropy(targets=3),
    )
    refused(TypeError, r"GaussianNLL: the outputs of `fn` must be a pair", zm.losses.GaussianNLL())
    refused(
        TypeError,
        re.escape("BatchedGGN: x has the complex dtype complex128"),
        lambda o, i: jnp.sum(jnp.abs(o)),
        x=w.astype(complex),
    )
    refused(
        TypeError,
        r"`fn` must return real floating-point arrays, .* dtype int64",
        lambda o, i: 0.0,
        fn=lambda w, i: jnp.arange(3),
    )
    refused(TypeError, r"complex ones are not supported", lambda o, i: 0.0, fn=lambda w, i: w * 1j)
    refused(
        TypeError, r"has_aux=True, `fn` must return a pair", lambda o, i: jnp.sum(o), has_aux=True
    )
    refused(
        ValueError,
        r"nbatches=4 is larger than the number of variables, 3",
        lambda o, i: jnp.sum(o),
        nbatches=4,
    )
    refused(
        ValueError, r"`x` has no inexact-array leaves", lambda o, i: jnp.sum(o), x=jnp.arange(3)
    )


def test_save_and_load(tmp_path):
    from serialise_functions import loss as sines

    transform = zm.BatchedGGN(jnp.sin, sines, nbatches=2, mode="rev")
    zm.save(tmp_path / "ggn.zm", transform)
    loaded = zm.load(tmp_path / "ggn.zm")
    assert loaded.config == transform.config and loaded.loss is sines
    # A loss without arrays is written with its configuration: no `like` needed.
    labelled = zm.BatchedGGN(jnp.sin, zm.losses.SoftmaxCrossEntropy(targets="labels"))
    zm.save(tmp_path / "labelled.zm", labelled)
    assert zm.load(tmp_path / "labelled.zm") == labelled
    # A loss with arrays is rebuilt from its skeleton in `like`, as a model is.
    weighted = zm.BatchedGGN(jnp.sin, zm.losses.SquaredError(weights=jnp.arange(3.0), targets=None))
    zm.save(tmp_path / "weighted.zm", weighted)
    skeleton = zm.losses.SquaredError(weights=jnp.zeros(3), targets=None)
    loaded = zm.load(tmp_path / "weighted.zm", like=skeleton)
    x = jax.device_put(np.asarray([0.1, 0.2, 0.3]))
    close(loaded(x), weighted(x))
    assert math.isclose(float(loaded.loss.weights[2]), 2.0)
