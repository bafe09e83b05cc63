"""`ChunkedVmap` against `jax.vmap` and `eqx.filter_vmap`."""

import functools
import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close, make_mlp
from hypothesis import given, settings, strategies as st

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


def reference(fn, in_axes, out_axes, args, kwargs=None):
    """`eqx.filter_vmap` of `fn`, with keyword arguments mapped by `eqx.if_array(0)`."""
    kwargs = {} if kwargs is None else kwargs
    kwarg_axes = {name: eqx.if_array(0) for name in kwargs}
    vectorised = eqx.filter_vmap(
        lambda a, k: fn(*a, **k), in_axes=(in_axes, kwarg_axes), out_axes=out_axes
    )
    # Compiled: one program rather than one per operation.
    return eqx.filter_jit(vectorised)(args, kwargs)


def values(shape, dtype, seed=0):
    size = int(np.prod(shape))
    raw = np.cos(np.arange(size) * 0.37 + seed).reshape(shape) * 3
    raw = raw.round() if jnp.issubdtype(dtype, jnp.integer) else raw
    return jax.device_put(raw.astype(dtype))  # cast by NumPy: no program to compile


# Every batch size from 0 to 20 with every chunk size from 1 to batch + 2: a mapped
# axis that is not the first, an unmapped argument, a keyword argument, and an
# output whose mapped axis is last.


def sweep_fn(x, y, *, z):
    return {"outer": jnp.outer(x * y, z), "total": jnp.sum(x) + z[0]}


SWEEP_OUT_AXES = {"outer": 2, "total": 0}


# Batch sizes from empty to 20, each with every chunk size up to two beyond it.
@pytest.mark.parametrize("batch", [0, 1, 2, 3, 4, 5, 7, 8, 16, 20])
def test_every_chunk_size(batch):
    x = values((3, batch), jnp.float64)
    y = values((3,), jnp.float64, seed=1)
    z = values((batch, 2), jnp.float32, seed=2)
    expected = reference(sweep_fn, (1, None), SWEEP_OUT_AXES, (x, y), {"z": z})
    assert expected["outer"].shape == (3, 2, batch)
    transforms = [
        zm.ChunkedVmap(sweep_fn, chunk_size=chunk_size, in_axes=(1, None), out_axes=SWEEP_OUT_AXES)
        for chunk_size in range(1, batch + 3)
    ]
    # All chunk sizes of one batch size in one program, compiled without the backend's
    # optimisations, keeps the sweep fast; it computes the same values.
    every_chunk_size = jax.jit(
        lambda x, y, z: [t(x, y, z=z) for t in transforms],
        compiler_options={"xla_backend_optimization_level": 0},
    )
    for out in every_chunk_size(x, y, z):
        close(out, expected)
    if batch in (7, 20):  # and as they are, for chunk sizes that do and do not divide
        for transform in transforms[1:5]:
            close(transform(x, y, z=z), expected)


# Pytree inputs and outputs, dtypes, and in_axes / out_axes mixes.


def pytree_fn(tree, scale):
    u, (v,) = tree["u"], tree["v"]
    return {
        "scaled": u * scale + v,
        "pair": (jnp.sum(u) * v, u.astype(jnp.float32)),
        "count": 3,
    }


