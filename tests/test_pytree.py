"""The pytree layer: which leaves are variables, and raveling them in and out."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mlp, tree_size
from hypothesis import given, strategies as st
from jax.flatten_util import ravel_pytree

from zodmem._pytree import basis_block, flat_function, split_variables

pytestmark = pytest.mark.usefixtures("float64")


class Holder(eqx.Module):
    """A model with leaves of every kind: arrays, ints, bools, functions, strings."""

    weight: jax.Array
    bias: jax.Array
    count: int
    flag: bool
    steps: jax.Array
    activation: object
    name: str = eqx.field(static=True)


def make_holder():
    return Holder(
        weight=jnp.arange(6.0).reshape(2, 3),
        bias=jnp.asarray(0.5),
        count=3,
        flag=True,
        steps=jnp.arange(4),
        activation=jax.nn.tanh,
        name="holder",
    )


# Pytrees of float arrays only, so that `ravel_pytree` is a reference. Built lazily:
# float64 is enabled only while the tests run.
FLOAT_TREES = {
    "scalar": lambda: jnp.asarray(2.0),
    "vector": lambda: jnp.arange(5.0),
    "dict": lambda: {"a": jnp.arange(3.0), "b": jnp.ones((2, 2)), "c": jnp.asarray(-1.0)},
    "nested": lambda: (
        jnp.ones((1, 3)),
        [jnp.zeros(()), jnp.arange(2.0)],
        {"z": jnp.full((2, 1, 2), 3.0)},
    ),
    "mixed-precision": lambda: [
        jnp.arange(4.0, dtype=jnp.float32),
        jnp.arange(2.0, dtype=jnp.float64),
    ],
    "numpy-leaf": lambda: {"np": np.arange(3.0), "jnp": jnp.ones(2)},
}


@pytest.mark.parametrize("name", FLOAT_TREES)
def test_ravel_matches_ravel_pytree(name):
    tree = FLOAT_TREES[name]()
    flat, variables = split_variables(tree)
    expected, unravel = ravel_pytree(tree)
    assert flat.dtype == expected.dtype
    np.testing.assert_array_equal(flat, expected)
    assert variables.size == expected.size
    assert variables.dtype == expected.dtype
    back = variables.unravel(flat * 2)
    reference = unravel(expected * 2)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(reference)
    for leaf, ref in zip(
        jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(reference), strict=True
    ):
        assert leaf.shape == ref.shape
        assert leaf.dtype == ref.dtype
        np.testing.assert_array_equal(leaf, ref)


def test_mixed_precision_keeps_leaf_dtypes():
    tree = {"half": jnp.ones(2, jnp.float32), "full": jnp.ones(3, jnp.float64)}
    flat, variables = split_variables(tree)
    assert flat.dtype == jnp.float64
    assert variables.dtypes == (jnp.dtype(jnp.float64), jnp.dtype(jnp.float32))
    back = variables.unravel(flat)
    assert back["half"].dtype == jnp.float32
    assert back["full"].dtype == jnp.float64


def test_fixed_leaves_are_held_and_restored():
    model = make_holder()
    flat, variables = split_variables(model)
    np.testing.assert_array_equal(flat, jnp.concatenate([jnp.arange(6.0), jnp.asarray([0.5])]))
    assert variables.shapes == ((2, 3), ())
    assert variables.offsets == (0, 6)
    assert variables.sizes == (6, 1)
    back = variables.unravel(-flat)
    np.testing.assert_array_equal(back.weight, -model.weight)
    np.testing.assert_array_equal(back.bias, -model.bias)
    assert back.count == 3 and back.flag is True and back.name == "holder"
    assert back.activation is jax.nn.tanh
    # An integer array is a fixed leaf too, put back as the very same object.
    assert back.steps is model.steps


def test_mlp_variables_are_its_arrays():
    mlp = make_mlp(3, 2, 4, 2)
    flat, variables = split_variables(mlp)
    params = eqx.filter(mlp, eqx.is_inexact_array)
    expected, _ = ravel_pytree(params)
    np.testing.assert_array_equal(flat, expected)
    assert variables.size == 3 * 4 + 4 + 4 * 4 + 4 + 4 * 2 + 2
    back = variables.unravel(flat + 1)
    assert back.activation is mlp.activation
    assert back.final_activation is mlp.final_activation
    np.testing.assert_allclose(
        back(jnp.ones(3)),
        eqx.combine(jax.tree_util.tree_map(lambda p: p + 1, params), mlp)(jnp.ones(3)),
    )


def test_python_floats_are_not_variables():
    flat, variables = split_variables({"a": jnp.ones(2), "b": 3.0})
    assert variables.size == 2
    assert variables.unravel(flat)["b"] == 3.0


@pytest.mark.parametrize(
    "tree",
    [{"n": jnp.arange(3), "f": jax.nn.relu}, (1, True, "s"), jnp.zeros(0, jnp.int32), {}],
    ids=["ints-and-function", "python-scalars", "int-array", "empty"],
)
def test_no_inexact_leaves_is_an_error(tree):
    with pytest.raises(ValueError, match="has no inexact-array leaves"):
        split_variables(tree)
    with pytest.raises(ValueError, match="`params` has no inexact-array leaves"):
        split_variables(tree, argname="params")


def test_zero_size_leaf_is_a_variable_of_size_zero():
    flat, variables = split_variables({"a": jnp.zeros((0, 3)), "b": jnp.arange(2.0)})
    assert variables.size == 2
    back = variables.unravel(flat)
    assert back["a"].shape == (0, 3)
    np.testing.assert_array_equal(back["b"], jnp.arange(2.0))


def test_split_per_leaf_and_fill():
    tree = {"a": jnp.ones((2, 2)), "b": jnp.ones(()), "c": jax.nn.relu}
    _, variables = split_variables(tree)
    matrix = jnp.arange(3 * 5.0).reshape(3, 5)
    pieces = variables.split_per_leaf(matrix, axis=-1)
    assert [p.shape for p in pieces] == [(3, 2, 2), (3,)]
    np.testing.assert_array_equal(pieces[0].reshape(3, 4), matrix[:, :4])
    np.testing.assert_array_equal(pieces[1], matrix[:, 4])
    pieces = variables.split_per_leaf(matrix.T, axis=0)
    assert [p.shape for p in pieces] == [(2, 2, 3), (3,)]
    filled = variables.fill(pieces, keep_fixed=False)
    assert filled["c"] is None
    assert variables.fill(pieces)["c"] is jax.nn.relu


def test_flat_function_and_basis_block():
    tree = {"a": jnp.arange(3.0), "k": 2}
    flat, variables = split_variables(tree)

    def fn(x, shift, *, scale):
        return scale * x["a"] ** x["k"] + shift

    fn_of_flat = flat_function(fn, variables, (1.0,), {"scale": 3.0})
    np.testing.assert_allclose(fn_of_flat(flat), 3.0 * jnp.arange(3.0) ** 2 + 1.0)
    block = basis_block(jnp.asarray(1), 2, 4, jnp.float64)
    np.testing.assert_array_equal(block, jnp.eye(4)[1:3])
    assert block.dtype == jnp.float64
    assert tree_size({"a": jnp.ones((2, 3)), "b": jnp.ones(()), "c": 1.0}) == 8


shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


@st.composite
def pytrees(draw, depth=0):
    """Nested dicts/tuples/lists of float32/float64 arrays (with some fixed leaves)."""
    kind = draw(
        st.sampled_from(["leaf", "leaf", "dict", "tuple", "list"] if depth < 2 else ["leaf"])
    )
    if kind == "leaf":
        if draw(st.integers(0, 5)) == 0:
            return draw(st.sampled_from([1, True, jax.nn.relu, jnp.arange(2)]))
        shape = draw(shapes)
        dtype = draw(st.sampled_from([jnp.float32, jnp.float64]))
        start = draw(st.integers(-5, 5))
        return jnp.arange(start, start + np.prod(shape, dtype=int), dtype=dtype).reshape(shape)
    children = draw(st.lists(pytrees(depth + 1), min_size=1, max_size=3))
    if kind == "dict":
        return {f"k{i}": c for i, c in enumerate(children)}
    return tuple(children) if kind == "tuple" else children


@given(pytrees())
def test_round_trip_of_random_pytrees(tree):
    params, static = eqx.partition(tree, eqx.is_inexact_array)
    if not jax.tree_util.tree_leaves(params):
        with pytest.raises(ValueError, match="no inexact-array leaves"):
            split_variables(tree)
        return
    flat, variables = split_variables(tree)
    expected, unravel = ravel_pytree(params)
    assert flat.dtype == expected.dtype
    np.testing.assert_array_equal(flat, expected)
    assert variables.size == flat.size == tree_size(params)
    back = variables.unravel(flat + 1)
    reference = eqx.combine(unravel(expected + 1), static)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for leaf, ref in zip(
        jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(reference), strict=True
    ):
        if eqx.is_array(ref):
            assert leaf.dtype == ref.dtype and leaf.shape == ref.shape
            np.testing.assert_array_equal(leaf, ref)
        else:
            assert leaf is ref
