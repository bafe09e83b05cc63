"""The losses of `zm.losses` summed or averaged over the examples: the GGN of each mean
against `J^T H J` of the plain mean loss from `jax.jacfwd` and `jax.hessian`, the same
mean over microbatches, the conventions of other libraries, and the checks of the
losses' options and data."""

import functools
import math
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close
from jax.flatten_util import ravel_pytree
from jax.scipy.special import gammaln

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

N = 8  # examples: microbatches of 4 divide them, microbatches of 3 do not
INPUTS = np.linspace(-1, 1, 2 * N).reshape(N, 2)
W = np.linspace(-0.6, 0.8, 6)
LABELS = np.arange(N) % 3
TARGETS = np.cos(np.arange(3.0 * N)).reshape(N, 3)


def three(w, inputs, targets):
    """Outputs (N, 3): predictions, logits or log-rates, with a dense Jacobian."""
    return jnp.tanh(inputs @ w.reshape(2, 3)) + 0.1 * w[:3]


def one(w, inputs, targets):
    """Outputs (N,): one prediction per example."""
    outputs = three(w, inputs, targets)
    return outputs[:, 0] - 0.5 * outputs[:, 1] + 0.25 * outputs[:, 2]


def mean_and_log_variance(w, inputs, targets):
    outputs = three(w, inputs, targets)
    return outputs[:, 0], outputs[:, 1] - outputs[:, 2]


def rates(w, inputs, counts):
    return jnp.exp(three(w, inputs, counts))


@eqx.filter_jit
def plain_ggn(fn, loss, w, inputs, targets):
    """`J^T H J` of the plain `loss(outputs, targets)`: `J` by `jax.jacfwd` of the raveled
    outputs, `H` by `jax.hessian` of the loss of them."""
    outputs, unravel = ravel_pytree(fn(w, inputs, targets))
    jacobian = jax.jacfwd(lambda w: ravel_pytree(fn(w, inputs, targets))[0])(w)
    hessian = jax.hessian(lambda o: loss(unravel(o), targets))(outputs)
    return jacobian.T @ hessian @ jacobian


# The plain mean losses, written from their formulas, each divided by the examples.
PRECISION = np.asarray([0.5, 2.0, 1.0])
COVARIANCE = np.cos(np.arange(9.0)).reshape(3, 3) @ np.cos(np.arange(9.0)).reshape(3, 3).T
COVARIANCE = COVARIANCE + np.eye(3)


def squared(outputs, targets):
    return 0.5 * jnp.sum(PRECISION * (outputs - targets) ** 2) / outputs.shape[0]


def squared_one(outputs, targets):
    return 0.5 * jnp.sum((outputs - targets) ** 2) / outputs.shape[0]


def squared_covariance(outputs, targets):
    r = outputs - targets
    return 0.5 * jnp.sum(r @ np.linalg.inv(COVARIANCE) * r) / outputs.shape[0]


def gaussian(outputs, targets):
    mean, log_variance = outputs
    squares = (targets - mean) ** 2 * jnp.exp(-log_variance)
    return 0.5 * jnp.sum(log_variance + squares + math.log(2 * math.pi)) / mean.shape[0]


def poisson(log_rate, counts):
    return jnp.sum(jnp.exp(log_rate) - counts * log_rate + gammaln(counts + 1)) / N


def poisson_rates(rate, counts):
    return jnp.sum(rate - counts * jnp.log(rate) + gammaln(counts + 1)) / N


def cross_entropy(logits, labels):
    log_p = jax.nn.log_softmax(logits)
    if jnp.issubdtype(labels.dtype, jnp.integer):
        return -jnp.sum(jnp.take_along_axis(log_p, labels[:, None], axis=1)) / N
    return -jnp.sum(labels * log_p) / N


def _gaussian_targets():
    mean, log_variance = mean_and_log_variance(W, INPUTS, None)
    sigma = jnp.exp(log_variance / 2)
    # The loss's Hessian is quadratic in the targets: its mean at mean ± sigma is its
    # expectation, the Fisher information that GaussianNLL applies.
    return np.asarray(mean + 0.3 * sigma), [mean + sigma, mean - sigma]


def _rate_targets():
    rate = rates(W, INPUTS, None)
    # The Hessian on rates is linear in the counts: at counts equal to the rates it is
    # its expectation.
    return np.asarray(np.round(3 * rate)), [rate]


