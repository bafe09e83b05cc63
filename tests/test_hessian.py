"""`BatchedHessian` and the `*_to_pytree` layouts against `jax.hessian`."""

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


def reference_hessian(key, fn, x, *args, **kwargs):
    """`jax.hessian` of the raveled function, cached under `key` so it compiles once."""
    if key not in _REFERENCES:
        fn_of_flat, flat = raveled(fn, x, *args, **kwargs)
        _REFERENCES[key] = jax.jit(jax.hessian(fn_of_flat))(flat)
    return _REFERENCES[key]


@eqx.filter_jit
def _together(transforms, x, args, kwargs):
    return [transform(x, *args, **kwargs) for transform in transforms]


def together(transforms, x, *args, **kwargs):
    """Call every transform on the same inputs inside one compiled function."""
    return _together(transforms, x, args, kwargs)


def variables_vector(x):
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(x) if eqx.is_inexact_array(leaf)]
    return jnp.concatenate([jnp.ravel(leaf).astype(jnp.float64) for leaf in leaves])


def mixing(rows, cols, seed=0.0):
    """A fixed dense matrix (a NumPy constant, so it costs nothing to compile)."""
    return np.cos(np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) * 0.7 + seed)


def loss(x, data=1.0, *, weight=0.5):
    """A scalar with a dense Hessian, using an extra argument and a keyword."""
    v = variables_vector(x)
    return jnp.sum(data * jnp.sin(mixing(3, v.size) @ v)) + weight * jnp.sum(v**2) ** 2


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
    """A module whose fixed leaves (ints, bools, functions, int arrays) shape the loss."""

    weight: jax.Array
    bias: jax.Array
    power: int
    negate: bool
    activation: object
    index: jax.Array
    label: str = eqx.field(static=True)

    def __call__(self, inputs):
        y = self.activation(self.weight @ inputs + self.bias) ** self.power
        y = jnp.sum(y[self.index])
        return -y if self.negate else y


def make_holder():
    return Holder(
        weight=jax.device_put(np.linspace(-1, 1, 6).reshape(3, 2)),
        bias=jax.device_put(np.asarray([0.1, -0.2, 0.3])),
        power=3,
        negate=True,
        activation=jnp.sin,
        index=jax.device_put(np.asarray([2, 0])),
        label="holder",
    )


def test_every_block_option():
    x = TREES["dict"]()  # n = 5
    expected = reference_hessian("dict-options", loss, x, 2.0, weight=0.25)
    np.testing.assert_allclose(expected, expected.T, rtol=1e-14)
    # Every nbatches; batch sizes that divide, do not divide, and exceed n.
    options = [{"nbatches": k} for k in range(1, 6)]
    options += [{"batch_size": k} for k in (1, 2, 3, 5, 8)] + [{}]
    transforms = [
        zm.BatchedHessian(loss, mode=mode, **option)
        for mode in ("auto", "fwd", "rev")
        for option in options
    ]
    for H in together(transforms, x, 2.0, weight=0.25):
        assert H.shape == (5, 5) and H.dtype == jnp.float64
        close(H, expected)
    # One of them on its own, outside any other jit.
    close(zm.BatchedHessian(loss, nbatches=2)(x, 2.0, weight=0.25), expected)


@pytest.mark.parametrize("name", TREES)
def test_pytree_inputs(name):
    x = TREES[name]()
    expected = reference_hessian(f"{name}-inputs", loss, x, -1.0, weight=2.0)
    n = expected.shape[0]
    transforms = [zm.BatchedHessian(loss, nbatches=n), zm.BatchedHessian(loss, batch_size=2)]
    for H in together(transforms, x, -1.0, weight=2.0):
        assert H.dtype == jnp.float64
        close(H, expected)


def test_has_aux():
    x = TREES["nested"]()

    def loss_and_aux(x, data):
        value = loss(x, data)
        return value, {"value": value, "count": jnp.asarray(2), "data": data}

    expected = reference_hessian("nested-aux", loss, x, 0.5)
    H, aux = zm.BatchedHessian(loss_and_aux, nbatches=3, has_aux=True)(x, 0.5)
    close(H, expected)
    close(aux["value"], jax.jit(loss)(x, 0.5))  # compiled: one program, not one per operation
    assert aux["count"] == 2 and aux["count"].dtype == jnp.int64
    np.testing.assert_allclose(aux["data"], 0.5)


