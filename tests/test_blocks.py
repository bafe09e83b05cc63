"""The block engine: planning blocks, and `map_blocks` writing them into one result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from zodmem._engine._block_plans import BlockPlan, plan_blocks
from zodmem._engine._blocks import map_blocks

pytestmark = pytest.mark.usefixtures("float64")


@pytest.mark.parametrize("total", [1, 2, 5, 7, 12])
def test_every_nbatches_covers_all_items(total):
    for nbatches in range(1, total + 1):
        plan = plan_blocks(total, nbatches=nbatches)
        assert plan.total == total
        assert plan.block_size == -(-total // nbatches)
        assert plan.num_blocks <= nbatches
        assert (plan.num_blocks - 1) * plan.block_size < total <= plan.num_blocks * plan.block_size
        starts = [int(plan.start(i)) for i in range(plan.num_blocks)]
        covered = set()
        for start in starts:
            assert 0 <= start <= total - plan.block_size
            covered.update(range(start, start + plan.block_size))
        assert covered == set(range(total))
        # Only the last block is moved back; all others start at multiples of the size.
        assert starts[:-1] == [i * plan.block_size for i in range(plan.num_blocks - 1)]
        assert starts[-1] == total - plan.block_size


@pytest.mark.parametrize(
    "total, batch_size, block_size, num_blocks, remainder",
    [
        (12, 3, 3, 4, 0),  # divides
        (12, 5, 5, 3, 2),  # does not divide
        (12, 12, 12, 1, 0),
        (12, 50, 12, 1, 0),  # larger than the total: one block
        (1, 1, 1, 1, 0),
        (7, 1, 1, 7, 0),
    ],
)
def test_batch_size(total, batch_size, block_size, num_blocks, remainder):
    plan = plan_blocks(total, batch_size=batch_size)
    assert plan.block_size == block_size
    assert plan.num_blocks == num_blocks
    assert plan.remainder == remainder
    assert plan.num_full_blocks == total // block_size


def test_nbatches_may_give_fewer_blocks():
    plan = plan_blocks(10, nbatches=6)
    assert (plan.block_size, plan.num_blocks) == (2, 5)


def test_neither_option_is_one_block():
    plan = plan_blocks(9)
    assert (plan.block_size, plan.num_blocks, plan.remainder) == (9, 1, 0)


def test_empty_work_is_an_empty_plan():
    for kwargs in [{}, {"nbatches": 3}, {"batch_size": 2}]:
        plan = plan_blocks(0, **kwargs)
        assert plan.num_blocks == 0
        assert plan.num_full_blocks == 0
        assert plan.remainder == 0


def test_plan_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"nbatches=6 is larger than the number of columns, 5"):
        plan_blocks(5, nbatches=6, what="columns")
    with pytest.raises(ValueError, match=r"chunks=4 .* items, 3: .* chunks <= 3"):
        plan_blocks(3, nbatches=4, nbatches_name="chunks")
    with pytest.raises(ValueError, match=r"at most one of `nbatches` and `batch_size`"):
        plan_blocks(5, nbatches=2, batch_size=2)


def items_of(start, size, width):
    """Item `i` is the row `[i, i + 0.5, ..., ]`: easy to check where every block landed."""
    index = (start + jnp.arange(size)).astype(jnp.float64)
    return index[:, None] + 0.5 * jnp.arange(width)


@pytest.mark.parametrize("total", [1, 4, 7])
def test_map_blocks_every_block_size(total):
    expected = np.asarray(items_of(0, total, 3))

    @jax.jit
    def run_all(dummy):
        # Every block size in one compiled function, to keep compilation down.
        results = []
        for size in range(1, total + 1):
            plan = plan_blocks(total, batch_size=size)
            results.append(map_blocks(lambda s, plan=plan: items_of(s, plan.block_size, 3), plan))
        return results

    for size, result in enumerate(run_all(0.0), start=1):
        assert result.shape == (total, 3), size
        np.testing.assert_array_equal(result, expected)


def test_map_blocks_pytree_and_axes():
    total = 7
    plan = plan_blocks(total, nbatches=3)

    def block_fn(start):
        rows = items_of(start, plan.block_size, 2)
        return {
            "rows": rows,  # items on axis 0
            "cols": (rows.T, rows.T[None].astype(jnp.float32)),  # items last
            "first": rows[:, 0],
        }

    out = jax.jit(lambda: map_blocks(block_fn, plan, axis={"rows": 0, "cols": -1, "first": 0}))()
    expected = items_of(0, total, 2)
    np.testing.assert_array_equal(out["rows"], expected)
    np.testing.assert_array_equal(out["cols"][0], expected.T)
    assert out["cols"][1].dtype == jnp.float32
    np.testing.assert_array_equal(out["cols"][1], expected.T[None])
    np.testing.assert_array_equal(out["first"], expected[:, 0])


def test_map_blocks_single_block_calls_once():
    calls = []

    def block_fn(start):
        calls.append(start)
        return items_of(start, 4, 1)

    out = map_blocks(block_fn, plan_blocks(4, nbatches=1))
    assert len(calls) == 1
    np.testing.assert_array_equal(out, items_of(0, 4, 1))


def test_map_blocks_errors():
    plan = plan_blocks(6, nbatches=2)
    with pytest.raises(ValueError, match=r"axis 0 has 2 items; expected the block size 3"):
        map_blocks(lambda s: jnp.zeros((2, 4)), plan)
    with pytest.raises(ValueError, match="at least one item"):
        map_blocks(lambda s: jnp.zeros((0,)), BlockPlan(total=0, block_size=0))


def test_map_blocks_under_vmap_and_grad():
    plan = plan_blocks(5, batch_size=2)

    def f(scale):
        return map_blocks(lambda s: scale * items_of(s, plan.block_size, 2) ** 2, plan)

    expected = np.asarray(items_of(0, 5, 2)) ** 2
    scales = jnp.asarray([0.0, 1.0, 2.0])
    batched, grad = jax.jit(lambda s: (jax.vmap(f)(s), jax.grad(lambda s: jnp.sum(f(s)))(1.0)))(
        scales
    )
    np.testing.assert_allclose(batched, np.asarray(scales)[:, None, None] * expected)
    # Overlapping items of the last block are overwritten, not added: grad sees each once.
    np.testing.assert_allclose(grad, expected.sum())


@given(
    total=st.integers(1, 20),
    option=st.sampled_from(["nbatches", "batch_size"]),
    fraction=st.floats(0.0, 1.0),
    big=st.booleans(),
)
def test_map_blocks_sweep(total, option, fraction, big):
    value = 1 + int(fraction * (total - 1))
    if option == "batch_size" and big:
        value = total + 3
    plan = plan_blocks(total, **{option: value})
    covered = np.zeros(total, int)
    for i in range(plan.num_blocks):
        start = int(plan.start(i))
        covered[start : start + plan.block_size] += 1
    assert covered.min() >= 1
    # Blocks overlap only where the last block was moved back.
    assert covered.sum() == plan.num_blocks * plan.block_size
    assert covered.sum() - total == (plan.block_size - plan.remainder) % plan.block_size
    out = jax.jit(lambda: map_blocks(lambda s: items_of(s, plan.block_size, 1)[:, 0], plan))()
    np.testing.assert_array_equal(out, np.arange(total, dtype=np.float64))


@pytest.mark.parametrize("total, block_size", [(7, 3), (8, 4), (5, 5), (9, 2)])
def test_read_ahead_equals_slicing_inside_the_block(total, block_size):
    from zodmem._engine._blocks import reduce_blocks

    data = jnp.arange(total * 2.0).reshape(total, 2) ** 1.5
    plan = plan_blocks(total, batch_size=block_size)

    def sliced(start):
        return jnp.sin(jax.lax.dynamic_slice_in_dim(data, start, plan.block_size))

    def read(start):
        return jax.lax.dynamic_slice_in_dim(data, start, plan.block_size)

    np.testing.assert_array_equal(
        map_blocks(lambda start, rows: jnp.sin(rows), plan, read=read),
        map_blocks(sliced, plan),
    )
    np.testing.assert_allclose(map_blocks(sliced, plan), jnp.sin(data), rtol=1e-6)

    def update(acc, result, index, size):
        return acc + result

    def block_sum(start, size):
        return jnp.sum(jax.lax.dynamic_slice_in_dim(data, start, size), axis=0)

    def read_rows(start, size):
        return jax.lax.dynamic_slice_in_dim(data, start, size)

    expected = jnp.sum(data, axis=0)
    zero = jnp.zeros(2)
    plain = reduce_blocks(block_sum, plan, zero, update)
    ahead = reduce_blocks(
        lambda start, size, rows: jnp.sum(rows, axis=0), plan, zero, update, read=read_rows
    )
    np.testing.assert_allclose(plain, expected, rtol=1e-6)
    np.testing.assert_allclose(ahead, expected, rtol=1e-6)
    # A traced count of blocks stops both the same way.
    for count in range(plan.num_blocks + 2):
        stop = jnp.asarray(count)
        first = min(count, plan.num_blocks)
        items = min(first * block_size, total)
        np.testing.assert_allclose(
            jax.jit(
                lambda s: reduce_blocks(
                    lambda start, size, rows: jnp.sum(rows, axis=0),
                    plan,
                    zero,
                    update,
                    read=read_rows,
                    num_blocks=s,
                )
            )(stop),
            jnp.sum(data[:items], axis=0),
            rtol=1e-6,
        )
