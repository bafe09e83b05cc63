"""`Microbatcher`: against the unbatched computation and a plain Python loop."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close, make_mlp
from hypothesis import given, settings, strategies as st

import zodmem as zm
from zodmem._engine._block_plans import plan_blocks
from zodmem._engine._blocks import reduce_blocks
from zodmem._transforms._accumulate import aggregate_stacked

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


KINDS = ["sum", "mean", "running_mean", "concat"]


def data(batch, seed=0):
    rng = np.random.default_rng(seed)
    w = np.linspace(0.5, 1.5, 3)
    return w, rng.normal(size=(batch, 3)), rng.normal(size=batch)


def per_example(w, x, y, xp=jnp):
    """Per-example values of a small model: a prediction, a loss and a feature row."""
    pred = xp.tanh(x @ w)
    return {"pred": pred, "loss": (pred - y) ** 2, "feat": x * w}


def batch_fn(kind, xp=jnp):
    """A function of a batch whose microbatched `kind` equals its unbatched value."""

    def fn(w, x, y):
        values = per_example(w, x, y, xp)
        if kind == "concat":
            return values
        reduce = xp.sum if kind == "sum" else xp.mean
        return {key: reduce(v, axis=0) for key, v in values.items()}

    return fn


def every_kind(xp=jnp):
    """A function returning one part per accumulator, and that accumulator tree."""

    def fn(w, x, y):
        return {kind: batch_fn(kind, xp)(w, x, y) for kind in KINDS}

    return fn, {kind: kind for kind in KINDS}


def combine(results, sizes, kind, batch, like):
    """Combine per-microbatch results (NumPy) the way accumulator `kind` does."""
    if kind == "concat":
        done = [np.reshape(r, (-1, *np.shape(like)[1:])) for r in results]
        done = np.concatenate(done) if done else np.zeros((0, *np.shape(like)[1:]))
        return np.concatenate([done, np.zeros((len(like) - len(done), *np.shape(like)[1:]))])
    total = sum(
        (n * np.asarray(r) for n, r in zip(sizes, results, strict=True)), np.zeros(np.shape(like))
    )
    if kind == "sum":
        return sum((np.asarray(r) for r in results), np.zeros(np.shape(like)))
    if kind == "mean":
        return total / batch
    return total / max(sum(sizes), 1)


def python_loop(fn, w, x, y, size, accumulator, count=None, concat_like=None):
    """The microbatched result of `fn` (NumPy), from contiguous microbatches."""
    batch = x.shape[0]
    starts = list(range(0, batch, size))
    sizes = [min(size, batch - s) for s in starts]
    results = [fn(w, x[s : s + size], y[s : s + size]) for s in starts]
    count = len(starts) if count is None else count
    like = fn(w, x, y) if concat_like is None else concat_like
    return {
        key: jax.tree_util.tree_map(
            lambda *leaves, kind=kind: combine(
                leaves[1 : count + 1], sizes[:count], kind, batch, leaves[0]
            ),
            like[key],
            *[r[key] for r in results],
        )
        for key, kind in accumulator.items()
    }


# ----------------------------------------------------------------------------------
# Values


@settings(max_examples=10)
@given(batch=st.integers(1, 20), size=st.integers(1, 22))
def test_every_accumulator_matches_unbatched(batch, size):
    w, x, y = data(batch)
    fn, accumulator = every_kind()
    got = zm.Microbatcher(fn, microbatch_size=size, argnums=(1, 2), accumulator=accumulator)(
        w, x, y
    )
    close(got, every_kind(np)[0](w, x, y))


@settings(max_examples=8)
@given(batch=st.integers(1, 20), size=st.integers(1, 21))
def test_nested_pytree_of_accumulators(batch, size):
    w, x, y = data(batch, seed=1)

    def fn(w, x, y, xp=jnp):
        return {
            "total": batch_fn("sum", xp)(w, x, y),
            "average": (batch_fn("mean", xp)(w, x, y), batch_fn("running_mean", xp)(w, x, y)),
            "rows": batch_fn("concat", xp)(w, x, y)["feat"],
        }

    accumulator = {
        "total": zm.AccumulationType.SUM,
        "average": ("mean", zm.AccumulationType.RUNNING_MEAN),
        "rows": "concat",
    }
    transform = zm.Microbatcher(
        fn, microbatch_size=size, argnums=1, argnames="y", accumulator=accumulator
    )
    close(transform(w, x, y=y), fn(w, x, y, np))


@settings(max_examples=8)
@given(
    batch=st.integers(1, 12),
    size=st.integers(1, 13),
    axes=st.sampled_from([(0, 0), (1, 0), (-1, 0), (1, -1)]),
    keyword=st.booleans(),
)
def test_argnums_argnames_and_in_axes(batch, size, axes, keyword):
    """Batch axes other than 0, given as positional or keyword arguments."""
    w, x, y = data(batch, seed=2)
    x_axis, _ = axes
    xt = np.moveaxis(x, 0, x_axis)
    reference, accumulator = every_kind()

    def fn(xt, w, *, y):
        return reference(w, jnp.moveaxis(xt, x_axis, 0), y)

    if keyword:
        transform = zm.Microbatcher(
            fn,
            microbatch_size=size,
            argnums=(),
            argnames=("xt", "y"),
            in_axes=axes,
            accumulator=accumulator,
        )
        got = transform(w=w, xt=xt, y=y)
    else:
        transform = zm.Microbatcher(
            fn,
            microbatch_size=size,
            argnums=[0],
            argnames=["y"],
            in_axes=list(axes),
            accumulator=accumulator,
        )
        got = transform(xt, w, y=y)
    close(got, every_kind(np)[0](w, x, y))


def grouped(xp=jnp):
    """Results that depend on how the batch is grouped into microbatches."""

    def fn(w, x, y):
        cross = xp.sum(x[:-1] * x[1:]) + xp.sum(y) ** 2 * w[0]
        return {kind: cross for kind in ("sum", "mean", "running_mean")} | {
            "concat": {"cum": xp.cumsum(y), "cross": cross}
        }

    return fn


@settings(max_examples=10)
@given(batch=st.integers(1, 16), size=st.integers(1, 17))
def test_non_decomposable_function_matches_python_loop(batch, size):
    w, x, y = data(batch, seed=3)
    accumulator = {kind: kind for kind in KINDS}
    num_blocks = -(-batch // size)
    like = {k: v for k, v in grouped(np)(w, x, y).items()}
    like["concat"] = {"cum": y, "cross": np.zeros(num_blocks)}
    got = zm.Microbatcher(grouped(), microbatch_size=size, argnums=(1, 2), accumulator=accumulator)(
        w, x, y
    )
    close(got, python_loop(grouped(np), w, x, y, size, accumulator, concat_like=like))


def test_pytree_batch_arguments_and_static_leaves():
    w, x, y = data(10, seed=4)

    def fn(params, batch, scale):
        return scale * jnp.sum(batch["x"] @ params["w"] + params["fn"](batch["y"]))

    params = {"w": w, "fn": jnp.sin}
    batch = {"x": x, "y": y}
    got = zm.Microbatcher(fn, microbatch_size=3, argnums=1)(params, batch, 2.0)
    np.testing.assert_allclose(got, 2.0 * np.sum(x @ w + np.sin(y)), rtol=1e-12)


def test_scalar_concat_gives_one_entry_per_microbatch():
    x = jnp.arange(10.0)
    got = zm.Microbatcher(jnp.sum, microbatch_size=4, accumulator="concat")(x)
    close(got, jax.device_put(np.asarray([6.0, 22.0, 17.0])))


def test_concat_with_several_rows_per_example():
    x = np.arange(7.0)
    fn = lambda x: jnp.concatenate([x, -x])  # noqa: E731
    got = zm.Microbatcher(fn, microbatch_size=3, accumulator="concat")(x)
    expected = np.array([0, 1, 2, -0, -1, -2, 3, 4, 5, -3, -4, -5, 6, -6.0])
    close(got, expected)


def test_microbatch_size_above_batch_is_one_microbatch():
    w, x, y = data(5)
    fn, accumulator = every_kind()
    got = zm.Microbatcher(fn, microbatch_size=64, argnums=(1, 2), accumulator=accumulator)(w, x, y)
    close(got, every_kind(np)[0](w, x, y))


@pytest.mark.parametrize(
    "dtype, kind",
    [
        (jnp.int32, "sum"),
        (jnp.int32, "concat"),
        (jnp.float16, "sum"),
        (jnp.float16, "mean"),
        (jnp.float32, "running_mean"),
        (jnp.bfloat16, "concat"),
        (jnp.complex64, "mean"),
        (jnp.bool_, "concat"),
    ],
)
def test_dtypes_are_kept(dtype, kind):
    x = jnp.arange(10).astype(dtype)
    fn = (lambda v: v) if kind == "concat" else (lambda v: jnp.sum(v, dtype=dtype))
    got = zm.Microbatcher(fn, microbatch_size=4, accumulator=kind)(x)
    assert got.dtype == jnp.dtype(dtype)
    if kind == "concat":
        close(got, x)


# ----------------------------------------------------------------------------------
# User-defined accumulators


def largest():
    return zm.Accumulator(
        init=lambda s: jnp.full(s.shape, -jnp.inf, s.dtype),
        update=lambda carry, value, index: jnp.maximum(carry, value),
        finalize=lambda carry: carry,
        aggregate=lambda values: jnp.max(values, axis=0),
    )


@settings(max_examples=10)
@given(batch=st.integers(1, 20), size=st.integers(1, 21))
def test_user_accumulator(batch, size):
    w, x, y = data(batch, seed=5)
    fn = lambda w, x, y: {"max": jnp.max(x, axis=0), "sum": jnp.sum(y)}  # noqa: E731
    transform = zm.Microbatcher(
        fn, microbatch_size=size, argnums=(1, 2), accumulator={"max": largest(), "sum": "sum"}
    )
    # The unbatched result by NumPy: no program to compile for every batch size.
    close(transform(w, x, y), {"max": np.max(x, axis=0), "sum": np.sum(y)})


def test_user_accumulator_sees_indices_in_order():
    # The carry records index * 10 + microbatch sum; it sees every index once.
    record = zm.Accumulator(
        init=lambda s: jnp.zeros((3,), s.dtype),
        update=lambda carry, value, index: carry.at[index].set(index * 10 + value),
        finalize=lambda carry: carry,
    )
    got = zm.Microbatcher(jnp.sum, microbatch_size=4, accumulator=record)(jnp.ones(10))
    close(got, jax.device_put(np.asarray([4.0, 14.0, 22.0])))


def test_aggregate_stacked():
    values = {
        "a": jax.device_put(np.arange(6.0).reshape(3, 2)),
        "b": jax.device_put(np.arange(3.0)),
        "c": jax.device_put(np.ones(3)),
    }
    accumulator = {"a": "sum", "b": largest(), "c": zm.AccumulationType.MEAN}
    got = aggregate_stacked(accumulator, values)
    close(
        got,
        {"a": jax.device_put(np.asarray([6.0, 9.0])), "b": jnp.asarray(2.0), "c": jnp.asarray(1.0)},
    )
    close(aggregate_stacked("concat", values), values)
    no_aggregate = zm.Accumulator(lambda s: s, lambda c, v, i: c, lambda c: c)
    with pytest.raises(ValueError, match="no `aggregate`"):
        aggregate_stacked(no_aggregate, values)


# ----------------------------------------------------------------------------------
# num_real_microbatches


@settings(max_examples=8)
@given(batch=st.integers(1, 16), size=st.integers(1, 17), data_=st.data())
def test_num_real_microbatches_traced_and_concrete(batch, size, data_):
    num_blocks = -(-batch // size)
    w, x, y = data(batch, seed=6)
    fn, accumulator = every_kind()

    @jax.jit
    def run(w, x, y, count):
        transform = zm.Microbatcher(
            fn,
            microbatch_size=size,
            argnums=(1, 2),
            accumulator=accumulator,
            num_real_microbatches=count,
        )
        return transform(w, x, y)

    for count in range(num_blocks + 1):  # one compilation serves every count
        expected = python_loop(every_kind(np)[0], w, x, y, size, accumulator, count)
        close(run(w, x, y, count), expected)
    count = data_.draw(st.integers(0, num_blocks))
    concrete = zm.Microbatcher(
        fn,
        microbatch_size=size,
        argnums=(1, 2),
        accumulator=accumulator,
        num_real_microbatches=count,
    )
    expected = python_loop(every_kind(np)[0], w, x, y, size, accumulator, count)
    close(concrete(w, x, y), expected)


def test_skipped_microbatches_are_not_evaluated():
    # Evaluating the second microbatch would put a NaN into the sum.
    x = jnp.array([1.0, 2.0, jnp.nan, 4.0, 5.0])

    def fn(x):
        return jax.lax.cond(jnp.isnan(x).any(), lambda: jnp.nan, lambda: jnp.sum(x))

    run = jax.jit(lambda x, n: zm.Microbatcher(fn, microbatch_size=2, num_real_microbatches=n)(x))
    assert run(x, 1) == 3.0
    assert jnp.isnan(run(x, 2))


def test_num_real_microbatches_counts_the_last_smaller_microbatch():
    x = jnp.arange(1.0, 11.0)  # microbatches of 4: [1..4], [5..8], [9, 10]
    counts = jnp.arange(4)
    run = jax.vmap(
        lambda n: zm.Microbatcher(jnp.sum, microbatch_size=4, num_real_microbatches=n)(x)
    )
    close(run(counts), jax.device_put(np.asarray([0.0, 10.0, 36.0, 55.0])))


def test_reduce_blocks_runs_past_the_count_as_all_blocks():
    plan = plan_blocks(5, batch_size=2)

    def block(start, size):
        return jax.lax.dynamic_slice_in_dim(jnp.arange(5.0), start, size).sum()

    add = lambda acc, r, i, s: acc + r  # noqa: E731
    for count, total in [(0, 0.0), (2, 6.0), (3, 10.0), (7, 10.0)]:
        assert reduce_blocks(block, plan, jnp.asarray(0.0), add, num_blocks=count) == total


# ----------------------------------------------------------------------------------
# Gradients and composition


def mean_loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def mean_loss_grad(w, x, y):
    """The gradient of `mean_loss` with respect to `w`, in NumPy."""
    pred = np.tanh(x @ w)
    return np.mean((2 * (pred - y) * (1 - pred**2))[:, None] * x, axis=0)


@settings(max_examples=10)
@given(batch=st.integers(1, 20), size=st.integers(1, 21))
def test_microbatched_gradient_equals_full_batch_gradient(batch, size):
    w, x, y = data(batch, seed=7)
    grad = jax.grad(mean_loss)
    both = zm.Microbatcher(
        lambda w, x, y: (grad(w, x, y), grad(w, x, y)),
        microbatch_size=size,
        argnums=(1, 2),
        accumulator=("mean", "running_mean"),
    )
    expected = mean_loss_grad(w, x, y)
    close(both(w, x, y), (expected, expected))


@settings(max_examples=6)
@given(batch=st.integers(1, 15), size=st.integers(1, 16))
def test_grad_and_jit_through_microbatcher(batch, size):
    w, x, y = data(batch, seed=8)
    loss = zm.Microbatcher(mean_loss, microbatch_size=size, argnums=(1, 2), accumulator="mean")
    expected = mean_loss_grad(w, x, y)
    # Reverse mode also goes through a traced num_real_microbatches.
    count = -(-batch // size)

    def counted(w, n):
        return zm.Microbatcher(
            mean_loss,
            microbatch_size=size,
            argnums=(1, 2),
            accumulator="mean",
            num_real_microbatches=n,
        )(w, x, y)

    # The three derivatives under one jit: one program for each example drawn.
    @jax.jit
    def derivatives(w, x, y, n):
        return (
            jax.grad(loss)(w, x, y),
            jax.grad(counted)(w, n),
            jax.jvp(lambda w: loss(w, x, y), (w,), (jnp.ones(3),))[1],
        )

    grad, counted_grad, jvp = derivatives(w, x, y, count)
    close(grad, expected)
    close(counted_grad, expected)
    np.testing.assert_allclose(jvp, np.sum(expected), rtol=1e-10)


def test_vmap_over_a_microbatcher():
    w, x, y = data(9, seed=9)
    ws = jnp.stack([w, 2 * w, -w])
    loss = zm.Microbatcher(mean_loss, microbatch_size=4, argnums=(1, 2), accumulator="mean")
    expected = eqx.filter_jit(jax.vmap(mean_loss, in_axes=(0, None, None)))(ws, x, y)
    close(jax.vmap(loss, in_axes=(0, None, None))(ws, x, y), expected)


def test_filter_grad_of_an_mlp():
    model = make_mlp(3, 1, 8, 2)  # (weights drawn by NumPy: no initialiser to compile)
    _, x, y = data(11, seed=10)

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)

    grad = zm.Microbatcher(
        eqx.filter_grad(loss), microbatch_size=4, argnums=(1, 2), accumulator="mean"
    )
    got = grad(model, x, y)
    expected = eqx.filter_jit(eqx.filter_grad(loss))(model, x, y)
    close(eqx.filter(got, eqx.is_array), eqx.filter(expected, eqx.is_array))
    # And the module's arrays are leaves of a transform that wraps a model.
    forward = zm.Microbatcher(eqx.filter_vmap(model), microbatch_size=4, accumulator="concat")
    close(forward(x), eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, x))
    wrapped = zm.Microbatcher(model, microbatch_size=4)
    assert len(jax.tree_util.tree_leaves(wrapped)) == len(jax.tree_util.tree_leaves(model))


def test_microbatcher_of_a_microbatcher():
    w, x, y = data(12, seed=11)
    inner = zm.Microbatcher(mean_loss, microbatch_size=2, argnums=(1, 2), accumulator="mean")
    outer = zm.Microbatcher(inner, microbatch_size=5, argnums=(1, 2), accumulator="mean")
    np.testing.assert_allclose(outer(w, x, y), mean_loss(w, x, y), rtol=1e-12)


def test_configuration():
    t = zm.Microbatcher(mean_loss, microbatch_size=3, argnums=[1, 2], accumulator="mean")
    assert t.argnums == (1, 2)
    assert t.batch_argnums == (1, 2)
    assert t.batch_argnames == ()
    assert t.batch_in_axes == (0, 0)
    assert t.config == {
        "microbatch_size": 3,
        "max_memory": None,
        "argnums": (1, 2),
        "argnames": (),
        "in_axes": 0,
        "accumulator": "mean",
        "progress": False,
    }
    assert zm.AccumulationType("running_mean") is zm.AccumulationType.RUNNING_MEAN


def test_numpy_integer_options_are_read_as_ints():
    w, x, y = data(10, seed=12)
    transform = zm.Microbatcher(
        mean_loss,
        microbatch_size=np.int64(4),
        argnums=(np.int64(1), np.int32(2)),
        in_axes=np.int64(0),
        accumulator="mean",
        num_real_microbatches=np.int64(3),
    )
    assert transform.config == {
        "microbatch_size": 4,
        "max_memory": None,
        "argnums": (1, 2),
        "argnames": (),
        "in_axes": 0,
        "accumulator": "mean",
        "progress": False,
    }
    stored = [transform.microbatch_size, *transform.argnums, transform.in_axes]
    assert all(type(value) is int for value in stored)
    assert type(transform.num_real_microbatches) is int
    close(transform(w, x, y), np.asarray(mean_loss(w, x, y)), rtol=1e-12)
    mixed = zm.Microbatcher(
        mean_loss,
        microbatch_size=np.int32(3),
        argnums=np.int64(1),
        argnames="y",
        in_axes=[np.int64(0), np.int8(-1)],
        accumulator="mean",
    )
    assert mixed.argnums == 1 and mixed.in_axes == (0, -1)
    assert type(mixed.argnums) is int and all(type(a) is int for a in mixed.in_axes)
    close(mixed(w, x, y=y), np.asarray(mean_loss(w, x, y)), rtol=1e-12)
    # A NumPy integer count is an int: one above the number of microbatches is refused.
    too_many = zm.Microbatcher(jnp.sum, microbatch_size=4, num_real_microbatches=np.int64(4))
    with pytest.raises(ValueError, match="num_real_microbatches=4 is more than the 3"):
        too_many(jnp.ones(10))


# ----------------------------------------------------------------------------------
# Errors at construction


def f(x):
    return jnp.sum(x)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(microbatch_size=0),
            ValueError,
            "`microbatch_size` must be a positive int, got microbatch_size=0",
        ),
        (dict(microbatch_size=-2), ValueError, "microbatch_size=-2"),
        (
            dict(microbatch_size=True),
            TypeError,
            "`microbatch_size` must be a positive int or None, got True",
        ),
        (dict(microbatch_size=2.5), TypeError, "microbatch_size"),
        (dict(microbatch_size=np.float64(2.0)), TypeError, "`microbatch_size` must be a positive"),
        (dict(microbatch_size=np.True_), TypeError, "`microbatch_size` must be a positive"),
        (dict(microbatch_size=np.int64(0)), ValueError, "got microbatch_size=0"),
        (dict(microbatch_size=2, argnums=(0, np.float32(1))), TypeError, "`argnums` must be"),
        (dict(microbatch_size=2, in_axes=np.True_), TypeError, "`in_axes` must be"),
        (
            dict(microbatch_size=2, argnums=(0, True)),
            TypeError,
            "`argnums` must be an int or a sequence",
        ),
        (dict(microbatch_size=2, argnums="a"), TypeError, "argnums"),
        (dict(microbatch_size=2, argnums=-1), ValueError, "non-negative indices, got argnums=-1"),
        (dict(microbatch_size=2, argnums=(1, 1)), ValueError, "repeated indices"),
        (dict(microbatch_size=2, argnames=3), TypeError, "argnames"),
        (dict(microbatch_size=2, argnames=("y", "y")), ValueError, "repeated names"),
        (
            dict(microbatch_size=2, argnums=(), argnames=()),
            ValueError,
            "at least one batch argument",
        ),
        (
            dict(microbatch_size=2, argnums=(0, 1), in_axes=(0,)),
            ValueError,
            "one entry per batch argument",
        ),
        (
            dict(microbatch_size=2, in_axes=(0, True)),
            TypeError,
            "`in_axes` must be an int or a sequence",
        ),
        (dict(microbatch_size=2, accumulator="median"), ValueError, "unknown accumulator 'median'"),
        (dict(microbatch_size=2, accumulator={"a": "sum", "b": "bogus"}), ValueError, "'bogus'"),
        (dict(microbatch_size=2, accumulator={"a": None}), ValueError, "unknown accumulator None"),
        (dict(microbatch_size=2, accumulator=3), ValueError, "unknown accumulator 3"),
        (dict(microbatch_size=2, accumulator={}), ValueError, "holds none"),
        (dict(microbatch_size=2, num_real_microbatches=-1), ValueError, "non-negative"),
        (
            dict(max_memory="10MB", num_real_microbatches=2),
            ValueError,
            r"num_real_microbatches=2 counts microbatches of a size that max_memory='10MB'",
        ),
        (
            dict(max_memory="auto", num_real_microbatches=jnp.asarray(2)),
            ValueError,
            "give `microbatch_size` with `num_real_microbatches`",
        ),
        (dict(microbatch_size=2, num_real_microbatches=1.5), TypeError, "num_real_microbatches"),
        (dict(microbatch_size=2, num_real_microbatches=True), TypeError, "num_real_microbatches"),
        (dict(microbatch_size=2, num_real_microbatches=np.int64(-1)), ValueError, "non-negative"),
        (
            dict(microbatch_size=2, num_real_microbatches=jnp.ones(())),
            TypeError,
            "num_real_microbatches",
        ),
        (
            dict(microbatch_size=2, num_real_microbatches=jnp.ones(2, int)),
            TypeError,
            "num_real_microbatches",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
def test_construction_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        zm.Microbatcher(f, **kwargs)


def test_construction_errors_for_callables():
    # (Under jaxtyping's import hook the annotation check speaks first.)
    with pytest.raises(TypeError, match="`fn` must be callable|parameter 'fn'"):
        zm.Microbatcher(3, microbatch_size=2)
    with pytest.raises(TypeError, match="`update` must be callable|parameter 'update'"):
        zm.Accumulator(lambda s: s, "add", lambda c: c)
    with pytest.raises(TypeError, match="`aggregate` must be callable|parameter 'aggregate'"):
        zm.Accumulator(lambda s: s, lambda c, v, i: c, lambda c: c, 0)


# ----------------------------------------------------------------------------------
# Errors at trace time


def test_call_errors():
    x = jnp.ones((6, 2))
    g = lambda a, b=None: jnp.sum(a)  # noqa: E731
    cases = [
        (
            zm.Microbatcher(g, microbatch_size=2, argnums=1),
            (x,),
            {},
            "argnums=1 names positional argument 1, but the call passed 1",
        ),
        (
            zm.Microbatcher(g, microbatch_size=2, argnames="b"),
            (x,),
            {},
            "argnames='b' names keyword argument 'b'",
        ),
        (
            zm.Microbatcher(g, microbatch_size=2, argnums=0, argnames="b"),
            (x,),
            {"b": jnp.ones(4)},
            "same size along their batch axes .* positional argument 0 \\(axis 0\\): 6, "
            "keyword argument 'b' \\(axis 0\\): 4",
        ),
        (
            zm.Microbatcher(g, microbatch_size=2, argnums=0, in_axes=1),
            ({"a": x, "b": jnp.ones(6)},),
            {},
            "with no axis 1",
        ),
        (zm.Microbatcher(g, microbatch_size=2), ((x, 3.0),), {}, "has a leaf 3.0 of type float"),
        (zm.Microbatcher(g, microbatch_size=2), ({},), {}, "hold no arrays"),
        (zm.Microbatcher(g, microbatch_size=2), (jnp.ones((0, 2)),), {}, "batch is empty"),
        (
            zm.Microbatcher(g, microbatch_size=2, num_real_microbatches=4),
            (x,),
            {},
            "num_real_microbatches=4 is more than the 3 microbatch",
        ),
        (
            zm.Microbatcher(g, microbatch_size=2, accumulator={"a": "sum"}),
            (x,),
            {},
            "prefix of the output",
        ),
        (
            zm.Microbatcher(g, microbatch_size=2, accumulator="mean"),
            (jnp.ones((6, 2), int),),
            {},
            "'mean' needs floating-point .* dtype int",
        ),
        (
            zm.Microbatcher(lambda a: a, microbatch_size=4, accumulator="running_mean"),
            (x,),
            {},
            "shape \\(4, 2\\) for a microbatch of 4 examples and \\(2, 2\\) for the last",
        ),
        (
            zm.Microbatcher(lambda a: a.T, microbatch_size=4, accumulator="concat"),
            (x,),
            {},
            "agree on the other axes",
        ),
        (
            zm.Microbatcher(
                lambda a: a[0, 0] if a.shape[0] == 4 else a[0],
                microbatch_size=4,
                accumulator="concat",
            ),
            (x,),
            {},
            "scalar result from a full",
        ),
    ]
    for transform, args, kwargs, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            transform(*args, **kwargs)