def sine_loss_and_aux(x, data):
    value = jnp.sum(jnp.sin(x["a"] * data) * x["b"] ** 2)
    return value, {"name": "loss", "count": 3, "value": value, "size": jnp.asarray(2)}


@eqx.filter_jit  # one program for every parametrisation of the test below
def hessian_and_array_aux(x, data):
    """jax.hessian's matrix and aux: it takes only arrays in aux."""

    def loss_and_array_aux(x, data):
        value, aux = sine_loss_and_aux(x, data)
        return value, eqx.filter(aux, eqx.is_array)

    H, aux = jax.hessian(loss_and_array_aux, has_aux=True)(x, data)
    return jnp.block([[H[i][j].reshape(x[i].size, x[j].size) for j in x] for i in x]), aux


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_has_aux_with_checkpoint_and_leaves_that_are_not_arrays(mode, jit):
    x = {"a": jax.device_put(np.asarray([0.5, -1.5])), "b": jnp.asarray(0.25)}
    # jax.hessian takes only arrays in aux; the other leaves come back unchanged.
    expected_H, expected_aux = hessian_and_array_aux(x, 0.5)
    expected_aux = {**expected_aux, "name": "loss", "count": 3}
    for strategy in ("linearize", "recompute"):
        transform = zm.BatchedHessian(
            sine_loss_and_aux,
            batch_size=2,
            mode=mode,
            strategy=strategy,
            has_aux=True,
            jit=jit,
            checkpoint=True,
        )
        H, aux = transform(x, 0.5)
        close(H, expected_H)
        close(aux, expected_aux)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_jit_and_checkpoint(jit, checkpoint):
    x = TREES["nested"]()
    expected = reference_hessian("nested-weighted", loss, x, 0.5, weight=1.5)
    transform = zm.BatchedHessian(loss, batch_size=3, jit=jit, checkpoint=checkpoint)
    close(transform(x, 0.5, weight=1.5), expected)


def test_empty_leaves_and_a_constant():
    x = {"a": jax.device_put(np.asarray([0.5, -1.5, 2.0])), "e": jnp.zeros((0, 2)), "n": None}
    expected = reference_hessian("empty-leaf", loss, x)
    for nbatches in (1, 2):
        close(zm.BatchedHessian(loss, nbatches=nbatches)(x), expected)
    blocks = zm.hessian_to_pytree(expected, x)
    assert blocks["a"]["e"].shape == (3, 0, 2) and blocks["e"]["e"].shape == (0, 2, 0, 2)
    assert blocks["n"] is None and blocks["a"]["n"] is None
    # Only empty variables: n = 0, an empty Hessian, as jax.hessian gives.
    H = zm.BatchedHessian(lambda x: jnp.sum(x["e"]) + 1.0)({"e": jnp.zeros((0, 2))})
    assert H.shape == (0, 0) and H.dtype == jnp.float64
    # A constant Python number has a zero Hessian.
    close(zm.BatchedHessian(lambda x: 2.0, nbatches=2)(x), jnp.zeros((3, 3)))


def holder_loss(holder, inputs):
    return holder(inputs)


def test_fixed_leaves_of_a_module():
    holder = make_holder()
    inputs = jax.device_put(np.asarray([0.4, -0.8]))
    expected = reference_hessian("holder", holder_loss, holder, inputs)
    assert expected.shape == (9, 9)
    transforms = [zm.BatchedHessian(holder_loss, nbatches=k) for k in (2, 9)]
    for H in together(transforms, holder, inputs):
        close(H, expected)
    blocks = zm.hessian_to_pytree(H, holder)
    assert blocks.weight.weight.shape == (3, 2, 3, 2)
    assert blocks.weight.bias.shape == (3, 2, 3)
    assert blocks.bias.weight.shape == (3, 3, 2)
    assert blocks.power is None and blocks.negate is None and blocks.activation is None
    assert blocks.index is None and blocks.weight.index is None and blocks.label == "holder"


def mse(model, inputs, targets):
    return jnp.mean((jax.vmap(model)(inputs) - targets) ** 2)


