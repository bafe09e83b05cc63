"""Work spread over 4 CPU devices: sharded Jacobians and Hessians, and maps and reductions
of sharded batches, against plain JAX and one device.

Run in a process of its own with `--xla_force_host_platform_device_count=4` (a step of
its own in .ci/run); collected only where JAX has at least 4 devices.
"""

import re
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zodmem as zm
from tests.helpers import close

pytestmark = pytest.mark.usefixtures("float64")

MESH_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def mesh_of(kind: str = "explicit", shape=(4,), names=("d",)):
    return jax.make_mesh(shape, names, axis_types=(MESH_TYPES[kind],) * len(shape))


def loss(params, data):
    """A scalar loss of a pytree whose Hessian is dense."""
    z = jnp.tanh(data @ params["w"] + params["b"])
    return jnp.sum(z**2) + jnp.sum(params["w"] ** 3) * jnp.sum(params["b"])


def make_params(n_w=6, n_b=2, dtype=jnp.float64):
    return {
        "b": jnp.linspace(-0.3, 0.4, n_b, dtype=dtype),
        "w": jnp.linspace(0.1, 0.9, n_w, dtype=dtype).reshape(n_w // 2, 2),
    }


DATA = np.linspace(-1.0, 1.0, 15).reshape(5, 3)


def data_for(n_w):
    return np.linspace(-1.0, 1.0, 5 * (n_w // 2)).reshape(5, n_w // 2)


def raveled(fn, params, *args):
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    return flat, lambda v: fn(unravel(v), *args)


def check_shards(result, sharding, share_shape):
    assert result.sharding.is_equivalent_to(sharding, result.ndim), result.sharding
    shards = result.addressable_shards
    assert len(shards) == 4
    for shard in shards:
        assert shard.data.shape == share_shape
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(result)[shard.index])


# ---------------------------------------------------------------------------------
# BatchedHessian(sharding=)


@pytest.mark.parametrize(
    "kind, spec, batch_size",
    [
        ("explicit", P("d", None), None),
        ("explicit", P("d", None), 3),
        ("explicit", P(None, "d"), 1),
        ("explicit", P(None, "d"), 3),
        ("explicit", P("d"), 3),
        ("explicit", P(), 3),
        ("auto", P("d", None), 3),
        ("auto", P(None, "d"), None),
    ],
)
def test_sharded_hessian_equals_jax_hessian(kind, spec, batch_size):
    mesh = mesh_of(kind)
    params = make_params()  # 8 variables: 2 per device
    flat, fn = raveled(loss, params, DATA)
    sharding = NamedSharding(mesh, spec)
    H = zm.BatchedHessian(loss, batch_size=batch_size, sharding=sharding)(params, DATA)
    close(H, jax.hessian(fn)(flat))
    split = [entry for entry in spec if entry is not None]
    share = (8, 8) if not split else ((2, 8) if spec[0] == "d" else (8, 2))
    check_shards(H, sharding, share)


@settings(max_examples=6)
@given(
    n_w=st.sampled_from([2, 6, 10, 14]),
    nbatches=st.integers(1, 4),
    columns=st.booleans(),
)
def test_sharded_hessian_sweep_equals_one_device(n_w, nbatches, columns):
    params = make_params(n_w, 2)
    spec = P(None, "d") if columns else P("d", None)
    one = zm.BatchedHessian(loss, nbatches=nbatches)(params, data_for(n_w))
    spread = zm.BatchedHessian(loss, nbatches=nbatches, sharding=NamedSharding(mesh_of(), spec))
    close(spread(params, data_for(n_w)), one, rtol=1e-12)


def test_mixed_precisions_split_by_columns_equal_jax_hessian_exactly_as_one_device():
    params = {"a": jnp.linspace(0.1, 0.5, 4, dtype=jnp.float32), "b": jnp.linspace(0.2, 1, 4)}

    def f(p):
        return jnp.sum(jnp.sin(p["a"]) ** 2) * jnp.sum(p["b"] ** 3)

    one = zm.BatchedHessian(f)(params)
    spread = zm.BatchedHessian(f, sharding=NamedSharding(mesh_of(), P(None, "d")))(params)
    close(spread, one, exact=True)


def test_several_mesh_axes_on_one_dimension_and_replicas_over_another():
    params = make_params(14, 2)  # 16 variables
    flat, fn = raveled(loss, params, data_for(14))
    mesh = mesh_of(shape=(2, 2), names=("x", "y"))
    expected = jax.hessian(fn)(flat)
    both = NamedSharding(mesh, P(("x", "y"), None))
    H = zm.BatchedHessian(loss, batch_size=3, sharding=both)(params, data_for(14))
    close(H, expected)
    check_shards(H, both, (4, 16))
    # Split over "x" only: the two devices along "y" hold the same rows.
    rows_over_x = NamedSharding(mesh, P("x", None))
    H = zm.BatchedHessian(loss, batch_size=3, sharding=rows_over_x)(params, data_for(14))
    close(H, expected)
    check_shards(H, rows_over_x, (8, 16))


def test_sharded_hessian_inside_jit_with_aux_and_sharded_inputs():
    mesh = mesh_of()
    params = make_params()
    data = jax.device_put(jnp.tile(DATA, (4, 1)), NamedSharding(mesh, P("d")))  # split data

    def with_aux(p, d):
        return loss(p, d), {"value": loss(p, d), "note": "kept"}

    sharding = NamedSharding(mesh, P("d", None))
    transform = zm.BatchedHessian(with_aux, batch_size=3, has_aux=True, sharding=sharding)
    H, aux = eqx.filter_jit(lambda p, d: transform(p, d))(params, data)
    flat, fn = raveled(loss, params, jnp.tile(DATA, (4, 1)))
    close(H, jax.hessian(fn)(flat))
    close(aux, {"value": fn(flat), "note": "kept"})
    check_shards(H, sharding, (2, 8))


def test_compiled_memory_per_device_is_the_share_and_one_block():
    n = 256
    w = jnp.linspace(0.0, 1.0, n)

    def f(w):  # a dense Hessian, from residuals of n numbers
        return jnp.sum(jnp.sin(w)) ** 2 * jnp.sum(w**3)

    def memory(transform):
        analysis = jax.jit(transform).lower(w).compile().memory_analysis()
        return analysis.temp_size_in_bytes + analysis.output_size_in_bytes, analysis

    whole_peak, whole = memory(zm.BatchedHessian(f, batch_size=16))
    sharding = NamedSharding(mesh_of(), P("d", None))
    peak, spread = memory(zm.BatchedHessian(f, batch_size=16, sharding=sharding))
    share = n * n * 8 // 4
    block = whole_peak - whole.output_size_in_bytes  # one block's working set
    assert spread.output_size_in_bytes == share
    assert peak <= share + block + 64 * 1024, (peak, share, block)
    assert peak < whole.output_size_in_bytes  # never the whole Hessian


def test_budget_is_per_device():
    n = 200
    w = jnp.linspace(0.0, 1.0, n)

    def f(w):
        return jnp.sum(jnp.sin(jnp.outer(w, w)))

    sharding = NamedSharding(mesh_of(), P("d", None))
    transform = zm.BatchedHessian(f, max_memory="100MB", sharding=sharding)
    plan = transform.plan(w)
    assert plan.total == n // 4 and "on each of 4 devices" in plan.what
    assert plan.output_bytes == n * n * 8 // 4
    assert plan.fits
    close(transform(w), jax.hessian(f)(w))


@pytest.mark.parametrize("spec, rows", [(P("d", None), "2"), (P(), "8")])
def test_progress_bar_is_drawn_once(capfd, spec, rows):
    sharding = NamedSharding(mesh_of(), spec)
    params = make_params()
    zm.BatchedHessian(loss, batch_size=1, sharding=sharding, progress=True)(params, DATA)
    err = capfd.readouterr().err
    assert "BatchedHessian" in err
    totals = set(re.findall(r"(\d+)/(\d+)", err))
    assert totals and all(total == rows for _, total in totals), err  # rows per device
    # One bar: its count of blocks done never goes back, as four bars' would.
    done = [int(count) for count, _ in re.findall(r"(\d+)/(\d+)", err)]
    assert done == sorted(done), err


# ---------------------------------------------------------------------------------
# BatchedJacobian(sharding=)


def outputs(params, data):
    z = data @ params["w"] + params["b"]
    return {"rows": jnp.tanh(z), "sums": jnp.sin(z).sum(0).repeat(2)}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_sharded_jacobian_by_rows_equals_jacrev(kind, batch_size):
    data = jnp.linspace(-1, 1, 12).reshape(4, 3)  # 4 rows of outputs: 1 per device
    params = make_params()
    flat, fn = raveled(outputs, params, data)
    sharding = NamedSharding(mesh_of(kind), P("d"))
    J = zm.BatchedJacobian(outputs, batch_size=batch_size, sharding=sharding)(params, data)
    close(J, jax.jacrev(fn)(flat))
    check_shards(J["rows"], sharding, (1, 2, 8))
    check_shards(J["sums"], sharding, (1, 8))


@pytest.mark.parametrize("batch_size", [None, 3])
def test_sharded_jacobian_by_columns_equals_jacfwd(batch_size):
    params = make_params()
    flat, fn = raveled(outputs, params, DATA)
    sharding = NamedSharding(mesh_of(), P(None, None, "d"))

    def matrix_out(p, d):
        return outputs(p, d)["rows"]

    J = zm.BatchedJacobian(matrix_out, batch_size=batch_size, sharding=sharding)(params, DATA)
    close(J, jax.jacfwd(lambda v: fn(v)["rows"])(flat))
    check_shards(J, sharding, (5, 2, 2))


def test_complex_outputs_split_by_columns_and_refused_by_rows():
    w = jnp.linspace(0.1, 1.0, 8)

    def f(w):
        return jnp.exp(1j * w[:4]) * jnp.sum(w)

    mesh = mesh_of()
    J = zm.BatchedJacobian(f, sharding=NamedSharding(mesh, P(None, "d")))(w)
    close(J, jax.jacfwd(f)(w))
    with pytest.raises(TypeError, match="reverse mode requires real-valued"):
        zm.BatchedJacobian(f, sharding=NamedSharding(mesh, P("d")))(w)


# ---------------------------------------------------------------------------------
# Clear errors


def test_errors_name_the_sharding_and_the_way_out():
    mesh = mesh_of(shape=(2, 2), names=("x", "y"))
    params = make_params()
    with pytest.raises(ValueError, match="may split one axis"):
        zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P("x", "y")))
    with pytest.raises(ValueError, match="do not divide 6"):
        zm.BatchedHessian(loss, sharding=NamedSharding(mesh_of(), P("d")))(
            make_params(4, 2), data_for(4)
        )
    with pytest.raises(ValueError, match="mode='fwd' makes the Hessian in blocks of columns"):
        zm.BatchedHessian(loss, mode="fwd", sharding=NamedSharding(mesh, P("x")))(params, DATA)
    with pytest.raises(ValueError, match="the Hessian has 2"):
        zm.BatchedHessian(loss, sharding=NamedSharding(mesh, P(None, None, "x")))(params, DATA)
    with pytest.raises(ValueError, match="mode='rev' makes the Jacobian in blocks of rows"):
        zm.BatchedJacobian(jnp.sin, mode="rev", sharding=NamedSharding(mesh, P(None, "x")))(
            jnp.ones(4)
        )
    with pytest.raises(ValueError, match="each device makes whole rows"):
        zm.BatchedJacobian(outputs, sharding=NamedSharding(mesh, P(None, "x")))(params, DATA)


