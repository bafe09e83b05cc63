"""`zodmem.compat.optax` against the installed `optax.microbatching` (0.2.8)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax.microbatching as om
import pytest
from helpers import close
from hypothesis import given, settings, strategies as st

import zodmem as zm
import zodmem.compat.optax as zo

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.

TYPES = ["SUM", "MEAN", "RUNNING_MEAN", "CONCAT"]
F32 = 2e-6  # float32 round-off, for results summed in another order


def both(name):
    """(ours, optax's) AccumulationType member called `name`."""
    return zo.AccumulationType[name], om.AccumulationType[name]


def raises_alike(ours, theirs, error, match):
    with pytest.raises(error, match=match):
        ours()
    with pytest.raises(error, match=match):
        theirs()


def example_fn(nonbatch, a, b):
    """One part per accumulation type, as the optax tests use."""
    return {
        "SUM": jnp.sum(nonbatch + a + 2 * b, axis=0),
        "MEAN": (jnp.mean(nonbatch * a), {"key": jnp.mean(b)}),
        "RUNNING_MEAN": jnp.mean(a * b, axis=0),
        "CONCAT": (a * b, a / (1 + b**2) * nonbatch),
    }


def arrays(shape, seed, dtype=np.float32):
    """Random normal values, cast by NumPy (no program to compile)."""
    return jax.device_put(np.random.default_rng(seed).normal(size=shape).astype(dtype))


def as_jax(x):
    """A NumPy array on the device as it is (no program to compile)."""
    return jax.device_put(np.asarray(x))


def compiled(fn, *args):
    """`fn(*args)` compiled as one program: optax's references cost one compilation
    each, rather than one per operation they run eagerly."""
    return jax.jit(fn)(*args)


def ours_alike(fns, *args):
    """`[fn(*args) for fn in fns]`, ours: the first called as it is (eagerly), the others
    inside one compiled function (one program rather than one per call)."""
    rest = compiled(lambda *args: [fn(*args) for fn in fns[1:]], *args) if fns[1:] else []
    return [fns[0](*args), *rest]


# ----------------------------------------------------------------------------------
# microbatch


@settings(max_examples=8)
@given(
    size=st.integers(1, 4),
    count=st.integers(1, 5),
    axis=st.sampled_from([0, 1]),
    optax_enum=st.booleans(),
)
def test_microbatch_matches_optax(size, count, axis, optax_enum):
    batch = size * count
    nonbatch = arrays((), 0)
    a, b = np.asarray(arrays((batch, 3), 1)), np.asarray(arrays((batch, 3), 2))
    pick = 1 if optax_enum else 0
    ours_acc = {name: both(name)[pick] for name in TYPES}
    theirs_acc = {name: both(name)[1] for name in TYPES}

    def fn(nonbatch, a, b):
        return example_fn(nonbatch, jnp.moveaxis(a, axis, 0), jnp.moveaxis(b, axis, 0))

    args = (nonbatch, as_jax(np.moveaxis(a, 0, axis)), as_jax(np.moveaxis(b, 0, axis)))
    ours = zo.microbatch(fn, (1, 2), size, ours_acc, in_axes=axis)(*args)
    # optax's compiled: one program per example rather than one per operation.
    theirs = jax.jit(om.microbatch(fn, (1, 2), size, theirs_acc, in_axes=axis))(*args)
    close(ours, theirs, F32, F32)
    close(ours["CONCAT"], theirs["CONCAT"], exact=True)


def test_grouping_of_examples_is_optax_s():
    def fn(x):
        return x[:-1] @ x[1:]

    x = as_jax(np.arange(12.0, dtype=np.float32))
    sizes = (3, 1, 2, 4, 6, 12)
    theirs = compiled(lambda x: [om.microbatch(fn, 0, size)(x) for size in sizes], x)
    ours = ours_alike([zo.microbatch(fn, 0, size) for size in sizes], x)
    for ours_one, theirs_one in zip(ours, theirs, strict=True):
        close(ours_one, theirs_one, exact=True)


@pytest.mark.parametrize("name", TYPES)
def test_num_real_microbatches_concrete_and_traced(name):
    x = as_jax(np.arange(1.0, 13.0, dtype=np.float32))
    fn = (lambda x: x * 2) if name == "CONCAT" else (lambda x: jnp.mean(x**2))
    ours_acc, theirs_acc = both(name)
    # optax's results for each concrete count, in one program.
    theirs = compiled(
        lambda x: [
            om.microbatch(fn, 0, 3, theirs_acc, num_real_microbatches=count)(x)
            for count in range(5)
        ],
        x,
    )
    for count in range(5):
        ours = zo.microbatch(fn, 0, 3, ours_acc, num_real_microbatches=count)(x)
        close(ours, theirs[count], F32, F32)

    def run(micro, acc):
        return jax.jit(lambda x, n: micro(fn, 0, 3, acc, num_real_microbatches=n)(x))

    ours_run, theirs_run = run(zo.microbatch, ours_acc), run(om.microbatch, theirs_acc)
    for count in range(5):
        close(ours_run(x, count), theirs_run(x, count), F32, F32)


@pytest.mark.parametrize("make", [om.Accumulator, zo.Accumulator])
def test_user_accumulators(make):
    def pieces():
        return (
            lambda s: jnp.zeros((4,) + s.shape, s.dtype),
            lambda carry, value, index: carry.at[index].set(value + index),
            lambda carry: carry[::-1],
            lambda values: values,
        )

    x = arrays((12, 2), 3)
    fn = lambda x: {k: jnp.sum(v, axis=0) for k, v in x.items()}  # noqa: E731
    ours = zo.microbatch(fn, 0, 3, {"a": make(*pieces()), "b": zo.AccumulationType.SUM})
    theirs = om.microbatch(fn, 0, 3, {"a": om.Accumulator(*pieces()), "b": om.AccumulationType.SUM})
    x2 = {"a": x, "b": as_jax(2 * np.asarray(x))}
    close(ours(x2), compiled(theirs, x2), F32, F32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.int32])
