"""`zodmem.compat.powerpax.sliced_scan` / `checkpoint_chunked_scan` against powerpax 0.2.1
and `lax.scan`."""

import inspect

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import powerpax
import pytest
from helpers import close
from hypothesis import given, settings

from zodmem.compat import powerpax as compat


def step(carry, x):
    n, v = carry
    xi, xf = (1, 1.0) if x is None else (x["i"], x["f"])
    n = (n * 5 + xi) % 97
    v = v * 0.5 + xf
    return (n, v), {"n": n, "v": (v, n > 40)}


def carry_only(carry, x):
    return step(carry, x)[0], None


STEPS = {"tree": step, "carry_only": carry_only}


def make_init():
    return (jnp.asarray(3, jnp.int32), jnp.asarray([1.0, -0.5], jnp.float32))


def make_xs(length):
    i = jnp.asarray((np.arange(length) * 5) % 11, jnp.int32)
    f = jnp.linspace(-1.0, 2.0, 2 * length, dtype=jnp.float32).reshape(length, 2)
    return {"i": i, "f": f}


def test_signatures_match_powerpax():
    for name in ("sliced_scan", "checkpoint_chunked_scan"):
        ours = inspect.signature(getattr(compat, name)).parameters
        theirs = inspect.signature(getattr(powerpax, name)).parameters
        assert list(ours) == list(theirs)
        for p in theirs:
            assert ours[p].kind == theirs[p].kind
            assert ours[p].default == theirs[p].default
        assert name in compat.__all__


def powerpax_mishandles(length, start, stop, step, reverse):
    """Where powerpax 0.2.1's `sliced_scan` is wrong: when, after it merges the steps
    before the first kept one with the gap between kept steps, exactly one step is
    left to run before the first kept step (forward), or after the last (reverse),
    it indexes `xs` with None, which gives wrongly shaped results or an error."""
    kept = range(*slice(start, stop, step).indices(length))
    if len(kept) in (0, length):
        return False
    stride = abs(kept.step)
    order = sorted(length - 1 - i if reverse else i for i in (kept[0], kept[-1]))
    before, after = order[0], length - 1 - order[1]
    if len(kept) > 1 and before >= stride - 1:
        before -= stride - 1
    return after == 1 if reverse else before == 1


bounds = st.one_of(st.none(), st.integers(-18, 18))


@settings(max_examples=8)
@given(
    length=st.integers(0, 15),
    start=bounds,
    stop=bounds,
    step_=st.one_of(st.none(), st.integers(-5, 5).filter(bool)),
    reverse=st.booleans(),
    unroll=st.integers(-1, 6),
    inputs=st.sampled_from(["xs", "length", "both"]),
    kind=st.sampled_from(sorted(STEPS)),
)
def test_sliced_scan_matches_powerpax(length, start, stop, step_, reverse, unroll, inputs, kind):
    fn = STEPS[kind]
    init = make_init()
    xs = None if inputs == "length" else make_xs(length)
    given_length = None if inputs == "xs" else length
    args = (fn, init, xs, given_length, reverse, unroll)
    slicing = {"start": start, "stop": stop, "step": step_}
    got = compat.sliced_scan(*args, **slicing)
    carry, ys = jax.lax.scan(fn, init, xs, length=length, reverse=reverse)
    index = slice(start, stop, step_)
    close(got, (carry, jax.tree_util.tree_map(lambda a: a[index], ys)), exact=True)
    if not (xs is not None and powerpax_mishandles(length, start, stop, step_, reverse)):
        close(got, powerpax.sliced_scan(*args, **slicing), exact=True)


@settings(max_examples=8)
@given(
    length=st.integers(0, 15),
    chunk_size=st.one_of(st.none(), st.integers(1, 18)),
    reverse=st.booleans(),
    unroll=st.integers(0, 5),
    inputs=st.sampled_from(["xs", "length", "both"]),
    kind=st.sampled_from(sorted(STEPS)),
)
def test_checkpoint_chunked_scan_matches_powerpax(
    length, chunk_size, reverse, unroll, inputs, kind
):
    fn = STEPS[kind]
    init = make_init()
    xs = None if inputs == "length" else make_xs(length)
    given_length = None if inputs == "xs" else length
    args = (fn, init, xs, given_length, reverse, unroll)
    got = compat.checkpoint_chunked_scan(*args, chunk_size=chunk_size)
    close(got, powerpax.checkpoint_chunked_scan(*args, chunk_size=chunk_size), exact=True)
    close(got, jax.lax.scan(fn, init, xs, length=length, reverse=reverse), exact=True)


@pytest.mark.parametrize("start,stop,step_,reverse", [(1, None, 3, False), (1, 8, 3, True)])
def test_where_powerpax_is_wrong_the_answer_is_lax_scans(start, stop, step_, reverse):
    init, xs = make_init(), make_xs(9)
    assert powerpax_mishandles(9, start, stop, step_, reverse)
    slicing = {"start": start, "stop": stop, "step": step_}
    got = compat.sliced_scan(step, init, xs, reverse=reverse, **slicing)
    carry, ys = jax.lax.scan(step, init, xs, reverse=reverse)
    close(got, (carry, jax.tree_util.tree_map(lambda a: a[start:stop:step_], ys)), exact=True)
    with pytest.raises((AssertionError, TypeError, ValueError)):
        close(got, powerpax.sliced_scan(step, init, xs, reverse=reverse, **slicing), exact=True)


