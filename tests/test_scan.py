"""`SlicedScan` and `CheckpointedScan` against `lax.scan` and plain Python loops."""

import contextlib
import functools
import io
import math
import re
from collections.abc import Callable

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_init
from hypothesis import given
from jax.ad_checkpoint import print_saved_residuals

import zodmem as zm
from zodmem._engine._block_plans import plan_blocks
from zodmem._engine._blocks import scan_blocks, write_once
from zodmem._transforms._scan import default_chunk_size

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


# A step with an int and a float carry and pytree outputs. Its arithmetic is exact
# or the same IEEE operations in numpy, so results compare with equality.
def tree_step(carry, x):
    n, v = carry
    xi, xf = (1, 1.0) if x is None else (x["i"], x["f"])
    n = (n * 3 + xi) % 101
    v = v * 0.5 + xf
    return (n, v), {"n": n, "pair": (v, n * 2)}


def carry_only_step(carry, x):
    (n, v), _ = tree_step(carry, x)
    return (n, v), None


STEPS = {"tree": tree_step, "carry_only": carry_only_step}


def make_init():
    return (
        jax.device_put(np.asarray(7, np.int32)),
        jax.device_put(np.asarray([0.25, -1.0], np.float32)),
    )


def make_xs(length):
    i = (np.arange(length, dtype=np.int32) * 7) % 13
    f = np.linspace(-2.0, 3.0, 2 * length, dtype=np.float32).reshape(length, 2)
    return {"i": jax.device_put(i), "f": jax.device_put(f)}


def python_scan(step, init, xs, length, reverse):
    """The scan as a plain Python loop over numpy values."""
    carry = jax.tree_util.tree_map(np.asarray, init)
    order = range(length - 1, -1, -1) if reverse else range(length)
    ys = [None] * length
    for i in order:
        x = None if xs is None else jax.tree_util.tree_map(lambda a, i=i: np.asarray(a)[i], xs)
        carry, ys[i] = step(carry, x)
        carry = jax.tree_util.tree_map(np.asarray, carry)
    return carry, ys


def take(ys, index):
    """`ys[index]` on every leaf, as after `lax.scan`."""
    return jax.tree_util.tree_map(lambda a: a[index], ys)


@functools.partial(
    jax.jit, static_argnames=("fn", "length", "reverse", "unroll", "start", "stop", "step")
)
def lax_scan(
    init, xs, *, fn, length=None, reverse=False, unroll=1, start=None, stop=None, step=None
):
    """The reference: `lax.scan`, its outputs sliced `[start:stop:step]`, as one compiled
    program (rather than the scan and one slice per output leaf, each compiled apart)."""
    carry, ys = jax.lax.scan(fn, init, xs, length=length, reverse=reverse, unroll=unroll)
    return carry, take(ys, np.s_[start:stop:step])


def assert_same(got, want):
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


bounds = st.one_of(st.none(), st.integers(-25, 25))
steps = st.one_of(st.none(), st.integers(-6, 6).filter(lambda s: s != 0))


@given(
    length=st.integers(0, 20),
    start=bounds,
    stop=bounds,
    step=steps,
    reverse=st.booleans(),
    with_xs=st.booleans(),
    kind=st.sampled_from(sorted(STEPS)),
)
def test_sliced_scan_matches_lax_scan_and_loop(length, start, stop, step, reverse, with_xs, kind):
    fn = STEPS[kind]
    init = make_init()
    xs = make_xs(length) if with_xs else None
    given_length = None if with_xs else length
    transform = zm.SlicedScan(
        fn, start=start, stop=stop, step=step, length=given_length, reverse=reverse
    )
    carry, ys = transform(init, xs)

    want_carry, want_ys = lax_scan(
        init, xs, fn=fn, length=length, reverse=reverse, start=start, stop=stop, step=step
    )
    assert_same(carry, want_carry)
    assert_same(ys, want_ys)

    loop_carry, loop_ys = python_scan(fn, init, xs, length, reverse)
    kept = loop_ys[start:stop:step]
    for g, w in zip(jax.tree_util.tree_leaves(carry), loop_carry, strict=True):
        np.testing.assert_array_equal(g, w)
    if kind == "tree":
        np.testing.assert_array_equal(ys["n"], [y["n"] for y in kept])
        want_v = np.array([y["pair"][0] for y in kept], np.float32).reshape(-1, 2)
        np.testing.assert_array_equal(ys["pair"][0], want_v)
    else:
        assert ys is None