@functools.cache
def cases():
    """`{id: (fn, make_loss, targets, plain_mean, targets_of_the_reference)}`, built once
    (in float64, the fixture's): the tests only read them."""
    soft = np.asarray(jax.nn.softmax(jnp.asarray(TARGETS)))
    gaussian_targets, gaussian_reference = _gaussian_targets()
    counts, rate_reference = _rate_targets()
    poisson_counts = np.round(3 * np.exp(TARGETS))
    losses = zm.losses
    return {
        "squared": (three, partial(losses.SquaredError, weights=PRECISION), TARGETS, squared),
        "squared-1d": (one, losses.SquaredError, TARGETS[:, 0], squared_one),
        "squared-covariance": (
            three,
            partial(losses.SquaredError, covariance=COVARIANCE),
            TARGETS,
            squared_covariance,
        ),
        "gaussian": (
            mean_and_log_variance,
            losses.GaussianNLL,
            gaussian_targets,
            gaussian,
            gaussian_reference,
        ),
        "poisson": (three, losses.PoissonNLL, poisson_counts, poisson),
        "poisson-rates": (
            rates,
            partial(losses.PoissonNLL, log_rate=False),
            counts,
            poisson_rates,
            rate_reference,
        ),
        "cross-entropy": (three, losses.SoftmaxCrossEntropy, LABELS, cross_entropy),
        "cross-entropy-soft": (three, losses.SoftmaxCrossEntropy, soft, cross_entropy),
    }


def case(name):
    """One case of `cases()`, built in float64 (the fixture's), with the targets of its
    reference."""
    found = cases()[name]
    return found if len(found) == 5 else (*found, [found[2]])


NAMES = [
    "squared",
    "squared-1d",
    "squared-covariance",
    "gaussian",
    "poisson",
    "poisson-rates",
    "cross-entropy",
    "cross-entropy-soft",
]


@pytest.mark.parametrize("name", NAMES)
def test_mean_is_the_ggn_of_the_mean_loss(name):
    fn, make_loss, targets, plain_mean, reference_targets = case(name)
    mean_loss, sum_loss = make_loss(reduction="mean"), make_loss()
    assert sum_loss.reduction == "sum" and mean_loss.reduction == "mean"
    expected = sum(np.asarray(plain_ggn(fn, plain_mean, W, INPUTS, t)) for t in reference_targets)
    expected = expected / len(reference_targets)
    G = zm.BatchedGGN(fn, mean_loss, batch_size=4)(W, INPUTS, targets)
    close(G, expected)
    close(zm.BatchedGGN(fn, sum_loss)(W, INPUTS, targets), N * expected)
    # The value: the plain mean loss, the sum over the examples divided by them.
    outputs = fn(W, INPUTS, targets)
    close(mean_loss(outputs, INPUTS, targets), plain_mean(outputs, jnp.asarray(targets)))
    close(mean_loss(outputs, INPUTS, targets), sum_loss(outputs, INPUTS, targets) / N)


