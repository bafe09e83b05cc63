"""`BatchedJacobian` against `jax.jacfwd` / `jax.jacrev` of the raveled function."""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MODES, block_options, check_init, close, leaf_sizes, make_mlp, raveled
from hypothesis import given, strategies as st
from jax.flatten_util import ravel_pytree

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


_REFERENCES = {}


def reference_jacobians(key, fn, x, *args, **kwargs):
    """`{"fwd": jacfwd, "rev": jacrev}` of the raveled function, checked to agree.

    They agree to float64 precision unless `x` has float32 leaves: reverse mode then
    rounds the cotangent of such a leaf to float32 (and so does zodmem's `"rev"`).
    Cached under `key`, so that each reference compiles once.
    """
    if key not in _REFERENCES:
        fn_of_flat, flat = raveled(fn, x, *args, **kwargs)
        fwd, rev = jax.jit(lambda z: (jax.jacfwd(fn_of_flat)(z), jax.jacrev(fn_of_flat)(z)))(flat)
        single = any(
            leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(x) if eqx.is_array(leaf)
        )
        close(fwd, rev, rtol=1e-6 if single else 1e-12)
        _REFERENCES[key] = {"fwd": fwd, "rev": rev}
    return _REFERENCES[key]


@eqx.filter_jit
def _together(transforms, x, args, kwargs):
    return [transform(x, *args, **kwargs) for transform in transforms]


def together(transforms, x, *args, **kwargs):
    """Call every transform on the same inputs inside one compiled function."""
    return _together(transforms, x, args, kwargs)


def expected_for(references, mode, n, m):
    """The reference computed the way `mode` computes (`"auto"`: fwd when n <= m)."""
    if mode == "auto":
        mode = "fwd" if n <= m else "rev"
    return references[mode]


def variables_vector(x):
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(x) if eqx.is_inexact_array(leaf)]
    return jnp.concatenate([jnp.ravel(leaf).astype(jnp.float64) for leaf in leaves])


def mixing(rows, cols, seed):
    """A fixed dense matrix (a NumPy constant, so it costs nothing to compile)."""
    return np.cos(np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) * 0.7 + seed)


def vector_fn(out_shape):
    """A nonlinear function of every variable of `x`, with an extra argument and keyword."""

    def fn(x, scale=1.0, *, shift=0.0):
        v = variables_vector(x)
        m = math.prod(out_shape)
        a, b = mixing(m, v.size, 0), mixing(m, v.size, 1)
        return (scale * jnp.sin(a @ v) + shift * (b @ v) ** 2).reshape(out_shape)

    return fn


def tree_fn(x, scale=1.0, *, shift=0.0):
    """A pytree of outputs of different shapes, including a scalar."""
    v = variables_vector(x)
    return {
        "matrix": vector_fn((2, 3))(x, scale, shift=shift),
        "pair": (jnp.tanh(v[:2] * scale), jnp.sum(v**3) + shift),
    }


# Built lazily: float64 is enabled only while the tests run.
TREES = {
    "dict": lambda: {
        "a": jax.device_put(np.arange(3.0) / 3),
        "b": jnp.asarray(0.5),
        "c": jax.device_put(np.ones((1, 1))),
    },
    "nested": lambda: (
        [jax.device_put(np.linspace(-1, 1, 4).reshape(2, 2)), jnp.asarray(0.3)],
        {"z": jax.device_put(np.arange(2.0))},
    ),
    "mixed-precision": lambda: {
        "single": jax.device_put(np.asarray([0.25, -0.5], np.float32)),
        "double": jax.device_put(np.asarray([1.5, 0.1, 0.2])),
    },
    "scalar": lambda: jnp.asarray(0.7),
}


class Holder(eqx.Module):
    """A module whose fixed leaves (ints, bools, functions, int arrays) shape the result."""

    weight: jax.Array
    bias: jax.Array
    power: int
    negate: bool
    activation: object
    index: jax.Array
    label: str = eqx.field(static=True)

    def __call__(self, inputs):
        y = self.activation(self.weight @ inputs + self.bias) ** self.power
        y = y[self.index]
        return -y if self.negate else y


