"""Calls compiled lean (`AbstractPlanned.compiled_lean`, `Policy.lean_options`): KFAC's
builds and `eigsh`'s iteration, whose compile sets their peak on a CPU, take the
platform's lean options; every other planned call takes XLA's defaults, and a probe its
own options."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zodmem as zm
from zodmem._estimators import _held
from zodmem._plan import _budget, _lean
from zodmem._plan._compiled import CPU_LEAN_OPTIONS, CPU_PROBE_OPTIONS


def predict(model, inputs, labels):
    return jax.vmap(model)(inputs)


@pytest.fixture
def compiles(monkeypatch):
    """The options of every compile the planner makes, with its plans forgotten."""
    seen = []
    original = _budget.compile_traced

    def recording(traced, options=None):
        seen.append(options)
        return original(traced, options)

    monkeypatch.setattr(_budget, "compile_traced", recording)
    _budget._PLANS.clear()
    yield seen
    _budget._PLANS.clear()


def data(size):
    model = eqx.nn.MLP(5, 3, 7, 1, key=jax.random.key(0))
    inputs = jax.random.normal(jax.random.key(1), (size, 5))
    return model, inputs, jnp.arange(size) % 3


def test_the_policies_lean_options():
    assert (
        _budget.policy_of("cpu").lean_options
        == CPU_LEAN_OPTIONS
        == {"xla_cpu_use_fusion_emitters": False}
    )
    assert _budget.policy_of("gpu").lean_options is None  # XLA's defaults


@pytest.mark.parametrize("transform", [zm.KFAC, zm.EKFAC])
def test_kfac_s_planned_passes_are_compiled_lean(compiles, transform):
    model, inputs, labels = data(22)
    kfac = transform(predict, zm.losses.SoftmaxCrossEntropy(), max_memory="1GB")
    built = kfac(model, inputs, labels)
    for_call = [options for options in compiles if options != CPU_PROBE_OPTIONS]
    assert for_call and all(options == CPU_LEAN_OPTIONS for options in for_call)
    # The same operator as in one block of the whole batch, compiled at XLA's defaults.
    whole = transform(predict, zm.losses.SoftmaxCrossEntropy())
    expected = eqx.filter_jit(lambda *a: whole(*a).as_matrix())(model, inputs, labels)
    np.testing.assert_allclose(built.as_matrix(), expected, rtol=1e-5, atol=1e-6)


def test_a_microbatcher_s_call_is_compiled_at_xla_s_defaults(compiles):
    model, inputs, labels = data(23)

    def loss(model, inputs, labels):
        return jnp.sum(predict(model, inputs, labels) ** 2)

    gradient = zm.Microbatcher(eqx.filter_grad(loss), max_memory="1GB", argnums=(1, 2))
    gradient(model, inputs, labels)
    for_call = [options for options in compiles if options != CPU_PROBE_OPTIONS]
    assert for_call and all(options is None for options in for_call)


@pytest.fixture
def platforms(monkeypatch):
    """The platforms whose lean options `lean_jit`'s calls asked for (`None`: none)."""
    asked = []
    original = _lean._jitted.__wrapped__

    def recording(platform):
        asked.append(platform)
        return original(platform)

    monkeypatch.setattr(_lean, "_jitted", recording)
    return asked


def test_a_build_is_compiled_lean_at_the_top_level_only(platforms):
    asked = platforms
    model, inputs, labels = data(9)
    kfac = zm.KFAC(predict, zm.losses.SoftmaxCrossEntropy())
    alone = kfac(model, inputs, labels).as_matrix()
    traced = eqx.filter_jit(lambda *a: kfac(*a).as_matrix())(model, inputs, labels)
    assert asked == [jax.default_backend(), None]  # under `jax.jit`: that program's options
    np.testing.assert_allclose(alone, traced, rtol=1e-5, atol=1e-6)


def hessian_operator(max_memory=None):
    model, inputs, labels = data(12)

    def loss(model, inputs, labels):
        return jnp.mean(predict(model, inputs, labels) ** 2)

    return zm.BatchedHessian(loss, max_memory=max_memory).operator(model, inputs, labels)


def test_eigsh_s_iteration_is_compiled_lean(platforms):
    op = hessian_operator()
    values, vectors = zm.eigsh(op, 2)
    traced = eqx.filter_jit(lambda op: zm.eigsh(op, 2)[0])(op)
    assert platforms == [jax.default_backend(), None]  # under `jax.jit`: that program's
    expected = jnp.linalg.eigh(op.as_matrix())[0][-2:]
    np.testing.assert_allclose(values, expected, rtol=1e-4)
    np.testing.assert_allclose(traced, values, rtol=1e-5)


def test_eigsh_s_iteration_within_a_budget_is_compiled_lean(monkeypatch):
    # The executable compiled to count the iteration's peak is the one that runs.
    seen = []
    original = _held.compile_call

    def recording(*args, options=None, **kwargs):
        seen.append(options)
        return original(*args, options=options, **kwargs)

    monkeypatch.setattr(_held, "compile_call", recording)
    _held._COMPILED.clear()
    op = hessian_operator("1GB")
    values, _ = zm.eigsh(op, 2)
    assert seen == [_budget.policy_of(jax.default_backend()).lean_options]
    expected = jnp.linalg.eigh(op.as_matrix())[0][-2:]
    np.testing.assert_allclose(values, expected, rtol=1e-4)
