"""`Microbatcher`: a function of a batch, evaluated a microbatch at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Int, PyTree

from .._checks import (
    check_bool,
    check_callable,
    checked_annotations,
    int_option,
    memory_option,
    typechecked_constructor,
)
from .._engine._sharding import Split
from .._operators._block_diagonal import BlockDiagonal
from .._operators._operator import BlockedOperator, flat_product, make_operator
from .._operators._options import OperatorSource, TransformOptions, options_of
from .._plan._memory import check_size_or_memory
from .._plan._plans import Work
from .._pytree import split_variables
from .._traceback import public
from ._accumulate import (
    AccumulationType,
    Accumulator,
    check_accumulator,
    is_accumulator_leaf,
    resolve,
)
from ._base import AbstractBlocked, in_shares
from ._derivative import AbstractDerivative
from ._microbatch_checks import (
    as_count,
    as_indices,
    as_tuple,
    check_argnames,
    check_argnums,
    check_in_axes,
    check_num_real_microbatches,
    common_batch_size,
)
from ._microbatch_run import (
    batch_of,
    batch_specs,
    batch_split_of,
    reduce_share,
    split_of_batch,
)

__all__ = ["Microbatcher", "Accumulator", "AccumulationType"]


@typechecked_constructor
class Microbatcher(AbstractBlocked, OperatorSource):
    """`fn` evaluated on microbatches of its batch arguments, one after another.

    Use it where a function of a whole batch (a loss, its gradient, a Hessian, a
    forward pass) does not fit in memory: the batch arguments are cut along their
    batch axis into microbatches of `microbatch_size` examples, `fn` is evaluated
    on each in a sequential loop, and the results are combined by an accumulator.
    Peak memory is that of `fn` on one microbatch, plus the accumulated result.

    **Arguments:**

    - `fn`: the function, called as `fn(*args, **kwargs)` with microbatches in place
      of the batch arguments. It returns a pytree of arrays. It may be an Equinox
      module (or another zodmem transform).
    - `microbatch_size`: the number of examples per microbatch, a positive int. A
      size above the batch size means one microbatch. (Here and in `argnums`,
      `in_axes` and `num_real_microbatches`, NumPy integers count as ints.)
    - `max_memory`: instead of `microbatch_size`, a budget for the call's memory: an
      int (bytes), a string with a unit (`"500MB"`, `"2GiB"`) or `"auto"`. The
      microbatch size is then planned, before anything runs, as the fastest whose
      compiled call fits. Give exactly one of `microbatch_size` and `max_memory`.
    - `argnums`: the positional arguments that carry a batch axis, an int or a
      sequence of ints.
    - `argnames`: the keyword arguments that carry a batch axis, a string or a
      sequence of strings.
    - `in_axes`: the batch axis, an int for every batch argument or a sequence of
      ints, one per entry of `argnums` followed by one per entry of `argnames`. It
      applies to every array leaf of that argument; negative values count from the
      end.
    - `accumulator`: how the results of the microbatches are combined: `"sum"`,
      `"mean"`, `"running_mean"`, `"concat"` (or the `zm.AccumulationType`
      members), a `zm.Accumulator`, or a pytree of these that is a prefix of the
      output of `fn`, to combine each part of the output its own way.
    - `num_real_microbatches`: optionally the number of microbatches to evaluate,
      counted from the first: an int or an integer scalar array, which may be
      traced (so one compiled function serves batches padded to a common size).
      The other microbatches are not evaluated and do not contribute. It counts
      microbatches of `microbatch_size`, so it is refused with `max_memory`.
    - `progress`: show a progress bar on stderr (microbatches done of the total, rate,
      time left), updated from inside the compiled loop after each microbatch;
      microbatches skipped by `num_real_microbatches` count as done when passed. Off by
      default, and then nothing is added to the compiled program.

    **Sharded batches:** a batch sharded along its batch axis over a mesh is reduced
    where it lies: each device reduces its own part in microbatches, and the parts are
    combined once, by one all-reduce for `"sum"`, `"mean"` and `"running_mean"`, while
    `"concat"` leaves each device's rows where they are (the result is sharded along
    axis 0). That needs built-in accumulators, every microbatch evaluated and a
    microbatch size that divides each device's part, so that every device's
    microbatches are microbatches of the whole batch; otherwise every device reduces
    the whole batch in order, as one device would. Either way the result is the one
    device's, whatever `fn` is (a mean or a maximum per microbatch included). Batch
    arguments placed differently (one split along the batch, another replicated) are
    all split as the first split one is.

    **Returns:**

    Calling `Microbatcher(fn, ...)(*args, **kwargs)` returns the combined result:
    for `"sum"` the sum of the results, for `"mean"` their mean weighted by
    microbatch size, for `"running_mean"` the same over the evaluated microbatches
    only, for `"concat"` the results concatenated along axis 0 (a scalar result
    gives one entry per microbatch), for an `Accumulator` what its `finalize`
    returns.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import zodmem as zm

        def loss(w, x, y):
            return jnp.mean((x @ w - y) ** 2)

        w, x, y = jnp.ones(3), jnp.ones((10, 3)), jnp.arange(10.0)
        grad = zm.Microbatcher(
            jax.grad(loss), microbatch_size=4, argnums=(1, 2), accumulator="mean"
        )
        grad(w, x, y)  # equals jax.grad(loss)(w, x, y), in microbatches of 4, 4, 2
        ```

    !!! note

        The microbatch size need not divide the batch size: the examples left over
        form a last, smaller microbatch, evaluated by a second call of `fn` at that
        size (no padding). `"sum"` and `"concat"` then give exactly the sum and the
        concatenation over the whole batch, and `"mean"` and `"running_mean"` weight
        each microbatch by its number of examples, so that when `fn` returns a mean
        over its examples the result is the mean over the whole batch. `"sum"`,
        `"mean"` and `"running_mean"` need results of one shape for every
        microbatch. `num_real_microbatches` counts the smaller microbatch as one
        microbatch, the last. `"mean"` divides by the whole batch size even when
        `num_real_microbatches` stops early (microbatches not evaluated count as
        zeros); `"running_mean"` averages over the examples evaluated.

    !!! tip

        `num_real_microbatches` is a field of the module, not static configuration,
        since it may be a traced value. A traced value is taken as given (values
        past the number of microbatches run them all), a Python int above the
        number of microbatches is refused.
    """

    fn: Callable[..., Any]
    microbatch_size: int | None = eqx.field(
        default=None, static=True, kw_only=True, converter=int_option
    )
    max_memory: int | str | None = eqx.field(
        default=None, static=True, kw_only=True, converter=memory_option
    )
    argnums: int | Sequence[int] = eqx.field(
        default=0, static=True, kw_only=True, converter=as_indices
    )
    argnames: str | Sequence[str] = eqx.field(
        default=(), static=True, kw_only=True, converter=as_tuple
    )
    in_axes: int | Sequence[int] = eqx.field(
        default=0, static=True, kw_only=True, converter=as_indices
    )
    accumulator: PyTree[str | AccumulationType | Accumulator] = eqx.field(
        default="sum", static=True, kw_only=True
    )
    num_real_microbatches: Int[ArrayLike, ""] | None = eqx.field(
        default=None, kw_only=True, converter=as_count
    )
    progress: bool = eqx.field(default=False, static=True, kw_only=True)

    # A reduction: its result is not made in blocks, for zm.to_host or zm.to_file.
    result_in_blocks: ClassVar[bool] = False

    @public
    def __check_init__(self):
        check_callable(self.fn, "fn", owner=self._owner)
        check_size_or_memory(self, "microbatch_size", "the examples per microbatch", "microbatches")
        check_argnums(self.argnums, owner=self._owner)
        check_argnames(self.argnames, owner=self._owner)
        if not self.batch_argnums and not self.batch_argnames:
            raise ValueError(
                f"{self._owner}: there must be at least one batch argument, but argnums="
                f"{self.argnums!r} and argnames={self.argnames!r} are both empty."
            )
        count = len(self.batch_argnums) + len(self.batch_argnames)
        check_in_axes(self.in_axes, count, owner=self._owner)
        check_accumulator(self.accumulator, owner=self._owner)
        check_num_real_microbatches(self.num_real_microbatches, owner=self._owner)
        if self.max_memory is not None and self.num_real_microbatches is not None:
            real = self.num_real_microbatches
            shown = real if isinstance(real, int) else "(an array)"
            raise ValueError(
                f"{self._owner}: num_real_microbatches={shown} counts microbatches of a size that "
                f"max_memory={self.max_memory!r} would choose, so the examples evaluated would "
                "change with the budget. To evaluate only the first examples of a batch, "
                "give `microbatch_size` with `num_real_microbatches` (and no max_memory)."
            )
        check_bool(self.progress, "progress", owner=self._owner)

    @property
    def batch_argnums(self) -> tuple[int, ...]:
        """`argnums` as a tuple."""
        return self.argnums if isinstance(self.argnums, tuple) else (self.argnums,)

    @property
    def batch_argnames(self) -> tuple[str, ...]:
        """`argnames` as a tuple."""
        return (self.argnames,) if isinstance(self.argnames, str) else tuple(self.argnames)

    @property
    def batch_in_axes(self) -> tuple[int, ...]:
        """`in_axes` as a tuple, one per batch argument (`argnums`, then `argnames`)."""
        count = len(self.batch_argnums) + len(self.batch_argnames)
        return self.in_axes if isinstance(self.in_axes, tuple) else (self.in_axes,) * count

    @public
    @checked_annotations
    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        return super().__call__(*args, **kwargs)

    def split(self, *args: Any, **kwargs: Any) -> Split | None:
        return split_of_batch(self, batch_of(self, args, kwargs))

    def specs(self, split: Split, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return batch_specs(self, split, args, kwargs)

    def compute_share(
        self, sink: Any, share: Any, split: Split | None, *args: Any, **kwargs: Any
    ) -> Any:
        # A reduction, not made in blocks: nothing goes to a sink (there is none: the
        # streamed calls refuse a Microbatcher).
        return reduce_share(self, split, args, kwargs)

    def work(self, *args: Any, **kwargs: Any) -> Work:
        batch = batch_of(self, args, kwargs)
        total = common_batch_size(batch, owner=self._owner)
        size = total if self.microbatch_size is None else min(self.microbatch_size, total)
        split = batch_split_of(batch, planned=True)
        return Work(total, "examples", "result", size).per_device(split)

    def with_block_size(self, size: int, strategy: str | None) -> Microbatcher:
        return dataclasses.replace(self, microbatch_size=size, max_memory=None)

    @public
    def _operator_options(self) -> TransformOptions:
        wrapped = options_of(self.fn)
        # Its own options cut the batch, not the vectors: the blocks of products are
        # those of the derivative it wraps (none for another Microbatcher).
        blocks = wrapped if isinstance(self.fn, AbstractDerivative) else TransformOptions()
        return blocks._replace(
            has_aux=wrapped.has_aux,
            jit=True,
            strategy=None,
            sharding=None,
            progress=self.progress,
        )

    def _unblocked(self) -> Microbatcher:
        return dataclasses.replace(self, max_memory=None, progress=False)

    def operator(self, *args: Any, **kwargs: Any) -> BlockedOperator | BlockDiagonal:
        """The summed or mean matrix of `fn` over the batch, as a `lineax` linear
        operator: each product runs over the microbatches one after another, so it
        takes one microbatch's memory, never the whole batch's.

        Use it around a transform that has an operator (`zm.BatchedHessian`,
        `zm.BatchedJacobian`), for a curvature of a dataset loss that is only multiplied
        by vectors: `Microbatcher(BatchedHessian(loss), microbatch_size=m, argnums=(1, 2),
        accumulator="mean").operator(w, xs, ys)` multiplies by the Hessian of the mean
        loss. Its products (`mv`, `mm`) and tags are those of `fn`'s operator; `mm`
        cuts the vectors into blocks as `fn`'s options say (`nbatches`, `batch_size`,
        `max_memory`) and takes each block through the microbatches once; `as_matrix()`
        is this transform's call. Around a transform of blocks per leaf
        (`blocks="leaf"`), it is a `zm.BlockDiagonal` of the blocks summed or averaged
        over the microbatches, made once: the blocks of the whole batch's matrix.

        **Arguments:** as for the call; the first positional argument is the point `x`,
        which may not be a batch argument. The accumulator must be `"sum"`, `"mean"` or
        `"running_mean"`, and the microbatch size given (`microbatch_size`).

        **Returns:**

        A `lineax.AbstractLinearOperator`, the one of `fn` summed or averaged over
        the batch.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            def loss(w, x, y):
                return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

            w, x, y = jnp.full(3, 0.1), jnp.ones((10, 3)), jnp.arange(10.0)
            hessian = zm.Microbatcher(
                zm.BatchedHessian(loss), microbatch_size=4, argnums=(1, 2), accumulator="mean"
            )
            op = hessian.operator(w, x, y)   # the Hessian of the mean loss over 10 examples
            op.mv(jnp.ones(3))               # one product, in microbatches of 4, 4 and 2
            ```
        """
        if not args:
            raise TypeError(
                f"{self._owner}.operator: give the point `x` as the first positional argument "
                "(the variables of the operator), then the arguments of `fn`."
            )
        x, rest = args[0], args[1:]
        inner = _inner_operator(self, x, rest, kwargs)
        if isinstance(inner, BlockDiagonal):
            return _leaf_blocks_operator(self, x, rest, kwargs, inner)
        return make_operator(
            self, _microbatch_products, x, rest, kwargs, square=inner.square, tags=inner.tags
        )


# ----------------------------------------------------------------------------------
# Operators: `fn`'s operator summed or averaged over the microbatches


def _inner_operator(transform: Microbatcher, x: Any, args: tuple, kwargs: dict) -> Any:
    """`fn`'s operator at the whole batch, for its shapes and tags, after the checks."""
    owner = f"{transform._owner}.operator"
    if not callable(getattr(transform.fn, "operator", None)):
        raise TypeError(
            f"{owner}: `fn` must have an operator (a zm.BatchedHessian or "
            f"zm.BatchedJacobian, say), but it is {type(transform.fn).__name__}, which has "
            "no `operator` method."
        )
    if 0 in transform.batch_argnums:
        raise ValueError(
            f"{owner}: argnums={transform.argnums!r} makes the first argument, the point "
            "`x` whose variables the operator acts on, a batch argument; the batch "
            "arguments are the data that follow it, e.g. argnums=(1, 2)."
        )
    if transform.microbatch_size is None:
        raise ValueError(
            f"{owner}: give `microbatch_size`: max_memory={transform.max_memory!r} plans "
            "the microbatches of the call, whose memory differs from a product's."
        )
    kinds = jax.tree_util.tree_leaves(transform.accumulator, is_leaf=is_accumulator_leaf)
    allowed = (AccumulationType.SUM, AccumulationType.MEAN, AccumulationType.RUNNING_MEAN)
    if not all(resolve(kind, owner=owner) in allowed for kind in kinds):
        raise ValueError(
            f"{owner}: accumulator={transform.accumulator!r} does not combine the "
            "microbatches' matrices into one; use 'sum', 'mean' or 'running_mean'."
        )
    # At one microbatch's shapes, placed nowhere: as each microbatch will be seen.
    call_args, call_kwargs = [x, *args], dict(kwargs)
    size = min(
        transform.microbatch_size,
        common_batch_size(batch_of(transform, (x, *args), kwargs), owner=owner),
    )
    positions = [*transform.batch_argnums, *transform.batch_argnames]
    for position, axis in zip(positions, transform.batch_in_axes, strict=True):
        holder = call_args if isinstance(position, int) else call_kwargs

        def shrink(leaf, axis=axis):
            shape = list(jnp.shape(leaf))
            shape[axis % len(shape)] = size
            return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

        holder[position] = jax.tree_util.tree_map(shrink, holder[position])

    def inner(x, args, kwargs):
        return transform.fn.operator(x, *args, **kwargs)

    return eqx.filter_eval_shape(inner, call_args[0], tuple(call_args[1:]), call_kwargs)