def test_mlp_as_x():
    mlp = make_mlp(3, 2, 4, 2)
    inputs = jax.device_put(np.linspace(-1, 1, 12).reshape(4, 3))
    targets = jax.device_put(np.linspace(0, 1, 8).reshape(4, 2))
    expected = reference_hessian("mlp", mse, mlp, inputs, targets)
    assert expected.shape == (46, 46)
    transforms = [zm.BatchedHessian(mse, nbatches=k) for k in (1, 5, 46)]
    for H in together(transforms, mlp, inputs, targets):
        close(H, expected)
    # hessian_to_pytree against jax.hessian on the model's arrays directly.
    params, fixed = eqx.partition(mlp, eqx.is_inexact_array)
    direct = jax.jit(jax.hessian(lambda p: mse(eqx.combine(p, fixed), inputs, targets)))(params)
    blocks = eqx.filter_jit(zm.hessian_to_pytree)(H, mlp)
    close(eqx.filter(blocks, eqx.is_array), direct)
    assert blocks.activation is None and blocks.layers[0].weight.activation is None
    assert blocks.layers[1].bias.layers[0].weight.shape == (4, 4, 3)


def test_mlp_as_fn_under_filter_jit_and_grad():
    mlp = make_mlp(3, "scalar", 5, 1)
    inputs = jax.device_put(np.asarray([0.3, -0.1, 0.8]))
    transform = zm.BatchedHessian(mlp, nbatches=2)

    @eqx.filter_jit
    def hessian_norm(transform, inputs):
        return jnp.sum(transform(inputs) ** 2)

    @eqx.filter_jit
    def plain_norm(model, inputs):
        return jnp.sum(jax.hessian(model)(inputs) ** 2)

    close(hessian_norm(transform, inputs), plain_norm(mlp, inputs))
    # The model's arrays are leaves of the transform: differentiate through them.
    grads = eqx.filter_jit(eqx.filter_grad(hessian_norm))(transform, inputs)
    expected = eqx.filter_jit(eqx.filter_grad(plain_norm))(mlp, inputs)
    close(eqx.filter(grads.fn, eqx.is_array), eqx.filter(expected, eqx.is_array))


def test_inside_jit_vmap_and_grad():
    x = TREES["dict"]()
    flat, unravel = ravel_pytree(x)
    transform = zm.BatchedHessian(loss, nbatches=2)

    def plain(x, data):
        return jax.hessian(lambda z: loss(unravel(z), data))(ravel_pytree(x)[0])

    def run(hessian, x, data, xs, datas):
        return {
            "jit": hessian(x, data),
            # Per-example Hessians: vmap over a batch of inputs and of the data.
            "vmap": jax.vmap(hessian)(xs, datas),
            "vmap-data": jax.vmap(lambda d: hessian(x, d))(datas),
            # Gradient of the Hessian's sum with respect to the data argument.
            "grad": jax.grad(lambda d: jnp.sum(hessian(x, d)))(data),
            "grad-x": jax.grad(lambda x: jnp.sum(jnp.sin(hessian(x, data))))(x),
        }

    xs = jax.tree_util.tree_map(
        lambda leaf: jax.device_put(np.stack([leaf, 2 * np.asarray(leaf), -np.asarray(leaf)])), x
    )
    datas = jax.device_put(np.asarray([1.0, 0.5, -2.0]))
    actual = jax.jit(lambda *a: run(transform, *a))(x, 1.5, xs, datas)
    expected = jax.jit(lambda *a: run(plain, *a))(x, 1.5, xs, datas)
    close(actual, expected)


def test_hessian_to_pytree_matches_jax_hessian_on_the_pytree():
    x = TREES["nested"]()
    H = zm.BatchedHessian(loss, nbatches=3)(x, 0.5)
    expected = jax.jit(jax.hessian(loss))(x, 0.5)
    blocks = zm.hessian_to_pytree(H, x)
    close(blocks, expected)
    # x's structure twice; block [i][j] has shape leaf_i.shape + leaf_j.shape.
    assert blocks[0][0][0][0].shape == (2, 2, 2, 2)
    assert blocks[0][0][1]["z"].shape == (2, 2, 2)
    assert blocks[1]["z"][0][1].shape == (2,)
    assert blocks[0][1][0][1].shape == ()
    # NumPy input is accepted as well.
    close(zm.hessian_to_pytree(np.asarray(H), x), expected)


