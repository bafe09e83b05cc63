"""Progress bars for the block engine's loops, drawn on the host from inside compiled code.

A loop that shows progress makes a `Progress` when it is traced. It stages two kinds of
host callback (`jax.debug.callback`) into the compiled program:

- `start()`, before the loop: opens a fresh bar (`tqdm`, on stderr) every time the
  compiled program runs, closing one that a failed run left open;
- `done(count, after)`, after each block: moves the bar to `count` blocks done, and
  closes it at the total. `after` is what the block wrote (its outputs, its carry): the
  callback reads one element of it, so that it runs once the block is computed rather
  than wherever the compiler schedules an independent call.

So a bar follows each run of a cached program, and one bar is shown per loop and per
run: the callbacks take only the loop counter and that element, which `jax.vmap` never
maps (its batching rule hands the whole batched element to one callback), so a vmapped loop
shows one bar for all its lanes, never one per lane. No `lax.cond` guards a callback
(under `vmap` a `cond` with a mapped predicate runs both branches): the host decides
what each call means. With progress off, `progress_bar` returns `NO_PROGRESS`, which
stages nothing.

A run that fails (an error in a block, a `KeyboardInterrupt`) stages no further call,
so its bars would stay open, drawn above every later one. The host code that waits on
a run wraps it in `closing_bars()`, which closes the bars opened inside when it ends
with an exception, and has later updates of those bars (from a computation that goes
on after the interrupted caller left) ignored until their loop opens again.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from tqdm import tqdm

__all__ = ["Progress", "NO_PROGRESS", "progress_bar", "label", "closing_bars"]

# The bars open now, by loop; callbacks may come from the runtime's threads.
_BARS: dict[int, tqdm] = {}
_LOCK = threading.Lock()
_KEYS = itertools.count()
# When each open bar was opened, in the order of `_OPENINGS`; and the loops whose bars
# a failed run left, whose updates are dropped until the loop opens a bar again.
_OPENINGS = itertools.count()
_OPENED_AT: dict[int, int] = {}
_ABANDONED: set[int] = set()


@contextlib.contextmanager
def closing_bars() -> Any:
    """Close the bars opened inside this context if it ends with an exception: the run
    that drew them failed, and will never bring them to their total."""
    with _LOCK:
        since = next(_OPENINGS)
    try:
        yield
    except BaseException:
        with _LOCK:
            for key in [k for k, opened in _OPENED_AT.items() if opened > since]:
                _ABANDONED.add(key)
                _close(key)
        raise


def _close(key: int) -> None:
    """Close the open bar of loop `key` (with `_LOCK` held)."""
    del _OPENED_AT[key]
    _BARS.pop(key).close()


def _first_device() -> Any:
    """Whether this device draws the bars: inside a `shard_map` every device runs the same
    loop, and the first along the mapped mesh axes (traced) draws it; elsewhere, `True`."""
    manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    return jax.lax.axis_index(manual) == 0 if manual else True


def label(transform: Any) -> str | None:
    """The label of a transform's bars (its class name), or `None` with progress off."""
    return type(transform).__name__ if transform.progress else None


class Progress:
    """The bar of one loop of `total` blocks (or steps: `unit`), labelled `label`."""

    def __init__(self, label: str, total: int, unit: str = "block"):
        self.key = next(_KEYS)
        self.label = label
        self.total = total
        self.unit = unit
        self._report = _reporter(self._done)
        self._drawn = jnp.asarray(_first_device())

    def start(self) -> None:
        """Stage the opening of the bar (traced, before the loop)."""
        jax.debug.callback(lambda drawn: self._open() if drawn else None, self._drawn)

    def done(self, count: Any, after: Any) -> None:
        """Stage the update to `count` blocks done (traced), once `after` is computed."""
        self._report(jnp.asarray(count, jnp.int32), _witness(after), self._drawn)

    def _new_bar(self) -> tqdm:
        """A bar for this loop, now open (with `_LOCK` held)."""
        _OPENED_AT[self.key] = next(_OPENINGS)
        bar = _BARS[self.key] = tqdm(total=self.total, desc=self.label, unit=self.unit, leave=None)
        return bar

    def _open(self) -> None:
        with _LOCK:
            _ABANDONED.discard(self.key)
            if self.key in _BARS:
                _close(self.key)  # left open by a run that failed before its last block
            self._new_bar()

    def _done(self, count: Any) -> None:
        # An array (possibly with a lane axis, should the counter ever be mapped).
        count = int(np.max(np.asarray(count)))
        with _LOCK:
            if self.key in _ABANDONED:
                return  # the rest of a run whose caller has given up on it
            bar = _BARS.get(self.key)
            if bar is None:
                if count >= self.total:
                    return  # a repeat of the last update, after the bar was closed
                # The opening did not run: a pass that recomputes the loop (checkpoint).
                bar = self._new_bar()
            if count > bar.n:
                bar.update(count - bar.n)
            if count >= self.total:
                _close(self.key)


class _NoProgress:
    """A loop without a bar: stages nothing."""

    def start(self) -> None:
        pass

    def done(self, count: Any, after: Any) -> None:
        pass


NO_PROGRESS = _NoProgress()


def progress_bar(label: str | None, total: int, unit: str = "block") -> Progress | _NoProgress:
    """A `Progress` for a loop of `total` blocks, or `NO_PROGRESS` when `label` is None."""
    return NO_PROGRESS if label is None else Progress(label, total, unit)


def _witness(tree: Any) -> Any:
    """One element of the first non-empty numeric array of `tree` (an empty array if
    there is none), without a derivative: the value a callback waits for."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and leaf.size and _is_numeric(leaf.dtype):
            return jax.lax.stop_gradient(jnp.ravel(leaf)[:1])
    return jnp.zeros((0,), jnp.int32)


def _is_numeric(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)


def _reporter(callback: Any) -> Any:
    """`report(count, witness)`, staging `callback(count)` once `witness` is computed."""

    @custom_vmap
    def report(count: Any, witness: Any, drawn: Any) -> Any:
        def on_host(count, _, drawn):
            if np.all(drawn):
                callback(count)

        jax.debug.callback(on_host, count, witness, drawn)
        return count

    @report.def_vmap
    def report_vmap(axis_size, in_batched, count, witness, drawn):
        # The whole batch at once: one callback for all the lanes, after all of them.
        return report(count, witness, drawn), in_batched[0]

    return report