def make_holder():
    return Holder(
        weight=jax.device_put(np.linspace(-1, 1, 6).reshape(3, 2)),
        bias=jax.device_put(np.asarray([0.1, -0.2, 0.3])),
        power=2,
        negate=True,
        activation=jnp.sin,
        index=jax.device_put(np.asarray([2, 0])),
        label="holder",
    )


def test_every_block_option_in_every_mode():
    x = TREES["dict"]()  # n = 5
    fn = vector_fn((2, 2))  # m = 4
    expected = reference_jacobians("dict-2x2", fn, x, 0.5, shift=0.25)["fwd"]
    # Every nbatches; batch sizes that divide, do not divide, and exceed the products.
    sweeps = {
        "fwd": [{"nbatches": k} for k in range(1, 6)] + [{"batch_size": k} for k in (1, 2, 3, 8)],
        "rev": [{"nbatches": k} for k in range(1, 5)] + [{"batch_size": k} for k in (3, 9)],
        "auto": [{"nbatches": 3}, {"batch_size": 2}, {}],
    }
    transforms = [
        zm.BatchedJacobian(fn, mode=mode, **option)
        for mode, options in sweeps.items()
        for option in options
    ]
    for transform, J in zip(transforms, together(transforms, x, 0.5, shift=0.25), strict=True):
        assert J.shape == (2, 2, 5), transform
        close(J, expected)
    # One of them called on its own, outside any other jit.
    close(zm.BatchedJacobian(fn, nbatches=2, mode="rev")(x, 0.5, shift=0.25), expected)


@pytest.mark.parametrize("name", TREES)
def test_pytree_inputs(name):
    x = TREES[name]()
    fn = vector_fn((3,))
    references = reference_jacobians(name, fn, x, 2.0, shift=-1.0)
    n = references["fwd"].shape[-1]
    modes = [("fwd", {"nbatches": n}), ("rev", {"nbatches": 2}), ("auto", {"batch_size": 2})]
    transforms = [zm.BatchedJacobian(fn, mode=mode, **option) for mode, option in modes]
    for (mode, _), J in zip(modes, together(transforms, x, 2.0, shift=-1.0), strict=True):
        assert J.dtype == jnp.float64
        close(J, expected_for(references, mode, n, 3))


def test_pytree_outputs():
    x = TREES["nested"]()  # n = 7, m = 6 + 2 + 1
    expected = reference_jacobians("nested-tree", tree_fn, x, 1.5, shift=0.5)["fwd"]
    transforms = [
        zm.BatchedJacobian(tree_fn, mode=mode, **option)
        for mode in ["fwd", "rev", "auto"]
        for option in [{"nbatches": 1}, {"nbatches": 4}, {"batch_size": 2}]
    ]
    for J in together(transforms, x, 1.5, shift=0.5):
        close(J, expected)
        assert J["matrix"].shape == (2, 3, 7)
        assert J["pair"][0].shape == (2, 7)
        assert J["pair"][1].shape == (7,)


def test_has_aux():
    x = TREES["dict"]()

    def fn(x, scale):
        out = vector_fn((4,))(x, scale)
        return out, {"value": out, "count": jnp.asarray(3), "scale": scale}

    expected = reference_jacobians("dict-aux", lambda x, s: fn(x, s)[0], x, 0.5)["fwd"]
    value = jax.jit(vector_fn((4,)))(x, 0.5)  # compiled: one program, not one per operation
    for mode in ["fwd", "rev"]:
        J, aux = zm.BatchedJacobian(fn, nbatches=2, mode=mode, has_aux=True)(x, 0.5)
        close(J, expected)
        close(aux["value"], value)
        assert aux["count"] == 3 and aux["count"].dtype == jnp.int64
        np.testing.assert_allclose(aux["scale"], 0.5)
    # A pytree output with an aux, both modes.
    expected = reference_jacobians("dict-tree", tree_fn, x)["fwd"]
    transforms = [
        zm.BatchedJacobian(lambda x: (tree_fn(x), x["b"]), mode=mode, has_aux=True, batch_size=2)
        for mode in ["fwd", "rev"]
    ]
    for J, aux in together(transforms, x):
        close(J, expected)
        close(aux, x["b"])


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_jit_and_checkpoint(jit, checkpoint):
    x = TREES["nested"]()
    expected = reference_jacobians("nested-tree-shift", tree_fn, x, 0.5, shift=2.0)["fwd"]
    for mode in ["fwd", "rev"]:
        transform = zm.BatchedJacobian(
            tree_fn, batch_size=3, mode=mode, jit=jit, checkpoint=checkpoint
        )
        close(transform(x, 0.5, shift=2.0), expected)


