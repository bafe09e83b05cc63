"""`powerpax` 0.2.1, on zodmem's transforms.

The functions here take the same arguments, return the same results (values and
dtypes) and raise the same exception types as their `powerpax` namesakes, so a
powerpax user changes only the import::

    from zodmem.compat.powerpax import chunked_vmap   # was: from powerpax import chunked_vmap

As in powerpax, `chunked_vmap` maps every argument over its leading axis. For
`in_axes` and `out_axes`, use `zm.ChunkedVmap`, which this module is a thin layer
over. What differs, deliberately: the remainder chunk is computed by moving the
last chunk back to overlap the one before it, and every chunk is written straight
into the preallocated results, with no stacking or concatenation of chunks.

`sliced_scan` and `checkpoint_chunked_scan` are thin layers over `zm.SlicedScan`
and `zm.CheckpointedScan`; both write each chunk's outputs straight into the
preallocated `ys` as well. `Static` is `zm.Static` itself, so the two mix freely; as
powerpax documents, its value must be hashable, and here that is checked when the
`Static` is built.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, SupportsIndex, TypeVar

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._checks import check_callable, check_int, common_size
from .._static import Static
from .._transforms._scan import CheckpointedScan, SlicedScan, scan_length
from .._transforms._vmap import ChunkedVmap

__all__ = ["chunked_vmap", "sliced_scan", "checkpoint_chunked_scan", "Static"]

C = TypeVar("C", bound=Callable[..., Any])


def _check_leading_axes(args: tuple, kwargs: dict) -> None:
    """Every leaf is mapped over its leading axis: check that there is one, and that
    their sizes agree."""
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        where = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
        if jnp.ndim(leaf) < 1:
            raise ValueError(
                f"chunked_vmap: every argument is mapped over its leading axis, but {where} is "
                f"zero-dimensional: {leaf!r}. Pass it through functools.partial or a "
                "closure instead, or wrap it in Static."
            )
        sizes[where] = jnp.shape(leaf)[0]
    if common_size(sizes, owner="chunked_vmap", what="leading axes") is None:
        raise ValueError(
            "chunked_vmap: there must be at least one array argument to map over, but the "
            "arguments hold no arrays."
        )


def chunked_vmap(fun: C, chunk_size: SupportsIndex) -> C:
    """`jax.vmap(fun)`, computed at most `chunk_size` elements at a time.

    Every positional and keyword argument is mapped over its leading axis, and every
    output gets the mapped axis first. For other axes, see `zm.ChunkedVmap`.

    **Arguments:**

    - `fun`: the function to vectorise.
    - `chunk_size`: the most elements vectorised at once, a positive int (anything
      with `__index__`).

    **Returns:**

    A function with the arguments of `fun` that returns `jax.vmap(fun)`'s results.

    !!! example

        ```python
        import jax.numpy as jnp
        from zodmem.compat.powerpax import chunked_vmap

        chunked_vmap(jnp.sin, chunk_size=4)(jnp.arange(10.0))  # shape (10,)
        ```
    """
    check_callable(fun, "fun", owner="chunked_vmap")
    chunk_size = check_int(chunk_size, "chunk_size", owner="chunked_vmap")
    if chunk_size <= 0:
        # powerpax's own tests match this wording.
        raise ValueError(f"chunked_vmap: chunk_size must be positive, got chunk_size={chunk_size}.")

    @functools.wraps(fun)
    def vectorised(*args: Any, **kwargs: Any) -> Any:
        _check_leading_axes(args, kwargs)
        transform = ChunkedVmap(fun, chunk_size=chunk_size, in_axes=0, out_axes=0)
        return transform(*args, **kwargs)

    return vectorised  # type: ignore[return-value]


def _scan_steps(xs: Any, length: SupportsIndex | None, owner: str) -> int:
    """The number of steps, with powerpax's checks in powerpax's order: the leaves
    of `xs` first, then `length`, then whether the two agree."""
    if jax.tree_util.tree_leaves(xs):
        scan_length(xs, None, owner=owner)
    length = check_int(length, "length", owner=owner, minimum=0, optional=True)
    return scan_length(xs, length, owner=owner)


def _clip_unroll(unroll: SupportsIndex, steps: int) -> int:
    # powerpax takes any int and clips it into [1, steps] (1 for an empty scan).
    return max(min(operator.index(unroll), steps), 1)


def sliced_scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: PyTree,
    xs: PyTree,
    length: SupportsIndex | None = None,
    reverse: bool = False,
    unroll: SupportsIndex = 1,
    *,
    start: SupportsIndex | None = None,
    stop: SupportsIndex | None = None,
    step: SupportsIndex | None = None,
) -> tuple[Any, Any]:
    """`lax.scan(f, init, xs, length, reverse, unroll)` with `ys[start:stop:step]`
    on every leaf of `ys`, without ever storing the outputs left out.

    A thin layer over `zm.SlicedScan`, which holds the algorithm.

    **Arguments:**

    - `f`, `init`, `xs`, `length`, `reverse`: as for `lax.scan`. `length` (anything
      with `__index__`) must agree with the leading axis of the leaves of `xs`.
    - `unroll`: an int, clipped into `[1, number of steps]`.
    - `start`, `stop`, `step`: the slice of `ys` to keep, with Python's meaning
      (ints, anything with `__index__`, or None).

    **Returns:**

    `(carry, ys)`: the final carry and the kept outputs.

    !!! example

        ```python
        import jax.numpy as jnp
        from zodmem.compat.powerpax import sliced_scan

        def step(c, x):
            return c + x, c

        carry, ys = sliced_scan(step, 0.0, jnp.arange(100.0), start=9, step=10)
        # ys.shape == (10,)
        ```

    !!! note

        The results are always `lax.scan`'s, sliced. powerpax 0.2.1 itself goes wrong
        (wrongly shaped results, or an error) when `xs` is given and exactly one
        discarded step is left to run on its own before the first kept step, or,
        with `reverse=True`, after the last one: for example `start=1, step=3`.
    """
    steps = _scan_steps(xs, length, "sliced_scan")
    unroll = _clip_unroll(unroll, steps)
    start, stop, step = (
        check_int(value, name, owner="sliced_scan", optional=True)
        for name, value in (("start", start), ("stop", stop), ("step", step))
    )
    if step == 0:
        raise ValueError(
            "sliced_scan: step cannot be zero, got step=0; use 1 or None to keep every step."
        )
    transform = SlicedScan(
        f,
        start=start,
        stop=stop,
        step=step,
        length=steps,
        reverse=bool(reverse),
        unroll=unroll,
    )
    return transform(init, xs)


def checkpoint_chunked_scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: PyTree,
    xs: PyTree,
    length: SupportsIndex | None = None,
    reverse: bool = False,
    unroll: SupportsIndex = 1,
    *,
    chunk_size: SupportsIndex | None = None,
) -> tuple[Any, Any]:
    """`lax.scan(f, init, xs, length, reverse, unroll)` with a `jax.checkpoint`
    around every chunk of `chunk_size` steps.

    A thin layer over `zm.CheckpointedScan`, which holds the algorithm.

    **Arguments:**

    - `f`, `init`, `xs`, `length`, `reverse`: as for `lax.scan`.
    - `unroll`: an int, clipped into `[1, number of steps]`.
    - `chunk_size`: the steps per checkpointed chunk, a positive int (anything with
      `__index__`). None means one chunk holding every step, as in powerpax; note
      that `zm.CheckpointedScan` defaults to about the square root of the number of
      steps instead.

    **Returns:**

    `(carry, ys)`, equal to `lax.scan`'s.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        from zodmem.compat.powerpax import checkpoint_chunked_scan

        def step(c, w):
            return jnp.tanh(w * c), None

        def loss(ws):
            c, _ = checkpoint_chunked_scan(step, jnp.ones(4), ws, chunk_size=16)
            return jnp.sum(c)

        jax.grad(loss)(jnp.linspace(0.5, 1.5, 256))
        ```
    """
    steps = _scan_steps(xs, length, "checkpoint_chunked_scan")
    unroll = _clip_unroll(unroll, steps)
    chunk_size = check_int(
        chunk_size, "chunk_size", owner="checkpoint_chunked_scan", minimum=1, optional=True
    )
    # powerpax's None is one chunk of every step.
    chunk_size = max(1, steps) if chunk_size is None else chunk_size
    transform = CheckpointedScan(
        f, chunk_size=chunk_size, length=steps, reverse=bool(reverse), unroll=unroll
    )
    return transform(init, xs)
