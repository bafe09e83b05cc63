"""Block plans and sinks: how `total` items are cut into blocks, and where the blocks of
a result that leaves the device block by block go.

- `BlockPlan` and `plan_blocks`: the size and count of the blocks, from either a number
  of blocks or a block size, with the checks users need;
- `OutputSink`: the host side of a streamed result (`zm.to_host`, `zm.to_file`), which
  hands each `map_blocks` call its `BlockSink`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp

__all__ = ["BlockPlan", "BlockSink", "OutputSink", "plan_blocks"]


class BlockPlan(eqx.Module):
    """How `total` items are cut into blocks of `block_size` consecutive items."""

    total: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True)

    @property
    def num_blocks(self) -> int:
        if self.total == 0:
            return 0
        return -(-self.total // self.block_size)

    @property
    def num_full_blocks(self) -> int:
        return self.total // self.block_size if self.block_size else 0

    @property
    def remainder(self) -> int:
        """Items left over after the full blocks (0 when `block_size` divides `total`)."""
        return self.total - self.num_full_blocks * self.block_size

    def start(self, index: Any) -> Any:
        """First item of block `index`; the last block ends exactly at `total`."""
        return jnp.minimum(index * self.block_size, self.total - self.block_size)


def plan_blocks(
    total: int,
    *,
    nbatches: int | None = None,
    batch_size: int | None = None,
    what: str = "items",
    nbatches_name: str = "nbatches",
    batch_size_name: str = "batch_size",
    owner: str = "",
    context: str = "",
) -> BlockPlan:
    """Plan blocks over `total` items from a number of blocks or a block size.

    - `nbatches`: cut into blocks of `ceil(total / nbatches)` items: this many
      blocks, or fewer where the rounded-up size covers `total` sooner (10 items
      in `nbatches=6` are 5 blocks of 2). It may not exceed `total`.
    - `batch_size`: cut into blocks of this many items (a size above `total` means
      a single block).
    - Neither: one block holding everything.
    - `what`, `nbatches_name`, `batch_size_name`: words for error messages;
      `owner`, the transform's name, starts them, and `context` (a parenthesis)
      follows the count of items, to say what an item is and why.
    """
    prefix = f"{owner}: " if owner else ""
    if nbatches is not None and batch_size is not None:
        raise ValueError(
            f"{prefix}give at most one of `{nbatches_name}` and `{batch_size_name}`, "
            f"got {nbatches_name}={nbatches} and {batch_size_name}={batch_size}."
        )
    if total == 0:
        return BlockPlan(total=0, block_size=0)
    if nbatches is not None:
        if nbatches > total:
            raise ValueError(
                f"{prefix}{nbatches_name}={nbatches} is larger than the number of {what}, "
                f"{total}{context}: there would be empty blocks. Choose "
                f"{nbatches_name} <= {total}."
            )
        return BlockPlan(total=total, block_size=-(-total // nbatches))
    if batch_size is not None:
        return BlockPlan(total=total, block_size=min(batch_size, total))
    return BlockPlan(total=total, block_size=total)


class BlockSink(NamedTuple):
    """Where one `map_blocks` call hands its finished blocks: `write(index, start, pieces,
    axes)` runs on the host (`index` counted over the whole output, `pieces` NumPy arrays,
    one per output leaf of the block function, `axes` their block axes), and the loop
    starts at block `first_block` (traced) of this call. With `share` (a traced int32:
    which device's share of a sharded result the blocks belong to), it is handed to
    `write` too, as `share=`."""

    write: Callable[..., None]
    first_block: Any
    share: Any = None


class OutputSink:
    """The host side of a result that leaves the device block by block.

    A transform's computation, given one, passes `sink.part(leaves, plan)` to each of
    its `map_blocks` calls; `leaves` are the indices, among the leaves of the result,
    that the call's output leaves fill. Blocks are numbered across the parts in the
    order they are made, and every block before `first_block` (a traced int32, so one
    compiled program can start anywhere) is skipped.

    - `write(index, leaves, start, pieces, axes)`: the host function that takes block
      `index`, whose items start at `start`, for the result leaves `leaves`.
    - `first_block`: the first block to compute, counted over the whole output.
    - `share`: optionally, inside one device's share of a sharded computation, the
      share's index (traced): `write` then takes it too, as `share=` (an int), so the host
      knows whose items `start` counts from. `parts` lists each part's `(leaves, plan)`.
    """

    def __init__(self, write: Callable[..., None], first_block: Any, share: Any = None):
        self._write = write
        self.first_block = first_block
        self.share = share
        self.num_blocks = 0
        self.leaves: list[int] = []
        self.parts: list[tuple[tuple[int, ...], BlockPlan]] = []

    def part(self, leaves: Sequence[int], plan: BlockPlan) -> BlockSink:
        """The sink of a `map_blocks` call over `plan` that fills the result's `leaves`."""
        offset, leaves = self.num_blocks, tuple(leaves)
        self.num_blocks += plan.num_blocks
        self.leaves.extend(leaves)
        self.parts.append((leaves, plan))
        first = jnp.clip(jnp.asarray(self.first_block, jnp.int32) - offset, 0, plan.num_blocks)

        def write(index: Any, start: Any, pieces: Sequence, axes: tuple, **share: Any) -> None:
            self._write(int(index) + offset, leaves, int(start), pieces, axes, **share)

        return BlockSink(write, first.astype(jnp.int32), self.share)
