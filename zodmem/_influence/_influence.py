"""`influence` and `influence_scorer`: the scores `g_q^T (C + damping I)^{-1} g_t` of
query examples against training examples, the gradients of the training examples made
and scored in blocks of a `zm.ChunkedVmap`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import lineax as lx
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Inexact, PyTree

from .._checks import Integer, Memory, RealScalar, check_int, typechecked
from .._operators._vectors import VectorSpace
from .._pytree import is_traced
from .._traceback import public
from .._transforms._vmap import ChunkedVmap
from ._arguments import check_damping, check_examples, curvature_form, variable_space
from ._scores import (
    ExampleGradient,
    QueryScores,
    SelfScores,
    pinned,
    preconditioned,
    solves_in_shard_map,
)

__all__ = ["influence", "influence_scorer"]

# Examples: a tuple of arrays, each with the examples along axis 0. Its items are checked
# by `check_examples`, every one (beartype would check one, drawn at random), in words
# that name the item.
Examples = tuple


def _check_query(query: Any, self_influence: bool, *, owner: str) -> int | None:
    """The number of queries (`None` for self-influence, which takes none)."""
    if self_influence:
        if query is not None:
            raise ValueError(
                f"{owner}: with self_influence=True each training example is scored against "
                f"itself, so `query` must be left out (None), got a tuple of "
                f"{len(query) if isinstance(query, tuple) else '?'} arrays."
            )
        return None
    if query is None:
        raise ValueError(
            f"{owner}: `query` is missing: give the examples whose predictions are "
            f"explained, as a tuple of arrays with the examples on axis 0 (or pass "
            f"self_influence=True to score each training example against itself)."
        )
    return check_examples(query, "query", owner=owner)


def _blocks(chunk_size: Any, max_memory: Any, count: int) -> dict[str, Any]:
    """A `ChunkedVmap`'s block options: as given, or one block of `count` items."""
    if chunk_size is None and max_memory is None:
        return {"chunk_size": max(count, 1)}
    return {"chunk_size": chunk_size, "max_memory": max_memory}


class _Checked(NamedTuple):
    """The arguments of a scorer, checked."""

    num_query: int | None
    damping: Any
    space: VectorSpace
    form: str


def _checked(
    curvature: Any,
    model: Any,
    query: Any,
    damping: Any,
    self_influence: bool,
    chunk_size: Any,
    max_memory: Any,
    *,
    owner: str,
) -> _Checked:
    num_query = _check_query(query, self_influence, owner=owner)
    damping = check_damping(damping, owner=owner)
    check_int(chunk_size, "chunk_size", owner=owner, minimum=1, optional=True)
    if chunk_size is not None and max_memory is not None:
        raise ValueError(
            f"{owner}: give at most one of `chunk_size` and `max_memory`, got "
            f"chunk_size={chunk_size!r} and max_memory={max_memory!r}."
        )
    space = variable_space(model, owner=owner)
    return _Checked(num_query, damping, space, curvature_form(curvature, space, owner=owner))


def _scorer(
    loss: Any,
    curvature: Any,
    model: Any,
    query: Any,
    checked: _Checked,
    solver: Any,
    chunk_size: Any,
    max_memory: Any,
    progress: bool,
    *,
    owner: str,
    train_blocks: dict[str, Any],
) -> ChunkedVmap:
    """The scorer: a `ChunkedVmap` of one training example's scores."""
    space, form, damping = checked.space, checked.form, checked.damping
    gradient = ExampleGradient(loss, model, owner)
    if checked.num_query is None:
        scores = SelfScores(gradient, curvature, damping, form, solver, space)
        return ChunkedVmap(scores, out_axes=0, progress=progress, **train_blocks)
    with jax.named_scope("query_gradients"):
        blocks = _blocks(chunk_size, max_memory, checked.num_query)
        gradients = ChunkedVmap(gradient, **blocks)(*query)
        gradients = pinned(space, gradients, block=True)
    with jax.named_scope("preconditioned_queries"):
        queries = preconditioned(
            curvature,
            form,
            space,
            gradients,
            damping,
            solver=solver,
            block=True,
            max_memory=max_memory,
        )
    return ChunkedVmap(
        QueryScores(gradient, queries, space), out_axes=1, progress=progress, **train_blocks
    )


def _whole(arrays: tuple) -> tuple:
    """The arrays, those split over several devices made whole on each of them (not
    traced ones, whose layout the call does not see on Auto axes)."""

    def whole(array):
        sharding = getattr(array, "sharding", None)
        if is_traced(array) or not isinstance(sharding, NamedSharding):
            return array
        if sharding.is_fully_replicated:
            return array
        return jax.device_put(array, NamedSharding(sharding.mesh, PartitionSpec()))

    return tuple(whole(array) for array in arrays)