@pytest.mark.parametrize(
    "length,step,unroll,reverse", [(12, 3, 2, False), (11, -2, 5, True), (7, 4, True, True)]
)
def test_sliced_scan_unroll_keeps_values(length, step, unroll, reverse):
    init, xs = make_init(), make_xs(length)
    got = zm.SlicedScan(tree_step, start=1, step=step, unroll=unroll, reverse=reverse)(init, xs)
    assert_same(got, lax_scan(init, xs, fn=tree_step, reverse=reverse, start=1, step=step))


@pytest.mark.parametrize("transform", [zm.SlicedScan, zm.CheckpointedScan])
@pytest.mark.parametrize("unroll", [np.True_, np.False_])
def test_numpy_bool_unroll_is_a_bool(transform, unroll):
    scan = transform(tree_step, unroll=unroll)
    assert type(scan.unroll) is bool and scan == transform(tree_step, unroll=bool(unroll))
    init, xs = make_init(), make_xs(5)
    assert_same(scan(init, xs), jax.lax.scan(tree_step, init, xs, unroll=unroll))


def smooth_step(carry, x):
    h, total = carry
    h = jnp.tanh(h * x["w"] + x["b"])
    return (h, total + jnp.sum(h**2)), {"h": h, "s": jnp.sin(total)}


def smooth_xs(length):
    # Built by NumPy (float64, as the tests that use it run): no programs to compile.
    w = np.linspace(0.5, 1.5, length * 3).reshape(length, 3)
    b = np.cos(np.arange(length, dtype=w.dtype))
    return {"w": jax.device_put(w), "b": jax.device_put(b)}


def loss_of(scan):
    def loss(init, xs):
        (h, total), ys = scan(init, xs)
        terms = [jnp.sum(leaf**3) for leaf in jax.tree_util.tree_leaves(ys)]
        return jnp.sum(h) + total + sum(terms)

    return loss


@pytest.mark.parametrize(
    "length,start,stop,step,reverse,with_xs",
    [
        (13, 2, 11, 3, False, True),
        (13, -2, 1, -4, True, True),
        (6, 9, 0, 1, False, True),
        (13, 1, None, 3, True, False),
        (9, -1, None, -2, False, False),
    ],
)
def test_sliced_scan_gradients_match_lax_scan(float64, length, start, stop, step, reverse, with_xs):
    init = (jax.device_put(np.asarray([0.1, -0.2, 0.3])), jnp.asarray(0.0))
    if with_xs:
        params, given_length = smooth_xs(length), None
        step_fn = smooth_step
    else:
        # Without xs, the differentiated inputs reach the steps through a closure.
        params, given_length = (
            {"w": jax.device_put(np.asarray([0.9, 1.1, 1.3])), "b": jnp.asarray(0.2)},
            length,
        )

        def step_fn(carry, x):
            return smooth_step(carry, params)

    def loss(scan):
        def value(init, params):
            xs = params if with_xs else None
            (h, total), ys = scan(init, xs, params)
            terms = [jnp.sum(leaf**3) for leaf in jax.tree_util.tree_leaves(ys)]
            return jnp.sum(h) + total + sum(terms)

        return value

    def reference(init, xs, params):
        fn = smooth_step if with_xs else (lambda c, x: smooth_step(c, params))
        carry, ys = jax.lax.scan(fn, init, xs, length=length, reverse=reverse)
        return carry, take(ys, np.s_[start:stop:step])

    def sliced(init, xs, params):
        fn = smooth_step if with_xs else (lambda c, x: smooth_step(c, params))
        transform = zm.SlicedScan(
            fn, start=start, stop=stop, step=step, length=given_length, reverse=reverse
        )
        return transform(init, xs)

    want = jax.jit(jax.grad(loss(reference), argnums=(0, 1)))(init, params)
    got = jax.grad(loss(sliced), argnums=(0, 1))(init, params)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


