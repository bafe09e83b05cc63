"""`SlicedScan` and `CheckpointedScan`: `lax.scan` that keeps only some of its
outputs, and `lax.scan` whose gradient stores only a carry per chunk of steps."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._checks import (
    NamedInMessages,
    as_int_or_bool,
    check_bool,
    check_callable,
    check_int,
    checked_annotations,
    common_size,
    int_option,
    typechecked_constructor,
)
from .._engine._block_plans import plan_blocks
from .._engine._blocks import scan_blocks, write_once
from .._engine._progress import closing_bars, label, progress_bar
from .._traceback import public
from ._base import AbstractTransform

__all__ = ["SlicedScan", "CheckpointedScan", "scan_length", "default_chunk_size"]


def _check_length(value: Any, *, owner: str) -> None:
    if check_int(value, "length", owner=owner, optional=True) is not None and value < 0:
        raise ValueError(
            f"{owner}: `length` is the number of steps and must be a non-negative int or "
            f"None, got length={value}."
        )


def _check_unroll(value: Any, *, owner: str) -> None:
    if not isinstance(value, bool):
        check_int(value, "unroll", owner=owner, minimum=1, allowed="a positive int or a bool")


def scan_length(xs: Any, length: int | None, *, owner: str) -> int:
    """The number of steps of a scan over `xs`, checked against `length`."""
    sizes: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(xs)[0]:
        shape = np.shape(leaf)
        where = "xs" + jax.tree_util.keystr(path)
        if not shape:
            raise ValueError(
                f"{owner}: every leaf of `xs` needs a leading axis to scan over, but {where} "
                "is a scalar. Give it a leading axis of one entry per step."
            )
        sizes[where] = shape[0]
    steps = common_size(
        sizes, owner=owner, subject="the leaves of `xs`", what="leading axes (the number of steps)"
    )
    if steps is not None:
        if length is not None and length != steps:
            raise ValueError(
                f"{owner}: `length`={length} disagrees with the leading axis size of `xs`, "
                f"{steps}. Leave `length` as None or make the two agree."
            )
        return steps
    if length is None:
        raise ValueError(
            f"{owner}: there is nothing to tell the number of steps: `xs`={xs!r} has no "
            "array leaves and `length` is None. Give `length`."
        )
    return length


def default_chunk_size(length: int) -> int:
    """The chunk size `CheckpointedScan` uses when none is given: the ceiling of the
    square root of the number of steps, which balances the carries stored (one per
    chunk) against the steps of the one chunk recomputed at a time."""
    return math.isqrt(length - 1) + 1 if length > 1 else 1


def _inner_unroll(unroll: int | bool, steps: int) -> int | bool:
    return unroll if isinstance(unroll, bool) else max(1, min(unroll, steps))


def _outer_unroll(unroll: int | bool, block_size: int) -> int | bool:
    # `unroll` bounds the unrolled steps, and one iteration over blocks runs a block.
    return unroll if isinstance(unroll, bool) else max(1, unroll // block_size)


class AbstractScan(AbstractTransform, NamedInMessages):
    """What `SlicedScan` and `CheckpointedScan` share: a step function `fn(carry, x) ->
    (carry, y)` run as `lax.scan` runs it, `length` steps (or one per entry of `xs`),
    in reverse with `reverse`, `unroll` steps unrolled at most, and a progress bar with
    `progress`."""

    fn: Callable[..., Any]
    length: int | None = eqx.field(default=None, static=True, kw_only=True, converter=int_option)
    reverse: bool = eqx.field(default=False, static=True, kw_only=True)
    unroll: int | bool = eqx.field(default=1, static=True, kw_only=True, converter=as_int_or_bool)
    progress: bool = eqx.field(default=False, static=True, kw_only=True)

    @public
    def __check_init__(self):
        owner = self._owner
        check_callable(self.fn, "fn", owner=owner)
        _check_length(self.length, owner=owner)
        check_bool(self.reverse, "reverse", owner=owner)
        _check_unroll(self.unroll, owner=owner)
        check_bool(self.progress, "progress", owner=owner)

    @public
    @checked_annotations
    def __call__(self, init: PyTree, xs: PyTree = None) -> tuple[PyTree, PyTree]:
        with closing_bars():  # a failed run's bar is closed, not left open
            return _scan_jit(self, init, xs)

    @abc.abstractmethod
    def _scan(
        self, fn: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any, length: int
    ) -> tuple[Any, Any]:
        """`(carry, ys)` of the `length` steps of `fn` (this transform's `fn` as a plain
        function) from `init` over `xs`, traced."""


def _scan(transform: AbstractScan, init: Any, xs: Any) -> tuple[Any, Any]:
    length = scan_length(xs, transform.length, owner=transform._owner)

    def fn(carry, x):
        # A plain function: lax.scan hashes its `fn`, and a module holding traced
        # arrays cannot be hashed.
        return transform.fn(carry, x)

    return transform._scan(fn, init, xs, length)


_scan_jit = eqx.filter_jit(_scan)


@typechecked_constructor
class SlicedScan(AbstractScan):
    """`lax.scan` that keeps only the outputs of the steps in a slice.

    Use it when a long scan's stacked outputs `ys` would not fit in memory and only
    some of them are wanted: every `step`-th state of a simulation, the last few
    steps of a long rollout. The result equals `lax.scan(fn, init, xs)` followed by
    `ys[start:stop:step]` on every leaf of `ys`, but the outputs of the steps left
    out are never stored: the result is preallocated with one entry per kept step,
    and each kept output is written into it as soon as it is made. The carry still
    goes through every step.

    How the steps run depends on `xs`:

    - With `length` alone (`xs` None, or a pytree without arrays), the steps before
      the first kept one run in a loop that discards their outputs, then a loop
      over the kept steps runs each kept step followed by an inner loop over the
      discarded steps up to the next one, then a last loop runs the steps after the
      last kept one. Outputs of discarded steps are never even computed.
    - With `xs`, one `lax.scan` over `xs` runs every step and writes the output of
      each kept step into the result, dropping the others at once. `xs` is read in
      place (never sliced or copied), and its gradient is formed as `lax.scan`
      forms it; every step's output is computed, as in `lax.scan`.

    **Arguments:**

    - `fn`: the step function `fn(carry, x) -> (carry, y)`, as for `lax.scan`. It
      may be an Equinox module.
    - `start`, `stop`, `step`: the slice of the steps whose outputs are kept, with
      Python's meaning (negative values count from the end, None is the default,
      a negative `step` returns the kept outputs last step first). `step` may not
      be 0.
    - `length`: the number of steps, needed when `xs` is None; when `xs` is given it
      must equal the leading axis size of its leaves.
    - `reverse`: run the steps from the last index to the first, as
      `lax.scan(reverse=True)`. The slice is of `ys` as `lax.scan` returns them
      (indexed like `xs`), whatever the order in which the steps run.
    - `unroll`: a positive int or a bool, `lax.scan`'s `unroll`: an upper bound on
      the steps unrolled in each loop (a loop over kept steps unrolls `unroll //
      step` of them). It changes speed, never values.
    - `progress`: show a progress bar on stderr (rate, time left), updated from inside
      the compiled loop: with `xs`, one tick per step, of `length` steps; with
      `length` alone, one per kept step (each runs the discarded steps after it). Off
      by default, and then nothing is added to the compiled program.

    **Returns:**

    Calling `SlicedScan(fn, ...)(init, xs=None)` returns `(carry, ys)`: the final
    carry, and the outputs of the kept steps stacked along a leading axis.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def advance(x, _):
            x = x + 0.1 * jnp.sin(x)
            return x, x

        scan = zm.SlicedScan(advance, start=99, step=100, length=10_000)
        x, every_100th = scan(jnp.zeros(3))   # every_100th.shape == (100, 3)
        ```

    !!! tip

        Only the outputs are sliced: under `jax.grad` every step still stores its
        residuals. To bound those as well, wrap `fn` in `jax.checkpoint`, or use
        `zm.CheckpointedScan` when every output is wanted.
    """

    start: int | None = eqx.field(default=None, static=True, kw_only=True, converter=int_option)
    stop: int | None = eqx.field(default=None, static=True, kw_only=True, converter=int_option)
    step: int | None = eqx.field(default=None, static=True, kw_only=True, converter=int_option)

    @public
    def __check_init__(self):
        owner = self._owner
        for name in ("start", "stop", "step"):
            check_int(getattr(self, name), name, owner=owner, optional=True)
        if self.step == 0:
            raise ValueError(
                f"{owner}: `step` may not be 0, got step={self.step}; use a non-zero int "
                "(negative to keep the outputs last step first) or None."
            )

    def _scan(
        self, fn: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any, length: int
    ) -> tuple[Any, Any]:
        kept = range(*slice(self.start, self.stop, self.step).indices(length))
        # Traced once as `lax.scan` itself, for its checks of `fn` and the shape of `ys`.
        _, ys_shapes = jax.eval_shape(
            lambda init, xs: jax.lax.scan(fn, init, xs, length=length, reverse=self.reverse),
            init,
            xs,
        )
        if not kept:
            bar = progress_bar(label(self), length, unit="step")

            def discard(state, x):
                carry, count = state
                carry = fn(carry, x)[0]
                bar.done(count + 1, carry)
                return (carry, count + 1), None

            bar.start()
            (carry, _), _ = jax.lax.scan(
                discard,
                (init, jnp.asarray(0, jnp.int32)),
                xs,
                length=length,
                reverse=self.reverse,
                unroll=_inner_unroll(self.unroll, length),
            )
            ys = jax.tree_util.tree_map(lambda s: jnp.zeros((0, *s.shape[1:]), s.dtype), ys_shapes)
            return carry, ys
        if jax.tree_util.tree_leaves(xs):
            return _scan_keeping(self, fn, init, xs, length, kept, ys_shapes)
        return _scan_skipping(self, fn, init, xs, length, kept)


def _scan_keeping(
    transform: SlicedScan,
    fn: Callable,
    init: Any,
    xs: Any,
    length: int,
    kept: range,
    ys_shapes: Any,
) -> tuple[Any, Any]:
    """One scan over `xs` that writes the output of each kept step into its slot."""
    low, high = min(kept[0], kept[-1]), max(kept[0], kept[-1])
    stride = abs(kept.step)
    outputs = jax.tree_util.tree_map(
        lambda s: jnp.zeros((len(kept), *s.shape[1:]), s.dtype), ys_shapes
    )
    bar = progress_bar(label(transform), length, unit="step")

    def step(state, x):
        carry, index, outputs = state
        carry, y = fn(carry, x)
        is_kept = (index >= low) & (index <= high) & ((index - low) % stride == 0)
        slot = jnp.clip((index - kept[0]) // kept.step, 0, len(kept) - 1)

        def write(out, value):
            # A select, not a branch: every step has the same residuals under AD.
            return write_once(out, jnp.asarray(value)[None], slot, is_kept)

        outputs = jax.tree_util.tree_map(write, outputs, y)
        bar.done(length - index if transform.reverse else index + 1, (carry, outputs))
        return (carry, index + (-1 if transform.reverse else 1), outputs), None

    first = jnp.asarray(length - 1 if transform.reverse else 0, jnp.int32)
    bar.start()
    (carry, _, outputs), _ = jax.lax.scan(
        step,
        (init, first, outputs),
        xs,
        length=length,
        reverse=transform.reverse,
        unroll=_inner_unroll(transform.unroll, length),
    )
    return carry, outputs


def _scan_skipping(
    transform: SlicedScan, fn: Callable, init: Any, xs: Any, length: int, kept: range
) -> tuple[Any, Any]:
    """Steps without inputs: loops that never compute the outputs of discarded steps."""

    def skip(carry: Any, steps: int) -> Any:
        if not steps:
            return carry
        carry, _ = jax.lax.scan(
            lambda carry, _: (fn(carry, xs)[0], None),
            carry,
            None,
            length=steps,
            unroll=_inner_unroll(transform.unroll, steps),
        )
        return carry

    # Kept steps come every `stride` steps in the order they run, from `first` on.
    stride = abs(kept.step)
    order = (lambda index: length - 1 - index) if transform.reverse else (lambda index: index)
    first = min(order(kept[0]), order(kept[-1]))
    # Each block runs a kept step, then the discarded steps before the next kept
    # one; the last block stops at the end of the scan when fewer steps are left.
    span = min(len(kept) * stride, length - first)

    def kept_then_skipped(carry: Any, start: Any, size: int) -> tuple[Any, Any]:
        carry, y = fn(carry, xs)
        carry = skip(carry, size - 1)
        return carry, jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf)[None], y)

    carry, ys = scan_blocks(
        kept_then_skipped,
        plan_blocks(span, batch_size=stride, what="steps"),
        skip(init, first),
        reverse=transform.reverse,
        unroll=_outer_unroll(transform.unroll, stride),
        reverse_outputs=kept.step < 0,
        progress=label(transform),
    )
    return skip(carry, length - first - span), ys


@typechecked_constructor
class CheckpointedScan(AbstractScan):
    """`lax.scan` whose gradient stores one carry per chunk of steps.

    Reverse-mode differentiation of `lax.scan` stores the residuals of every step,
    so the memory of `jax.grad` through a long scan grows with its length. This
    transform runs the scan in chunks of `chunk_size` consecutive steps, each under
    `jax.checkpoint`: the forward pass keeps only the carry at the start of each
    chunk, and the backward pass recomputes one chunk at a time. The stored state is
    then about `length / chunk_size` carries plus one chunk's residuals, for about
    one extra forward pass of compute. Each chunk reads its inputs from `xs` where
    they lie, so `xs` is never sliced or copied as a whole. Values and gradients
    equal those of `lax.scan`.

    **Arguments:**

    - `fn`: the step function `fn(carry, x) -> (carry, y)`, as for `lax.scan`. It
      may be an Equinox module.
    - `chunk_size`: the number of steps per checkpointed chunk, a positive int. When
      it does not divide the number of steps, the last chunk is shorter. None (the
      default) means the ceiling of the square root of the number of steps, which
      makes the two terms above about equal.
    - `length`: the number of steps, needed when `xs` is None; when `xs` is given it
      must equal the leading axis size of its leaves.
    - `reverse`: run the steps from the last index to the first, as
      `lax.scan(reverse=True)`.
    - `unroll`: a positive int or a bool, `lax.scan`'s `unroll`: an upper bound on
      the steps unrolled in each chunk's loop.
    - `progress`: show a progress bar on stderr (chunks done of the total, rate, time
      left), updated from inside the compiled loop after each chunk. It follows the
      forward pass: the backward pass under `jax.grad` runs without one. Off by
      default, and then nothing is added to the compiled program.

    **Returns:**

    Calling `CheckpointedScan(fn, ...)(init, xs=None)` returns `(carry, ys)`, equal
    to `lax.scan(fn, init, xs)`.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import zodmem as zm

        def step(x, w):
            x = jnp.tanh(w * x)
            return x, None

        def loss(x0, ws):
            x, _ = zm.CheckpointedScan(step, chunk_size=32)(x0, ws)
            return jnp.sum(x**2)

        grad = jax.grad(loss)(jnp.ones(8), jnp.linspace(0.5, 1.5, 1024))
        ```

    !!! tip

        A `chunk_size` of at least the number of steps puts one checkpoint around
        the whole scan, which lowers nothing at the peak: the backward pass then
        recomputes every step and holds all their residuals at once. The stored
        state is smallest for chunk sizes near the default.
    """

    chunk_size: int | None = eqx.field(
        default=None, static=True, kw_only=True, converter=int_option
    )

    @public
    def __check_init__(self):
        check_int(self.chunk_size, "chunk_size", owner=self._owner, minimum=1, optional=True)

    def _scan(
        self, fn: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any, length: int
    ) -> tuple[Any, Any]:
        if length == 0:
            return jax.lax.scan(fn, init, xs, length=0, reverse=self.reverse)
        chunk_size = default_chunk_size(length) if self.chunk_size is None else self.chunk_size
        plan = plan_blocks(length, batch_size=chunk_size, what="steps")

        def checkpointed_chunk(carry: Any, start: Any, size: int) -> tuple[Any, Any]:
            def chunk(carry, start):
                # The chunk's inputs, read from `xs` where they lie: no slice of `xs` is
                # made outside the loop, and its gradient is assembled chunk by chunk.
                part = jax.tree_util.tree_map(
                    lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), xs
                )
                unroll = _inner_unroll(self.unroll, size)
                return jax.lax.scan(
                    fn, carry, part, length=size, reverse=self.reverse, unroll=unroll
                )

            return jax.checkpoint(chunk)(carry, start)

        return scan_blocks(
            checkpointed_chunk,
            plan,
            init,
            reverse=self.reverse,
            unroll=_outer_unroll(self.unroll, plan.block_size),
            progress=label(self),
        )
