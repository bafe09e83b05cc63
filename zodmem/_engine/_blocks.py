"""The block engine: the one place in zodmem that cuts work into pieces.

A transform describes its work as `total` independent items (columns of a
Jacobian, elements of a batch, ...) and a *block function* that computes the
results for `block_size` consecutive items starting at a traced index. With the
blocks planned (`_block_plans.plan_blocks`), the engine

1. runs the block function in a `lax.fori_loop` (its body's convolutions in the form
   a CPU runs fast inside a loop, `_layout.canonical_body`) and writes each block's results
   straight into preallocated outputs with `dynamic_update_slice` (`map_blocks`),
   or folds them into an accumulator (`reduce_blocks`); or, when the output leaves
   the device block by block (`zm.to_host`, `zm.to_file`), hands each finished
   block to the host (`_block_plans.OutputSink`) and assembles nothing;
2. runs a `lax.scan` one block of consecutive steps at a time, with a per-block
   function and a remainder block, writing each block's outputs into preallocated
   outputs (`scan_blocks`); blocks are handed their first step number, and read
   their inputs in place.

No stacked copy of all blocks is ever made, the outputs are never transposed or
padded and sliced: when `block_size` does not divide `total`, the last block of
`map_blocks` is moved back so that it ends at `total` and overlaps the one before
it (its overlapping rows are recomputed and rewritten with identical values), and
the last block of `reduce_blocks` is a second, smaller call of the block function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from ._block_plans import BlockPlan, BlockSink
from ._layout import canonical_body
from ._progress import progress_bar

__all__ = ["map_blocks", "scan_blocks", "write_once", "reduce_blocks"]


def _leaf_axes(axis: Any, tree: Any) -> list[int]:
    """Broadcast an int or a pytree prefix of ints to one axis per leaf of `tree`."""
    if isinstance(axis, int):
        return [axis] * len(jax.tree_util.tree_leaves(tree))
    full = jax.tree_util.tree_map(
        lambda a, sub: jax.tree_util.tree_map(lambda _: a, sub), axis, tree
    )
    return jax.tree_util.tree_leaves(full)


def map_blocks(
    block_fn: Callable[..., Any],
    plan: BlockPlan,
    *,
    axis: Any = 0,
    read: Callable[[Any], Any] | None = None,
    sink: BlockSink | None = None,
    progress: str | None = None,
) -> Any:
    """Run `block_fn` over every block and assemble the results along `axis`.

    - `block_fn(start)`: results for items `start, ..., start + plan.block_size - 1`
      (`start` is a traced int32), a pytree whose leaves hold those items along
      their `axis`. Called as `block_fn(start, inputs)` when `read` is given.
    - `axis`: the block axis of each output leaf, an int or a pytree prefix of the
      output with one int per subtree (negative values count from the end).
    - `read(start)`: optionally, the block's inputs (a pytree of arrays, such as
      slices of the mapped arrays), handed to `block_fn`. The loop reads each
      block's inputs one iteration ahead and carries them, so the block function
      gets arrays of their own rather than slices fused into its first operations:
      XLA's CPU compiler does not vectorise elementwise work that reads through a
      dynamic slice (it reloads the offset for every element).
    - `sink`: optionally, hand each finished block to the host (`OutputSink.part`)
      instead of assembling it: the loop runs from `sink.first_block` and calls
      `sink.write` for every block, in order (an ordered `io_callback`), and nothing
      but one block is ever held on the device.
    - `progress`: optionally, the label of a progress bar of the blocks done, drawn on
      stderr from inside the compiled loop (`None`: no bar, and no callback compiled).

    Returns the pytree of the block function with `plan.total` items along `axis`
    (`None` with a `sink`). With one block and no sink, the block function is called
    once and its result returned as it is.
    """
    if plan.num_blocks == 0:
        raise ValueError("map_blocks needs at least one item; handle empty work before.")

    def compute(start, inputs):
        return block_fn(start) if read is None else block_fn(start, inputs)

    def read_block(index):
        return None if read is None else read(plan.start(index).astype(jnp.int32))

    first = jnp.asarray(0, jnp.int32)
    bar = progress_bar(progress, plan.num_blocks)
    bar.start()
    if plan.num_blocks == 1 and sink is None:
        result = compute(first, read_block(first))
        bar.done(1, result)
        return result
    block_shapes = jax.eval_shape(lambda start: compute(start, read_block(start)), first)
    leaves, treedef = jax.tree_util.tree_flatten(block_shapes)
    axes = [
        a % len(leaf.shape) for a, leaf in zip(_leaf_axes(axis, block_shapes), leaves, strict=True)
    ]
    for leaf, a in zip(leaves, axes, strict=True):
        if leaf.shape[a] != plan.block_size:
            raise ValueError(
                f"The block function returned a leaf of shape {leaf.shape} whose axis {a} "
                f"has {leaf.shape[a]} items; expected the block size {plan.block_size}."
            )

    if sink is not None:
        return _hand_over_blocks(compute, read_block, plan, axes, sink, bar)

    buffers = [
        jnp.zeros(leaf.shape[:a] + (plan.total,) + leaf.shape[a + 1 :], leaf.dtype)
        for leaf, a in zip(leaves, axes, strict=True)
    ]

    def write_block(index, state):
        buffers, inputs = state
        start = plan.start(index).astype(jnp.int32)
        block = jax.tree_util.tree_leaves(compute(start, inputs))
        buffers = [
            jax.lax.dynamic_update_slice_in_dim(buf, piece.astype(buf.dtype), start, axis=a)
            for buf, piece, a in zip(buffers, block, axes, strict=True)
        ]
        bar.done(index + 1, buffers)
        # The next block's inputs; past the last block `plan.start` clamps the index
        # to the last block, so this read stays in bounds (and is unused).
        return buffers, read_block(index + 1)

    buffers, _ = jax.lax.fori_loop(
        0, plan.num_blocks, canonical_body(write_block), (buffers, read_block(first))
    )
    return jax.tree_util.tree_unflatten(treedef, buffers)


def _hand_over_blocks(
    compute: Callable[..., Any],
    read_block: Callable[[Any], Any],
    plan: BlockPlan,
    axes: list[int],
    sink: BlockSink,
    bar: Any,
) -> None:
    """The loop of `map_blocks` with a sink: each block goes to the host as it is made.
    A resumed loop's bar starts at the blocks already done."""

    def write(index, start, *pieces):
        sink.write(index, start, pieces, tuple(axes))

    def write_share(index, start, share, *pieces):
        sink.write(index, start, pieces, tuple(axes), share=int(share))

    def hand_over(index, inputs):
        start = plan.start(index).astype(jnp.int32)
        block = jax.tree_util.tree_leaves(compute(start, inputs))
        # Ordered: the host sees the blocks in loop order, so "blocks done" is a prefix.
        if sink.share is None:
            io_callback(write, None, index, start, *block, ordered=True)
        else:
            io_callback(write_share, None, index, start, sink.share, *block, ordered=True)
        bar.done(index + 1, block)
        return read_block(index + 1)

    bar.done(sink.first_block, sink.first_block)
    jax.lax.fori_loop(
        sink.first_block, plan.num_blocks, canonical_body(hand_over), read_block(sink.first_block)
    )


