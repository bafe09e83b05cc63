"""The planner's search against synthetic peaks: `search` sees a call only through its
peak at a block size, so the sizes it chooses, the sizes it compiles and the refusals it
makes are checked here in milliseconds, on peaks written down. The compiled path (plan,
call, refusal before anything runs) is tested in test_budget.py."""

import pytest
from hypothesis import given, settings, strategies as st

from zodmem._plan._search import search, size_for as _size_for


class Refused(Exception):
    """What `refuse` makes here: it carries the least peak the search saw."""


class Peaks:
    """A peak per block size, `peak(size)`, that records the sizes the search asks for
    (each one a compile in the planner)."""

    def __init__(self, peak):
        self.peak = peak
        self.asked = []

    def __call__(self, size):
        self.asked.append(size)
        return self.peak(size)


def searched(peak, total, budget, block_bytes=None, least=None):
    """`(size, asked)`: the size `search` chose for `peak`, and the sizes it asked for."""
    peaks = Peaks(peak)
    size = search(peaks, total, budget, refuse=Refused, block_bytes=block_bytes, least=least)
    return size, peaks.asked


def sizes_of(total):
    """Every block size `ceil(total / num_blocks)`: the smallest for its number of blocks."""
    return {-(-total // num_blocks) for num_blocks in range(1, total + 1)}


def affine(base, per_item):
    return lambda size: base + per_item * size


# --- sizes --------------------------------------------------------------------------------


@settings(max_examples=200)
@given(st.integers(1, 10**6), st.data())
def test_a_size_is_the_smallest_for_its_number_of_blocks(total, data):
    block_size = data.draw(st.integers(1, total))
    size = _size_for(total, block_size)
    num_blocks = -(-total // block_size)
    assert 1 <= size <= block_size and -(-total // size) == num_blocks
    assert size == 1 or -(-total // (size - 1)) > num_blocks
    assert _size_for(total, size) == size


# --- peaks that grow with the size ----------------------------------------------------------


def test_the_whole_work_in_one_block_when_it_fits():
    peak = affine(1000, 100)
    assert searched(peak, 50, peak(50)) == (50, [50])
    assert searched(peak, 1, peak(1)) == (1, [1])


@settings(max_examples=200)
@given(
    total=st.integers(2, 3000),
    base=st.integers(0, 10**6),
    per_item=st.integers(1, 10**4),
    share=st.floats(0, 1, exclude_max=True),
)
def test_affine_peaks_give_the_largest_size_that_fits_in_few_compiles(total, base, per_item, share):
    peak = affine(base, per_item)
    budget = peak(1) + min(int(share * (peak(total) - peak(1))), peak(total) - peak(1) - 1)
    size, asked = searched(peak, total, budget)
    assert size == max(s for s in sizes_of(total) if peak(s) <= budget)
    # Both ends first, then the secant lands on the answer: each size is compiled once.
    assert asked[:2] == [total, 1] and len(asked) <= 4 and len(set(asked)) == len(asked)
    assert all(s == _size_for(total, s) for s in asked)


def kinked(size):
    """Three bytes an item up to 800 items, one beyond: each secant from one item
    overshoots, until the bracket closes on the steep part."""
    return 3 * size if size <= 800 else 2400 + (size - 800)


def s_shaped(size):
    """One byte an item, four from 2000 items, one again from 90,000: the secants land on
    either side of the answer in turn."""
    if size <= 2000:
        return size
    return 2000 + 4 * (size - 2000) if size <= 90_000 else 354_000 + (size - 90_000)


@pytest.mark.parametrize("peak, total, budget", [(kinked, 10**6, 2000), (s_shaped, 10**5, 3500)])
def test_the_secant_stops_once_it_would_gain_less_than_a_sixteenth(peak, total, budget):
    size, asked = searched(peak, total, budget)
    assert peak(size) <= budget and size == _size_for(total, size)
    over = min(s for s in asked if s > size)
    assert peak(over) > budget
    # The bracket is more than one size wide (so there was more to gain), but within a
    # sixteenth of the size that fits: the search stops there, compiling nothing between.
    assert 1 < over - size <= size // 16
    assert not [s for s in asked if size < s < over]
    assert len(asked) <= 8


def test_peaks_over_the_budget_at_one_item_are_refused_with_the_least_peak():
    peak = affine(1000, 100)
    with pytest.raises(Refused) as info:
        searched(peak, 100, 500)
    assert info.value.args == (peak(1),)
    with pytest.raises(Refused) as info:
        searched(peak, 1, 500)
    assert info.value.args == (peak(1),)


# --- peaks that do not grow with the size -----------------------------------------------------


def test_a_large_block_may_need_less_than_small_ones():
    # As when XLA forms a large block's products as one matrix product: below 30 items
    # the peak is over the budget, from 30 to 90 items it fits.
    def peak(size):
        return 20_000 if size < 30 else 100 * size

    size, asked = searched(peak, 160, 9000)
    assert size == 80 == max(s for s in sizes_of(160) if peak(s) <= 9000)
    assert asked[:3] == [160, 1, 80]  # the ladder of halves, from the top

    # From the largest size of the ladder that fits, the secant goes on upwards.
    def peak(size):
        return 50_000 if size < 50 else 100 * size

    size, asked = searched(peak, 1000, 40_000)
    assert size == 334 == max(s for s in sizes_of(1000) if peak(s) <= 40_000)
    assert 250 in asked and asked[-1] == 334


def test_a_ladder_where_nothing_fits_is_refused_with_the_least_peak_it_saw():
    # The least peak is at 20 items, on the ladder; neither end has it.
    def peak(size):
        return 1000 + 10 * abs(size - 20)

    with pytest.raises(Refused) as info:
        searched(peak, 160, 500)
    assert info.value.args == (1000,)


# --- the cap on a block's temporaries ---------------------------------------------------------


def test_block_bytes_caps_the_size_by_the_temporaries_per_item():
    peak = affine(1000, 100)  # 100 bytes an item
    # 3000 bytes hold 30 items; 25 is the smallest size for as many blocks (4).
    assert searched(peak, 100, 10**9, block_bytes=3000) == (25, [100, 1, 25])
    assert searched(peak, 100, 10**9) == (100, [100])
    # The budget may be the tighter bound: the search goes on below the cap.
    assert searched(peak, 100, 2000, block_bytes=3000) == (10, [100, 1, 25, 10])
    # Less than one item's temporaries: one item per block.
    assert searched(peak, 100, 10**9, block_bytes=50)[0] == 1
    # Peaks that do not grow give no temporaries per item to cap.
    assert searched(lambda size: 1000, 100, 10**9, block_bytes=50)[0] == 100
    assert searched(peak, 1, 10**9, block_bytes=50) == (1, [1])


def test_peaks_that_grow_faster_than_linearly_take_few_compiles():
    """The secant through a convex peak guesses low every time; the Illinois rule keeps
    the compiles few (a plain secant took about 500 here) and the answer within a
    sixteenth of the largest size that fits."""

    def convex(size):
        return 10**6 + 1000 * size + 3 * size * size

    size, asked = searched(convex, 10**6, 10**7)
    assert convex(size) <= 10**7 and convex(size + size // 16 + 1) > 10**7
    assert len(asked) <= 20


def test_a_known_least_peak_stands_in_for_one_item_per_block():
    # The output (here 1000 bytes) bounds one item's peak from below: the slope from it
    # is no smaller, and where its cap fits, one item per block is never compiled.
    peak = affine(1000, 100)
    assert searched(peak, 100, 10**9, block_bytes=3000, least=1000) == (25, [100, 25])
    # A lower bound below the true peak gives a steeper slope and blocks no larger.
    size, asked = searched(affine(5000, 100), 100, 10**9, block_bytes=3000, least=1000)
    assert size <= 25 and 1 not in asked
