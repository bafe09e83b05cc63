"""The option checks that every transform and compat function shares."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close
from jax.sharding import NamedSharding, PartitionSpec as P

import zodmem as zm
from zodmem._checks import (
    as_index,
    as_int_or_bool,
    check_block_options,
    check_bool,
    check_int,
    common_size,
)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, "must be a positive int, got nbatches=0"),
        (-3, ValueError, "must be a positive int, got nbatches=-3"),
        (2.0, TypeError, "must be a positive int or None, got 2.0 of type float"),
        (True, TypeError, "got True of type bool"),
        ("4", TypeError, "got '4' of type str"),
    ],
)
def test_block_option_refuses_all_but_positive_ints(value, error, match):
    with pytest.raises(error, match=match):
        check_int(value, "nbatches", owner="Owner", minimum=1, optional=True)
    assert check_int(None, "nbatches", owner="Owner", minimum=1, optional=True) is None
    assert check_int(3, "nbatches", owner="Owner", minimum=1, optional=True) == 3


@pytest.mark.parametrize("value", [np.int64(4), np.int32(4), np.uint8(4), 4])
def test_numpy_integers_are_integers(value):
    assert check_int(value, "n", owner="Owner", minimum=1) == 4
    assert type(as_index(value)) is int and as_index(value) == 4


@pytest.mark.parametrize("value", [True, False, 4.0, np.float64(4.0), "4", None])
def test_as_index_leaves_non_integers_for_the_checks(value):
    assert as_index(value) is value


@pytest.mark.parametrize(
    "value, expected", [(np.True_, True), (np.False_, False), (True, True), (np.int64(3), 3)]
)
def test_as_int_or_bool_reads_numpy_bools_and_integers(value, expected):
    assert type(as_int_or_bool(value)) is type(expected) and as_int_or_bool(value) == expected


@pytest.mark.parametrize("value", [1.5, np.float32(2.0), "1", None])
def test_as_int_or_bool_leaves_the_rest_for_the_checks(value):
    assert as_int_or_bool(value) is value


def test_messages_name_numpy_types_in_full():
    with pytest.raises(TypeError, match=r"got np\.True_ of type numpy\.bool\.$"):
        check_bool(np.True_, "flag", owner="Owner")
    with pytest.raises(TypeError, match=r"got np\.float64\(2\.0\) of type numpy\.float64\.$"):
        check_int(np.float64(2.0), "n", owner="Owner")
    with pytest.raises(TypeError, match=r"got True of type bool\.$"):
        check_int(True, "n", owner="Owner")


def test_block_options_pair():
    check_block_options(None, None, owner="Owner")
    check_block_options(np.int64(2), None, owner="Owner")
    with pytest.raises(ValueError, match="Owner: give at most one of `nbatches` and `batch_size`"):
        check_block_options(2, 3, owner="Owner")
    with pytest.raises(ValueError, match="Owner: `chunks` must be a positive int, got chunks=0"):
        check_block_options(0, None, owner="Owner", count_name="chunks")


def test_common_size_lists_every_input():
    assert common_size({}, owner="Owner", what="mapped axes") is None
    assert common_size({"a": 3, "b": 3}, owner="Owner", what="mapped axes") == 3
    with pytest.raises(ValueError, match=r"Owner: the mapped inputs .* mapped axes.* a: 3, b: 4"):
        common_size({"a": 3, "b": 4}, owner="Owner", what="mapped axes")


# Every integer option of every transform takes NumPy integers, stores a Python int
# (so that configurations hash, compare and serialise alike), and refuses bools.
INT_OPTIONS = [
    (zm.BatchedJacobian, {"nbatches": 2}),
    (zm.BatchedJacobian, {"batch_size": 2}),
    (zm.BatchedHessian, {"nbatches": 2}),
    (zm.BatchedHessian, {"batch_size": 2}),
    (zm.ChunkedVmap, {"chunk_size": 2}),
    (zm.SlicedScan, {"start": 2}),
    (zm.SlicedScan, {"stop": 2}),
    (zm.SlicedScan, {"step": 2}),
    (zm.SlicedScan, {"length": 2}),
    (zm.SlicedScan, {"unroll": 2}),
    (zm.CheckpointedScan, {"chunk_size": 2}),
    (zm.CheckpointedScan, {"length": 2}),
    (zm.CheckpointedScan, {"unroll": 2}),
]


@pytest.mark.parametrize("cls, option", INT_OPTIONS)
def test_every_int_option_takes_numpy_integers(cls, option):
    ((name, value),) = option.items()
    from_numpy = cls(lambda *a: a[0], **{name: np.int64(value)})
    assert type(getattr(from_numpy, name)) is int
    assert from_numpy == cls(from_numpy.fn, **option)
    with pytest.raises(TypeError, match=f"{cls.__name__}: `{name}` must be"):
        cls(lambda *a: a[0], **{name: float(value)})
    if name != "unroll":  # lax.scan's unroll takes bools
        with pytest.raises(TypeError, match=f"{cls.__name__}: `{name}` must be .* bool"):
            cls(lambda *a: a[0], **{name: True})


# ---------------------------------------------------------------------------------
# `sharding` (the multi-device behaviour is tested in tests/multidevice)


@pytest.mark.parametrize("transform", [zm.BatchedJacobian, zm.BatchedHessian])
@pytest.mark.parametrize("bad", ["d", P("d"), jax.devices()[0]])
def test_sharding_must_be_a_named_sharding(transform, bad):
    with pytest.raises(TypeError, match=r"`sharding` must be a jax.sharding.NamedSharding"):
        transform(jnp.sum, sharding=bad)


def test_sharding_that_splits_two_axes_is_refused_at_construction():
    mesh = jax.make_mesh((1, 1), ("x", "y"))
    with pytest.raises(ValueError, match=r"may split one axis.*P\('x', 'y'\)"):
        zm.BatchedHessian(jnp.sum, sharding=NamedSharding(mesh, P("x", "y")))


@pytest.mark.parametrize("spec", [P("d", None), P(None, "d")])
def test_a_mesh_of_one_device_gives_the_whole_result(spec):
    sharding = NamedSharding(jax.make_mesh((1,), ("d",)), spec)
    w = jnp.linspace(0.1, 1.0, 5)

    def f(w):
        return jnp.sum(jnp.sin(w) ** 3)

    close(
        zm.BatchedHessian(f, batch_size=2, sharding=sharding)(w), eqx.filter_jit(jax.hessian(f))(w)
    )
    close(
        zm.BatchedJacobian(jnp.sin, batch_size=2, sharding=sharding)(w),
        eqx.filter_jit(jax.jacfwd(jnp.sin))(w),
    )
