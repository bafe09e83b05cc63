"""The diagonal and the trace of an operator: exactly, from unit vectors in planned blocks,
or estimated from random probes (Hutchinson's estimator and its variance-reduced forms,
Hutch++ for the trace and Diag++ for the diagonal)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Inexact, PRNGKeyArray, PyTree

from .._checks import Integer, Memory, check_choice, check_int, check_key, typechecked
from .._engine._sharding import replicate, sharding_of
from .._operators._flat import FlatView, flat_view
from .._operators._operator import BlockedOperator
from .._operators._vectors import VectorSpace, vector_space
from .._traceback import public
from ._lanczos import space_product
from ._probes import AbstractColumns, ProbeJob, ProbeOptions, run_probes
from ._random import probe_seeds, sign_probes

__all__ = ["diagonal", "trace"]

_DIAGONAL_METHODS = ("exact", "hutchinson", "diag++")
_TRACE_METHODS = ("exact", "hutchinson", "hutch++")


# -- what the blocks of probes compute ---------------------------------------------------


class UnitDiagonal(ProbeJob):
    """The diagonal entries `e_i^T A e_i`, one unit vector a probe. With `space` (the
    variables' space, sharded over devices), each unit vector is made leaf by leaf in the
    variables' layout, each device making its own share (`VectorSpace.unit`), and its
    product taken there."""

    space: VectorSpace | None = None
    reduce: ClassVar[bool] = False
    what: ClassVar[str] = "unit vectors"

    def count(self, view: FlatView) -> int:
        return view.size

    def product(self, view: FlatView, strategy: Any) -> Callable:
        return space_product(view, self.space, strategy)

    def spread(self) -> UnitDiagonal:
        return UnitDiagonal()

    def block(self, view: FlatView, product: Callable, start: Any, size: int) -> Any:
        space = self.space

        def entry(index):
            if space is not None:
                unit = space.unit(index)
                return space.dot(unit, product(unit))
            return product(jax.nn.one_hot(index, view.size, dtype=view.dtype))[index]

        return jax.vmap(entry)(start + jnp.arange(size, dtype=jnp.int32))


class Columns(AbstractColumns):
    """The products with the columns of a matrix, assembled as columns."""

    matrix: jax.Array
    what: ClassVar[str] = "vectors"

    def block(self, view: FlatView, product: Callable, start: Any, size: int) -> Any:
        return jax.vmap(product, in_axes=1, out_axes=1)(self.columns(start, size))


class Hutchinson(ProbeJob):
    """The number, mean and summed squared deviations from the mean of Hutchinson's
    samples over random sign probes `g` (probe `i` is `sign_probes(key, first + i)`,
    whatever the blocks): `g^T A g` for a trace, `g * (A g)` for a diagonal. With `basis`
    (orthonormal columns `Q`, `P = Q Q^T`), the samples of what `P` leaves: `g' ^T A g'`
    with `g' = (I - P) g` (Hutch++), or `g * (I - P) A g` (Diag++). With `space` (the
    variables' space, sharded over devices), each probe is drawn leaf by leaf in the
    variables' layout and its product taken in it (`VectorSpace.signs`, the same signs):
    no device holds a whole probe, and a diagonal's moments come laid out like the
    variables.

    Deviations, not the sums of the samples and of their squares: a trace far larger than
    the samples' spread would lose the spread to rounding in `sum(x^2) - p mean^2`."""

    key: jax.Array
    basis: jax.Array | None
    num: int = eqx.field(static=True)
    for_trace: bool = eqx.field(static=True)
    first: int = eqx.field(static=True, default=0)
    space: VectorSpace | None = None
    reduce: ClassVar[bool] = True
    what: ClassVar[str] = "probes"

    def count(self, view: FlatView) -> int:
        return self.num

    def sums_like(self, view: FlatView) -> Any:
        if self.space is not None and not self.for_trace:
            return None  # moments in the variables' structure: found by tracing a block
        shape = () if self.for_trace else (view.size,)
        moment = jax.ShapeDtypeStruct(shape, view.dtype)
        return jax.ShapeDtypeStruct((), jnp.int32), moment, moment

    def product(self, view: FlatView, strategy: Any) -> Callable:
        return space_product(view, self.space, strategy)

    def spread(self) -> Hutchinson:
        return self if self.space is None else dataclasses.replace(self, space=None)

    def block(self, view: FlatView, product: Callable, start: Any, size: int) -> Any:
        indices = start + jnp.arange(size, dtype=jnp.int32)
        if self.space is not None:
            values = self._laid_out_samples(product, indices)
        else:
            values = self._flat_samples(view, product, indices)
        # Past the last probe (the last device's share, when the devices do not divide
        # the probes): no sample.
        real = indices < self.num
        count = jnp.sum(real, dtype=jnp.int32)

        def moments(values):
            where = jnp.expand_dims(real, tuple(range(1, values.ndim)))
            total = jnp.sum(jnp.where(where, values, 0), axis=0)
            mean = total / jnp.maximum(count, 1).astype(values.dtype)
            deviations = jnp.where(where, values - mean, 0)
            return mean, jnp.sum(deviations * deviations, axis=0)

        leaves, treedef = jax.tree_util.tree_flatten(values)
        pairs = [moments(leaf) for leaf in leaves]
        means = jax.tree_util.tree_unflatten(treedef, [mean for mean, _ in pairs])
        spreads = jax.tree_util.tree_unflatten(treedef, [spread for _, spread in pairs])
        return count, means, spreads

    def _flat_samples(self, view: FlatView, product: Callable, indices: Any) -> jax.Array:
        basis = self.basis

        def deflated(vector):
            return vector - basis @ (basis.T @ vector)

        def sample(probe):
            if self.for_trace:
                if basis is not None:
                    probe = deflated(probe)
                return jnp.dot(probe, product(probe))
            applied = product(probe)
            return probe * (applied if basis is None else deflated(applied))

        probes = sign_probes(self.key, self.first + indices, view.size, view.dtype)
        return jax.vmap(sample)(probes)

    def _laid_out_samples(self, product: Callable, indices: Any) -> Any:
        space = self.space
        probes = space.signs(probe_seeds(self.key, self.first + indices))
        images = jax.vmap(product)(probes)
        if self.for_trace:
            return jax.vmap(space.dot)(probes, images)
        return space.map(jnp.multiply, probes, images)

    def combine(self, total: Any, part: Any) -> Any:
        """Two sets of samples' statistics merged (Chan, Golub and LeVeque's pairwise
        update), never subtracting two large sums; an empty set leaves the other as is."""
        count_a, mean_a, spread_a = total
        count_b, mean_b, spread_b = part
        dtype = jax.tree_util.tree_leaves(mean_a)[0].dtype
        a, b = count_a.astype(dtype), count_b.astype(dtype)
        share = b / jnp.maximum(a + b, 1)  # of the merged samples that are `part`'s

        def mean(mean_a, mean_b):
            return mean_a + (mean_b - mean_a) * share

        def spread(spread_a, spread_b, mean_a, mean_b):
            delta = mean_b - mean_a
            return spread_a + spread_b + delta * delta * a * share

        tree_map = jax.tree_util.tree_map
        return (
            count_a + count_b,
            tree_map(mean, mean_a, mean_b),
            tree_map(spread, spread_a, spread_b, mean_a, mean_b),
        )


# -- checks --------------------------------------------------------------------------------


def _check_key(key: Any, owner: str, method: str) -> jax.Array:
    if key is None:
        raise TypeError(
            f"{owner}: method={method!r} draws random probes and needs a key, e.g. "
            f"key=jax.random.key(0); got key=None."
        )
    return check_key(key, owner=owner)


def _check_probes(num_probes: Any, owner: str, method: str, least: int) -> int:
    if num_probes is None:
        raise TypeError(
            f"{owner}: method={method!r} needs `num_probes`, the number of random probes "
            f"(products with the operator), at least {least}; got num_probes=None."
        )
    return check_int(
        num_probes, "num_probes", owner=owner, minimum=least, allowed=f"an int >= {least}"
    )


def _stochastic_view(operator: Any, owner: str, method: str) -> FlatView:
    view = flat_view(operator, owner)
    if jnp.issubdtype(view.dtype, jnp.complexfloating):
        raise TypeError(
            f"{owner}: method={method!r} estimates from real random probes and takes a "
            f"real operator, but this one is {view.dtype}; use method='exact'."
        )
    return view


def _mean_and_error(statistics: tuple, count: int, *, laid_out: bool = False) -> tuple:
    """The mean of `count` samples and its standard error, from `Hutchinson`'s
    statistics (their number, mean and summed squared deviations; with `laid_out`, a
    diagonal's in the variables' structure, laid out like them). Statistics held whole
    in this process are finished in NumPy, in double precision, which compiles nothing
    (a program would cost a one-shot call more than the estimate's products do)."""
    _, mean, spread = statistics
    concrete = all(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_fully_addressable
        for x in (mean, spread)
    )
    if laid_out or not concrete:
        return mean, jax.tree_util.tree_map(lambda s: _standard_error_traced(s, count), spread)
    error = _standard_error(np, np.asarray(spread, np.float64), count)
    # Put on the device in the mean's dtype (`jnp.asarray` with a dtype would compile a
    # cast).
    return mean, jax.device_put(np.asarray(error, mean.dtype))


@functools.partial(jax.jit, static_argnums=1)
def _standard_error_traced(spread: jax.Array, count: int) -> jax.Array:
    return _standard_error(jnp, spread, count)


def _standard_error(xp: Any, spread: Any, count: int) -> Any:
    """The standard error of the mean of `count` samples whose squared deviations from
    it sum to `spread`, in the array module `xp` (NumPy or `jax.numpy`); `count`, a
    Python int, keeps the spread's dtype in either."""
    return xp.sqrt(spread / ((count - 1) * count))


def _sketch(view: FlatView, key: jax.Array, width: int, options: ProbeOptions) -> tuple:
    """`(Q, A Q)`: an orthonormal basis of the range of `A S` for `width` random sign
    probes `S` (probes `0, ..., width - 1` of `key`; it holds the directions of `A`'s
    largest eigenvalues), and its products."""
    signs = _sign_columns(key, width, view.size, view.dtype)
    sketch = _whole(run_probes(view, Columns(signs), options))
    basis, _ = jnp.linalg.qr(sketch)
    return basis, _whole(run_probes(view, Columns(basis), options))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sign_columns(key: jax.Array, width: int, n: int, dtype: Any) -> jax.Array:
    """Probes `0, ..., width - 1` of `key` as the columns of an `(n, width)` matrix."""
    return sign_probes(key, jnp.arange(width, dtype=jnp.int32), n, dtype).T


def _whole(array: jax.Array) -> jax.Array:
    """`array` whole on every device, where its columns came back spread over explicit
    mesh axes (a QR factorisation takes no split columns)."""
    sharding = sharding_of(array)
    return array if sharding is None else replicate(array, sharding.mesh)


# The diagonal: flat, or shaped like the operator's input.
Diagonal = Inexact[Array, " n"] | PyTree[Inexact[Array, "..."]]


def _shaped(view: FlatView, vector: jax.Array, pytree: bool) -> Any:
    return view.laid_out(vector) if pytree else vector


# -- the public functions ------------------------------------------------------------------


@public
@typechecked
def diagonal(
    operator: lx.AbstractLinearOperator,
    *,
    method: Literal["exact", "hutchinson", "diag++"] = "exact",
    num_probes: Integer | None = None,
    key: PRNGKeyArray | None = None,
    max_memory: Memory = None,
    batch_size: Integer | None = None,
    sharding: NamedSharding | None = None,
    progress: bool | None = None,
    pytree: bool = False,
) -> Diagonal | tuple[Diagonal, Diagonal]:
    """The diagonal of a square operator: exactly, or estimated from random probes.

    - `method="exact"`: `A[i, i] = e_i^T A e_i` for every unit vector `e_i`, in blocks of
      unit vectors of which only the diagonal entries are kept. It takes `n` products,
      the work of the dense matrix, but holds one block of products, never `n x n`.
    - `method="hutchinson"`: the mean of `g * (A g)` over `num_probes` random sign
      vectors `g` (unbiased: `E[g g^T] = I`), and its standard error, entry by entry.
    - `method="diag++"`: a third of the probes sketch the range of `A` (`Q`, from the
      products `A S`), whose part `diag(Q Q^T A)` is exact (another third), and the
      last third estimate what is left, `diag((I - Q Q^T) A)`, by Hutchinson's
      samples. Far more accurate than `"hutchinson"` with the same products when a few
      eigenvalues dominate, as in a network's Hessian or Gauss-Newton matrix; it needs
      a symmetric operator. The standard error is that of the last third's estimate.

    **Arguments:**

    - `operator`: a square linear operator: `transform.operator(x, *args)` of
      `zm.BatchedHessian`, `zm.BatchedGGN` (or either wrapped in `zm.Microbatcher`, for
      a dataset's curvature), or any `lineax` operator.
    - `method`: `"exact"`, `"hutchinson"` or `"diag++"`.
    - `num_probes`: the number of random probes (products) of a stochastic method: at
      least 2 for `"hutchinson"`, 4 for `"diag++"`.
    - `key`: a `jax.random.key` for the probes of a stochastic method. Probe `i` is a
      hash of `i` and the key's words, so the estimate does not depend on the blocks.
    - `max_memory`, `batch_size`: at most one: the probes per block, given, or as many
      as fit the budget (planned as any transform's blocks). By default the options of
      the operator's transform (its budget, `nbatches` or `batch_size`).
    - `sharding`: a `NamedSharding` whose first entry names the mesh axes that split the
      probes over devices (their number must divide the probes); by default the
      operator's transform's.
    - `progress`: a progress bar of the blocks done; by default the transform's.
    - `pytree`: return the diagonal shaped like the operator's input (for a curvature,
      like the variables of `x`) instead of flat. Where the operator's variables are
      sharded over several devices, it always comes back so (as `zm.eigsh`'s
      eigenvectors do), each leaf laid out like its variable.

    Where the operator's variables are sharded over several devices and `sharding` is
    `None`, `"exact"` and `"hutchinson"` make each probe leaf by leaf laid out like them
    (a unit vector, each device its own share; the same random signs as on one device)
    and take its product so: no device holds a whole probe.

    **Returns:**

    The diagonal (flat `(n,)`, or a pytree), in the operator's dtype; for a stochastic
    method, `(estimate, standard_error)`, both in that form.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import zodmem as zm

        def loss(w, x):
            return jnp.mean(jnp.tanh(x @ w) ** 2)

        w, x = jnp.ones(50) / 10, jnp.ones((20, 50))
        op = zm.BatchedHessian(loss, max_memory="100MB").operator(w, x)
        exact = zm.diagonal(op)
        estimate, error = zm.diagonal(op, method="hutchinson", num_probes=100,
                                      key=jax.random.key(0))
        ```
    """
    options = ProbeOptions("zm.diagonal", max_memory, batch_size, sharding, progress)
    view, found, space = _diagonal_or_trace(
        operator, method, num_probes, key, options, for_trace=False
    )
    # Variables sharded over devices: the diagonal always in their structure, laid out.
    pytree = pytree or space is not None
    if method == "exact":
        return _shaped(view, found, pytree)
    if method == "hutchinson" and space is not None:
        return found  # Hutchinson's moments come in the variables' structure
    return tuple(_shaped(view, part, pytree) for part in found)


@public
@typechecked
def trace(
    operator: lx.AbstractLinearOperator,
    *,
    method: Literal["exact", "hutchinson", "hutch++"] = "exact",
    num_probes: Integer | None = None,
    key: PRNGKeyArray | None = None,
    max_memory: Memory = None,
    batch_size: Integer | None = None,
    sharding: NamedSharding | None = None,
    progress: bool | None = None,
) -> Inexact[Array, ""] | tuple[Inexact[Array, ""], Inexact[Array, ""]]:
    """The trace of a square operator: exactly, or estimated from random probes.

    - `method="exact"`: the sum of the exact diagonal (`zm.diagonal`): `n` products in
      blocks of unit vectors, one block held at a time.
    - `method="hutchinson"`: the mean of `g^T A g` over `num_probes` random sign vectors
      `g`, and its standard error. Its variance is `2 (||A||_F^2 - sum_i A_ii^2)` per
      probe.
    - `method="hutch++"` (Meyer, Musco, Musco and Woodruff, 2021): a third of the
      probes sketch the range of `A` (`Q`), whose part `trace(Q^T A Q)` is exact
      (another third), and the last third estimate the trace of what is left,
      `(I - Q Q^T) A (I - Q Q^T)`. With the same products its error is far smaller when
      a few eigenvalues dominate. The standard error is that of the last third's part.

    **Arguments:** as for `zm.diagonal` (without `pytree`); `num_probes` at least 2 for
    `"hutchinson"` and 4 for `"hutch++"`. As there, the probes of `"exact"` and
    `"hutchinson"` of an operator whose variables are sharded over devices are laid out
    like them.

    **Returns:**

    The trace, a scalar in the operator's dtype; for a stochastic method,
    `(estimate, standard_error)`.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import zodmem as zm

        def loss(w, x):
            return jnp.mean(jnp.tanh(x @ w) ** 2)

        w, x = jnp.ones(50) / 10, jnp.ones((20, 50))
        op = zm.BatchedHessian(loss).operator(w, x)
        estimate, error = zm.trace(op, method="hutch++", num_probes=30,
                                   key=jax.random.key(0))
        ```
    """
    options = ProbeOptions("zm.trace", max_memory, batch_size, sharding, progress)
    _, found, _ = _diagonal_or_trace(operator, method, num_probes, key, options, for_trace=True)
    return jnp.sum(found) if method == "exact" else found


def _diagonal_or_trace(
    operator: Any, method: Any, num_probes: Any, key: Any, options: ProbeOptions, *, for_trace: bool
) -> tuple[FlatView, Any, VectorSpace | None]:
    """`operator`'s flat view, its exact diagonal or estimated diagonal or trace, and
    the variables' space where they are sharded (`None` otherwise): the probes' space."""
    owner = options.owner
    methods = _TRACE_METHODS if for_trace else _DIAGONAL_METHODS
    check_choice(method, "method", methods, owner=owner)
    if method == "exact":
        view = flat_view(operator, owner)
        space = _variables_space(view, owner)
        return view, run_probes(view, UnitDiagonal(space), options), space
    view = _stochastic_view(operator, owner, method)
    if method == "diag++" and not lx.is_symmetric(view.operator):
        raise ValueError(
            f"{owner}: method='diag++' needs a symmetric operator (its exact part is "
            "diag(Q Q^T A) = sum(Q * (A Q), 1) only then); tag a symmetric one with "
            "lineax.TaggedLinearOperator(op, lineax.symmetric_tag), or use "
            "method='hutchinson'."
        )
    space = _variables_space(view, owner)
    return view, _estimate(view, space, method, num_probes, key, options, for_trace), space


def _estimate(
    view: FlatView,
    space: VectorSpace | None,
    method: str,
    num_probes: Any,
    key: Any,
    options: ProbeOptions,
    for_trace: bool,
) -> tuple:
    """A stochastic estimate of the trace or the diagonal, and its standard error:
    Hutchinson's (with a `space`, its probes laid out there, and a diagonal's two in
    the variables' structure), or with a third of the probes sketching the range of `A`
    and another third taking its exact part (Hutch++, Diag++)."""
    owner = options.owner
    key = _check_key(key, owner, method)
    if method == "hutchinson":
        num = _check_probes(num_probes, owner, method, 2)
        statistics = run_probes(view, Hutchinson(key, None, num, for_trace, space=space), options)
        return _mean_and_error(statistics, num, laid_out=space is not None and not for_trace)
    num = _check_probes(num_probes, owner, method, 4)
    width = num // 3
    # The key's probes 0 to width - 1 sketch; those after them estimate the rest.
    basis, products = _sketch(view, key, width, options)
    known = jnp.sum(basis * products) if for_trace else jnp.sum(basis * products, axis=1)
    rest = num - 2 * width
    job = Hutchinson(key, basis, rest, for_trace, first=width)
    mean, error = _mean_and_error(run_probes(view, job, options), rest)
    return known + mean, error


def _variables_space(view: FlatView, owner: str) -> VectorSpace | None:
    """The variables' space where they are sharded over devices (the probes are drawn
    and taken there, laid out like them), else `None` (flat probes)."""
    space = vector_space(view.operator, owner)
    return space if space.sharded else None


@lx.diagonal.register(BlockedOperator)
def _(operator):
    # lineax's diagonal of a zodmem operator: exact, in the blocks of its transform,
    # without the dense matrix.
    return diagonal(operator)