def empty_and_constant(x):
    """Outputs that include an empty array and a constant Python number."""
    v = variables_vector(x)
    return {"y": jnp.sin(v[:2]) * jnp.sum(v), "empty": jnp.zeros((0, 3)) + jnp.sum(v), "c": 3.0}


@pytest.mark.parametrize("mode", ["fwd", "rev", "auto"])
def test_empty_leaves_and_constant_outputs(mode):
    # A zero-size variable among others, an empty output and a constant output.
    x = {"a": jax.device_put(np.asarray([0.5, -1.5, 2.0])), "e": jnp.zeros((0, 2)), "n": None}
    expected = reference_jacobians("empty-leaf", empty_and_constant, x)["fwd"]
    close(zm.BatchedJacobian(empty_and_constant, mode=mode, batch_size=2)(x), expected)
    assert expected["empty"].shape == (0, 3, 3) and expected["c"].shape == (3,)
    # Only empty variables: n = 0, an empty Jacobian, as jax.jacfwd gives.
    x = {"e": jnp.zeros((0, 2))}
    J = zm.BatchedJacobian(lambda x: jnp.ones(2) + jnp.sum(x["e"]), mode=mode)(x)
    assert J.shape == (2, 0) and J.dtype == jnp.float64


def call_holder(holder, inputs):
    return holder(inputs)


def test_fixed_leaves_of_a_module():
    holder = make_holder()
    inputs = jax.device_put(np.asarray([0.4, -0.8]))
    expected = reference_jacobians("holder", call_holder, holder, inputs)["fwd"]
    assert expected.shape == (2, 9)
    transforms = [zm.BatchedJacobian(call_holder, nbatches=2, mode=m) for m in ["fwd", "rev"]]
    for J in together(transforms, holder, inputs):
        close(J, expected)
    J = zm.BatchedJacobian(call_holder, batch_size=4)(holder, inputs)
    close(J, expected)
    blocks = zm.jacobian_to_pytree(J, holder)
    assert blocks.weight.shape == (2, 3, 2) and blocks.bias.shape == (2, 3)
    assert blocks.power is None and blocks.negate is None and blocks.activation is None
    assert blocks.index is None and blocks.label == "holder"


def predictions(model, inputs):
    return jax.vmap(model)(inputs)


def test_mlp_as_x():
    mlp = make_mlp(3, 2, 4, 2)
    inputs = jax.device_put(np.linspace(-1, 1, 12).reshape(4, 3))
    expected = reference_jacobians("mlp", predictions, mlp, inputs)["fwd"]
    assert expected.shape == (4, 2, 46)
    transforms = [
        zm.BatchedJacobian(predictions, nbatches=nbatches, mode=mode)
        for mode, nbatches in [("fwd", 5), ("rev", 3), ("auto", 8)]
    ]
    for J in together(transforms, mlp, inputs):
        close(J, expected)
    # Against jax.jacrev on the model's arrays directly.
    params, fixed = eqx.partition(mlp, eqx.is_inexact_array)
    direct = jax.jit(jax.jacrev(lambda p: predictions(eqx.combine(p, fixed), inputs)))(params)
    blocks = zm.jacobian_to_pytree(J, mlp)
    close(eqx.filter(blocks, eqx.is_array), direct)
    assert blocks.activation is None and blocks.final_activation is None