def test_to_pytree_errors():
    x = TREES["dict"]()  # n = 5
    with pytest.raises(ValueError, match=r"H has shape \(4, 4\), but x flattens to 5 elements"):
        zm.hessian_to_pytree(jnp.zeros((4, 4)), x)
    with pytest.raises(ValueError, match=r"H has shape \(5,\).*shape \(5, 5\)"):
        zm.hessian_to_pytree(jnp.zeros(5), x)
    with pytest.raises(ValueError, match=r"H has shape \(5, 4\)"):
        zm.hessian_to_pytree(jnp.zeros((5, 4)), x)
    with pytest.raises(ValueError, match="`x` has no inexact-array leaves"):
        zm.hessian_to_pytree(jnp.zeros((1, 1)), {"n": 1})
    with pytest.raises(ValueError, match="`x` has no inexact-array leaves"):
        zm.jacobian_to_pytree(jnp.zeros((1, 1)), (jnp.arange(2),))


# (config, error raised by the constructor, error raised by __check_init__, its message).
# Under a jaxtyping import hook (as in these tests) the constructor's own type check
# refuses a value of the wrong type before `__check_init__` runs; both name the field
# and the value.
CONSTRUCTION_ERRORS = [
    ({"nbatches": 0}, ValueError, ValueError, r"`nbatches` must be a positive int, got nbatches=0"),
    (
        {"nbatches": -1},
        ValueError,
        ValueError,
        r"`nbatches` must be a positive int, got nbatches=-1",
    ),
    (
        {"nbatches": 3.0},
        TypeError,
        TypeError,
        r"`nbatches` must be a positive int or None, got 3\.0 of type float",
    ),
    ({"nbatches": False}, TypeError, TypeError, r"`nbatches` .* got False of type bool"),
    (
        {"batch_size": 0},
        ValueError,
        ValueError,
        r"`batch_size` must be a positive int, got batch_size=0",
    ),
    (
        {"batch_size": -4},
        ValueError,
        ValueError,
        r"`batch_size` must be a positive int, got batch_size=-4",
    ),
    ({"batch_size": 0.5}, TypeError, TypeError, r"`batch_size` .* got 0\.5 of type float"),
    ({"batch_size": True}, TypeError, TypeError, r"`batch_size` .* got True of type bool"),
    (
        {"nbatches": 1, "batch_size": 3},
        ValueError,
        ValueError,
        r"give at most one of `nbatches` and `batch_size`, got nbatches=1 and batch_size=3",
    ),
    ({"has_aux": None}, TypeError, TypeError, r"`has_aux` must be True or False, got None"),
    ({"jit": 0}, TypeError, TypeError, r"`jit` must be True or False, got 0 of type int"),
    ({"checkpoint": "no"}, TypeError, TypeError, r"`checkpoint` must be True or False, got 'no'"),
]


@pytest.mark.parametrize("config, error, check_error, message", CONSTRUCTION_ERRORS)
def test_construction_errors(config, error, check_error, message):
    (name, value), *_ = config.items()
    with pytest.raises(error, match=rf"{name}[\s\S]*{re.escape(repr(value))}"):
        zm.BatchedHessian(loss, **config)
    with pytest.raises(check_error, match=rf"^BatchedHessian: {message}"):
        check_init(zm.BatchedHessian, **config)


def test_mode_and_fn_must_be_callable():
    for mode in ("auto", "fwd", "rev"):
        assert zm.BatchedHessian(loss, mode=mode).mode == mode
    with pytest.raises((TypeError, ValueError), match=r"mode[\s\S]*'jacfwd'"):
        zm.BatchedHessian(loss, mode="jacfwd")
    with pytest.raises(
        ValueError,
        match=r"^BatchedHessian: `mode` must be one of 'auto', 'fwd', 'rev'; got 'jacfwd'",
    ):
        check_init(zm.BatchedHessian, mode="jacfwd")
    with pytest.raises(TypeError, match=r"fn[\s\S]*'loss'"):
        zm.BatchedHessian("loss")
    with pytest.raises(TypeError, match=r"`fn` must be callable .* got 'loss' of type str"):
        check_init(zm.BatchedHessian, fn="loss")