def test_streaming_a_column_split_is_refused():
    # Rows stream (tests/multidevice/test_stream.py); columns are not contiguous in a file.
    transform = zm.BatchedHessian(jnp.sum, sharding=NamedSharding(mesh_of(), P(None, "d")))
    with pytest.raises(ValueError, match="Split the rows"):
        zm.to_host(transform, jnp.ones(8))


def test_save_and_load_rebuild_the_mesh_on_the_devices_present():
    mesh = mesh_of(shape=(2, 2), names=("x", "y"))
    sharding = NamedSharding(mesh, P(("x", "y"), None))
    transform = zm.BatchedHessian(loss, batch_size=2, sharding=sharding)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hessian.zm"
        zm.save(path, transform)
        loaded = zm.load(path)
    assert loaded == transform
    params = make_params()
    close(loaded(params, DATA), transform(params, DATA))


# ---------------------------------------------------------------------------------
# ChunkedVmap and Microbatcher follow the sharding of their batch


def element(x, w):
    return {"scaled": jnp.sin(x) * w, "total": jnp.sum(x**2), "name": "element"}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("chunk_size", [3, 16])
def test_chunked_vmap_maps_each_devices_part(kind, chunk_size):
    mesh = mesh_of(kind)
    xs = jax.device_put(jnp.linspace(0, 1, 32).reshape(16, 2), NamedSharding(mesh, P("d")))
    w = jnp.array([1.5, -2.0])
    out_axes = {"scaled": 1, "total": 0, "name": None}
    mapped = zm.ChunkedVmap(element, chunk_size=chunk_size, in_axes=(0, None), out_axes=out_axes)
    result = mapped(xs, w)
    expected = jax.vmap(
        lambda x, w: {k: v for k, v in element(x, w).items() if k != "name"},
        in_axes=(0, None),
        out_axes={"scaled": 1, "total": 0},
    )(np.asarray(xs), w)
    close({k: v for k, v in result.items() if k != "name"}, expected)
    assert result["name"] == "element"
    check_shards(result["scaled"], NamedSharding(mesh, P(None, "d")), (2, 4))
    check_shards(result["total"], NamedSharding(mesh, P("d")), (4,))