def _replicated(scores: jax.Array, space: VectorSpace) -> jax.Array:
    """The scores whole on every device of the variables' mesh, where they are sharded."""
    sharding = next((s for s in space.shardings if s is not None), None)
    if sharding is None:
        return scores
    whole = NamedSharding(sharding.mesh, PartitionSpec())
    if space.explicit:
        return jax.sharding.reshard(scores, whole)
    return jax.lax.with_sharding_constraint(scores, whole)


@public
@typechecked
def influence(
    loss: Callable[..., Any],
    curvature: lx.AbstractLinearOperator,
    model: PyTree,
    *,
    query: Examples | None = None,
    train: Examples,
    damping: RealScalar,
    self_influence: bool = False,
    solver: lx.AbstractLinearSolver | None = None,
    chunk_size: Integer | None = None,
    max_memory: Memory = None,
    progress: bool = False,
) -> Inexact[Array, "q t"] | Inexact[Array, " t"]:
    """Influence scores: how much each training example's gradient aligns with each
    query example's, through the inverse of a damped curvature.

    For every query example `q` and training example `t`, the score is
    `g_q^T (C + damping I)^{-1} g_t`, `g = jax.grad(loss)(model, *example)` with respect
    to the model's variables (its inexact-array leaves) for one example: a first-order
    estimate of how much upweighting `t` in training changes the loss at `q` (Koh and
    Liang, 2017, with the sign that makes a helpful example score high). Use it to find
    which training examples made a prediction, or, with `self_influence=True`, which are
    most unusual to the model (mislabelled examples score high).

    The query gradients are computed and preconditioned once, `(C + damping I)^{-1} g_q`
    by the curvature's own damped `solve` where it has one (exactly, for
    `zm.KFAC`/`zm.EKFAC`'s operators, `zm.BlockDiagonal` and `zm.LowRankDiagonal`), else
    by `zm.solve` (conjugate gradients, for an exact curvature such as
    `zm.BatchedGGN(...).operator(...)`). The training gradients are then made and scored
    in blocks of training examples, a `zm.ChunkedVmap` over them, `chunk_size` at a time
    or as many as `max_memory` holds; the `(num_query, n)` preconditioned queries and one
    block of `(chunk, n)` gradients are what the call holds beside the scores.

    It is `zm.influence_scorer(...)(*train)`: for a score matrix too large to hold, stream
    that scorer to a file with `zm.to_file`.

    **Arguments:**

    - `loss`: the loss of one example, `loss(model, *example)`, a real scalar; `example`
      holds the slices of the arrays of `query` or `train` at one index (without their
      axis of examples). Not the curvature's loss: the curvature is given built.
    - `curvature`: `C`, a square operator on the model's variables: `zm.KFAC` or
      `zm.EKFAC`'s result, `zm.BatchedGGN(..., blocks="leaf").operator(...)` (a
      `zm.BlockDiagonal`), a `zm.LowRankDiagonal` (from `zm.low_rank`), or any square
      lineax operator (such as `zm.BatchedGGN(...).operator(...)` or
      `zm.BatchedHessian(...).operator(...)`), solved by `zm.solve`. Its scale is the
      user's to match: KFAC of a loss with `reduction="sum"` is the curvature of the sum
      over the training set, with `"mean"` of the mean.
    - `model`: the model (any pytree) at which the gradients are taken; its inexact
      arrays are the variables, every other leaf is held fixed.
    - `query`: the query examples, a tuple of arrays with the examples along axis 0
      (`(inputs, labels)`). Left out with `self_influence=True`.
    - `train`: the training examples, a tuple of arrays as `query`.
    - `damping`: `damping >= 0` added to the curvature's diagonal (a finite Python or
      NumPy number, or a 0-d array, traced under `jax.jit`).
    - `self_influence`: score each training example against itself,
      `g_t^T (C + damping I)^{-1} g_t`, instead of against queries: one solve per
      training example (cheap with an operator's own solve; one CG run each through
      `zm.solve`).
    - `solver`: for a curvature solved by `zm.solve`, the lineax solver (say
      `lx.CG(rtol=1e-10, atol=1e-10)` in float64); `None`, `zm.solve`'s choice
      (CG to a tolerance of 1e-6 for a positive semi-definite operator).
    - `chunk_size`: the training examples (and query examples) whose gradients are made
      at once; it need not divide their number.
    - `max_memory`: instead of `chunk_size`, a budget from which the blocks are planned
      (an int of bytes, `"500MB"`, `"auto"`), as for `zm.ChunkedVmap`. Neither: every
      example in one block.
    - `progress`: a progress bar over the blocks of training examples.

    **Returns:**

    A `(num_query, num_train)` array (with `self_influence=True`, `(num_train,)`) in the
    gradients' dtype, the common dtype of the variables. Where the variables are sharded
    over devices, it is replicated on every device of their mesh; the gradients stay
    laid out like the variables, and only a curvature whose solve takes flat vectors
    sees the query gradients gathered.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        import zodmem as zm

        model = eqx.nn.MLP(2, 3, 8, 1, key=jax.random.key(0))
        inputs = jax.random.normal(jax.random.key(1), (32, 2))
        labels = jnp.arange(32) % 3

        def loss(model, x, label):  # one example
            return -jax.nn.log_softmax(model(x))[label]

        def logits(model, inputs, labels):
            return jax.vmap(model)(inputs)

        fisher = zm.EKFAC(logits, zm.losses.SoftmaxCrossEntropy())(model, inputs, labels)
        scores = zm.influence(
            loss, fisher, model, query=(inputs[:2], labels[:2]), train=(inputs, labels),
            damping=1e-3,
        )
        assert scores.shape == (2, 32)
        unusual = zm.influence(
            loss, fisher, model, train=(inputs, labels), damping=1e-3, self_influence=True
        )
        assert unusual.shape == (32,)
        ```
    """
    owner = "zm.influence"
    num_train = check_examples(train, "train", owner=owner)
    checked = _checked(
        curvature, model, query, damping, self_influence, chunk_size, max_memory, owner=owner
    )
    if num_train:
        # A loss that does not fit the examples is refused here, before any gradient.
        first = tuple(array[0] for array in train)
        eqx.filter_eval_shape(ExampleGradient(loss, model, owner), *first)
    scorer = _scorer(
        loss,
        curvature,
        model,
        query,
        checked,
        solver,
        chunk_size,
        max_memory,
        progress,
        owner=owner,
        train_blocks=_blocks(chunk_size, max_memory, num_train),
    )
    if self_influence and not solves_in_shard_map(checked.form):
        train = _whole(train)
    return _replicated(scorer(*train), checked.space)