class Cell(eqx.Module):
    weight: jax.Array
    activation: Callable = eqx.field(static=True)

    def __call__(self, h, x):
        h = self.activation(self.weight @ h + x)
        return h, h[0]


def test_module_fn_is_a_leaf_and_differentiable(float64):
    cell = Cell(jax.device_put(np.eye(3) * 0.9 + 0.05), jnp.tanh)
    xs = jax.device_put(np.linspace(-1.0, 1.0, 30).reshape(10, 3))
    sliced = zm.SlicedScan(cell, start=1, step=4)
    assert any(leaf is cell.weight for leaf in jax.tree_util.tree_leaves(sliced))
    assert sliced.config == {
        "start": 1,
        "stop": None,
        "step": 4,
        "length": None,
        "reverse": False,
        "unroll": 1,
        "progress": False,
    }

    def loss(transform, h0):
        h, ys = transform(h0, xs)
        return jnp.sum(h) + jnp.sum(ys**2)

    def reference(c, h0):
        h, ys = jax.lax.scan(lambda h, x: c(h, x), h0, xs)
        return jnp.sum(h) + jnp.sum(ys[1::4] ** 2)

    h0 = jnp.ones(3)
    got = eqx.filter_grad(loss)(sliced, h0)
    # The references compiled: one program each rather than one per operation.
    want = eqx.filter_jit(eqx.filter_grad(reference))(cell, h0)
    np.testing.assert_allclose(got.fn.weight, want.weight, rtol=1e-12)

    checkpointed = zm.CheckpointedScan(cell, chunk_size=3)
    got = eqx.filter_grad(lambda t, h0: jnp.sum(t(h0, xs)[1] ** 2))(checkpointed, h0)
    want = eqx.filter_jit(
        eqx.filter_grad(lambda c, h0: jnp.sum(jax.lax.scan(lambda h, x: c(h, x), h0, xs)[1] ** 2))
    )(cell, h0)
    np.testing.assert_allclose(got.fn.weight, want.weight, rtol=1e-12)


def test_jit_vmap_and_python_carries():
    init, xs = make_init(), make_xs(11)
    sliced = zm.SlicedScan(tree_step, start=3, stop=-1, step=2)

    jitted = jax.jit(lambda init, xs: sliced(init, xs))
    want = lax_scan(init, xs, fn=tree_step, start=3, stop=-1, step=2)
    assert_same(jitted(init, xs), want)

    rows = [np.asarray(init[1]), np.asarray(init[1]) + np.float32(1.0)]
    got = jax.vmap(lambda v: sliced((init[0], v), xs))(jax.device_put(np.stack(rows)))
    for row in range(2):
        want_row = lax_scan(
            (init[0], jax.device_put(rows[row])), xs, fn=tree_step, start=3, stop=-1, step=2
        )
        assert_same(jax.tree_util.tree_map(lambda a, row=row: np.asarray(a)[row], got), want_row)

    # A Python float carry and output, as lax.scan takes them.
    def count(c, x):
        return c + x, 2.0

    carry, ys = zm.SlicedScan(count, step=3)(0.0, jnp.arange(7.0))
    want_carry, want_ys = jax.lax.scan(count, 0.0, jnp.arange(7.0))
    assert carry.dtype == want_carry.dtype and float(carry) == float(want_carry)
    assert ys.dtype == want_ys.dtype
    np.testing.assert_array_equal(ys, want_ys[::3])