def test_mlp_as_fn_under_filter_jit_and_grad():
    mlp = make_mlp(3, 2, 5, 1)
    inputs = jax.device_put(np.asarray([0.3, -0.1, 0.8]))
    transform = zm.BatchedJacobian(mlp, nbatches=2, mode="fwd")

    @eqx.filter_jit
    def jacobian_norm(transform, inputs):
        return jnp.sum(transform(inputs) ** 2)

    @eqx.filter_jit
    def plain_norm(model, inputs):
        return jnp.sum(jax.jacfwd(model)(inputs) ** 2)

    close(jacobian_norm(transform, inputs), plain_norm(mlp, inputs))
    # The model's arrays are leaves of the transform: differentiate through them.
    grads = eqx.filter_jit(eqx.filter_grad(jacobian_norm))(transform, inputs)
    expected = eqx.filter_jit(eqx.filter_grad(plain_norm))(mlp, inputs)
    close(eqx.filter(grads.fn, eqx.is_array), eqx.filter(expected, eqx.is_array))


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_inside_jit_vmap_and_grad(mode):
    x = TREES["dict"]()
    fn = vector_fn((3,))
    flat, unravel = ravel_pytree(x)
    transform = zm.BatchedJacobian(fn, nbatches=2, mode=mode)

    def plain(x, s):
        return jax.jacfwd(lambda z: fn(unravel(z), s, shift=0.5))(ravel_pytree(x)[0])

    @jax.jit
    def run(x, s, xs, scales):
        """Everything at once, so that it compiles once."""
        return {
            "jit": transform(x, s, shift=0.5),
            # Per-example Jacobians: vmap over a batch of inputs and of the extra argument.
            "vmap": jax.vmap(lambda x, s: transform(x, s, shift=0.5))(xs, scales),
            "vmap-arg": jax.vmap(lambda s: transform(x, s, shift=0.5))(scales),
            # Gradient of a function of the Jacobian with respect to the extra argument.
            "grad": jax.grad(lambda s: jnp.sum(jnp.sin(transform(x, s, shift=0.5))))(s),
        }

    @jax.jit
    def run_plain(x, s, xs, scales):
        return {
            "jit": plain(x, s),
            "vmap": jax.vmap(plain)(xs, scales),
            "vmap-arg": jax.vmap(lambda s: plain(x, s))(scales),
            "grad": jax.grad(lambda s: jnp.sum(jnp.sin(plain(x, s))))(s),
        }

    xs = jax.tree_util.tree_map(
        lambda leaf: jax.device_put(np.stack([leaf, 2 * np.asarray(leaf), -np.asarray(leaf)])), x
    )
    scales = jax.device_put(np.asarray([1.0, 0.5, -2.0]))
    close(run(x, 1.5, xs, scales), run_plain(x, 1.5, xs, scales))


def test_jacobian_to_pytree_matches_jacrev_on_the_pytree():
    x = TREES["nested"]()
    fn = vector_fn((2, 2))

    @jax.jit
    def both(x):
        return (
            zm.jacobian_to_pytree(zm.BatchedJacobian(tree_fn, nbatches=3)(x, 0.5), x),
            zm.jacobian_to_pytree(zm.BatchedJacobian(fn)(x), x),
        )

    @jax.jit
    def both_plain(x):
        return jax.jacrev(tree_fn)(x, 0.5), jax.jacrev(fn)(x)

    blocks, expected = both(x), both_plain(x)
    close(blocks, expected)
    # A single-array output: the structure of x with leaves (*out_shape, *leaf.shape).
    assert blocks[1][0][0].shape == (2, 2, 2, 2)
    assert blocks[1][1]["z"].shape == (2, 2, 2)
    # NumPy input is accepted as well.
    J = np.asarray(zm.BatchedJacobian(fn)(x))
    close(zm.jacobian_to_pytree(J, x), expected[1])


def test_jacobian_to_pytree_shape_mismatch():
    x = TREES["dict"]()
    with pytest.raises(ValueError, match=r"J has a leaf of shape \(3, 4\), but x flattens to 5"):
        zm.jacobian_to_pytree(jnp.zeros((3, 4)), x)
    with pytest.raises(ValueError, match=r"shape \(\)"):
        zm.jacobian_to_pytree({"a": jnp.zeros((2, 5)), "b": jnp.zeros(())}, x)


