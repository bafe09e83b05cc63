"""`optax.microbatching` 0.2.8, on zodmem's `Microbatcher`.

`microbatch`, `micro_vmap`, `micro_grad`, `reshape_batch_axis`, `Accumulator` and
`AccumulationType` take the same arguments and return the same results as
`optax.microbatching`, so a user of it changes only the import::

    from zodmem.compat.optax import microbatch   # was: from optax.microbatching import ...

The microbatches are the ones optax forms: microbatch `j` of a batch of `B`
examples in microbatches of `m` holds examples `j, j + B/m, j + 2B/m, ...`, and
`CONCAT` results come back in the order of the batch. The batch arguments are
reordered once (one copy, as optax's column-major reshape makes) so that these
microbatches are contiguous, and `zm.Microbatcher` runs the loop.

What differs, deliberately:

- accumulators may be this module's (`zodmem.compat.optax.AccumulationType`, the
  same as `zm.AccumulationType`; `zm.Accumulator`) or optax's own; `Accumulator`'s
  `aggregate` is optional (only `micro_vmap` needs it);
- `MEAN` and `RUNNING_MEAN` also accept complex results;
- a Python int `num_real_microbatches` above the number of microbatches is a
  `ValueError` (optax reads past the batch), and a traced one stops the loop by
  skipping microbatches, so the result stays reverse-mode differentiable;
- `reshape_batch_axis` takes a negative `axis` counted from the end, and leaves
  the placement of sharded arrays to XLA.
- integer arguments (`argnums`, `in_axes`, `batch_argnums`, `microbatch_size`) may
  be NumPy integers.

`micro_grad`'s per-example outputs are optax's own namedtuple when optax is
installed, so its results and optax's have one pytree structure.

Batch sizes that `microbatch_size` does not divide raise a `ValueError`, as in
optax; `zm.Microbatcher` is the transform that takes them.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._checks import as_index
from .._eager import one_program
from .._transforms._accumulate import aggregate_stacked
from .._transforms._microbatch import AccumulationType, Accumulator, Microbatcher

__all__ = [
    "microbatch",
    "micro_vmap",
    "micro_grad",
    "reshape_batch_axis",
    "Accumulator",
    "AccumulationType",
]

# What `micro_grad` returns beside the gradient, one entry per example. optax's own
# class where it is installed: pytrees of two namedtuple classes never map together.
try:
    from optax.microbatching._microbatching import IndividualOutputs
except ImportError:
    IndividualOutputs = collections.namedtuple("Aux", ["values", "metrics", "aux"])


def _as_tuple(value: Any) -> tuple:
    """An integer (a NumPy integer included) as a 1-tuple, a sequence as a tuple; the
    integers in it as Python ints."""
    if _is_int(value):
        return (as_index(value),)
    return tuple(as_index(item) for item in value)


def _is_int(value: Any) -> bool:
    index = as_index(value)
    return isinstance(index, int) and not isinstance(index, bool)


def reshape_batch_axis(tree: PyTree, microbatch_size: int, axis: int = 0) -> Any:
    """Split the batch axis of every leaf into `(num_microbatches, microbatch_size)`.

    Entry `[j, k]` of the two new axes (at `axis` and `axis + 1`) is example
    `j + k * num_microbatches`: row `j` is optax's microbatch `j`.
    """

    return jax.tree_util.tree_map(lambda x: _split_batch_axis(x, microbatch_size, axis), tree)


@one_program(static=("microbatch_size", "axis"))
def _split_batch_axis(x: Any, microbatch_size: int, axis: int) -> Any:
    x = jnp.asarray(x)
    ax = axis % x.ndim
    by_column = x.reshape(x.shape[:ax] + (microbatch_size, -1) + x.shape[ax + 1 :])
    return jnp.swapaxes(by_column, ax, ax + 1)


def _is_accumulator_leaf(node: Any) -> bool:
    return isinstance(node, (enum.Enum, Accumulator))


def _convert(accumulator: Any) -> Any:
    """Turn a pytree of optax's or this module's accumulators into zodmem's."""

    def convert(leaf):
        if isinstance(leaf, (AccumulationType, Accumulator)):
            return leaf
        if isinstance(leaf, enum.Enum) and leaf.name in AccumulationType.__members__:
            return AccumulationType[leaf.name]
        parts = ("init", "update", "finalize", "aggregate")
        if not isinstance(leaf, enum.Enum) and all(callable(getattr(leaf, p, None)) for p in parts):
            return Accumulator(*(getattr(leaf, p) for p in parts))
        raise ValueError(
            f"Unknown accumulator: {leaf!r}. Use an AccumulationType member or an Accumulator."
        )

    return jax.tree_util.tree_map(convert, accumulator, is_leaf=_is_accumulator_leaf)