def test_sliced_scan_memory_scales_with_kept_steps():
    def step(c, x):
        c = jnp.sin(c) + x
        return c, c

    length, width, stride = 1000, 256, 100
    init, xs = jnp.zeros(width), jnp.ones(length)

    def compiled(fn):
        analysis = jax.jit(fn).lower(init, xs).compile().memory_analysis()
        if analysis is None or not hasattr(analysis, "temp_size_in_bytes"):
            pytest.skip("this backend gives no memory analysis of compiled code")
        return analysis

    def reference(init, xs):
        carry, ys = jax.lax.scan(step, init, xs)
        return carry, ys[::stride]

    all_ys = length * width * 4
    kept_ys = (length // stride) * width * 4
    plain = compiled(reference)
    assert plain.temp_size_in_bytes >= all_ys  # the plain scan holds every output

    for reverse, sign in [(False, 1), (True, -1)]:
        sliced = compiled(zm.SlicedScan(step, step=sign * stride, reverse=reverse))
        assert sliced.output_size_in_bytes == plain.output_size_in_bytes
        assert sliced.output_size_in_bytes < kept_ys + width * 4 + 64
        assert sliced.temp_size_in_bytes < kept_ys

    # With `length` alone, the steps between kept ones run in inner loops.
    def free_step(c, _):
        return step(c, 1.0)

    sliced = zm.SlicedScan(free_step, start=7, step=stride, length=length)
    analysis = jax.jit(sliced).lower(init).compile().memory_analysis()
    assert analysis.output_size_in_bytes < kept_ys + width * 4 + 64
    assert analysis.temp_size_in_bytes < kept_ys


def test_sliced_scan_gradient_memory_is_no_more_than_lax_scan():
    def step(c, x):
        c = jnp.sin(c) * x
        return c, c[:4]

    init, xs = jnp.zeros(128), jnp.ones((300, 128))

    def temp_bytes(scan):
        def loss(init, xs):
            carry, ys = scan(init, xs)
            return jnp.sum(carry) + jnp.sum(ys**2)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        analysis = grad.lower(init, xs).compile().memory_analysis()
        if analysis is None or not hasattr(analysis, "temp_size_in_bytes"):
            pytest.skip("this backend gives no memory analysis of compiled code")
        return analysis.temp_size_in_bytes

    def reference(init, xs):
        carry, ys = jax.lax.scan(step, init, xs)
        return carry, ys[3::7]

    plain = temp_bytes(reference)
    assert temp_bytes(zm.SlicedScan(step, start=3, step=7)) <= plain
    assert temp_bytes(zm.CheckpointedScan(step, chunk_size=20)) < plain / 4


def test_empty_and_length_only_scans():
    init = make_init()
    cases = [
        (length, start, stop, step)
        for length in (0, 1, 5)
        for start, stop, step in [(None, None, None), (3, 1, None), (None, None, -1)]
    ]
    inputs = [make_xs(length) for length, *_ in cases]
    transforms = [zm.SlicedScan(tree_step, start=a, stop=b, step=c) for _, a, b, c in cases]

    # Every scan and its reference in one compiled function (one program rather than
    # one per case), and the first scan also called as it is.
    @jax.jit
    def every_case(init, inputs):
        return [transform(init, xs) for transform, xs in zip(transforms, inputs, strict=True)], [
            jax.lax.scan(tree_step, init, xs) for xs in inputs
        ]

    got, plain = every_case(init, inputs)
    assert_same(transforms[0](init, inputs[0]), got[0])
    for (_, start, stop, step), got_one, (carry, ys) in zip(cases, got, plain, strict=True):
        # (The outputs sliced by NumPy: no slice compiled per leaf.)
        ys = jax.tree_util.tree_map(np.asarray, ys)
        assert_same(got_one, (carry, take(ys, np.s_[start:stop:step])))
    got = zm.SlicedScan(tree_step, length=0)(init)
    assert_same(got, jax.lax.scan(tree_step, init, None, length=0))
    # xs with no leaves scans `length` times, as in lax.scan.
    got = zm.SlicedScan(lambda c, x: (c + 1, c), length=4, step=2)(0, ())
    assert_same(got, (jnp.asarray(4), jax.device_put(np.asarray([0, 2]))))


def check_construction(cls, kwargs, error, match):
    """Building refuses the value (a type the annotations exclude may be refused by the
    type checker the tests run under, with a message naming the field and value);
    the validation itself raises `error` with the message `match`."""
    (name, value), *_ = kwargs.items()
    with pytest.raises(error, match=rf"{name}[\s\S]*{re.escape(repr(value))}"):
        cls(tree_step, **kwargs)
    with pytest.raises(error, match=rf"^{cls.__name__}: .*{match}"):
        check_init(cls, fn=tree_step, **kwargs)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"step": 0}, ValueError, r"`step` may not be 0, got step=0"),
        ({"start": 1.5}, TypeError, r"`start` must be an int or None, got 1\.5"),
        ({"stop": "end"}, TypeError, r"`stop` must be an int or None, got 'end'"),
        ({"step": True}, TypeError, r"`step` must be an int or None, got True of type bool"),
        ({"length": -1}, ValueError, r"`length` .* non-negative int or None, got length=-1"),
        ({"length": 2.0}, TypeError, r"`length` must be an int or None, got 2\.0"),
        ({"reverse": 1}, TypeError, r"`reverse` must be True or False, got 1"),
        ({"unroll": 0}, ValueError, r"`unroll` must be a positive int or a bool, got unroll=0"),
        ({"unroll": -3}, ValueError, r"got unroll=-3"),
        ({"unroll": 1.5}, TypeError, r"`unroll` must be a positive int or a bool, got 1\.5"),
        (
            {"unroll": np.float64(2.0)},
            TypeError,
            r"`unroll` must be a positive int or a bool, got np\.float64\(2\.0\) of type "
            r"numpy\.float64\.",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
def test_sliced_scan_construction_errors(kwargs, error, match):
    check_construction(zm.SlicedScan, kwargs, error, match)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"chunk_size": 0}, ValueError, r"`chunk_size` must be a positive int, got chunk_size=0"),
        ({"chunk_size": -2}, ValueError, r"chunk_size=-2"),
        ({"chunk_size": 2.5}, TypeError, r"`chunk_size` must be a positive int or None, got 2\.5"),
        ({"chunk_size": True}, TypeError, r"`chunk_size` .* got True of type bool"),
        ({"length": -4}, ValueError, r"got length=-4"),
        ({"length": "3"}, TypeError, r"`length` must be an int or None, got '3'"),
        ({"reverse": None}, TypeError, r"`reverse` must be True or False, got None"),
        ({"unroll": 0}, ValueError, r"got unroll=0"),
        ({"unroll": "2"}, TypeError, r"`unroll` must be a positive int or a bool, got '2'"),
    ],
)
def test_checkpointed_scan_construction_errors(kwargs, error, match):
    check_construction(zm.CheckpointedScan, kwargs, error, match)