@given(
    batch=st.integers(0, 20),
    chunk=st.integers(1, 22),
    dtype=st.sampled_from([jnp.float32, jnp.float64, jnp.int32]),
    u_axis=st.sampled_from([0, 1, -1]),
    scale_mapped=st.booleans(),
    out_axis=st.sampled_from([0, 1, -1, -2]),
)
@settings(max_examples=8)
def test_pytrees_dtypes_and_axes(batch, chunk, dtype, u_axis, scale_mapped, out_axis):
    u_shape = [2, 2]
    u_shape[u_axis] = batch
    tree = {"u": values(tuple(u_shape), dtype), "v": [values((batch,), dtype, seed=1)]}
    scale = values((batch, 2) if scale_mapped else (2,), dtype, seed=2)
    in_axes = ({"u": u_axis, "v": 0}, 0 if scale_mapped else None)
    out_axes = {"scaled": out_axis, "pair": (0, eqx.if_array(1)), "count": None}
    transform = zm.ChunkedVmap(
        pytree_fn, chunk_size=min(chunk, batch + 2), in_axes=in_axes, out_axes=out_axes
    )
    out = transform(tree, scale)

    # Both references in one compiled program.
    @eqx.filter_jit
    def references(tree, scale):
        # Against plain jax.vmap, for the array outputs.
        plain = jax.vmap(
            lambda t, s: {k: v for k, v in pytree_fn(t, s).items() if k != "count"},
            in_axes=in_axes,
            out_axes={"scaled": out_axis, "pair": (0, 1)},
        )(tree, scale)
        return reference(pytree_fn, in_axes, out_axes, (tree, scale)), plain

    filtered, plain = references(tree, scale)
    close(out, filtered)
    close({k: v for k, v in out.items() if k != "count"}, plain)
    assert out["count"] == 3


def keyword_fn(a, b, *, c, d):
    return a * b + jnp.sum(c) * d


@functools.partial(jax.jit, static_argnames="unmapped_b")
def keyword_references(a, b, c, d, unmapped_b):
    """The references of the test below, in one program (compiled once per shape)."""
    in_axes = (0, None if unmapped_b else 0, 1, 0)
    return (
        jax.vmap(lambda a, b, c, d: keyword_fn(a, b, c=c, d=d), in_axes=in_axes)(a, b, c, d),
        jax.vmap(lambda a, d: a * d)(a, d),
    )


@given(batch=st.integers(0, 12), chunk=st.integers(1, 14), unmapped_b=st.booleans())
@settings(max_examples=10)
def test_keyword_arguments_and_named_in_axes(batch, chunk, unmapped_b):
    fn = keyword_fn
    a = values((batch,), jnp.float64)
    b = values(() if unmapped_b else (batch,), jnp.float64, seed=1)
    c = values((3, batch), jnp.float64, seed=2)
    d = values((batch,), jnp.float64, seed=3)
    in_axes = {"c": 1, "b": None} if unmapped_b else {"c": 1}
    transform = zm.ChunkedVmap(fn, chunk_size=chunk, in_axes=in_axes)
    expected, expected_default = keyword_references(a, b, c, d, unmapped_b)
    close(transform(a, b, c=c, d=d), expected)
    # Keyword arguments follow jax.vmap: mapped over their leading axis.
    default = zm.ChunkedVmap(lambda a, *, d: a * d, chunk_size=chunk)
    close(default(a, d=d), expected_default)


def test_in_axes_as_a_list_as_jax_vmap_takes_it():
    def scaled(a, b):
        return a * b

    a, b = jnp.arange(5.0), jnp.ones((3, 5))
    transform = zm.ChunkedVmap(scaled, chunk_size=2, in_axes=[0, 1])
    assert transform.in_axes == (0, 1) and isinstance(hash(transform), int)
    close(transform(a, b), eqx.filter_jit(jax.vmap(scaled, in_axes=[0, 1]))(a, b))
    close(
        zm.ChunkedVmap(scaled, chunk_size=2, in_axes=[np.int64(0), None])(a, b[0]),
        jax.vmap(scaled, in_axes=(0, None))(a, b[0]),
    )


def test_single_spec_in_axes_applies_to_every_positional_argument():
    x, y = values((4, 5), jnp.float64), values((4, 5), jnp.float64, seed=1)
    expected = eqx.filter_jit(jax.vmap(jnp.add, in_axes=1))(x, y)  # one reference for all
    for in_axes in (1, -1, eqx.if_array(1)):
        transform = zm.ChunkedVmap(jnp.add, chunk_size=2, in_axes=in_axes)
        close(transform(x, y), expected)


def test_non_array_arguments_are_passed_unchanged():
    def fn(x, power, name):
        assert isinstance(power, int) and name == "p"
        return x**power

    x = values((7,), jnp.float64)
    close(zm.ChunkedVmap(fn, chunk_size=3)(x, 3, "p"), x**3)