# These run as one program each where called eagerly, rather than one per operation.
@one_program(static=("microbatch_size", "axis"))
def _in_strided_order(x: Any, microbatch_size: int, axis: int) -> Any:
    """Reorder the batch axis so that optax's microbatches are contiguous blocks."""
    x = jnp.asarray(x)
    return _split_batch_axis(x, microbatch_size, axis).reshape(x.shape)


@one_program(static=("num_microbatches",))
def _in_batch_order(x: Any, num_microbatches: int) -> Any:
    """Undo `_in_strided_order` on a concatenation of per-microbatch results."""
    rows = x.shape[0] // num_microbatches
    blocks = x.reshape((num_microbatches, rows) + x.shape[1:])
    return jnp.swapaxes(blocks, 0, 1).reshape(x.shape)


def microbatch(
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    microbatch_size: int | None,
    accumulator: PyTree = AccumulationType.SUM,
    *,
    argnames: str | Sequence[str] = (),
    in_axes: int | Sequence[int] = 0,
    num_real_microbatches: int | jax.Array | None = None,
) -> Callable[..., Any]:
    """`fun` evaluated on microbatches of its batch arguments, results accumulated.

    As `optax.microbatching.microbatch`: `argnums`/`argnames` name the batch
    arguments, `in_axes` their batch axes (one int, or one per argument, argnums
    first), `microbatch_size` must divide the batch size (`None` returns `fun`),
    `accumulator` is an `AccumulationType`, an `Accumulator` or a pytree prefix of
    the output of these, and `num_real_microbatches` stops after that many.

    !!! example

        ```python
        import jax.numpy as jnp
        from zodmem.compat.optax import AccumulationType, microbatch

        fn = lambda x: (x + 1, jnp.sum(3 * x))
        both = (AccumulationType.CONCAT, AccumulationType.SUM)
        microbatch(fn, argnums=0, microbatch_size=2, accumulator=both)(jnp.arange(4))
        # (Array([1, 2, 3, 4], dtype=int32), Array(18, dtype=int32))
        ```
    """
    if microbatch_size is None:
        return fun
    microbatch_size = as_index(microbatch_size)
    argnums = _as_tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    count = len(argnums) + len(argnames)
    in_axes = _as_tuple(in_axes) * count if _is_int(in_axes) else _as_tuple(in_axes)

    def microbatched(*args, **kwargs):
        batch = [args[i] for i in argnums] + [kwargs[name] for name in argnames]
        sizes = [
            size
            for value, axis in zip(batch, in_axes, strict=True)
            for size in jax.tree_util.tree_leaves(
                jax.tree_util.tree_map(lambda x, axis=axis: x.shape[axis], value)
            )
        ]
        if len(set(sizes)) > 1:
            raise ValueError(f"The batch arguments must have equal-size batch axes, found {sizes}.")
        batch_size = sizes[0]
        if batch_size % microbatch_size != 0:
            raise ValueError(
                f"batch_size={batch_size} must be divisible by microbatch_size={microbatch_size}."
            )
        num_microbatches = batch_size // microbatch_size
        accumulators = _convert(accumulator)

        def reorder(value, axis):
            return jax.tree_util.tree_map(
                lambda x: _in_strided_order(x, microbatch_size, axis), value
            )

        new_args, new_kwargs = list(args), dict(kwargs)
        for i, axis in zip(argnums, in_axes[: len(argnums)], strict=True):
            new_args[i] = reorder(args[i], axis)
        for name, axis in zip(argnames, in_axes[len(argnums) :], strict=True):
            new_kwargs[name] = reorder(kwargs[name], axis)

        transform = Microbatcher(
            fun,
            microbatch_size=microbatch_size,
            argnums=argnums,
            argnames=argnames,
            in_axes=in_axes,
            accumulator=accumulators,
            num_real_microbatches=num_real_microbatches,
        )
        result = transform(*new_args, **new_kwargs)

        def restore(kind, part):
            if kind is not AccumulationType.CONCAT:
                return part
            return jax.tree_util.tree_map(lambda x: _in_batch_order(x, num_microbatches), part)

        return jax.tree_util.tree_map(restore, accumulators, result, is_leaf=_is_accumulator_leaf)

    return microbatched