@pytest.mark.parametrize("transform", [zm.SlicedScan, zm.CheckpointedScan])
def test_fn_must_be_callable(transform):
    with pytest.raises(TypeError, match=r"fn[\s\S]*3"):
        transform(3)
    with pytest.raises(TypeError, match=r"`fn` must be callable.*got 3 of type int"):
        check_init(transform, fn=3)


@pytest.mark.parametrize("transform", [zm.SlicedScan, zm.CheckpointedScan])
def test_trace_time_errors(transform):
    name = transform.__name__
    init = make_init()
    with pytest.raises(ValueError, match=rf"{name}: `length`=4 disagrees .* `xs`, 5"):
        transform(tree_step, length=4)(init, make_xs(5))
    uneven = {"i": jnp.zeros(3, jnp.int32), "f": jnp.zeros((4, 2))}
    with pytest.raises(ValueError, match=r"same size along their leading axes.*xs\['f'\]: 4"):
        transform(tree_step)(init, uneven)
    with pytest.raises(ValueError, match=r"needs a leading axis.*xs\['i'\] is a scalar"):
        transform(tree_step)(init, {"i": jnp.asarray(1), "f": jnp.zeros((1, 2))})
    with pytest.raises(ValueError, match=r"`xs`=None has no array leaves and `length` is None"):
        transform(tree_step)(init)
    with pytest.raises(TypeError):  # lax.scan's own check of the carry
        transform(lambda c, x: (c.astype(jnp.float32), c), length=3)(
            jax.device_put(np.asarray(1, np.int32))
        )