@pytest.mark.parametrize("batch,chunk", [(0, 1), (0, 5), (5, 2), (5, 9)])
def test_unmapped_and_non_array_outputs_are_returned_once(batch, chunk):
    weights = values((3,), jnp.float64)

    def fn(x):
        return x * jnp.sum(weights), jnp.cos(weights), "label", None

    out_axes = (0, None, None, None)
    x = values((batch,), jnp.float64)
    transform = zm.ChunkedVmap(fn, chunk_size=chunk, out_axes=out_axes)
    close(transform(x), reference(fn, eqx.if_array(0), out_axes, (x,)))
    # The default out_axes, eqx.if_array(0), broadcasts arrays and keeps the rest.
    close(
        zm.ChunkedVmap(fn, chunk_size=chunk)(x),
        reference(fn, eqx.if_array(0), eqx.if_array(0), (x,)),
    )


def test_empty_batch_gives_empty_outputs_of_the_right_shapes_and_dtypes():
    def fn(x, n):
        return {"m": jnp.outer(x, x), "i": n.astype(jnp.int16), "s": jnp.sum(x)}

    x, n = jnp.zeros((0, 3), jnp.float32), jnp.zeros((0,), jnp.int32)
    expected = eqx.filter_jit(jax.vmap(fn))(x, n)  # one reference for both chunk sizes
    for chunk in (1, 4):
        out = zm.ChunkedVmap(fn, chunk_size=chunk)(x, n)
        close(out, expected)
        assert out["m"].shape == (0, 3, 3) and out["i"].dtype == jnp.int16


def test_no_mapped_input_behaves_as_filter_vmap():
    def fn(w):
        return w * 2, "tag"

    w = jnp.arange(3.0)
    transform = zm.ChunkedVmap(fn, chunk_size=2, in_axes=None, out_axes=None)
    close(transform(w), eqx.filter_vmap(fn, in_axes=None, out_axes=None)(w))
    with pytest.raises(ValueError, match="batch dimension"):
        zm.ChunkedVmap(fn, chunk_size=2, in_axes=None)(w)


def test_dtypes_without_float64():
    with jax.enable_x64(False):
        x = jnp.arange(7, dtype=jnp.int32)
        f = jnp.arange(7, dtype=jnp.float32)
        out = zm.ChunkedVmap(lambda i, g: (i * 2, g * i, i > 3, 1.5), chunk_size=3)(x, f)
        expected = eqx.filter_jit(jax.vmap(lambda i, g: (i * 2, g * i, i > 3, 1.5)))(x, f)
        close(out[:3], expected[:3])
        assert out[3] == 1.5


# Gradients, jit and nesting.


def loss_terms(x, w):
    return jnp.sin(x @ w) * x[0] + jnp.sum(w**2)


def plain_loss_terms(x, w):
    return jnp.sum(jax.vmap(loss_terms, in_axes=(0, None))(x, w))


@jax.jit
def plain_derivatives(x, w):
    """The references of the test below, in one program: the gradient with respect to
    both arguments, and the forward-mode Jacobian with respect to `w`."""
    return (
        jax.grad(plain_loss_terms, argnums=(0, 1))(x, w),
        jax.jacfwd(plain_loss_terms, argnums=1)(x, w),
    )


@pytest.mark.parametrize("batch,chunk", [(1, 1), (7, 3), (8, 4)])
def test_gradients_equal_the_unbatched_ones(batch, chunk):
    x = values((batch, 3), jnp.float64)
    w = values((3,), jnp.float64, seed=1)
    transform = zm.ChunkedVmap(loss_terms, chunk_size=chunk, in_axes=(0, None))
    gradients, jacobian = plain_derivatives(x, w)

    def chunked(x, w):
        return jnp.sum(transform(x, w))

    close(jax.grad(chunked, argnums=(0, 1))(x, w), gradients)
    # Forward mode, and a gradient through a closed-over value.
    close(jax.jacfwd(chunked, argnums=1)(x, w), jacobian)

    def closed(w):
        return jnp.sum(zm.ChunkedVmap(lambda x: loss_terms(x, w), chunk_size=chunk)(x))

    close(jax.grad(closed)(w), gradients[1])