def micro_vmap(
    fun: Callable[..., Any],
    in_axes: int | Sequence[int | None] = 0,
    out_axes: PyTree[int | None] = 0,
    *,
    microbatch_size: int | None = None,
    vmap_fn: Callable[..., Any] = jax.vmap,
    accumulator: PyTree = AccumulationType.CONCAT,
    num_real_microbatches: int | jax.Array | None = None,
) -> Callable[..., Any]:
    """`vmap_fn(fun, in_axes)` in microbatches, results combined by `accumulator`.

    As `optax.microbatching.micro_vmap`: `CONCAT` gives what `jax.vmap` gives; `SUM`,
    `MEAN` (or an `Accumulator` with `aggregate`) reduce over the batch axis instead.
    Keyword arguments are mapped over axis 0. `out_axes` must be 0.
    """
    if out_axes != 0:
        raise NotImplementedError(
            f"micro_vmap supports out_axes=0 only, got out_axes={out_axes!r}."
        )
    in_axes = _as_tuple(in_axes)

    def mapped_and_reduced(*args, kwargs):
        outputs = vmap_fn(fun, in_axes, out_axes)(*args, **kwargs)
        return aggregate_stacked(_convert(accumulator), outputs)

    mapped = microbatch(
        mapped_and_reduced,
        argnums=tuple(i for i, axis in enumerate(in_axes) if axis is not None),
        microbatch_size=microbatch_size,
        accumulator=accumulator,
        argnames="kwargs",
        in_axes=tuple(axis for axis in in_axes if axis is not None) + (0,),
        num_real_microbatches=num_real_microbatches,
    )

    def vmapped(*args, **kwargs):
        return mapped(*args, kwargs=kwargs)

    return vmapped


def micro_grad(
    fun: Callable[..., Any],
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    *,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    microbatch_size: int | None = None,
    accumulator: PyTree = AccumulationType.SUM,
    transform_fn: Callable[[Any], Any] = lambda x: x,
    metrics_fn: Callable[[Any], Any] = lambda x: None,
    num_real_microbatches: int | jax.Array | None = None,
) -> Callable[..., Any]:
    """Per-example gradients of `fun`, transformed and accumulated in microbatches.

    As `optax.microbatching.micro_grad`: returns a function giving
    `(accumulated transform_fn(grad), IndividualOutputs(values, metrics, aux))`,
    the second part with one entry per example. `batch_argnums` are the arguments
    with a batch axis (axis 0); with `keep_batch_dim`, `fun` sees each example as a
    batch of one.

    !!! example

        ```python
        import jax.numpy as jnp
        from zodmem.compat.optax import AccumulationType, micro_grad

        def loss(w, x, y):
            return 0.5 * jnp.mean((x @ w - y) ** 2)

        w, x, y = jnp.zeros(1), jnp.ones((4, 1)), jnp.array([0.0, 2.0, 4.0, 6.0])
        grad_fn = micro_grad(
            loss, batch_argnums=(1, 2), microbatch_size=2, accumulator=AccumulationType.MEAN
        )
        grad, per_example = grad_fn(w, x, y)
        grad, per_example.values  # [-3.] and [0., 2., 8., 18.]
        ```
    """
    batch_argnums = _as_tuple(batch_argnums)
    with_aux = fun if has_aux else (lambda *args, **kwargs: (fun(*args, **kwargs), None))
    value_and_grad = jax.value_and_grad(with_aux, argnums, has_aux=True)

    def per_example(*args, **kwargs):
        (value, aux), grad = value_and_grad(*args, **kwargs)
        return transform_fn(grad), IndividualOutputs(value, metrics_fn(grad), aux)

    in_axes: list[int | None] = [None] * (max(batch_argnums) + 1)
    for i in batch_argnums:
        in_axes[i] = 0
    mapped = micro_vmap(
        per_example,
        in_axes=in_axes,
        accumulator=(accumulator, AccumulationType.CONCAT),
        microbatch_size=microbatch_size,
        num_real_microbatches=num_real_microbatches,
    )
    if not keep_batch_dim:
        return mapped

    def with_batch_of_one(*args, **kwargs):
        args = list(args)
        for i in batch_argnums:
            args[i] = jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 1), args[i])
        return mapped(*args, **kwargs)

    return with_batch_of_one