@given(
    length=st.integers(0, 20),
    chunk_size=st.one_of(st.none(), st.integers(1, 25)),
    reverse=st.booleans(),
    with_xs=st.booleans(),
    kind=st.sampled_from(sorted(STEPS)),
)
def test_checkpointed_scan_matches_lax_scan(length, chunk_size, reverse, with_xs, kind):
    fn = STEPS[kind]
    init = make_init()
    xs = make_xs(length) if with_xs else None
    transform = zm.CheckpointedScan(
        fn, chunk_size=chunk_size, length=None if with_xs else length, reverse=reverse
    )
    got = transform(init, xs)
    assert_same(got, lax_scan(init, xs, fn=fn, length=length, reverse=reverse))


@pytest.mark.parametrize(
    "length,chunk_size,reverse", [(10, 3, False), (10, 3, True), (7, None, True)]
)
def test_checkpointed_scan_gradients_match_lax_scan(float64, length, chunk_size, reverse):
    init = (jax.device_put(np.asarray([0.1, -0.2, 0.3])), jnp.asarray(0.0))
    xs = smooth_xs(length)
    checkpointed = zm.CheckpointedScan(smooth_step, chunk_size=chunk_size, reverse=reverse)
    plain = lambda init, xs: jax.lax.scan(smooth_step, init, xs, reverse=reverse)  # noqa: E731
    want = jax.jit(jax.grad(loss_of(plain), argnums=(0, 1)))(init, xs)
    got = jax.grad(loss_of(checkpointed), argnums=(0, 1))(init, xs)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def saved_elements(fn, *args):
    """Total elements of the residuals that reverse mode stores for `fn`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    total = 0
    for line in out.getvalue().splitlines():
        shape = re.match(r"\w+\[([\d,]*)\]", line).group(1)
        total += math.prod(int(d) for d in shape.split(",") if d)
    return total


def test_checkpointed_scan_stores_fewer_residuals():
    def step(c, x):
        return jnp.sin(c) * x, None

    length, width = 400, 64
    init, xs = jnp.ones(width), jnp.linspace(0.5, 1.0, length)

    def plain(c):
        return jnp.sum(jax.lax.scan(step, c, xs)[0])

    def checkpointed(c, chunk_size=None):
        return jnp.sum(zm.CheckpointedScan(step, chunk_size=chunk_size)(c, xs)[0])

    assert saved_elements(plain, init) >= length * width
    # About one carry per chunk of sqrt(400) = 20 steps, and the inputs.
    assert saved_elements(checkpointed, init) <= (length // 20 + 1) * width + 2 * length
    assert saved_elements(lambda c: checkpointed(c, 400), init) <= width + 2 * length

    analysis = jax.jit(jax.grad(plain)).lower(init).compile().memory_analysis()
    if analysis is None or not hasattr(analysis, "temp_size_in_bytes"):
        pytest.skip("this backend gives no memory analysis of compiled code")
    chunked = jax.jit(jax.grad(checkpointed)).lower(init).compile().memory_analysis()
    assert analysis.temp_size_in_bytes >= length * width * 4
    assert chunked.temp_size_in_bytes < analysis.temp_size_in_bytes / 4


def test_default_chunk_size():
    lengths = (0, 1, 2, 4, 5, 10, 400, 401)
    assert [default_chunk_size(n) for n in lengths] == [1, 1, 2, 2, 3, 4, 20, 21]
    for n in range(1, 300):
        assert default_chunk_size(n) == math.ceil(math.sqrt(n))


def doubling_step(c, x):
    return c * 2 + x, c + x


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("reverse_outputs", [False, True])
def test_scan_blocks_places_block_outputs(reverse, reverse_outputs):
    step = doubling_step
    xs = jax.device_put(np.arange(11, dtype=np.int32))
    # (One reference program for each direction, whatever the order of the outputs.)
    want_carry, want_ys = lax_scan(jnp.asarray(1), xs, fn=step, reverse=reverse)

    def block(carry, start, size):
        assert start.dtype == jnp.int32 and start.shape == ()
        part = jax.lax.dynamic_slice_in_dim(xs, start, size)
        return jax.lax.scan(step, carry, part, reverse=reverse)

    carry, ys = scan_blocks(
        block,
        plan_blocks(11, batch_size=4),
        1,
        reverse=reverse,
        reverse_outputs=reverse_outputs,
    )
    assert int(carry) == int(want_carry)
    want_ys = np.asarray(want_ys)
    np.testing.assert_array_equal(ys, want_ys[::-1] if reverse_outputs else want_ys)
    with pytest.raises(ValueError, match="at least one step"):
        scan_blocks(block, plan_blocks(0), 1)


def test_write_once_values_and_derivatives(float64):
    buffer = jax.device_put(np.zeros((4, 2)))
    piece = jax.device_put(np.asarray([[-0.0, 2.0]]))
    written = np.asarray(write_once(buffer, piece, 1))  # (read by NumPy: no slices compiled)
    np.testing.assert_array_equal(written[1], [-0.0, 2.0])
    assert np.signbit(written[1, 0])  # written as it is, sign of zero included
    np.testing.assert_array_equal(write_once(buffer, piece, 2, jnp.asarray(False)), buffer)
    flags = write_once(
        jax.device_put(np.zeros((3,), bool)),
        jax.device_put(np.asarray([True])),
        2,
        jnp.asarray(True),
    )
    np.testing.assert_array_equal(flags, [False, False, True])

    def fill(values, keep):
        def body(out, i):
            return write_once(out, jnp.sin(values[i])[None], i, keep[i]), None

        out, _ = jax.lax.scan(body, jnp.zeros(4), jnp.arange(4))
        return out

    def reference(values, keep):
        return jnp.where(keep, jnp.sin(values), 0.0)

    values, keep = (
        jax.device_put(np.asarray([0.1, 0.2, 0.3, 0.4])),
        jax.device_put(np.asarray([True, False, True, True])),
    )
    weights = jax.device_put(np.asarray([1.0, -2.0, 3.0, 0.5]))

    # The value, gradient and JVP of each side in one compiled program.
    def derivatives(fn):
        @jax.jit
        def run(values, keep, weights):
            return (
                fn(values, keep),
                jax.grad(lambda v: jnp.dot(fn(v, keep), weights))(values),
                jax.jvp(lambda v: fn(v, keep), (values,), (weights,))[1],
            )

        return run(values, keep, weights)

    got, want = derivatives(fill), derivatives(reference)
    np.testing.assert_allclose(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-14)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-14)


def test_kept_outputs_are_exact():
    def step(c, x):
        return c + x, -c * 0.0  # outputs -0.0 for positive carries

    xs = jnp.arange(1.0, 9.0)
    for length_only in (False, True):
        if length_only:
            got = zm.SlicedScan(lambda c, _: step(c, 1.0), step=3, length=8)(1.0)
            want = jax.lax.scan(lambda c, _: step(c, 1.0), 1.0, None, length=8)
        else:
            got = zm.SlicedScan(step, step=3)(1.0, xs)
            want = jax.lax.scan(step, 1.0, xs)
        np.testing.assert_array_equal(np.signbit(got[1]), np.signbit(want[1][::3]))
