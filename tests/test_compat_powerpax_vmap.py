"""`zodmem.compat.powerpax.chunked_vmap` and `Static` against powerpax 0.2.1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import powerpax
import pytest
from hypothesis import given, settings, strategies as st

import zodmem as zm
from zodmem.compat import powerpax as compat

pytestmark = pytest.mark.usefixtures("float64")


def same(actual, expected, rtol=1e-12):
    """Same structure, and leaves of the same type, shape, dtype and values."""
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        assert type(a) is type(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        if jnp.issubdtype(e.dtype, jnp.inexact):
            rtol = max(rtol, 1e-5) if jnp.finfo(e.dtype).bits <= 32 else rtol
            np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol)
        else:
            np.testing.assert_array_equal(a, e)


def values(shape, dtype, seed=0):
    size = int(np.prod(shape))
    raw = np.cos(np.arange(size) * 0.37 + seed).reshape(shape) * 3
    return jnp.asarray(raw.round() if jnp.issubdtype(dtype, jnp.integer) else raw, dtype)


def mixed(tree, scale, *, offset, how):
    u, (v,) = tree["u"], tree["v"]
    total = jnp.sum(u * scale) + offset
    if how.value == "square":
        total = total**2
    return {"total": total, "pair": (u * v, v.astype(jnp.float32)), "one": 1.0}


@given(
    batch=st.integers(0, 20),
    chunk=st.integers(1, 22),
    dtype=st.sampled_from([jnp.float32, jnp.float64, jnp.int32]),
    how=st.sampled_from(["square", "plain"]),
)
@settings(max_examples=15)
def test_same_results_as_powerpax_and_vmap(batch, chunk, dtype, how):
    tree = {"u": values((batch, 2), dtype), "v": [values((batch, 1), dtype, seed=1)]}
    scale = values((batch, 2), dtype, seed=2)
    offset = values((batch,), jnp.float64, seed=3)
    chunk = min(chunk, batch + 2)
    args, kwargs = (tree, scale), {"offset": offset}
    ours = compat.chunked_vmap(mixed, chunk)(*args, **kwargs, how=compat.Static(how))
    theirs = powerpax.chunked_vmap(mixed, chunk)(*args, **kwargs, how=powerpax.Static(how))
    same(ours, theirs)
    plain = jax.vmap(functools.partial(mixed, how=zm.Static(how)))(*args, **kwargs)
    # Summation order differs between compiled and eager float32 sums.
    same(ours, plain, rtol=1e-5 if dtype == jnp.float32 else 1e-12)


@pytest.mark.parametrize("batch,chunk", [(7, 3), (8, 4), (3, 5)])
def test_gradients_as_powerpax(batch, chunk):
    x = values((batch, 3), jnp.float64)

    def loss(chunked_vmap, x):
        return jnp.sum(chunked_vmap(lambda r: jnp.sin(r) * r[0], chunk)(x))

    same(
        jax.grad(loss, argnums=1)(compat.chunked_vmap, x),
        jax.grad(loss, argnums=1)(powerpax.chunked_vmap, x),
    )


def test_under_jit_and_vmap():
    x = values((3, 7, 2), jnp.float64)

    def fn(r):
        return jnp.outer(r, r)

    same(
        jax.jit(jax.vmap(compat.chunked_vmap(fn, 3)))(x),
        jax.jit(jax.vmap(powerpax.chunked_vmap(fn, 3)))(x),
    )


def test_wrapper_and_chunk_size_conversions():
    def fn(x):
        """Square."""
        return x**2

    wrapped = compat.chunked_vmap(fn, 2)
    assert wrapped.__wrapped__ is fn and wrapped.__name__ == "fn" and wrapped.__doc__ == "Square."
    x = jnp.arange(5.0)
    for chunk_size in (True, np.int64(2), np.int32(3)):
        same(compat.chunked_vmap(fn, chunk_size)(x), powerpax.chunked_vmap(fn, chunk_size)(x))


def outcome(call):
    """The result of `call()`, or the type of the exception it raised."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001
        return type(error)


@pytest.mark.parametrize("chunk_size", [0, -2, 2.5, None, "2"])
def test_bad_chunk_sizes_raise_as_powerpax(chunk_size):
    expected = outcome(lambda: powerpax.chunked_vmap(jnp.sin, chunk_size))
    assert isinstance(expected, type) and issubclass(expected, Exception)
    with pytest.raises(expected, match="chunk_size|integer|SupportsIndex"):
        compat.chunked_vmap(jnp.sin, chunk_size)


def first(*args, **kwargs):
    return jax.tree_util.tree_leaves((args, kwargs))[0]


@pytest.mark.parametrize(
    "fun,args,kwargs",
    [
        (first, (jnp.ones(3), 2.0), {}),  # a zero-dimensional argument
        (first, (jnp.ones(3),), {"k": jnp.ones(())}),  # a zero-dimensional keyword
        (first, (jnp.ones(3), "text"), {}),  # not an array
        (first, (), {}),  # nothing to map over
        (lambda s: 0, (compat.Static(1),), {}),  # only static values
        (first, (jnp.ones(3), jnp.ones(4)), {}),  # inconsistent leading sizes
        (first, (jnp.ones(3),), {"k": jnp.ones((5, 2))}),
        (lambda x: "text", (jnp.ones(5),), {}),  # not a JAX type out
        (3, (jnp.ones(5),), {}),  # not callable
    ],
)
def test_bad_calls_raise_as_powerpax(fun, args, kwargs):
    expected = outcome(lambda: powerpax.chunked_vmap(fun, 2)(*args, **kwargs))
    assert isinstance(expected, type) and issubclass(expected, Exception)
    with pytest.raises(expected):
        compat.chunked_vmap(fun, 2)(*args, **kwargs)


def test_inconsistent_sizes_are_listed():
    with pytest.raises(ValueError, match="3, 4"):
        compat.chunked_vmap(first, 2)(jnp.ones(3), jnp.ones(4))


def test_static_as_powerpax():
    for value in (3, "a", (1, 2), None):
        ours, theirs = compat.Static(value), powerpax.Static(value)
        assert jax.tree_util.tree_leaves(ours) == jax.tree_util.tree_leaves(theirs) == []
        assert ours.value == theirs.value and repr(ours) == repr(theirs)
        assert ours == compat.Static(value) and hash(ours) == hash(compat.Static(value))
    assert compat.Static(1) != compat.Static(2)
    assert compat.Static(value=1) == compat.Static(1) and compat.Static[int](1).value == 1
    # As in powerpax, an unhashable value is accepted, and only hashing it fails.
    ours, theirs = compat.Static([1, 2]), powerpax.Static([1, 2])
    assert ours == compat.Static([1, 2]) and repr(ours) == repr(theirs)
    assert outcome(lambda: hash(ours)) is outcome(lambda: hash(theirs)) is TypeError
    x = jnp.arange(7.0)
    same(
        compat.chunked_vmap(lambda x, s: x * len(s.value), 3)(x, ours),
        powerpax.chunked_vmap(lambda x, s: x * len(s.value), 3)(x, theirs),
    )