@public
@typechecked
def influence_scorer(
    loss: Callable[..., Any],
    curvature: lx.AbstractLinearOperator,
    model: PyTree,
    *,
    query: Examples | None = None,
    damping: RealScalar,
    self_influence: bool = False,
    solver: lx.AbstractLinearSolver | None = None,
    chunk_size: Integer | None = None,
    max_memory: Memory = None,
    progress: bool = False,
) -> ChunkedVmap:
    """`zm.influence` as a transform of the training examples: the query gradients made
    and preconditioned now, the training examples scored when it is called.

    Call it with the training arrays, `scorer(*train)`, for `zm.influence(...,
    train=train)`'s scores; or hand it to `zm.to_file(path, scorer, *train)` to write a
    score matrix too large to hold to a `.npy` file block by block (resumed where it
    stopped after a crash, with a progress bar if `progress=True`), or to `zm.to_host`.
    The same preconditioned queries then score any number of training sets.

    **Arguments:**

    As for `zm.influence`, less `train`; `chunk_size` or `max_memory` is needed (the
    number of training examples is not known yet): the training examples scored at once,
    or a budget to plan them from.

    **Returns:**

    A `zm.ChunkedVmap` over the training examples (their arrays mapped along axis 0),
    returning `(num_query, num_train)` scores (with `self_influence=True`, `(num_train,)`).

    !!! example

        ```python
        import os, tempfile
        import jax, jax.numpy as jnp
        import zodmem as zm

        def loss(w, x, y):
            return (jnp.tanh(x @ w) - y) ** 2

        w = jnp.array([0.5, -1.0, 2.0])
        x, y = jax.random.normal(jax.random.key(0), (100, 3)), jnp.zeros(100)
        predict = lambda w, x, y: jnp.tanh(x @ w)
        C = zm.BatchedGGN(predict, zm.losses.SquaredError()).operator(w, x, y)
        scorer = zm.influence_scorer(loss, C, w, query=(x[:4], y[:4]), damping=0.1, chunk_size=16)
        path = os.path.join(tempfile.mkdtemp(), "scores.npy")
        scores = zm.to_file(path, scorer, x, y)  # a read-only memmap, (4, 100)
        assert scores.shape == (4, 100)
        ```
    """
    owner = "zm.influence_scorer"
    if chunk_size is None and max_memory is None:
        raise ValueError(
            f"{owner}: give `chunk_size` (the training examples scored at once) or "
            f"`max_memory` (a budget to plan them from): the scorer does not know yet how "
            f"many training examples it will be called with."
        )
    checked = _checked(
        curvature, model, query, damping, self_influence, chunk_size, max_memory, owner=owner
    )
    return _scorer(
        loss,
        curvature,
        model,
        query,
        checked,
        solver,
        chunk_size,
        max_memory,
        progress,
        owner=owner,
        train_blocks=_blocks(chunk_size, max_memory, 0),
    )
