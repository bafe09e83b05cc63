"""`zm.influence` and `zm.influence_scorer` against the dense formula
`g_q^T (C + damping I)^{-1} g_t`: per-example gradients by `jax.grad` of the raveled
variables, the curvature as a dense matrix (`jax.hessian` for the exact Hessian and
Gauss-Newton matrix, `as_matrix()` for the structured ones) and `jnp.linalg.solve`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import close
from jax.flatten_util import ravel_pytree

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

DAMPING = 0.1
# Converged far below the tolerance of the comparison.
CG = lx.CG(rtol=1e-13, atol=1e-13)


def as_dtype(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)


@functools.cache
def classifier(dtype=jnp.float64):
    """An MLP (functions and ints among its leaves) and a small labelled data set, built
    once per dtype: the tests only read them."""
    model = as_dtype(eqx.nn.MLP(2, 3, 4, 1, activation=jnp.tanh, key=jax.random.key(0)), dtype)
    inputs = jax.random.normal(jax.random.key(1), (12, 2), dtype)
    labels = jnp.arange(12) % 3
    return model, inputs, labels


def example_loss(model, x, label):
    return -jax.nn.log_softmax(model(x))[label]


def logits(model, inputs, labels):
    return jax.vmap(model)(inputs)


def data_loss(model, inputs, labels):
    return jnp.sum(jax.vmap(example_loss, in_axes=(None, 0, 0))(model, inputs, labels))


def raveled(model):
    params, others = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    return flat, lambda z: eqx.combine(unravel(z), others)


def gradients(model, *examples):
    """`(num_examples, n)`: each example's gradient, raveled."""
    flat, rebuild = raveled(model)

    def one(*example):
        return jax.grad(lambda z: example_loss(rebuild(z), *example))(flat)

    return jax.vmap(one)(*examples)


@eqx.filter_jit
def dense_scores(model, C, query, train, damping=DAMPING):
    gq, gt = gradients(model, *query), gradients(model, *train)
    return gq @ jnp.linalg.solve(C + damping * jnp.eye(C.shape[0], dtype=C.dtype), gt.T)


@eqx.filter_jit
def dense_hessian(model, inputs, labels):
    flat, rebuild = raveled(model)
    return jax.hessian(lambda z: data_loss(rebuild(z), inputs, labels))(flat)


@eqx.filter_jit
def dense_ggn(model, inputs, labels):
    """`J^T H J`: the outputs' Jacobian and the loss's Hessian in the outputs, by
    `jax.jacfwd` and `jax.hessian`."""
    flat, rebuild = raveled(model)
    outputs = logits(model, inputs, labels)
    J = jax.jacfwd(lambda z: logits(rebuild(z), inputs, labels))(flat).reshape(-1, flat.size)

    def loss_of_outputs(out):
        return jnp.sum(-jax.nn.log_softmax(out.reshape(outputs.shape))[jnp.arange(12), labels])

    H = jax.hessian(loss_of_outputs)(outputs.ravel())
    return J.T @ H @ J


def ggn(model, inputs, labels):
    return zm.BatchedGGN(logits, zm.losses.SoftmaxCrossEntropy()).operator(model, inputs, labels)