def test_dtypes(dtype):
    x = as_jax((np.arange(12) % 5).astype(dtype))
    names = ("SUM", "CONCAT") if dtype == jnp.int32 else TYPES

    def fn(name):
        return (lambda x: x + 1) if name == "CONCAT" else (lambda x: jnp.sum(x))

    theirs = compiled(lambda x: [om.microbatch(fn(n), 0, 4, both(n)[1])(x) for n in names], x)
    ours = ours_alike([zo.microbatch(fn(n), 0, 4, both(n)[0]) for n in names], x)
    for ours_one, theirs_one in zip(ours, theirs, strict=True):
        close(ours_one, theirs_one, F32, F32)


def test_argnums_argnames_and_in_axes():
    a = arrays((10, 4, 5), 4)
    b = as_jax(np.transpose(np.asarray(a), (1, 0, 2)))

    def fn(a, b):
        return jnp.einsum("bij,kbj->ik", a, b)

    def ways(a, b):
        return [
            (dict(argnums=(0, 1), in_axes=(0, 1)), (a, b), {}),
            (dict(argnums=(1, 0), in_axes=(1, 0)), (a, b), {}),
            (dict(argnums=(), argnames=("b", "a"), in_axes=(1, 0)), (), {"a": a, "b": b}),
            (dict(argnums=0, argnames="b", in_axes=(0, 1)), (a,), {"b": b}),
        ]

    # Which arguments are batched does not depend on the accumulator: every way with the
    # first, the first way with every other.
    cases = [(name, way) for i, name in enumerate(TYPES) for way in range(4 if i == 0 else 1)]

    def run(micro, pick, a, b):
        results = []
        for name, way in cases:
            kwargs, call_args, call_kwargs = ways(a, b)[way]
            mapped = micro(fn, microbatch_size=2, accumulator=both(name)[pick], **kwargs)
            results.append(mapped(*call_args, **call_kwargs))
        return results

    theirs = compiled(lambda a, b: run(om.microbatch, 1, a, b), a, b)
    for ours, theirs_one in zip(run(zo.microbatch, 0, a, b), theirs, strict=True):
        close(ours, theirs_one, F32, F32)


def test_no_microbatch_size_returns_fun():
    fn = jnp.sum
    assert zo.microbatch(fn, 0, None) is fn
    assert om.microbatch(fn, 0, None) is fn


