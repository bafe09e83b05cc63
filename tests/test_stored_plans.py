"""Plans kept beside JAX's persistent compilation cache (`_plan/_stored.py`): a call
planned again in another process takes the kept plan in one compile where its program
and budget are the same, and plans as if nothing were kept otherwise. (The folder is
set here directly; `tests/test_compilation_cache.py` runs it through JAX's option in
fresh processes.)"""

import glob
import os
import shutil

import jax.numpy as jnp
import pytest

import zodmem as zm
from zodmem._plan import _budget, _stored


@pytest.fixture
def folder(tmp_path, monkeypatch):
    path = str(tmp_path / "plans")
    monkeypatch.setattr(_stored, "_folder", lambda: path)
    return path


def _fresh_plan(fn, budget, x):
    _budget._PLANS.clear()  # another process: nothing planned in this one
    return zm.BatchedHessian(fn, max_memory=budget).plan(x)


def _fn(kind):
    # The same qualified name for programs that differ: what a script edited between
    # two runs gives.
    def f(w):
        if kind == "cube":
            return jnp.sum(jnp.sin(w) ** 3)
        return jnp.sum(jnp.outer(w, w) ** 2) + jnp.sum(jnp.outer(jnp.cos(w), w) ** 3)

    return f


X = jnp.linspace(0.1, 1.0, 48)


def _decision(plan):
    return plan.block_size, plan.strategy, plan.peak_bytes, plan.output_bytes


def test_a_kept_plan_is_taken_in_one_compile(folder):
    first = _fresh_plan(_fn("outer"), "200kB", X)
    assert first.compiles > 1
    assert len(glob.glob(os.path.join(folder, "*.json"))) == 1
    second = _fresh_plan(_fn("outer"), "200kB", X)
    assert second.compiles == 1
    assert _decision(second) == _decision(first)


def test_a_kept_plan_of_another_program_is_not_taken(folder):
    kept = _fresh_plan(_fn("outer"), "200kB", X)
    edited = _fresh_plan(_fn("cube"), "200kB", X)  # the same key, another program
    assert edited.compiles > 1
    shutil.rmtree(folder)
    assert _decision(edited) == _decision(_fresh_plan(_fn("cube"), "200kB", X))
    assert _decision(edited) != _decision(kept)


def test_a_kept_plan_that_does_not_fit_is_not_taken(folder):
    _fresh_plan(_fn("outer"), "1MB", X)
    (large,) = glob.glob(os.path.join(folder, "*.json"))
    small = _fresh_plan(_fn("outer"), "200kB", X)
    (small_path,) = set(glob.glob(os.path.join(folder, "*.json"))) - {large}
    shutil.copyfile(large, small_path)  # the larger budget's choice, under this key
    again = _fresh_plan(_fn("outer"), "200kB", X)
    assert again.compiles > 1
    assert _decision(again) == _decision(small)
    assert again.peak_bytes <= again.budget_bytes


@pytest.mark.parametrize("record", ["not json", '{"strategy": 1}', '{"block_size": 9999}'])
def test_a_damaged_record_plans_as_usual(folder, record):
    made = _fresh_plan(_fn("outer"), "200kB", X)
    (path,) = glob.glob(os.path.join(folder, "*.json"))
    with open(path, "w") as file:
        file.write(record)
    again = _fresh_plan(_fn("outer"), "200kB", X)
    assert again.compiles > 1
    assert _decision(again) == _decision(made)
