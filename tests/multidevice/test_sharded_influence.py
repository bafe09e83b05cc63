"""`zm.influence` of a model whose variables are sharded over the devices (FSDP, data-
and tensor-parallel layouts): the scores those of the same model on one device,
replicated on every device of the mesh, and the preconditioned queries laid out like the
variables (a block axis first), so that scoring the training examples gathers no
vector of the variables.

Run in a process of its own with `--xla_force_host_platform_device_count=4`: the device
count is read here.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from jax.sharding import AxisType

import zodmem as zm
from tests.multidevice.models import D, check_laid_out, laid_out

CG = lx.CG(rtol=1e-7, atol=1e-7)


def example_loss(model, x, label):
    return -jax.nn.log_softmax(model(x))[label]


def logits(model, inputs, labels):
    return jax.vmap(model)(inputs)


def problem():
    model = eqx.nn.MLP(3, D, 2 * D, 1, activation=jnp.tanh, key=jax.random.key(0))
    inputs = jax.random.normal(jax.random.key(1), (2 * D, 3))
    labels = jnp.arange(2 * D) % D
    return model, inputs, labels


def ggn(model, inputs, labels):
    return zm.BatchedGGN(logits, zm.losses.SoftmaxCrossEntropy()).operator(model, inputs, labels)


CURVATURES = {
    "ggn": ggn,
    "low-rank": lambda m, x, y: zm.low_rank(ggn(m, x, y), 3),
    "kfac": lambda m, x, y: zm.KFAC(logits, zm.losses.SoftmaxCrossEntropy())(m, x, y),
}
OPTIONS = dict(damping=0.5, solver=CG, chunk_size=3)


@functools.cache
def on_one_device(name):
    """The scores of every training example against every other, the model on one device."""
    model, inputs, labels = problem()
    C = CURVATURES[name](model, inputs, labels)
    train = (inputs, labels)
    return zm.influence(example_loss, C, model, query=train, train=train, **OPTIONS)


def replicated_on(array, mesh):
    assert array.sharding.is_fully_replicated, array.sharding
    assert set(array.sharding.device_set) == set(mesh.devices.flat)


@pytest.mark.parametrize(
    "name, layout",
    [(name, layout) for name in CURVATURES for layout in ("fsdp", "data")] + [("ggn", "tensor")],
)
def test_scores_of_a_sharded_model_equal_those_on_one_device(name, layout):
    model, inputs, labels = problem()
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Auto,))
    sharded, xs, ys = laid_out(mesh, model, inputs, labels, layout, batch=layout == "data")
    # KFAC's factors (small) of the model on one device; its solves take flat vectors.
    at = (model, inputs, labels) if name == "kfac" else (sharded, xs, ys)
    C = CURVATURES[name](*at)
    every = on_one_device(name)
    scores = zm.influence(
        example_loss, C, sharded, query=(xs[:2], ys[:2]), train=(xs, ys), **OPTIONS
    )
    replicated_on(scores, mesh)
    np.testing.assert_allclose(scores, every[:2], rtol=2e-4, atol=2e-5)
    own = zm.influence(example_loss, C, sharded, train=(xs, ys), self_influence=True, **OPTIONS)
    replicated_on(own, mesh)
    np.testing.assert_allclose(own, jnp.diagonal(every), rtol=2e-4, atol=2e-5)
    if layout == "data" and name != "kfac":
        # The scorer itself, called with training examples split over the devices, whose
        # shard_map these solves do not run in yet, says what to do.
        scorer = zm.influence_scorer(
            example_loss, C, sharded, self_influence=True, damping=0.5, solver=CG, chunk_size=3
        )
        with pytest.raises(ValueError, match="Give the training arrays replicated"):
            scorer(xs, ys)


@pytest.mark.parametrize("layout", ["fsdp", "tensor"])
def test_the_preconditioned_queries_are_laid_out_like_the_variables(layout):
    model, inputs, labels = problem()
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Auto,))
    sharded, xs, ys = laid_out(mesh, model, inputs, labels, layout, batch=False)
    C = zm.low_rank(ggn(sharded, xs, ys), 3)
    scorer = zm.influence_scorer(
        example_loss, C, sharded, query=(xs[:3], ys[:3]), damping=0.5, chunk_size=4
    )
    check_laid_out(scorer.fn.queries, sharded, block=True)
    for query, variable in zip(
        jax.tree.leaves(scorer.fn.queries),
        jax.tree.leaves(eqx.filter(sharded, eqx.is_inexact_array)),
        strict=True,
    ):
        assert query.shape == (3, *variable.shape)
