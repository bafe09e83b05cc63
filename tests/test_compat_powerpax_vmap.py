"""`zodmem.compat.powerpax.chunked_vmap` and `Static` against powerpax 0.2.1."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import powerpax
import pytest
from helpers import close
from hypothesis import given, settings, strategies as st

import zodmem as zm
from zodmem.compat import powerpax as compat

pytestmark = pytest.mark.usefixtures("float64")


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
@settings(max_examples=8)
def test_same_results_as_powerpax_and_vmap(batch, chunk, dtype, how):
    tree = {"u": values((batch, 2), dtype), "v": [values((batch, 1), dtype, seed=1)]}
    scale = values((batch, 2), dtype, seed=2)
    offset = values((batch,), jnp.float64, seed=3)
    chunk = min(chunk, batch + 2)
    args, kwargs = (tree, scale), {"offset": offset}
    ours = compat.chunked_vmap(mixed, chunk)(*args, **kwargs, how=compat.Static(how))
    # The references compiled: one program per example rather than one per operation.
    theirs = eqx.filter_jit(powerpax.chunked_vmap(mixed, chunk))(
        *args, **kwargs, how=powerpax.Static(how)
    )
    # Summation order may differ between two compiled float32 programs.
    tol = 1e-5 if dtype == jnp.float32 else 1e-12
    close(ours, theirs, tol, tol)
    plain = eqx.filter_jit(jax.vmap(functools.partial(mixed, how=zm.Static(how))))(*args, **kwargs)
    close(ours, plain, tol, tol)


@pytest.mark.parametrize("batch,chunk", [(7, 3), (8, 4), (3, 5)])
def test_gradients_as_powerpax(batch, chunk):
    x = values((batch, 3), jnp.float64)

    def loss(chunked_vmap, x):
        return jnp.sum(chunked_vmap(lambda r: jnp.sin(r) * r[0], chunk)(x))

    close(
        jax.grad(loss, argnums=1)(compat.chunked_vmap, x),
        jax.grad(loss, argnums=1)(powerpax.chunked_vmap, x),
    )


def test_under_jit_and_vmap():
    x = values((3, 7, 2), jnp.float64)

    def fn(r):
        return jnp.outer(r, r)

    close(
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
    for chunk_size in (np.int64(2), np.int32(3), np.uint8(4)):
        close(compat.chunked_vmap(fn, chunk_size)(x), powerpax.chunked_vmap(fn, chunk_size)(x))
    # powerpax reads True as 1; a bool where a count is meant is refused, as across zodmem.
    with pytest.raises(TypeError, match=r"chunked_vmap: `chunk_size` must be an int, got True"):
        compat.chunked_vmap(fn, True)


def outcome(call):
    """The result of `call()`, or the type of the exception it raised."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001
        return type(error)


@pytest.mark.parametrize("chunk_size", [-1, 0])
def test_non_positive_chunk_size_message_as_powerpax(chunk_size):
    """powerpax's own test matches this wording."""
    with pytest.raises(ValueError, match="chunk_size must be positive") as theirs:
        powerpax.chunked_vmap(jnp.sin, chunk_size=chunk_size)
    assert str(chunk_size) in str(theirs.value)
    with pytest.raises(
        ValueError,
        match=rf"^chunked_vmap: chunk_size must be positive, got "
        rf"chunk_size={chunk_size}\.$",
    ):
        compat.chunked_vmap(jnp.sin, chunk_size=chunk_size)


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
    listed = r"chunked_vmap: .* leading axes, but the sizes are args\[0\]: 3, args\[1\]: 4\."
    with pytest.raises(ValueError, match=listed):
        compat.chunked_vmap(first, 2)(jnp.ones(3), jnp.ones(4))
    with pytest.raises(ValueError, match=r"sizes are args\[0\]\['u'\]: 5, kwargs\['k'\]: 2\."):
        compat.chunked_vmap(first, 2)({"u": jnp.ones(5)}, k=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"kwargs\['k'\] is zero-dimensional"):
        compat.chunked_vmap(first, 2)(jnp.ones(3), k=jnp.ones(()))


def test_uncallable_fun_is_refused_when_wrapped():
    with pytest.raises(
        TypeError, match=r"chunked_vmap: `fun` must be callable .*got 3 of type int"
    ):
        compat.chunked_vmap(3, 2)


def test_static_as_powerpax():
    for value in (3, "a", (1, 2), None, 1.5):
        ours, theirs = compat.Static(value), powerpax.Static(value)
        assert jax.tree_util.tree_leaves(ours) == jax.tree_util.tree_leaves(theirs) == []
        assert ours.value == theirs.value and repr(ours) == repr(theirs)
        assert ours == compat.Static(value) and hash(ours) == hash(compat.Static(value))
        flat, treedef = jax.tree_util.tree_flatten(ours)
        rebuilt = jax.tree_util.tree_unflatten(treedef, flat)
        assert rebuilt == ours and hash(rebuilt) == hash(ours)
    assert compat.Static(1) != compat.Static(2)
    assert compat.Static(value=1) == compat.Static(1) and compat.Static[int](1).value == 1
    x = jnp.arange(7.0)
    close(
        compat.chunked_vmap(lambda x, s: x * len(s.value), 3)(x, compat.Static((1, 2))),
        powerpax.chunked_vmap(lambda x, s: x * len(s.value), 3)(x, powerpax.Static((1, 2))),
    )


def test_static_is_zodmems():
    """One class: a compat Static and a zm.Static are interchangeable."""
    assert compat.Static is zm.Static
    assert isinstance(compat.Static(1), zm.Static) and compat.Static(1) == zm.Static(1)
    assert hash(compat.Static("a")) == hash(zm.Static("a"))


def test_unhashable_static_value_is_refused_when_built():
    """powerpax documents that the value must be hashable, and fails only when it is
    hashed; here the mistake is reported where the Static is built."""
    theirs = powerpax.Static([1, 2])
    assert outcome(lambda: hash(theirs)) is TypeError
    with pytest.raises(TypeError, match=r"Static: `value` must be hashable, got \[1, 2\]"):
        compat.Static([1, 2])