def test_index_like_arguments():
    init, xs = make_init(), make_xs(9)
    got = compat.sliced_scan(step, init, xs, np.int64(9), start=np.int32(2), step=np.int8(3))
    close(got, powerpax.sliced_scan(step, init, xs, 9, start=2, step=3), exact=True)
    got = compat.checkpoint_chunked_scan(step, init, xs, unroll=True, chunk_size=np.int16(4))
    close(got, powerpax.checkpoint_chunked_scan(step, init, xs, chunk_size=4), exact=True)


def test_gradients_match_powerpax(float64):
    def smooth(h, w):
        h = jnp.tanh(h * w)
        return h, jnp.sum(h**2)

    ws = jnp.linspace(0.5, 1.5, 22).reshape(11, 2)
    h0 = jnp.asarray([0.3, -0.7])

    def loss(scan, **kwargs):
        def value(h0, ws):
            h, ys = scan(smooth, h0, ws, **kwargs)
            return jnp.sum(h) + jnp.sum(ys**3)

        return jax.grad(value, argnums=(0, 1))(h0, ws)

    for name, kwargs in [
        ("sliced_scan", {"start": 3, "step": 4}),
        ("checkpoint_chunked_scan", {"chunk_size": 4}),
    ]:
        close(loss(getattr(compat, name), **kwargs), loss(getattr(powerpax, name), **kwargs))


def bad_calls():
    xs = {"i": jnp.zeros(4, jnp.int32), "f": jnp.zeros((4, 2))}
    uneven = {"i": jnp.zeros(3, jnp.int32), "f": jnp.zeros((4, 2))}
    scalar = {"i": jnp.asarray(1), "f": jnp.zeros((4, 2))}
    common = [
        ("uneven xs", (uneven,), {}),
        ("scalar leaf", (scalar,), {}),
        ("no xs, no length", (None,), {}),
        ("empty xs, no length", ((),), {}),
        ("length disagrees", (xs, 5), {}),
        ("negative length", (None, -1), {}),
        ("float length", (None, 2.5), {}),
        ("float unroll", (xs, None, False, 1.5), {}),
    ]
    sliced = [
        ("zero step", (xs,), {"step": 0}),
        ("float start", (xs,), {"start": 0.5}),
        ("string stop", (xs,), {"stop": "2"}),
    ]
    chunked = [
        ("zero chunk", (xs,), {"chunk_size": 0}),
        ("negative chunk", (xs,), {"chunk_size": -3}),
        ("float chunk", (xs,), {"chunk_size": 2.0}),
    ]
    return [("sliced_scan", *c) for c in common + sliced] + [
        ("checkpoint_chunked_scan", *c) for c in common + chunked
    ]


@pytest.mark.parametrize(
    "name,what,args,kwargs", bad_calls(), ids=[f"{c[0]}: {c[1]}" for c in bad_calls()]
)
def test_errors_match_powerpax(name, what, args, kwargs):
    init = make_init()
    with pytest.raises(Exception) as theirs:
        getattr(powerpax, name)(step, init, *args, **kwargs)
    with pytest.raises(theirs.type):
        getattr(compat, name)(step, init, *args, **kwargs)


def test_error_messages_name_the_problem():
    init, xs = make_init(), make_xs(4)
    with pytest.raises(ValueError, match=r"sliced_scan: `length`=5 disagrees .* `xs`, 4"):
        compat.sliced_scan(step, init, xs, 5)
    with pytest.raises(ValueError, match=r"checkpoint_chunked_scan: .* got length=-1"):
        compat.checkpoint_chunked_scan(step, init, None, -1)
    positive = r"checkpoint_chunked_scan: `chunk_size` must be a positive int.*, got chunk_size=0"
    with pytest.raises(ValueError, match=positive):
        compat.checkpoint_chunked_scan(step, init, xs, chunk_size=0)
    with pytest.raises(ValueError, match=r"step cannot be zero"):
        compat.sliced_scan(step, init, xs, step=0)


@pytest.mark.parametrize(
    "name,args,kwargs,error,message",
    [
        ("sliced_scan", (None, 2.5), {}, TypeError, r"^sliced_scan: `length` must be a non-"),
        ("sliced_scan", (None, True), {}, TypeError, r"`length` must be .*, got True"),
        ("sliced_scan", (None, 4), {"start": 0.5}, TypeError, r"^sliced_scan: `start` must be"),
        ("sliced_scan", (None, 4), {"stop": "2"}, TypeError, r"^sliced_scan: `stop` must be"),
        ("sliced_scan", (None, 4), {"step": 0}, ValueError, r"^sliced_scan: step cannot be zero"),
        ("checkpoint_chunked_scan", (None, -1), {}, ValueError, r"^checkpoint_chunked_scan: `l"),
        ("checkpoint_chunked_scan", (None, 4), {"chunk_size": 2.0}, TypeError, r"_scan: `chunk"),
        ("checkpoint_chunked_scan", (None, 4), {"chunk_size": True}, TypeError, r"got True"),
    ],
    ids=[
        "float length",
        "bool length",
        "float start",
        "string stop",
        "zero step",
        "negative length",
        "float chunk_size",
        "bool chunk_size",
    ],
)
def test_bad_options_name_the_function_and_argument(name, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        getattr(compat, name)(step, make_init(), *args, **kwargs)


def test_numpy_integers_are_ints():
    init = make_init()
    got = compat.sliced_scan(step, init, None, np.uint16(9), start=np.int8(-7), stop=np.int64(8))
    close(got, powerpax.sliced_scan(step, init, None, 9, start=-7, stop=8), exact=True)
    got = compat.checkpoint_chunked_scan(step, init, None, np.int32(9), chunk_size=np.uint8(2))
    close(got, jax.lax.scan(step, init, None, length=9), exact=True)
