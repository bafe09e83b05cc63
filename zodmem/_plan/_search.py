"""The search for a block size: the largest whose compiled peak fits a budget, in few
compiles, seen through one function, the peak at a block size.

1. The largest size considered: where a platform caps a block's temporaries
   (`block_bytes`, on a CPU), the largest whose temporaries stay within the cap (the
   temporaries per item are the slope of the peaks between one item per block and the
   whole work); elsewhere the whole work. If it fits, it is the plan.
2. One item per block: if that does not fit either, a ladder of sizes (the largest
   considered, halved up to eight times, down to 2) is tried, since XLA may form a
   large block's products as one matrix product with fewer temporaries than a few
   separate products take. If none fits, the search is refused with the least peak it
   saw; otherwise it goes on from the largest size that fits.
3. Between a size known to fit and one known not to, the peak grows about linearly with
   the block size: a secant step guesses the largest size that fits, each guess is
   checked, and the search stops when the two sizes are within a sixteenth of the one
   that fits. Where the peak grows faster than linearly the secant guesses low every
   time: after two such steps the end that does not fit counts half as far over the
   budget each time (the Illinois rule), so the guesses still close in.

Sizes are taken as `ceil(total / num_blocks)`, the smallest size for a number of blocks,
so the blocks come out even. Which sizes are tried does not depend on the budget until
the first that fits, so a search that fits at one budget fits at any larger one.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CPU_BLOCK_BYTES", "search", "size_for"]


# On a CPU, the most temporaries a block is planned to make: a block whose temporaries
# outgrow the caches runs slower per item.
CPU_BLOCK_BYTES = 16 * 10**6


def size_for(total: int, block_size: int) -> int:
    """The smallest block size that cuts `total` into as many blocks as `block_size` does."""
    return -(-total // -(-total // block_size))


def search(
    peak_at: Callable[[int], int],
    total: int,
    budget: int,
    *,
    refuse: Callable[[int], Exception],
    block_bytes: int | None = None,
    least: int | None = None,
) -> int:
    """The block size to use: the largest whose peak (`peak_at(size)`) fits `budget` and,
    with `block_bytes`, whose temporaries (the peaks' slope per item times the size) stay
    within it. `least`, where given, is a lower bound of one item's peak (the output,
    which every block size holds) that the slope is taken from instead of compiling one
    item per block: a slope no smaller, so blocks no larger. `refuse(least_peak)` is
    raised when no size fits."""
    peaks: dict[int, int] = {}

    def peak(size: int) -> int:
        if size not in peaks:
            peaks[size] = peak_at(size)
        return peaks[size]

    cap = total
    if block_bytes is not None and total > 1:
        whole = peak(total)
        per_item = (whole - (peak(1) if least is None else least)) / (total - 1)
        if per_item > 0:
            cap = size_for(total, max(1, min(total, int(block_bytes // per_item))))
    if peak(cap) <= budget:
        return cap
    fits, over = 1, cap
    if peak(1) > budget:
        # Usually nothing fits then; but the peak need not grow with the block size
        # (XLA may form a large block's products as one matrix product, with fewer
        # temporaries than a few separate ones): look down a ladder of sizes first.
        ladder = [size_for(total, cap >> k) for k in range(1, 9) if cap >> k > 1]
        fitting = [size for size in ladder if peak(size) <= budget]
        if not fitting:
            raise refuse(min(peaks.values()))
        fits = fitting[0]
        over = min(size for size in peaks if size > fits)
    rising = 0  # how many steps in a row have raised the size known to fit
    while over - fits > max(1, fits // 16):
        # The secant between the largest size known to fit and the smallest known not to.
        # Where the peak grows faster than linearly it guesses low every time; from the
        # second such step on, the excess of the end that does not fit is halved each
        # time (the Illinois rule), so the guesses reach the answer in few steps.
        excess = (peak(over) - budget) / 2 ** max(0, rising - 1)
        slope = (budget + excess - peak(fits)) / (over - fits)
        guess = fits + (budget - peak(fits)) / slope if slope > 0 else over - 1
        size = size_for(total, int(min(max(guess, fits + 1), over - 1)))
        if size <= fits or size >= over:
            break
        if peak(size) <= budget:
            fits, rising = size, rising + 1
        else:
            over, rising = size, 0
    return fits