# (config, error raised by the constructor, error raised by __check_init__, its message).
# Under a jaxtyping import hook (as in these tests) the constructor's own type check
# refuses a value of the wrong type before `__check_init__` runs; both name the field
# and the value.
CONSTRUCTION_ERRORS = [
    ({"nbatches": 0}, ValueError, ValueError, r"`nbatches` must be a positive int, got nbatches=0"),
    (
        {"nbatches": -2},
        ValueError,
        ValueError,
        r"`nbatches` must be a positive int, got nbatches=-2",
    ),
    (
        {"nbatches": 2.0},
        TypeError,
        TypeError,
        r"`nbatches` must be a positive int or None, got 2\.0 of type float",
    ),
    (
        {"nbatches": True},
        TypeError,
        TypeError,
        r"`nbatches` must be a positive int or None, got True of type bool",
    ),
    (
        {"batch_size": 0},
        ValueError,
        ValueError,
        r"`batch_size` must be a positive int, got batch_size=0",
    ),
    (
        {"batch_size": -1},
        ValueError,
        ValueError,
        r"`batch_size` must be a positive int, got batch_size=-1",
    ),
    (
        {"batch_size": 1.5},
        TypeError,
        TypeError,
        r"`batch_size` must be a positive int or None, got 1\.5",
    ),
    ({"batch_size": False}, TypeError, TypeError, r"`batch_size` .* got False of type bool"),
    (
        {"nbatches": 2, "batch_size": 2},
        ValueError,
        ValueError,
        r"give at most one of `nbatches` and `batch_size`, got nbatches=2 and batch_size=2",
    ),
    (
        {"mode": "reverse"},
        (ValueError, TypeError),
        ValueError,
        r"`mode` must be one of 'auto', 'fwd', 'rev'; got 'reverse'",
    ),
    ({"mode": None}, (ValueError, TypeError), ValueError, r"`mode` must be one of .*; got None"),
    ({"has_aux": 1}, TypeError, TypeError, r"`has_aux` must be True or False, got 1 of type int"),
    ({"jit": "yes"}, TypeError, TypeError, r"`jit` must be True or False, got 'yes'"),
    ({"checkpoint": None}, TypeError, TypeError, r"`checkpoint` must be True or False, got None"),
]


@pytest.mark.parametrize("config, error, check_error, message", CONSTRUCTION_ERRORS)
def test_construction_errors(config, error, check_error, message):
    (name, value), *_ = config.items()
    with pytest.raises(error, match=rf"{name}[\s\S]*{re.escape(repr(value))}"):
        zm.BatchedJacobian(vector_fn((2,)), **config)
    with pytest.raises(check_error, match=rf"^BatchedJacobian: {message}"):
        check_init(zm.BatchedJacobian, **config)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match=r"fn[\s\S]*3"):
        zm.BatchedJacobian(3)
    with pytest.raises(TypeError, match=r"`fn` must be callable .* got 3 of type int"):
        check_init(zm.BatchedJacobian, fn=3)
    check_init(zm.BatchedJacobian, fn=jnp.sin)


def test_trace_time_errors():
    x = TREES["dict"]()  # n = 5
    fn = vector_fn((3,))  # m = 3
    with pytest.raises(ValueError, match=r"nbatches=6 is larger than the number of variables, 5"):
        zm.BatchedJacobian(fn, nbatches=6, mode="fwd")(x)
    with pytest.raises(
        ValueError, match=r"nbatches=4 is larger than the number of output elements, 3"
    ):
        zm.BatchedJacobian(fn, nbatches=4, mode="rev")(x)
    with pytest.raises(ValueError, match="`x` has no inexact-array leaves"):
        zm.BatchedJacobian(lambda x: x.astype(float))(jnp.arange(3))
    with pytest.raises(ValueError, match="no inexact-array leaves"):
        zm.BatchedJacobian(lambda x: jnp.ones(2), jit=False)({"n": 2, "f": jnp.sin})
    with pytest.raises(TypeError, match=r"must return a pair \(output, aux\)"):
        zm.BatchedJacobian(fn, has_aux=True)(x)
    with pytest.raises(TypeError, match=r"must return a pair"):
        zm.BatchedJacobian(lambda x: (fn(x), 1.0, 2.0), has_aux=True)(x)
    with pytest.raises(TypeError, match=r"output leaf has dtype int64 and shape \(3,\)"):
        zm.BatchedJacobian(lambda x: jnp.arange(3))(x)
    with pytest.raises(TypeError, match="dtype bool"):
        zm.BatchedJacobian(lambda x: (fn(x), x["a"] > 0))(x)