def leaf_blocks(model, inputs, labels):
    """The dense Gauss-Newton matrix's diagonal blocks, one per variable leaf."""
    G = dense_ggn(model, inputs, labels)
    sizes = [leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))]
    cuts = np.cumsum([0, *sizes])
    blocks = [G[a:b, a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    return zm.BlockDiagonal(blocks, positive_semidefinite=True)


def low_rank(model, inputs, labels):
    """The dense Gauss-Newton matrix's top 4 eigenpairs and the diagonal of the rest."""
    G = dense_ggn(model, inputs, labels)
    values, vectors = jnp.linalg.eigh(G)
    U, s = vectors[:, -4:], values[-4:]
    rest = jnp.diagonal(G) - jnp.sum(U * U * s, axis=1)
    return zm.LowRankDiagonal(U, s, jnp.maximum(rest, 0))


CURVATURES = {
    "ggn": ggn,
    "hessian": lambda m, x, y: zm.BatchedHessian(data_loss).operator(m, x, y),
    "kfac": lambda m, x, y: zm.KFAC(logits, zm.losses.SoftmaxCrossEntropy())(m, x, y),
    "ekfac": lambda m, x, y: zm.EKFAC(logits, zm.losses.SoftmaxCrossEntropy())(m, x, y),
    "blocks": leaf_blocks,
    "low-rank": low_rank,
}


def dense_of(name, C, model, inputs, labels):
    if name == "ggn":
        return dense_ggn(model, inputs, labels)
    if name == "hessian":
        return dense_hessian(model, inputs, labels)
    return C.as_matrix()


def solver_for(name):
    # The Hessian is indefinite away from a minimum: GMRES, as zm.solve picks for it.
    return {"ggn": CG, "hessian": lx.GMRES(rtol=1e-13, atol=1e-13, restart=40)}.get(name)


@pytest.mark.parametrize("name", CURVATURES)
def test_scores_equal_the_dense_formula(name):
    model, inputs, labels = classifier()
    C = CURVATURES[name](model, inputs, labels)
    query, train = (inputs[:3], labels[:3]), (inputs, labels)
    scores = zm.influence(
        example_loss, C, model, query=query, train=train, damping=1.0, solver=solver_for(name)
    )
    expected = dense_scores(model, dense_of(name, C, model, inputs, labels), query, train, 1.0)
    assert scores.shape == (3, 12) and scores.dtype == jnp.float64
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(scores, expected, rtol=1e-8, atol=1e-8 * scale)


@pytest.mark.parametrize("name", ["ggn", "ekfac", "low-rank"])
def test_self_influence_is_the_diagonal_of_the_scores_of_train_against_itself(name):
    model, inputs, labels = classifier()
    C = CURVATURES[name](model, inputs, labels)
    train = (inputs, labels)
    options = dict(damping=DAMPING, solver=solver_for(name), chunk_size=5)
    own = zm.influence(example_loss, C, model, train=train, self_influence=True, **options)
    scores = zm.influence(example_loss, C, model, query=train, train=train, **options)
    assert own.shape == (12,) and own.dtype == jnp.float64
    close(own, np.diagonal(scores), rtol=1e-9, atol=1e-12)
    expected = dense_scores(model, dense_of(name, C, model, inputs, labels), train, train)
    np.testing.assert_allclose(own, np.diagonal(expected), rtol=1e-8)


@pytest.mark.parametrize("chunk_size", [4, 5, 40])
def test_blocks_that_do_and_do_not_divide_the_training_examples(chunk_size):
    model, inputs, labels = classifier()
    C = CURVATURES["kfac"](model, inputs, labels)
    query, train = (inputs[:5], labels[:5]), (inputs, labels)
    whole = zm.influence(example_loss, C, model, query=query, train=train, damping=DAMPING)
    blocked = zm.influence(
        example_loss, C, model, query=query, train=train, damping=DAMPING, chunk_size=chunk_size
    )
    close(blocked, whole, rtol=1e-12, atol=1e-14)


def test_a_budget_plans_the_blocks_and_a_bar_shows_them(capsys):
    model, inputs, labels = classifier()
    C = CURVATURES["kfac"](model, inputs, labels)
    query, train = (inputs[:2], labels[:2]), (inputs, labels)
    whole = zm.influence(example_loss, C, model, query=query, train=train, damping=DAMPING)
    planned = zm.influence(
        example_loss,
        C,
        model,
        query=query,
        train=train,
        damping=DAMPING,
        max_memory="20MB",
        progress=True,
    )
    close(planned, whole, rtol=1e-12, atol=1e-14)
    assert "block" in capsys.readouterr().err


def test_float32_within_float32_tolerances():
    model, inputs, labels = classifier(jnp.float32)
    query, train = (inputs[:3], labels[:3]), (inputs, labels)
    model64, inputs64 = as_dtype(model, jnp.float64), inputs.astype(jnp.float64)
    for name in ("ggn", "ekfac"):
        C = CURVATURES[name](model, inputs, labels)
        scores = zm.influence(example_loss, C, model, query=query, train=train, damping=1.0)
        assert scores.dtype == jnp.float32
        # The formula in float64 at the same weights, with the same approximation.
        dense = dense_ggn(model64, inputs64, labels) if name == "ggn" else C.as_matrix()
        expected = dense_scores(
            model64, dense.astype(jnp.float64), (inputs64[:3], labels[:3]), (inputs64, labels), 1.0
        )
        scale = float(np.max(np.abs(expected)))
        np.testing.assert_allclose(scores, expected, rtol=1e-3, atol=1e-4 * scale)


class Model(eqx.Module):
    """A pytree model with leaves that are no variables: an int array, a function, a
    string."""

    weights: dict
    counts: jax.Array
    activation: object
    name: str

    def __call__(self, x):
        hidden = self.activation(self.weights["first"] @ x) * self.counts[0]
        return self.weights["second"] @ hidden + self.weights["bias"]


def test_a_pytree_model_with_leaves_that_are_no_variables():
    key1, key2 = jax.random.split(jax.random.key(3))
    weights = {
        "first": jax.random.normal(key1, (4, 2)),
        "second": jax.random.normal(key2, (3, 4)),
        "bias": jnp.zeros(3),
    }
    model = Model(weights, jnp.array([2]), jnp.tanh, "small")
    _, inputs, labels = classifier()
    C = CURVATURES["kfac"](model, inputs, labels)
    query, train = (inputs[:2], labels[:2]), (inputs, labels)
    scores = zm.influence(example_loss, C, model, query=query, train=train, damping=DAMPING)
    expected = dense_scores(model, C.as_matrix(), query, train)
    np.testing.assert_allclose(scores, expected, rtol=1e-8)


def test_under_jit_with_a_traced_damping():
    model, inputs, labels = classifier()
    C = CURVATURES["kfac"](model, inputs, labels)
    query, train = (inputs[:2], labels[:2]), (inputs, labels)

    @jax.jit
    def scores(damping, inputs):
        train = (inputs, labels)
        return zm.influence(example_loss, C, model, query=query, train=train, damping=damping)

    expected = zm.influence(example_loss, C, model, query=query, train=train, damping=DAMPING)
    close(scores(jnp.asarray(DAMPING), inputs), expected, rtol=1e-12, atol=1e-14)


def test_the_scorer_streams_to_a_file_and_resumes(tmp_path):
    model, inputs, labels = classifier()
    C = CURVATURES["ggn"](model, inputs, labels)
    query, train = (inputs[:3], labels[:3]), (inputs, labels)
    options = dict(damping=DAMPING, solver=CG)
    expected = zm.influence(example_loss, C, model, query=query, train=train, **options)
    scorer = zm.influence_scorer(example_loss, C, model, query=query, chunk_size=5, **options)
    assert isinstance(scorer, zm.ChunkedVmap)
    path = tmp_path / "scores.npy"
    on_disk = zm.to_file(path, scorer, *train)
    assert on_disk.shape == (3, 12) and not on_disk.flags.writeable
    close(np.asarray(on_disk), np.asarray(expected), rtol=1e-12, atol=1e-14)
    again = zm.to_file(path, scorer, *train)  # finished: nothing recomputed
    close(np.asarray(again), np.asarray(on_disk), exact=True)


def test_no_training_examples():
    model, inputs, labels = classifier()
    C = CURVATURES["blocks"](model, inputs, labels)
    none = (inputs[:0], labels[:0])
    scores = zm.influence(
        example_loss, C, model, query=(inputs[:2], labels[:2]), train=none, damping=DAMPING
    )
    assert scores.shape == (2, 0) and scores.dtype == jnp.float64


# -- refusals ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def problem():
    # Nothing is computed by a refused call: an identity serves as the curvature.
    model, inputs, labels = classifier(jnp.float32)
    return model, inputs, labels, zm.BlockDiagonal([jnp.eye(27, dtype=jnp.float32)])


REFUSALS = {
    "query as a list": (lambda x, y: dict(query=[x[:2], y[:2]]), TypeError, "`query`"),
    "query as an array": (lambda x, y: dict(query=x[:2]), TypeError, "`query`"),
    "train holding a list": (lambda x, y: dict(train=(x, [0] * 12)), TypeError, "`train[1]`"),
    "train of a 0-d array": (lambda x, y: dict(train=(x, y[0])), ValueError, "`train[1]`"),
    "an empty train": (lambda x, y: dict(train=()), ValueError, "`train`"),
    "counts that differ": (lambda x, y: dict(train=(x, y[:11])), ValueError, "`train[1]`: 11"),
    "query counts that differ": (
        lambda x, y: dict(query=(x[:3], y[:2])),
        ValueError,
        "`query[0]`: 3",
    ),
    "a negative damping": (lambda x, y: dict(damping=-1.0), ValueError, "damping=-1.0"),
    "a NaN damping": (lambda x, y: dict(damping=float("nan")), ValueError, "damping=nan"),
    "a damping that is no number": (lambda x, y: dict(damping="0.1"), TypeError, "`damping`"),
    "a dense matrix as curvature": (
        lambda x, y: dict(curvature=jnp.eye(27)),
        TypeError,
        "`curvature`",
    ),
    "a curvature of another size": (
        lambda x, y: dict(curvature=zm.BlockDiagonal([jnp.eye(5)])),
        ValueError,
        "27 variables",
    ),
    "a loss that is no scalar": (
        lambda x, y: dict(loss=lambda model, x, label: jax.nn.log_softmax(model(x))),
        ValueError,
        "`loss` must return a real floating scalar",
    ),
    "no query": (lambda x, y: dict(query=None), ValueError, "`query` is missing"),
    "a query with self-influence": (
        lambda x, y: dict(self_influence=True),
        ValueError,
        "`query` must be left out",
    ),
    "a model without variables": (
        lambda x, y: dict(model={"counts": jnp.arange(3)}),
        ValueError,
        "`model`",
    ),
    "both block options": (
        lambda x, y: dict(chunk_size=4, max_memory="1GB"),
        ValueError,
        "at most one of `chunk_size` and `max_memory`",
    ),
    "a chunk size of 0": (lambda x, y: dict(chunk_size=0), ValueError, "`chunk_size`"),
}


@pytest.mark.parametrize("label", REFUSALS)
def test_bad_input_is_refused_in_words(problem, label):
    changes, error, words = REFUSALS[label]
    _, inputs, labels, _ = problem
    changes = changes(inputs, labels)
    model, _, _, C = problem
    loss = changes.pop("loss", example_loss)
    curvature = changes.pop("curvature", C)
    model = changes.pop("model", model)
    arguments = dict(query=(inputs[:2], labels[:2]), train=(inputs, labels), damping=DAMPING)
    with pytest.raises(error, match="zm.influence") as raised:
        zm.influence(loss, curvature, model, **(arguments | changes))
    assert words in str(raised.value), str(raised.value)


def test_the_scorer_needs_its_blocks(problem):
    model, inputs, labels, C = problem
    with pytest.raises(ValueError, match="`chunk_size`.*`max_memory`"):
        zm.influence_scorer(example_loss, C, model, query=(inputs, labels), damping=DAMPING)