def test_microbatch_errors_like_optax():
    x = as_jax(np.arange(12.0, dtype=np.float32))
    raises_alike(
        lambda: zo.microbatch(jnp.sum, 0, 5)(x),
        lambda: om.microbatch(jnp.sum, 0, 5)(x),
        ValueError,
        "batch_size=12 must be divisible by microbatch_size=5",
    )
    two = lambda x, y: jnp.sum(x) + jnp.sum(y)  # noqa: E731
    half = as_jax(np.arange(6.0, dtype=np.float32))
    raises_alike(
        lambda: zo.microbatch(two, (0, 1), 3)(x, half),
        lambda: om.microbatch(two, (0, 1), 3)(x, half),
        ValueError,
        r"(?i)batch arguments must have equal-size batch axes, found \[12, 6\]",
    )
    for bad in ("sum", 3):
        raises_alike(
            lambda bad=bad: zo.microbatch(jnp.sum, 0, 3, bad)(x),
            lambda bad=bad: om.microbatch(jnp.sum, 0, 3, bad)(x),
            ValueError,
            "Unknown accumulator: '?" + str(bad),
        )
    integers = as_jax(np.arange(12, dtype=np.int32))
    for name in ("MEAN", "RUNNING_MEAN"):
        raises_alike(
            lambda name=name: zo.microbatch(jnp.sum, 0, 3, both(name)[0])(integers),
            lambda name=name: om.microbatch(jnp.sum, 0, 3, both(name)[1])(integers),
            ValueError,
            "(?i)require|needs floating-point",
        )


def test_numpy_integer_arguments():
    x = arrays((12, 2), 11)
    xt, column = as_jax(np.asarray(x).T), as_jax(np.asarray(x)[:, 0])
    params, targets = jax.device_put(np.asarray([0.3, -0.2])), arrays((12,), 12)
    fn = lambda nonbatch, x: jnp.sum(x * nonbatch, axis=0)  # noqa: E731
    square = lambda x: x**2  # noqa: E731
    scaled = lambda w, x: jnp.sum((x * w) ** 2)  # noqa: E731

    def theirs_of(x, xt, column, params, targets):
        return [
            om.microbatch(fn, 1, 3, in_axes=0)(2.0, x),
            om.microbatch(fn, [1], 4, in_axes=[1])(2.0, xt),
            om.micro_vmap(square, in_axes=1, microbatch_size=1)(x),
            om.micro_grad(scaled, batch_argnums=1, microbatch_size=4)(0.5, column),
            om.micro_grad(squared_loss, batch_argnums=(1, 2), microbatch_size=3)(
                params, x, targets
            ),
        ]

    theirs = compiled(theirs_of, x, xt, column, params, targets)
    ours = zo.microbatch(fn, np.int64(1), np.int64(3), in_axes=np.int32(0))(2.0, x)
    close(ours, theirs[0], F32, F32)
    ours = zo.microbatch(fn, [np.int64(1)], 4, in_axes=[np.int8(-1)])(2.0, xt)
    close(ours, theirs[1], F32, F32)
    ours = zo.micro_vmap(square, in_axes=np.int64(1), microbatch_size=np.int64(1))(x)
    close(ours, theirs[2], exact=True)
    ours = zo.micro_grad(scaled, batch_argnums=np.int64(1), microbatch_size=np.int64(4))
    close(ours(0.5, column), theirs[3], F32, F32)
    ours = zo.micro_grad(squared_loss, batch_argnums=(np.int64(1), np.int32(2)), microbatch_size=3)
    close(ours(params, x, targets), theirs[4], F32, F32)


def test_num_real_microbatches_above_count_is_refused():
    with pytest.raises(ValueError, match="num_real_microbatches=5 is more than the 4"):
        zo.microbatch(jnp.sum, 0, 3, num_real_microbatches=5)(jnp.arange(12.0))


def test_accumulation_type_is_zodmem_s():
    assert zo.AccumulationType is zm.AccumulationType
    assert zo.Accumulator is zm.Accumulator
    assert set(zo.AccumulationType.__members__) == set(om.AccumulationType.__members__)


# ----------------------------------------------------------------------------------
# micro_vmap