def _write(buffer: Any, piece: Any, start: Any, keep: Any) -> Any:
    if keep is not None:
        old = jax.lax.dynamic_slice_in_dim(buffer, start, piece.shape[0])
        piece = jnp.where(keep, piece, old)
    return jax.lax.dynamic_update_slice_in_dim(buffer, piece, start, axis=0)


@jax.custom_jvp
def _write_inexact(buffer: Any, piece: Any, start: Any, keep: Any) -> Any:
    return _write(buffer, piece, start, keep)


@_write_inexact.defjvp
def _write_inexact_jvp(primals, tangents):
    buffer, piece, start, keep = primals
    d_buffer, d_piece = tangents[:2]
    if keep is not None:
        d_piece = jnp.where(keep, d_piece, jnp.zeros_like(d_piece))
    # The entries written still hold the buffer's initial constant, whose tangent is
    # zero, so adding the piece's tangent in is exact; and the transpose of this
    # form only reads the output cotangent, where a plain dynamic_update_slice
    # would also zero it, costing a copy of the whole buffer on every write.
    placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(d_buffer), d_piece, start, 0)
    return _write(buffer, piece, start, keep), d_buffer + placed


def write_once(buffer: Any, piece: Any, start: Any, keep: Any = None) -> Any:
    """`buffer` with `piece` written at `start` along the leading axis.

    For a preallocated output carried through a loop in which every entry is
    written at most once, while it still holds its initial value: then its
    reverse-mode derivative reads the cotangent of each piece out of the output's
    cotangent without rewriting it, and the loop needs no copy of the output per
    write. `keep` (a traced bool) makes the write conditional without a branch.
    """
    piece = jnp.asarray(piece, buffer.dtype)
    if jnp.issubdtype(buffer.dtype, jnp.inexact):
        return _write_inexact(buffer, piece, start, keep)
    return _write(buffer, piece, start, keep)


