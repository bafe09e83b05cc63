"""KFAC and EKFAC are transforms like the others: saved and loaded, planned, with a bar."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kfac_functions import predict

import zodmem as zm

_LOSS = zm.losses.SoftmaxCrossEntropy(reduction="mean")


@pytest.fixture(scope="module")
def problem():
    model = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    inputs = jax.random.normal(jax.random.key(1), (24, 4))
    labels = jnp.arange(24) % 3
    return model, inputs, labels


@pytest.mark.parametrize("cls", [zm.KFAC, zm.EKFAC])
@pytest.mark.parametrize(
    "options",
    [{}, {"microbatch_size": 5}, {"fisher": "mc", "key": jax.random.key(3), "mc_samples": 2}],
)
def test_a_saved_kfac_loads_and_gives_the_same_operator(tmp_path, problem, cls, options):
    model, inputs, labels = problem
    kfac = cls(predict, _LOSS, **options)
    assert isinstance(kfac, zm.AbstractTransform)
    zm.save(tmp_path / "kfac.zm", kfac)
    loaded = zm.load(tmp_path / "kfac.zm")
    assert type(loaded) is cls and loaded.config == kfac.config
    np.testing.assert_array_equal(
        loaded(model, inputs, labels).as_matrix(), kfac(model, inputs, labels).as_matrix()
    )


@pytest.mark.parametrize("cls", [zm.KFAC, zm.EKFAC])
def test_the_plan_is_the_microbatches_the_call_uses(problem, cls):
    model, inputs, labels = problem
    by_size = cls(predict, _LOSS, microbatch_size=5).plan(model, inputs, labels)
    assert (by_size.block_size, by_size.num_blocks, by_size.total) == (5, 5, 24)
    assert by_size.owner == cls.__name__ and by_size.budget_bytes is None
    whole = cls(predict, _LOSS).plan(model, inputs, labels)
    assert (whole.block_size, whole.num_blocks) == (24, 1)
    budget = cls(predict, _LOSS, max_memory="1GB").plan(model, inputs, labels)
    assert budget.fits and budget.budget_bytes == 10**9 and budget.num_blocks == 1


def test_a_tight_budget_plans_several_microbatches_within_it(problem):
    model, _, _ = problem
    inputs = jax.random.normal(jax.random.key(1), (4096, 4))
    labels = jnp.arange(4096) % 3
    whole = zm.KFAC(predict, _LOSS).plan(model, inputs, labels)
    budget = whole.peak_bytes // 3
    plan = zm.KFAC(predict, _LOSS, max_memory=budget).plan(model, inputs, labels)
    assert plan.num_blocks > 1 and plan.peak_bytes <= budget
    kfac = zm.KFAC(predict, _LOSS, max_memory=budget)(model, inputs, labels)
    np.testing.assert_allclose(
        kfac.as_matrix(),
        zm.KFAC(predict, _LOSS)(model, inputs, labels).as_matrix(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_plan_passes_arguments_of_another_length_whole():
    # Inputs (N, D) beside positions (T, D) shared by every example, then the targets.
    def shifted(model, inputs, positions, targets):
        return jax.vmap(model)(inputs + positions[0])

    model = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    inputs, positions, targets = jnp.ones((6, 4)), jnp.ones((2, 4)), jnp.zeros((6, 3))
    loss = zm.losses.SquaredError()
    plan = zm.KFAC(shifted, loss).plan(model, inputs, positions, targets)
    assert (plan.block_size, plan.num_blocks) == (6, 1)