@pytest.mark.parametrize("name", ["squared-1d", "gaussian", "poisson", "cross-entropy-soft"])
def test_dtypes_of_the_mean(name):
    fn, make_loss, targets, _, _ = case(name)
    loss = make_loss(reduction="mean")
    w = W.astype(np.float32)
    targets = targets.astype(np.float32)
    outputs = fn(w, INPUTS.astype(np.float32), targets)
    value = loss(outputs, INPUTS, targets)
    assert value.dtype == jnp.float32 and value.shape == ()
    tangents = jax.tree_util.tree_map(lambda o: jnp.ones_like(o), outputs)
    products = loss.hessian_product(outputs, tangents, INPUTS, targets)
    assert jax.tree_util.tree_map(lambda a: a.dtype, products) == jax.tree_util.tree_map(
        lambda a: a.dtype, tangents
    )
    G = zm.BatchedGGN(fn, loss)(w, INPUTS.astype(np.float32), targets)
    assert G.dtype == jnp.float32
    close(G, zm.BatchedGGN(fn, loss)(W, INPUTS, targets).astype(np.float32), rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_microbatched_mean_is_the_mean_of_the_batch(name):
    fn, make_loss, targets, _, _ = case(name)
    ggn = zm.BatchedGGN(fn, make_loss(reduction="mean"))
    v = np.sin(np.arange(6.0))

    @eqx.filter_jit
    def everything():
        full = ggn(W, INPUTS, targets)
        results = [full, ggn.operator(W, INPUTS, targets).mv(v)]
        for size in (4, 3):  # 4 + 4, and 3 + 3 + 2
            dataset = zm.Microbatcher(ggn, microbatch_size=size, argnums=(1, 2), accumulator="mean")
            results += [dataset(W, INPUTS, targets), dataset.operator(W, INPUTS, targets).mv(v)]
        return results

    full, product, *microbatched = everything()
    close(product, full @ v)
    for G, Gv in zip(microbatched[::2], microbatched[1::2], strict=True):
        close(G, full)
        close(Gv, full @ v)


def test_squared_error_as_torch_mse_and_laplax_mse():
    outputs = three(W, INPUTS, TARGETS)
    count, width = outputs.shape

    def torch_mse(outputs, targets):  # torch.nn.MSELoss(): the mean of all entries, no 1/2
        return jnp.mean((outputs - targets) ** 2)

    summed = zm.losses.SquaredError(weights=2 / (count * width))
    averaged = zm.losses.SquaredError(weights=2 / width, reduction="mean")
    for loss in (summed, averaged):
        close(loss(outputs, INPUTS, TARGETS), torch_mse(outputs, TARGETS))
    expected = plain_ggn(three, torch_mse, W, INPUTS, TARGETS)
    close(zm.BatchedGGN(three, summed)(W, INPUTS, TARGETS), expected)
    close(zm.BatchedGGN(three, averaged)(W, INPUTS, TARGETS), expected)
    # laplax's "mse": sum over examples of J_i^T (2 I) J_i.
    J = np.asarray(jax.jit(jax.jacfwd(lambda w: three(w, INPUTS, TARGETS)))(W))  # (N, 3, 6)
    laplax = sum(2 * J[i].T @ J[i] for i in range(count))
    close(zm.BatchedGGN(three, zm.losses.SquaredError(weights=2.0))(W, INPUTS, TARGETS), laplax)


@pytest.mark.parametrize(
    "make",
    [
        zm.losses.SquaredError,
        zm.losses.GaussianNLL,
        zm.losses.PoissonNLL,
        zm.losses.SoftmaxCrossEntropy,
    ],
)
def test_reduction_is_sum_or_mean(make):
    name = make.__name__
    for bad in ("avg", "none", "Mean"):
        with pytest.raises(
            ValueError, match=rf"^{name}: `reduction` must be one of 'sum', 'mean'; got {bad!r}"
        ):
            make(reduction=bad)


def test_mean_needs_an_examples_axis():
    scalar = jnp.asarray(0.5)
    with pytest.raises(TypeError, match=r"SquaredError: reduction='mean' .* a scalar"):
        zm.losses.SquaredError(reduction="mean", targets=None)(scalar)
    with pytest.raises(TypeError, match=r"PoissonNLL: reduction='mean' .* a scalar"):
        zm.losses.PoissonNLL(reduction="mean").hessian_product(scalar, scalar, scalar)
    logits = jnp.zeros(3)  # one example's classes, with no examples axis
    with pytest.raises(TypeError, match=r"SoftmaxCrossEntropy: reduction='mean' .* shape \(3,\)"):
        zm.losses.SoftmaxCrossEntropy(reduction="mean")(logits, jnp.asarray(1))
    # In BatchedGGN, the check of the loss names it.
    with pytest.raises(TypeError, match=r"`loss` cannot take .* reduction='mean'"):
        zm.BatchedGGN(jnp.sum, zm.losses.SquaredError(reduction="mean", targets=None))(W)
    with pytest.raises(TypeError, match=r"GaussianNLL: .* shape \(0,\), have none"):
        zm.losses.GaussianNLL(reduction="mean")((jnp.zeros(0), jnp.zeros(0)), jnp.zeros(0))
    # The sum needs none: one example.
    zm.losses.SquaredError(targets=None)(scalar)


def test_save_and_load_keep_the_reduction(tmp_path):
    transform = zm.BatchedGGN(jnp.sin, zm.losses.SoftmaxCrossEntropy(reduction="mean"))
    zm.save(tmp_path / "mean.zm", transform)
    loaded = zm.load(tmp_path / "mean.zm")
    assert loaded == transform and loaded.loss.reduction == "mean"


# --- soft labels ------------------------------------------------------------------------


def soft_labels(classes=3, dtype=jnp.float64):
    logits = jnp.cos(jnp.arange(N * classes, dtype=dtype).reshape(N, classes) * 0.37) * 4
    return jax.nn.softmax(logits)


def test_soft_labels_must_sum_to_one():
    loss = zm.losses.SoftmaxCrossEntropy()
    logits = three(W, INPUTS, None)
    bad = soft_labels().at[2].multiply(1.5)  # the closed form would be off by half here
    with pytest.raises(
        ValueError,
        match=r"^SoftmaxCrossEntropy: the labels \(targets=-1 .*\) are probabilities, so each "
        r"example's must sum to 1 .* within 1\.5e-08 in float64, but one sums to 1\.5\b",
    ):
        loss.hessian_product(logits, logits, INPUTS, bad)
    with pytest.raises(ValueError, match=r"but one sums to 1\.5\b"):
        zm.BatchedGGN(three, loss, jit=False)(W, INPUTS, bad)  # not compiled: concrete labels
    named = zm.losses.SoftmaxCrossEntropy(targets="labels")
    with pytest.raises(ValueError, match=r"labels \(targets='labels' .* sums to 1\.5"):
        named.hessian_product(logits, logits, INPUTS, labels=bad)
    # A tolerance for the dtype: rounding passes, a slip of a few parts in 10^4 does not.
    loss.hessian_product(logits, logits, INPUTS, soft_labels())
    with pytest.raises(ValueError, match=r"within 1\.5e-08 in float64, but one sums to 1\.000001"):
        loss.hessian_product(logits, logits, INPUTS, soft_labels() * (1 + 1e-6))
    many = soft_labels(2000, jnp.float32)  # rounded in float32 over 2000 classes
    logits32 = jnp.zeros((N, 2000), jnp.float32)
    loss.hessian_product(logits32, logits32, INPUTS, many)
    with pytest.raises(ValueError, match=r"in float32, but one sums to 1\.002"):
        loss.hessian_product(logits32, logits32, INPUTS, many.at[0].multiply(1.002))
    # Class indices and labels that sum to one pass.
    loss.hessian_product(logits, logits, INPUTS, LABELS)
    loss.hessian_product(logits, logits, INPUTS, jax.nn.one_hot(LABELS, 3))


def test_soft_labels_must_sum_to_one_under_jit():
    bad = soft_labels().at[2].multiply(1.5)
    ggn = zm.BatchedGGN(three, zm.losses.SoftmaxCrossEntropy())
    message = r"SoftmaxCrossEntropy: the labels \(targets=-1 .*\) are probabilities, so each"
    for call in (
        ggn,  # compiled: the labels are traced inside
        jax.jit(lambda w, inputs, labels: ggn(w, inputs, labels)),
        eqx.filter_jit(ggn),
        lambda *args: ggn.operator(*args).mv(W),
        zm.Microbatcher(ggn, microbatch_size=3, argnums=(1, 2)),
    ):
        with pytest.raises(RuntimeError, match=message):
            jax.block_until_ready(call(W, INPUTS, bad))
    good = soft_labels()
    expected = plain_ggn(three, lambda o, t: cross_entropy(o, t) * N, W, INPUTS, good)
    close(eqx.filter_jit(ggn)(W, INPUTS, good), expected)


@pytest.mark.parametrize("label", [7, 3, -1])
def test_class_indices_outside_the_classes_are_refused(label):
    loss = zm.losses.SoftmaxCrossEntropy()
    logits = three(W, INPUTS, None)
    bad = jnp.asarray(LABELS).at[2].set(label)
    message = (
        r"^SoftmaxCrossEntropy: the labels \(targets=-1 .*\) are class indices, so each must "
        rf"lie in \[0, 3\) for logits of 3 classes \(the last axis\), but one is {label}\b"
    )
    with pytest.raises(ValueError, match=message):
        loss(logits, INPUTS, bad)
    with pytest.raises(ValueError, match=message):
        loss.hessian_product(logits, logits, INPUTS, bad)
    # BatchedGGN tries the loss on the outputs first, and passes its error on in a TypeError.
    with pytest.raises(TypeError, match=message[1:]):
        zm.BatchedGGN(three, loss, jit=False)(W, INPUTS, bad)
    traced = r"SoftmaxCrossEntropy: the labels \(targets=-1 .*\) are class indices, so each"
    for call in (
        jax.jit(loss),
        jax.jit(lambda o, *args: loss.hessian_product(o, o, *args)),
        jax.jit(jax.grad(loss)),
    ):
        with pytest.raises(RuntimeError, match=traced):
            jax.block_until_ready(call(logits, INPUTS, bad))
    with pytest.raises(RuntimeError, match=traced):
        jax.block_until_ready(zm.BatchedGGN(three, loss)(W, INPUTS, bad))
    # Every class index in range passes, eagerly and compiled.
    loss(logits, INPUTS, jnp.asarray([0, 1, 2] * 3)[:N])
    jax.block_until_ready(jax.jit(loss)(logits, INPUTS, LABELS))


def test_empirical_kfac_refuses_class_indices_outside_the_classes(float64):
    model = eqx.nn.MLP(2, 3, 4, 1, key=jax.random.key(0))
    predict = lambda m, inputs, labels: jax.vmap(m)(inputs)  # noqa: E731
    loss = zm.losses.SoftmaxCrossEntropy()
    bad = jnp.asarray(LABELS).at[2].set(7)
    with pytest.raises((ValueError, RuntimeError), match=r"are class indices, so each must"):
        F = zm.KFAC(predict, loss, fisher="empirical")(model, INPUTS, bad)
        jax.block_until_ready(F.as_matrix())
    F = zm.KFAC(predict, loss, fisher="empirical")(model, INPUTS, LABELS)
    assert np.all(np.isfinite(F.as_matrix()))