def scan_blocks(
    block_fn: Callable[[Any, Any, int], tuple[Any, Any]],
    plan: BlockPlan,
    init: Any,
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
    reverse_outputs: bool = False,
    progress: str | None = None,
) -> tuple[Any, Any]:
    """Run a scan of `plan.total` steps one block of consecutive steps at a time.

    The steps are numbered `0, ..., plan.total - 1` in index order, as the entries
    of a `lax.scan`'s `xs`; the engine hands each block its first step number and
    never touches `xs`, so the block function reads its own inputs where they lie
    (`lax.dynamic_slice_in_dim`) and `xs` is never sliced or copied as a whole.

    - `block_fn(carry, start, size)`: runs steps `start, ..., start + size - 1`
      from `carry` and returns `(carry, out)`. `start` is an int32 scalar (traced in
      the loop over full blocks) and `size` a Python int: `plan.block_size`, or
      `plan.remainder` for the last block. With `reverse=True` the block runs its
      steps from the last to the first, as `lax.scan(reverse=True)` does. Every leaf
      of `out` holds the block's results along its leading axis, as many for every
      full block.
    - `init`: the carry before the first step.
    - `reverse`: run the steps from the last to the first. The remainder block then
      holds the lowest step numbers, so that it still runs last.
    - `unroll`: the `unroll` of the `lax.scan` over full blocks.
    - `reverse_outputs`: assemble the outputs in the opposite order.
    - `progress`: optionally, the label of a progress bar of the blocks done (as in
      `map_blocks`).

    Returns `(carry, outputs)`: the carry after the last step, and every block's
    results along the leading axis in the order of the step numbers that made them
    (the order of `lax.scan`'s `ys`), or in the opposite order with
    `reverse_outputs`. The results are written (`write_once`) into preallocated
    outputs carried by the loop over full blocks, so no stacked copy,
    concatenation or flip of all the outputs is ever made, in the forward pass or
    the backward one.
    """
    if plan.total == 0:
        raise ValueError("scan_blocks needs at least one step; handle an empty scan before.")
    size, full, rest = plan.block_size, plan.num_full_blocks, plan.remainder
    first = rest if reverse else 0  # first step of the full blocks
    rest_start = jnp.asarray(0 if reverse else full * size, jnp.int32)

    def out_shapes(steps: int) -> Any:
        start = jax.ShapeDtypeStruct((), jnp.int32)
        return jax.eval_shape(lambda c, s: block_fn(c, s, steps)[1], init, start)

    shapes, treedef = jax.tree_util.tree_flatten(out_shapes(size if full else rest))
    per_block = [leaf.shape[0] if full else 0 for leaf in shapes]
    if not rest:
        in_rest = [0] * len(shapes)
    elif not full:
        in_rest = [leaf.shape[0] for leaf in shapes]
    else:
        in_rest = [leaf.shape[0] for leaf in jax.tree_util.tree_leaves(out_shapes(rest))]
    buffers = [
        jnp.zeros((full * n + r, *leaf.shape[1:]), leaf.dtype)
        for n, r, leaf in zip(per_block, in_rest, shapes, strict=True)
    ]

    def write(buffers: list, out: Any, positions: list) -> list:
        written = []
        pieces = jax.tree_util.tree_leaves(out)
        for buf, piece, position in zip(buffers, pieces, positions, strict=True):
            piece = jnp.asarray(piece, buf.dtype)
            if reverse_outputs:
                position = buf.shape[0] - position - piece.shape[0]
                piece = jnp.flip(piece, axis=0) if piece.shape[0] > 1 else piece
            written.append(write_once(buf, piece, position))
        return written

    bar = progress_bar(progress, plan.num_blocks)

    def run_block(state, index):
        carry, buffers = state
        carry, out = block_fn(carry, first + index * size, size)
        offsets = in_rest if reverse else [0] * len(buffers)
        positions = [offset + index * n for offset, n in zip(offsets, per_block, strict=True)]
        buffers = write(buffers, out, positions)
        # Blocks done so far, whichever way the loop runs over `index`.
        bar.done(full - index if reverse else index + 1, (carry, buffers))
        return (carry, buffers), None

    carry = init
    bar.start()
    if full == 1:
        (carry, buffers), _ = run_block((carry, buffers), jnp.asarray(0, jnp.int32))
    elif full > 1:
        indices = jnp.arange(full, dtype=jnp.int32)
        (carry, buffers), _ = jax.lax.scan(
            canonical_body(run_block), (carry, buffers), indices, reverse=reverse, unroll=unroll
        )
    if rest:
        carry, out = block_fn(carry, rest_start, rest)
        positions = [0 if reverse else full * n for n in per_block]
        buffers = write(buffers, out, positions)
        bar.done(plan.num_blocks, (carry, buffers))
    return carry, jax.tree_util.tree_unflatten(treedef, buffers)