def test_chunked_vmap_inside_jit_and_grad():
    mesh = mesh_of()
    xs = jax.device_put(jnp.linspace(0, 1, 16), NamedSharding(mesh, P("d")))

    def total(w):
        return jnp.sum(zm.ChunkedVmap(lambda x: jnp.sin(w * x), chunk_size=3)(xs))

    with jax.set_mesh(mesh):  # plain JAX needs it too, for this gradient
        got = jax.jit(jax.grad(total))(0.7)
        close(got, jax.grad(lambda w: jnp.sum(jnp.sin(w * xs)))(0.7))
    result = jax.jit(lambda xs: zm.ChunkedVmap(jnp.cos, chunk_size=3)(xs))(xs)
    check_shards(result, NamedSharding(mesh, P("d")), (4,))


def per_example(w, x):
    return {"sum": jnp.sum(jnp.sin(x @ w)), "mean": jnp.mean(x**2), "rows": x[:, 0] * w[0]}


ACCUMULATOR = {"sum": "sum", "mean": "mean", "rows": "concat"}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("microbatch_size", [2, 4])
def test_microbatcher_reduces_each_part_then_combines_once(kind, microbatch_size):
    mesh = mesh_of(kind)
    xs = jax.device_put(jnp.linspace(-1, 1, 48).reshape(24, 2), NamedSharding(mesh, P("d")))
    w = jnp.array([0.5, -1.0])
    transform = zm.Microbatcher(
        per_example, microbatch_size=microbatch_size, argnums=1, accumulator=ACCUMULATOR
    )
    one_device = zm.Microbatcher(
        per_example, microbatch_size=microbatch_size, argnums=1, accumulator=ACCUMULATOR
    )(w, np.asarray(xs))
    close(transform(w, xs), one_device, rtol=1e-12)
    result = transform(w, xs)
    assert result["sum"].sharding.is_fully_replicated
    if 6 % microbatch_size == 0:  # whole microbatches on each device: rows stay there
        check_shards(result["rows"], NamedSharding(mesh, P("d")), (6,))