@pytest.mark.parametrize("name", TYPES)
def test_micro_vmap_matches_optax(name):
    x = arrays((2, 8, 3), 5)
    ours_acc, theirs_acc = both(name)
    fn = lambda x: jnp.sum(x**2, axis=-1)  # noqa: E731
    sizes = (2, None, 1, 4, 8)
    theirs = compiled(
        lambda x: [
            om.micro_vmap(fn, in_axes=1, microbatch_size=size, accumulator=theirs_acc)(x)
            for size in sizes
        ],
        x,
    )
    ours = ours_alike(
        [
            zo.micro_vmap(fn, in_axes=1, microbatch_size=size, accumulator=ours_acc)
            for size in sizes
        ],
        x,
    )
    for ours_one, theirs_one in zip(ours, theirs, strict=True):
        close(ours_one, theirs_one, F32, F32)


def test_micro_vmap_kwargs_unmapped_args_and_pytrees():
    x = as_jax(np.arange(32, dtype=np.int32).reshape(4, 8))
    y = as_jax(np.ones((4, 8), np.int32))

    def fn(scale, x, *, y):
        return {"s": jnp.sum(x + y) * scale, "rows": x * y}

    accumulator = {"s": both("SUM"), "rows": both("CONCAT")}
    ours_acc = {k: v[0] for k, v in accumulator.items()}
    theirs_acc = {k: v[1] for k, v in accumulator.items()}
    ours = zo.micro_vmap(fn, in_axes=(None, 0), microbatch_size=2, accumulator=ours_acc)
    theirs = om.micro_vmap(fn, in_axes=(None, 0), microbatch_size=2, accumulator=theirs_acc)
    ours_result = ours(3, x, y=y)
    theirs, vmapped = compiled(
        lambda x, y: (theirs(3, x, y=y), jax.vmap(fn, (None, 0))(3, x, y=y)), x, y
    )
    close(ours_result, theirs, exact=True)
    close(ours_result["rows"], vmapped["rows"], exact=True)


def test_micro_vmap_early_stopping_and_user_accumulator():
    x = as_jax(np.arange(16.0, dtype=np.float32))
    ours = zo.micro_vmap(
        jnp.sum, microbatch_size=4, num_real_microbatches=3, accumulator=zo.AccumulationType.SUM
    )
    theirs = om.micro_vmap(
        jnp.sum, microbatch_size=4, num_real_microbatches=3, accumulator=om.AccumulationType.SUM
    )
    close(ours(x), compiled(theirs, x), F32, F32)

    def pieces():
        return (
            lambda s: jnp.full(s.shape, -jnp.inf, s.dtype),
            lambda carry, value, index: jnp.maximum(carry, value),
            lambda carry: carry,
            lambda values: jnp.max(values, axis=0),
        )

    fn = lambda x: x * (x - 7)  # noqa: E731
    ours = zo.micro_vmap(fn, microbatch_size=4, accumulator=zo.Accumulator(*pieces()))
    theirs = om.micro_vmap(fn, microbatch_size=4, accumulator=om.Accumulator(*pieces()))
    close(ours(x), compiled(theirs, x), F32, F32)
    no_aggregate = zo.Accumulator(*pieces()[:3])
    with pytest.raises(ValueError, match="no `aggregate`"):
        zo.micro_vmap(fn, microbatch_size=4, accumulator=no_aggregate)(x)


def test_micro_vmap_out_axes_error_like_optax():
    raises_alike(
        lambda: zo.micro_vmap(jnp.sum, out_axes=1),
        lambda: om.micro_vmap(jnp.sum, out_axes=1),
        NotImplementedError,
        "out_ax",
    )


# ----------------------------------------------------------------------------------
# micro_grad


def squared_loss(params, features, targets):
    diff = features @ params - targets
    return 0.5 * jnp.mean(diff**2)