def reduce_blocks(
    block_fn: Callable[..., Any],
    plan: BlockPlan,
    init: Any,
    update: Callable[[Any, Any, Any, int], Any],
    *,
    num_blocks: Any = None,
    read: Callable[[Any, int], Any] | None = None,
    progress: str | None = None,
) -> Any:
    """Fold the results of every block into an accumulator, block by block.

    - `block_fn(start, size)`: results for items `start, ..., start + size - 1`;
      `start` is traced and `size` a Python int (`plan.block_size`, or
      `plan.remainder` for the last, smaller block). Called as
      `block_fn(start, size, inputs)` when `read` is given.
    - `init`: the starting accumulator.
    - `update(acc, result, index, size)`: the accumulator after block `index`.
    - `num_blocks`: optionally a (possibly traced) number of blocks to run, counted
      from the first; the remainder block, when there is one, is the last block and
      counts as one. Blocks from `num_blocks` on are not evaluated and leave the
      accumulator as it is (a value above `plan.num_blocks` runs every block).
    - `read(start, size)`: optionally, the block's inputs (a pytree of arrays), handed
      to `block_fn`. As in `map_blocks`, the loop over full blocks reads each block's
      inputs one iteration ahead and carries them, so that the block function gets
      arrays of their own rather than slices fused into its first operations.
    - `progress`: optionally, the label of a progress bar of the blocks done (as in
      `map_blocks`); blocks skipped by `num_blocks` count as done when they are passed.

    Blocks never overlap, so every item is counted exactly once. The loop has a
    fixed trip count even when `num_blocks` is traced (skipped blocks go through
    `lax.cond`), so the reduction stays reverse-mode differentiable.
    """
    acc = init
    bar = progress_bar(progress, plan.num_blocks)

    def compute(start, size, inputs):
        return block_fn(start, size) if read is None else block_fn(start, size, inputs)

    def read_full(index):
        if read is None:
            return None
        # Past the last full block the start is clamped, so the read stays in bounds
        # (and is unused).
        start = jnp.minimum(index * plan.block_size, plan.total - plan.block_size)
        return read(start.astype(jnp.int32), plan.block_size)

    def run(index, acc, inputs):
        start = (index * plan.block_size).astype(jnp.int32)
        return update(acc, compute(start, plan.block_size, inputs), index, plan.block_size)

    def step(index, state):
        acc, inputs = state
        acc = run(index, acc, inputs)
        bar.done(index + 1, acc)
        return acc, read_full(index + 1)

    def last(acc):
        start = jnp.asarray(plan.num_full_blocks * plan.block_size, jnp.int32)
        inputs = None if read is None else read(start, plan.remainder)
        result = compute(start, plan.remainder, inputs)
        return update(acc, result, jnp.asarray(plan.num_full_blocks), plan.remainder)

    first = jnp.asarray(0, jnp.int32)
    bar.start()
    if num_blocks is None:
        if plan.num_full_blocks:
            acc, _ = jax.lax.fori_loop(
                0, plan.num_full_blocks, canonical_body(step), (acc, read_full(first))
            )
        if plan.remainder:
            acc = last(acc)
            bar.done(plan.num_blocks, acc)
        return acc

    stop = jnp.asarray(num_blocks, jnp.int32)

    def step_if_running(index, state):
        acc, inputs = state
        acc = jax.lax.cond(index < stop, lambda a: run(index, a, inputs), lambda a: a, acc)
        # Outside the `cond`: under `vmap` a mapped `stop` would run both branches.
        bar.done(index + 1, acc)
        return acc, read_full(index + 1)

    if plan.num_full_blocks:
        acc, _ = jax.lax.fori_loop(
            0, plan.num_full_blocks, canonical_body(step_if_running), (acc, read_full(first))
        )
    if plan.remainder:
        acc = jax.lax.cond(stop > plan.num_full_blocks, last, lambda a: a, acc)
        bar.done(plan.num_blocks, acc)
    return acc