def test_microbatcher_running_mean_custom_accumulators_and_early_stop():
    mesh = mesh_of()
    xs = jax.device_put(jnp.linspace(-1, 1, 16), NamedSharding(mesh, P("d")))
    plain = np.asarray(xs)
    largest = zm.Accumulator(
        init=lambda s: jnp.full(s.shape, -jnp.inf, s.dtype),
        update=lambda carry, value, index: jnp.maximum(carry, value),
        finalize=lambda carry: carry,
    )
    for accumulator in ("running_mean", largest):
        transform = zm.Microbatcher(jnp.max, microbatch_size=2, accumulator=accumulator)
        close(transform(xs), transform(plain))
    early = zm.Microbatcher(jnp.sum, microbatch_size=2, num_real_microbatches=3)
    close(early(xs), early(plain))


def test_microbatcher_gradient_of_a_sharded_batch():
    mesh = mesh_of()
    xs = jax.device_put(jnp.linspace(-1, 1, 48).reshape(24, 2), NamedSharding(mesh, P("d")))
    w = jnp.array([0.5, -1.0])

    def f(w, x):
        return jnp.sum(jnp.sin(x @ w))

    transform = zm.Microbatcher(f, microbatch_size=3, argnums=1)
    with jax.set_mesh(mesh):  # plain JAX needs it too, for a gradient outside jit
        got = jax.grad(lambda w: transform(w, xs))(w)
    close(got, jax.grad(f)(w, np.asarray(xs)), rtol=1e-12)


def test_budgets_of_sharded_batches_are_planned_per_device():
    mesh = mesh_of()
    xs = jax.device_put(jnp.linspace(-1, 1, 64).reshape(32, 2), NamedSharding(mesh, P("d")))
    plan = zm.ChunkedVmap(jnp.sin, max_memory="100MB").plan(xs)
    assert plan.total == 8 and "on each of 4 devices" in plan.what
    plan = zm.Microbatcher(jnp.sum, max_memory="100MB").plan(xs)
    assert plan.total == 8
    close(zm.ChunkedVmap(jnp.sin, max_memory="100MB")(xs), jnp.sin(np.asarray(xs)))