class _ProductAt(eqx.Module):
    """`fn`'s operator at a microbatch, times `vector`: the function reduced over the
    microbatches for one product."""

    inner: Any
    vector: Any

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return flat_product(self.inner.operator(x, *args, **kwargs), self.vector)


class _BlocksOf(eqx.Module):
    """`fn`'s blocks per leaf at a microbatch, its aux left out: what the accumulator
    sums or averages over the microbatches."""

    inner: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        blocks = self.inner(*args, **kwargs)
        return blocks[0] if self.inner.has_aux else blocks


def _leaf_blocks_operator(
    transform: Microbatcher, x: Any, args: tuple, kwargs: dict, inner: BlockDiagonal
) -> BlockDiagonal:
    """The operator of `fn`'s blocks per leaf reduced over the microbatches, positive
    semi-definite where `fn`'s own operator is declared so."""
    per_microbatch = dataclasses.replace(transform, fn=_BlocksOf(transform.fn))
    blocks = per_microbatch(x, *args, **kwargs)
    return BlockDiagonal(
        blocks,
        positive_semidefinite=inner.positive_semidefinite,
        structure=inner.layout.structure(),
    )


def _microbatch_products(transform: Microbatcher, x: Any, args: tuple, kwargs: dict) -> tuple:
    """`(flat, variables, mv)`: `mv(v)` reduces `fn`'s product with `v` over the
    microbatches, one microbatch at a time."""
    flat, variables = split_variables(x, owner=f"{transform._owner}.operator")

    def mv(vector):
        per_microbatch = dataclasses.replace(transform, fn=_ProductAt(transform.fn, vector))
        split = per_microbatch.split(x, *args, **kwargs)
        return in_shares(per_microbatch, (x, *args), kwargs, split)

    return flat, variables, mv