def test_trace_time_errors():
    x = TREES["dict"]()  # n = 5
    with pytest.raises(ValueError, match=r"nbatches=6 is larger than the number of variables, 5"):
        zm.BatchedHessian(loss, nbatches=6)(x)
    with pytest.raises(ValueError, match="`x` has no inexact-array leaves"):
        zm.BatchedHessian(lambda x: jnp.sum(x).astype(float))(jnp.arange(3))
    with pytest.raises(TypeError, match=r"must return a scalar \(shape \(\)\), .* shape \(1,\)"):
        zm.BatchedHessian(lambda x: loss(x)[None])(x)
    with pytest.raises(TypeError, match=r"must return a scalar .* shape \(2, 3\)"):
        zm.BatchedHessian(lambda x: jnp.ones((2, 3)) * loss(x), jit=False)(x)
    with pytest.raises(TypeError, match=r"must return a scalar .* returned \{'value'"):
        zm.BatchedHessian(lambda x: {"value": loss(x)})(x)
    with pytest.raises(TypeError, match=r"must return a scalar"):
        zm.BatchedHessian(lambda x: (loss(x), loss(x)))(x)
    with pytest.raises(TypeError, match=r"has_aux=True, `fn` must return a pair \(value, aux\)"):
        zm.BatchedHessian(loss, has_aux=True)(x)
    with pytest.raises(TypeError, match=r"must return a scalar .* shape \(3,\)"):
        zm.BatchedHessian(lambda x: (x["a"], 0.0), has_aux=True)(x)
    with pytest.raises(TypeError, match="real floating-point scalar, but it returned dtype int64"):
        zm.BatchedHessian(lambda x: jnp.sum(x["a"] > 0))(x)
    with pytest.raises(
        TypeError, match="real floating-point scalar, but it returned dtype complex"
    ):
        zm.BatchedHessian(lambda x: loss(x) * (1 + 1j))(x)


def test_hessian_memory_has_no_second_copy():
    """The result is written in place: XLA's temporaries stay well below one Hessian."""
    n = 2000

    def quadratic(x, data):
        return 0.5 * jnp.sum(x) ** 2 + jnp.sum(data * x**2) + jnp.sum(x[:-1] * x[1:])

    x = jax.device_put(np.linspace(0, 1, n))
    data = jax.device_put(np.linspace(1, 2, n))
    transform = zm.BatchedHessian(quadratic, nbatches=8)
    compiled = jax.jit(transform).lower(x, data).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("memory_analysis is unavailable on this backend")
    hessian_bytes = n * n * 8
    assert analysis.output_size_in_bytes == hessian_bytes
    assert analysis.temp_size_in_bytes < 0.5 * hessian_bytes
    # And the numbers are right: check a few rows against the closed form.
    H = compiled(x, data)
    rows = np.asarray(H[:3])
    exact = np.ones((3, n))
    exact[np.arange(3), np.arange(3)] += 2 * np.asarray(data[:3])
    exact[np.arange(3), np.arange(1, 4)] += 1
    exact[np.arange(1, 3), np.arange(0, 2)] += 1
    np.testing.assert_allclose(rows, exact, rtol=1e-12)


# --- a sweep over sizes and blocks, against the Hessian worked out by hand ---


@st.composite
def hessian_cases(draw):
    sizes = draw(leaf_sizes())
    options = draw(block_options(sum(sizes)))
    m = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 3))
    mode = draw(st.sampled_from(MODES))
    return sizes, options, m, seed, mode


@given(hessian_cases())
def test_sweep_against_the_exact_hessian(case):
    sizes, kwargs, m, seed, mode = case
    n = sum(sizes)
    rng = np.random.default_rng(seed)
    v = rng.uniform(-1, 1, n)
    a, c, w = rng.normal(size=(m, n)), rng.normal(size=m), rng.normal(size=n)
    s = rng.normal(size=(n, n))
    s = s + s.T
    offsets = np.cumsum([0, *sizes])
    x = [
        jax.device_put(v[offsets[i] : offsets[i + 1]].reshape((s_,) + (1,) * i))
        for i, s_ in enumerate(sizes)
    ]

    def fn(x):
        z = jnp.concatenate([jnp.ravel(leaf) for leaf in x])
        return jnp.sum(c * jnp.sin(a @ z)) + 0.5 * z @ s @ z + (w @ z) ** 3 / 6

    exact = a.T @ np.diag(-c * np.sin(a @ v)) @ a + s + (w @ v) * np.outer(w, w)
    H = zm.BatchedHessian(fn, mode=mode, **kwargs)(x)
    assert H.shape == (n, n) and H.dtype == jnp.float64
    np.testing.assert_allclose(H, exact, rtol=1e-11, atol=1e-11)


