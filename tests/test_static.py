"""`Static`: a hashable value carried as a pytree with no leaves."""

import dataclasses
import math
import re
import textwrap
import typing
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import zodmem as zm

hashable_values = st.one_of(
    st.integers(),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.tuples(st.integers(), st.text(max_size=3)),
    st.frozensets(st.integers(), max_size=3),
)


@given(value=hashable_values)
def test_no_leaves_and_the_value_in_the_structure(value):
    static = zm.Static(value)
    leaves, treedef = jax.tree_util.tree_flatten(static)
    assert leaves == []
    rebuilt = jax.tree_util.tree_unflatten(treedef, [])
    assert isinstance(rebuilt, zm.Static) and rebuilt.value == value
    assert jax.tree_util.tree_map(lambda leaf: 1 / 0, static) == static


def same_value(a, b):
    """Equal values of the same types, inside tuples and frozensets too; a float's sign
    counts (0.0 and -0.0 differ)."""
    if type(a) is not type(b) or a != b:
        return False
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, tuple):
        return all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, frozenset):
        return all(any(same_value(x, y) for y in b) for x in a)
    return True


mixed_values = st.one_of(
    hashable_values,
    st.floats(allow_nan=False),
    st.tuples(st.one_of(st.integers(0, 2), st.booleans(), st.floats(0, 2))),
    st.frozensets(st.one_of(st.integers(0, 2), st.booleans()), max_size=2),
)


@given(a=mixed_values, b=mixed_values)
def test_equality_and_hash_by_value_and_type(a, b):
    assert zm.Static(a) == zm.Static(a)
    assert hash(zm.Static(a)) == hash(zm.Static(a))
    assert (zm.Static(a) == zm.Static(b)) == same_value(a, b)
    assert jax.tree_util.tree_structure(zm.Static(a)) == jax.tree_util.tree_structure(zm.Static(a))


def test_jit_compiles_once_per_value():
    traces = []

    @jax.jit
    def scale(x, how):
        traces.append(how.value)
        return 2 * x if how.value == "double" else x

    x = jnp.arange(3.0)
    np.testing.assert_array_equal(scale(x, zm.Static("double")), 2 * x)
    np.testing.assert_array_equal(scale(x, zm.Static("double")), 2 * x)
    np.testing.assert_array_equal(scale(x, zm.Static("same")), x)
    assert traces == ["double", "same"]


@pytest.mark.parametrize(
    "first, second",
    [(1, True), (1, 1.0), (0, False), ((1, 2), (1.0, 2)), (frozenset({1}), frozenset({True}))],
)
def test_values_equal_in_python_but_of_other_types_stay_apart(first, second):
    assert zm.Static(first) != zm.Static(second)
    assert jax.tree_util.tree_structure(zm.Static(first)) != jax.tree_util.tree_structure(
        zm.Static(second)
    )


@dataclasses.dataclass(frozen=True)
class Setting:
    level: object
    name: str = "a"


class Pair(typing.NamedTuple):
    first: object
    second: object


def traces_of(values):
    """How often `jax.jit` traces a function called with `Static(value)` for each value."""
    traces = []

    @jax.jit
    def read(x, how):
        traces.append(how.value)
        return x

    for value in values:
        read(jnp.zeros(()), zm.Static(value))
    return len(traces)


@pytest.mark.parametrize(
    "first, second",
    [
        (Setting(1), Setting(True)),
        (Setting(1), Setting(1.0)),
        (Setting((1, 1)), Setting((1, True))),
        (0.0, -0.0),
        ((0.0,), (-0.0,)),
        (Setting(0.0), Setting(-0.0)),
        (complex(0.0, 0.0), complex(0.0, -0.0)),
        (Pair(1, 2), (1, 2)),
        (Pair(1, 1), Pair(1, True)),
        (np.int64(1), 1),
        (np.int64(1), np.int32(1)),
        (np.float32(1.5), 1.5),
        (np.float64(1.5), 1.5),
        (np.bool_(True), True),
        (np.float64(0.0), np.float64(-0.0)),
    ],
)
def test_values_equal_in_python_compile_apart(first, second):
    assert zm.Static(first) != zm.Static(second)
    assert hash(zm.Static(first)) != hash(zm.Static(second))
    assert traces_of([first, second, first, second]) == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: float("nan"),
        lambda: (1, float("nan")),
        lambda: frozenset({float("nan")}),
        lambda: Setting(float("nan")),
        lambda: Pair(float("nan"), 0),
        lambda: complex(float("nan"), 1.0),
        lambda: np.float64("nan"),
        lambda: np.float32("nan"),
        lambda: np.int64(1),
        lambda: Setting(np.int64(1)),
        lambda: -0.0,
    ],
)
def test_a_value_compiles_once(make):
    assert zm.Static(make()) == zm.Static(make())
    assert hash(zm.Static(make())) == hash(zm.Static(make()))
    assert traces_of([make() for _ in range(3)]) == 1


@pytest.mark.parametrize("value", [np.int64(3), np.float32(0.5), np.bool_(False), np.str_("a")])
def test_numpy_scalars_are_kept_without_warnings(value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        static = zm.Static(value)
        assert jax.tree_util.tree_leaves(static) == []
    assert type(static.value) is type(value) and static.value == value


def test_jit_tells_values_of_other_types_apart():
    @jax.jit
    def as_array(how):
        return jnp.asarray(how.value)

    for value, dtype in [(1, jnp.int32), (True, jnp.bool_), (1.5, jnp.float32), (1.0, jnp.float32)]:
        result = as_array(zm.Static(value))
        assert result.dtype == dtype and result == value

    @eqx.filter_jit
    def scaled(x, how):
        return x * how.value

    assert scaled(jnp.ones(2, int), zm.Static(2)).dtype == jnp.int32
    assert scaled(jnp.ones(2, int), zm.Static(2.0)).dtype == jnp.float32


def test_through_vmap_chunked_vmap_and_scan():
    def power(x, p):
        return x**p.value

    x = jnp.arange(5.0)
    expected = x**3
    np.testing.assert_array_equal(jax.vmap(power)(x, zm.Static(3)), expected)
    np.testing.assert_array_equal(zm.ChunkedVmap(power, chunk_size=2)(x, zm.Static(3)), expected)

    def step(carry, x):
        total, p = carry
        return (total + x**p.value, p), None

    (total, p), _ = jax.lax.scan(step, (0.0, zm.Static(2)), x)
    assert p == zm.Static(2) and float(total) == float(jnp.sum(x**2))


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, {1}, np.ones(2), jnp.ones(2)])
@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
def test_unhashable_values_are_refused(value):
    with pytest.raises(TypeError, match="`value` must be hashable"):
        zm.Static(value)


def test_generic_frozen_and_repr():
    static = zm.Static[int](3)
    assert static.value == 3 and repr(static) == "Static(value=3)"
    assert zm.Static(value="a") == zm.Static("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        static.value = 4


def test_docstring_example():
    (code,) = re.findall(r"```python\n(.*?)```", zm.Static.__doc__, re.S)
    exec(textwrap.dedent(code), {})