def test_under_jit_and_as_a_jit_argument():
    x = values((11, 3), jnp.float64)
    w = values((3,), jnp.float64, seed=1)
    transform = zm.ChunkedVmap(loss_terms, chunk_size=4, in_axes=(0, None))
    expected = eqx.filter_jit(jax.vmap(loss_terms, in_axes=(0, None)))(x, w)
    close(jax.jit(transform)(x, w), expected)
    close(eqx.filter_jit(lambda t, x: t(x, w))(transform, x), expected)


def test_inside_vmap_and_nested():
    x = values((3, 7, 2), jnp.float64)
    w = values((2,), jnp.float64, seed=1)
    inner = zm.ChunkedVmap(loss_terms, chunk_size=3, in_axes=(0, None))
    expected = eqx.filter_jit(jax.vmap(jax.vmap(loss_terms, in_axes=(0, None)), in_axes=(0, None)))(
        x, w
    )
    close(jax.vmap(inner, in_axes=(0, None))(x, w), expected)
    close(zm.ChunkedVmap(inner, chunk_size=2, in_axes=(0, None))(x, w), expected)
    # Mapping the argument the chunked transform leaves unmapped.
    ws = values((4, 2), jnp.float64, seed=2)
    close(
        jax.vmap(inner, in_axes=(None, 0))(x[0], ws),
        jax.jit(jax.vmap(jax.vmap(loss_terms, in_axes=(0, None)), in_axes=(None, 0)))(x[0], ws),
    )


def test_equinox_model_as_fn():
    model = make_mlp(3, 2, 8, 2)  # (weights drawn by NumPy: no initialiser to compile)
    x = values((10, 3), jnp.float32)
    transform = zm.ChunkedVmap(model, chunk_size=4)
    close(transform(x), eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, x))
    # The model's arrays are leaves of the transform, and are not mapped.
    leaves = jax.tree_util.tree_leaves(transform)
    assert len(leaves) == len(jax.tree_util.tree_leaves(model))
    assert all(a is b for a, b in zip(leaves, jax.tree_util.tree_leaves(model), strict=True))

    @eqx.filter_grad
    def grads(transform):
        return jnp.sum(transform(x) ** 2)

    @eqx.filter_jit
    @eqx.filter_grad
    def plain_grads(model):
        return jnp.sum(jax.vmap(model)(x) ** 2)

    close(grads(transform).fn, plain_grads(model))


def test_peak_memory_is_one_chunk():
    def fn(x):
        m = jnp.tanh(jnp.outer(x, x))
        return jnp.sum(jnp.sin(m @ m) @ m)

    x = jnp.ones((64, 256), jnp.float32)
    whole = jax.jit(jax.vmap(fn)).lower(x).compile().memory_analysis()
    chunked = jax.jit(zm.ChunkedVmap(fn, chunk_size=4)).lower(x).compile().memory_analysis()
    if whole is None or chunked is None:
        pytest.skip("no memory analysis on this backend")
    one_matrix = 256 * 256 * 4
    # Whole batch: 64 matrices at once at least; chunked: a few matrices per element of a chunk.
    assert whole.temp_size_in_bytes >= 64 * one_matrix
    assert chunked.temp_size_in_bytes <= 3 * 4 * one_matrix


def test_configuration_is_static():
    def fn(x):
        return (x,)

    transform = zm.ChunkedVmap(fn, chunk_size=3, in_axes=1, out_axes=(0,))
    assert jax.tree_util.tree_leaves(transform) == [fn]
    assert transform.config == {
        "chunk_size": 3,
        "max_memory": None,
        "in_axes": 1,
        "out_axes": (0,),
        "progress": False,
    }
    assert transform.chunk_size == 3 and transform.fn is fn
    assert transform == zm.ChunkedVmap(fn, chunk_size=3, in_axes=1, out_axes=(0,))
    assert hash(transform) == hash(zm.ChunkedVmap(fn, chunk_size=3, in_axes=1, out_axes=(0,)))