# --- rows by VJPs, leaf by leaf ---


def test_leaves_holding_many_blocks_whole_get_their_own():
    from zodmem._engine._block_plans import BlockPlan
    from zodmem._pytree import split_variables
    from zodmem._transforms._leafwise import leaves_of_their_own as _leaves_of_their_own

    x = {"a": jnp.zeros(40), "b": jnp.zeros(3), "c": jnp.zeros((6, 5))}
    _, variables = split_variables(x, owner="test")
    # 73 rows in blocks of 4: 19 blocks, 10 of them wholly in "a" and 7 in "c".
    assert _leaves_of_their_own(variables, BlockPlan(73, 4), 0) == [0, 2]
    # Rows 40.. of a share: only "c" holds blocks whole.
    assert _leaves_of_their_own(variables, BlockPlan(33, 4), 40) == [2]
    # One block, or one leaf: nothing to choose between.
    assert _leaves_of_their_own(variables, BlockPlan(73, 73), 0) == []
    _, alone = split_variables(jnp.zeros(9), owner="test")
    assert _leaves_of_their_own(alone, BlockPlan(9, 2), 0) == []


def _two_layer(params, inputs):
    hidden = jnp.tanh(inputs @ params["w1"] + params["b1"])
    out = hidden @ params["w2"] + params["b2"]
    return jnp.sum(jnp.sin(out) ** 2) + 0.1 * jnp.sum(params["w1"] ** 2), {"out": out}


two_layer_compiled = jax.jit(_two_layer)  # the reference: one program for every option


def _two_layer_params():
    return {
        "b1": jax.device_put(np.linspace(-0.3, 0.2, 6)),
        "b2": jax.device_put(np.linspace(0.1, 0.4, 2)),
        "w1": jax.device_put(mixing(4, 6)),
        "w2": jax.device_put(mixing(6, 2, seed=1.0)),
    }


@pytest.mark.parametrize(
    "options",
    [
        dict(batch_size=2),
        dict(batch_size=3),
        dict(batch_size=5, strategy="recompute"),
        dict(nbatches=7, checkpoint=True),
        dict(batch_size=4, jit=False),
    ],
)
def test_blocks_within_one_leaf_match_jax_hessian(options):
    params, inputs = _two_layer_params(), jax.device_put(mixing(3, 4, seed=2.0))
    exact = reference_hessian("two-layer", lambda p, i: _two_layer(p, i)[0], params, inputs)
    transform = zm.BatchedHessian(_two_layer, mode="rev", has_aux=True, **options)
    H, aux = transform(params, inputs)
    assert H.dtype == jnp.float64
    close(H, exact)
    close(aux["out"], two_layer_compiled(params, inputs)[1]["out"])


def test_blocks_within_one_leaf_under_vmap_and_grad():
    params, inputs = _two_layer_params(), jax.device_put(mixing(3, 4, seed=2.0))
    transform = zm.BatchedHessian(lambda p, i: _two_layer(p, i)[0], batch_size=3, mode="rev")

    def exact(p, i):
        fn_of_flat, flat = raveled(lambda p, i: _two_layer(p, i)[0], p, i)
        return jax.hessian(fn_of_flat)(flat)

    scales = jax.device_put(np.asarray([0.5, 1.0, 2.0]))
    batched = jax.vmap(lambda s: transform(params, s * inputs))(scales)
    # The references compiled: one program each rather than one per operation.
    close(batched, jax.jit(jax.vmap(lambda s: exact(params, s * inputs)))(scales))
    grad = jax.grad(lambda s: jnp.sum(transform(params, s * inputs) ** 2))(0.7)
    close(grad, jax.jit(jax.grad(lambda s: jnp.sum(exact(params, s * inputs) ** 2)))(0.7))