@pytest.mark.parametrize("devices", [1, 4])
def test_inputs_replicated_over_explicit_axes_work_unsharded(devices):
    """Arrays over explicit mesh axes carry their mesh in their type; every transform
    takes them, as jax.jit does, and gives the plain JAX answer."""
    mesh = mesh_of(shape=(devices,))
    w = jax.device_put(jnp.linspace(0.1, 1.0, 8), NamedSharding(mesh, P()))
    plain = np.asarray(w)

    def f(w):
        return jnp.sum(jnp.sin(w)) ** 2 * jnp.sum(w**3)

    close(zm.BatchedHessian(f, nbatches=3)(w), jax.hessian(f)(plain))
    close(zm.BatchedJacobian(jnp.sin, nbatches=3)(w), jax.jacfwd(jnp.sin)(plain))
    close(zm.ChunkedVmap(jnp.sin, chunk_size=3)(w), jnp.sin(plain))
    close(zm.Microbatcher(jnp.sum, microbatch_size=3)(w), jnp.sum(plain))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize(
    "fn, accumulator, microbatch_size",
    [
        (jnp.mean, "sum", 16),  # larger than a device's part of 8
        (jnp.max, "mean", 16),
        (jnp.mean, "sum", 3),  # does not divide a device's part
        (jnp.max, "running_mean", 3),
        (jnp.mean, "sum", 4),  # whole microbatches on each device
    ],
)
def test_microbatcher_of_a_function_not_additive_keeps_the_batchs_microbatches(
    kind, fn, accumulator, microbatch_size
):
    """Every device's microbatches must be microbatches of the whole batch: a mean (or a
    maximum) per microbatch changes with how the examples are grouped."""
    mesh = mesh_of(kind)
    x = jnp.arange(32.0)
    sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
    transform = zm.Microbatcher(fn, microbatch_size=microbatch_size, accumulator=accumulator)
    starts = range(0, 32, microbatch_size)
    values = [fn(x[s : s + microbatch_size]) for s in starts]
    sizes = [min(microbatch_size, 32 - s) for s in starts]
    expected = (
        sum(values)
        if accumulator == "sum"
        else sum(v * n for v, n in zip(values, sizes, strict=True)) / 32
    )
    close(transform(x), expected)
    close(transform(sharded), expected)


def test_microbatcher_planned_on_a_sharded_batch_keeps_the_batchs_microbatches():
    mesh = mesh_of("auto")
    x = jnp.arange(32.0)
    sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
    transform = zm.Microbatcher(jnp.mean, max_memory="100MB", accumulator="sum")
    size = transform.plan(sharded).block_size
    expected = sum(jnp.mean(x[s : s + size]) for s in range(0, 32, size))
    close(transform(sharded), expected)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_batch_arguments_sharded_differently_are_mapped_and_reduced(kind):
    """One batch argument split along its batch axis, another replicated: both mapped."""
    mesh = mesh_of(kind)
    x = jnp.linspace(-1, 1, 32).reshape(16, 2)
    y = jnp.linspace(0, 2, 16)
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    ys = jax.device_put(y, NamedSharding(mesh, P()))

    def f(x, y):
        return jnp.sum(jnp.sin(x) * y[:, None])

    reduced = zm.Microbatcher(f, microbatch_size=2, argnums=(0, 1))
    close(reduced(xs, ys), f(x, y))

    def g(x, y):
        return jnp.sin(x) * y

    mapped = zm.ChunkedVmap(g, chunk_size=3)
    close(mapped(xs, ys), jax.vmap(g)(x, y))


def test_plans_of_one_batch_sharded_and_whole_are_not_confused():
    """A plan is cached per placement too: the per-device plan of a sharded batch is not
    the plan of the same batch on one device."""
    mesh = mesh_of()
    x = jnp.linspace(-1, 1, 64).reshape(32, 2)
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    for transform in (
        zm.ChunkedVmap(jnp.sin, max_memory="100MB"),
        zm.Microbatcher(jnp.sum, max_memory="100MB"),
    ):
        assert transform.plan(xs).total == 8
        assert transform.plan(x).total == 32
        assert transform.plan(xs).total == 8
        traced = jax.jit(lambda x, transform=transform: jnp.asarray(transform.plan(x).total))
        assert int(traced(xs)) == 8 and int(traced(x)) == 32