@pytest.mark.parametrize("keep_batch_dim", [True, False])
@pytest.mark.parametrize("name", ["SUM", "MEAN", "RUNNING_MEAN"])
def test_micro_grad_matches_optax(keep_batch_dim, name):
    params = jax.device_put(np.asarray([0.3, -0.2]))
    features = arrays((8, 2), 6)
    targets = arrays((8,), 7)
    sizes = (2, None, 4)

    def kwargs(size):
        return dict(
            argnums=0,
            batch_argnums=(1, 2),
            transform_fn=lambda g: (g, g**2),
            metrics_fn=jnp.linalg.norm,
            keep_batch_dim=keep_batch_dim,
            microbatch_size=size,
        )

    theirs = compiled(
        lambda *args: [
            om.micro_grad(squared_loss, accumulator=both(name)[1], **kwargs(size))(*args)
            for size in sizes
        ],
        params,
        features,
        targets,
    )
    ours = ours_alike(
        [zo.micro_grad(squared_loss, accumulator=both(name)[0], **kwargs(s)) for s in sizes],
        params,
        features,
        targets,
    )
    for (ours_grad, ours_aux), (theirs_grad, theirs_aux) in zip(ours, theirs, strict=True):
        close(ours_grad, theirs_grad, F32, F32)
        assert type(ours_aux).__name__ == type(theirs_aux).__name__ == "Aux"
        assert ours_aux._fields == theirs_aux._fields
        close(ours_aux, theirs_aux, F32, F32)


def test_micro_grad_has_aux_several_argnums_and_early_stop():
    def loss(w, b, x):
        value = jnp.sum((x * w + b) ** 2)
        return value, {"twice": 2 * value}

    w, b, x = jnp.asarray(0.5), jnp.asarray(0.1), arrays((12,), 8)
    counts = (None, 2)

    def kwargs(count):
        return dict(
            has_aux=True,
            argnums=(0, 1),
            batch_argnums=2,
            microbatch_size=3,
            num_real_microbatches=count,
        )

    theirs_all = compiled(
        lambda *args: [om.micro_grad(loss, **kwargs(count))(*args) for count in counts], w, b, x
    )
    for count, theirs in zip(counts, theirs_all, strict=True):
        ours = zo.micro_grad(loss, **kwargs(count))(w, b, x)
        close(ours[0], theirs[0], F32, F32)
        close(ours[1], theirs[1], F32, F32)


def test_micro_grad_results_map_together_with_optax_s():
    params, features, targets = (
        jax.device_put(np.asarray([0.3, -0.2])),
        arrays((8, 2), 9),
        arrays((8,), 10),
    )
    kwargs = dict(batch_argnums=(1, 2), microbatch_size=4, metrics_fn=jnp.linalg.norm)
    ours = zo.micro_grad(squared_loss, **kwargs)(params, features, targets)
    theirs = compiled(om.micro_grad(squared_loss, **kwargs), params, features, targets)
    assert type(ours[1]) is type(theirs[1])
    # (The differences taken by NumPy: no program to compile per leaf.)
    difference = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), theirs, ours)
    close(difference, jax.tree.map(np.zeros_like, theirs), F32, F32)


# ----------------------------------------------------------------------------------
# reshape_batch_axis


def test_reshape_batch_axis_matches_optax():
    tree = {
        "a": as_jax(np.arange(24.0, dtype=np.float32).reshape(2, 12)),
        "b": as_jax(np.arange(36, dtype=np.int32).reshape(12, 3)),
    }
    x = as_jax(np.arange(60, dtype=np.int32).reshape(3, 4, 5))
    sizes = (1, 2, 3, 4, 6, 12)

    def theirs_of(tree, x):
        return (
            [om.reshape_batch_axis(tree["b"], size) for size in sizes],
            [om.reshape_batch_axis(tree["a"], size, axis=1) for size in sizes],
            om.reshape_batch_axis(x, 5, axis=2),
            om.reshape_batch_axis({"t": (x, x)}, 2, axis=1),
        )

    def ours_of(tree, x):
        return (
            [zo.reshape_batch_axis(tree["b"], size) for size in sizes],
            [zo.reshape_batch_axis(tree["a"], size, axis=1) for size in sizes],
            zo.reshape_batch_axis(x, 5, axis=-1),
            zo.reshape_batch_axis({"t": (x, x)}, 2, axis=1),
        )

    # Ours compiled as well, and one of them called as it is.
    theirs = compiled(theirs_of, tree, x)
    close(compiled(ours_of, tree, x), theirs, exact=True)
    close(zo.reshape_batch_axis(tree["a"], 3, axis=1), theirs[1][sizes.index(3)], exact=True)
    raises_alike(
        lambda: zo.reshape_batch_axis(x, 3, axis=1),
        lambda: om.reshape_batch_axis(x, 3, axis=1),
        TypeError,
        "reshape",
    )