def test_jacobian_memory_has_no_second_copy():
    n, m = 400, 300
    a = mixing(m, n, 0.0)

    def fn(x):
        return jnp.tanh(a @ x) * jnp.sum(x**2)

    x = jax.device_put(np.linspace(-1, 1, n))
    for mode in ["fwd", "rev"]:
        compiled = jax.jit(zm.BatchedJacobian(fn, nbatches=8, mode=mode)).lower(x).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            pytest.skip("memory_analysis is unavailable on this backend")
        assert analysis.output_size_in_bytes == m * n * 8
        assert analysis.temp_size_in_bytes < 0.5 * m * n * 8, mode


# --- a sweep over sizes, output sizes and blocks, against the Jacobian worked out by hand ---


@st.composite
def jacobian_cases(draw):
    sizes = draw(leaf_sizes())
    n = sum(sizes)
    out_shape = draw(st.sampled_from([(), (1,), (3,), (2, 3), (7,), (4, 5)]))
    mode = draw(st.sampled_from(MODES))
    m = math.prod(out_shape)
    products = n if mode == "fwd" or (mode == "auto" and n <= m) else m
    options = draw(block_options(products))
    seed = draw(st.integers(0, 3))
    return sizes, out_shape, mode, options, seed


@given(jacobian_cases())
def test_sweep_against_the_exact_jacobian(case):
    sizes, out_shape, mode, kwargs, seed = case
    n, m = sum(sizes), math.prod(out_shape)
    rng = np.random.default_rng(seed)
    v = rng.uniform(-1, 1, n)
    a, b = rng.normal(size=(m, n)), rng.normal(size=(m, n))
    # Leaves of shapes (size,), (1, size), ... in a dict.
    offsets = np.cumsum([0, *sizes])
    x = {
        f"leaf{i}": jax.device_put(v[offsets[i] : offsets[i + 1]].reshape((1,) * (i % 2) + (s,)))
        for i, s in enumerate(sizes)
    }

    def fn(x):
        z = jnp.concatenate([jnp.ravel(x[f"leaf{i}"]) for i in range(len(sizes))])
        return (jnp.sin(a @ z) + 0.5 * (b @ z) ** 2).reshape(out_shape)

    exact = (np.cos(a @ v)[:, None] * a + (b @ v)[:, None] * b).reshape(*out_shape, n)
    J = zm.BatchedJacobian(fn, mode=mode, **kwargs)(x)
    assert J.shape == (*out_shape, n) and J.dtype == jnp.float64
    np.testing.assert_allclose(J, exact, rtol=1e-12, atol=1e-12)


def test_forward_mode_refuses_a_custom_vjp_function_in_words():
    @jax.custom_vjp
    def squash(z):
        return jnp.tanh(z)

    squash.defvjp(lambda z: (jnp.tanh(z), jnp.tanh(z)), lambda t, g: (g * (1 - t**2),))

    def fn(w, inputs):
        return squash(inputs @ w)

    w, inputs = (
        jax.device_put(np.asarray([0.5, -0.25, 1.0])),
        jax.device_put(np.cos(np.arange(12.0).reshape(4, 3))),
    )
    expected = jax.jit(jax.jacrev(lambda w: jnp.tanh(inputs @ w)))(w)
    close(zm.BatchedJacobian(fn, mode="rev", batch_size=2)(w, inputs), expected)
    refusals = [
        ("fwd", r"mode='fwd' takes forward-mode derivatives \(JVPs\) of `fn`"),
        # 3 variables, 4 output elements: "auto" takes columns, by forward mode.
        ("auto", r"mode='auto' \(which chose forward mode for 3 variables and 4 output elements\)"),
    ]
    for mode, match in refusals:
        for strategy in ("linearize", "recompute"):
            with pytest.raises(TypeError, match=rf"BatchedJacobian: {match}.*Pass mode='rev'"):
                zm.BatchedJacobian(fn, mode=mode, strategy=strategy, batch_size=2)(w, inputs)