def test_docstring_example():
    (code,) = re.findall(r"```python\n(.*?)```", zm.ChunkedVmap.__doc__, re.S)
    exec(textwrap.dedent(code), {})


# Errors.


@pytest.mark.parametrize(
    "chunk_size,error",
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), (None, ValueError)],
)
def test_bad_chunk_size(chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        zm.ChunkedVmap(jnp.sin, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "field,value",
    [
        ("in_axes", "a"),
        ("in_axes", (0, 1.5)),
        ("in_axes", (True,)),
        ("out_axes", {"a": "x"}),
        ("out_axes", [0, object()]),
    ],
)
def test_bad_axis_specs(field, value):
    with pytest.raises(TypeError, match=field):
        zm.ChunkedVmap(jnp.sin, chunk_size=2, **{field: value})


def test_bad_fn_and_named_in_axes_keys():
    with pytest.raises(TypeError, match="fn"):
        zm.ChunkedVmap(3, chunk_size=2)
    with pytest.raises(TypeError, match="key 0"):
        zm.ChunkedVmap(jnp.sin, chunk_size=2, in_axes={0: 1})


def test_inconsistent_sizes_are_listed():
    transform = zm.ChunkedVmap(lambda a, b, c: a + b + c, chunk_size=2, in_axes=(0, 1, None))
    with pytest.raises(ValueError, match=r"args\[0\] \(axis 0\): 3, args\[1\] \(axis 1\): 4"):
        transform(jnp.ones(3), jnp.ones((3, 4)), 1.0)
    with pytest.raises(ValueError, match=r"kwargs\['k'\] \(axis 0\): 5"):
        zm.ChunkedVmap(lambda a, k: a + k, chunk_size=2)(jnp.ones(3), k=jnp.ones(5))


def test_zero_dimensional_mapped_input():
    transform = zm.ChunkedVmap(jnp.add, chunk_size=2, in_axes=0)
    with pytest.raises(ValueError, match=r"args\[1\] .* zero-dimensional: 2.0"):
        transform(jnp.ones(3), 2.0)
    with pytest.raises(ValueError, match=r"args\[0\]\['w'\] .* zero-dimensional"):
        zm.ChunkedVmap(lambda d: d["w"], chunk_size=2, in_axes=0)({"w": jnp.ones(())})


def test_out_of_range_axes():
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(3, 2\).*axis 2"):
        zm.ChunkedVmap(jnp.add, chunk_size=2, in_axes=(0, 2))(jnp.ones(3), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match=r"args\[0\] has shape \(3,\).*axis -2"):
        zm.ChunkedVmap(jnp.sin, chunk_size=2, in_axes=-2)(jnp.ones(3))
    with pytest.raises(ValueError, match=r"output\[1\] of `fn` has shape \(2,\).*at 2"):
        zm.ChunkedVmap(lambda x: (x, x[:2]), chunk_size=2, out_axes=(0, 2))(jnp.ones((5, 3)))


def test_axes_that_do_not_fit_the_arguments():
    with pytest.raises(ValueError, match="`in_axes` must be a pytree prefix"):
        zm.ChunkedVmap(jnp.add, chunk_size=2, in_axes=(0,))(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match="`out_axes` must be a pytree prefix"):
        zm.ChunkedVmap(jnp.sin, chunk_size=2, out_axes=(0, 0))(jnp.ones(3))
    with pytest.raises(ValueError, match=r"names \['c'\], which match no argument"):
        zm.ChunkedVmap(lambda a, b: a + b, chunk_size=2, in_axes={"c": 0})(jnp.ones(3), jnp.ones(3))
    with pytest.raises(TypeError, match="must return an int or None"):
        zm.ChunkedVmap(jnp.sin, chunk_size=2, in_axes=lambda leaf: "zero")(jnp.ones(3))
