"""A symmetric operator's top eigenpairs, and the diagonal of what they leave out, as a
`LowRankDiagonal` (`low_rank`): a Laplace posterior's precision from a curvature."""

from __future__ import annotations

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import Integer, Number, check_int, check_key, described, typechecked
from .._operators._arguments import check_dtype
from .._operators._low_rank_diagonal import LowRankDiagonal
from .._operators._low_rank_leaves import is_leafwise
from .._traceback import public
from ._diagonal import diagonal as diagonal_of
from ._eigsh import eigenpairs
from ._lanczos import symmetric_space

__all__ = ["low_rank"]

_DIAGONALS = (None, "exact", "estimate")


@public
@typechecked
def low_rank(
    operator: lx.AbstractLinearOperator,
    rank: Integer,
    *,
    diagonal: Literal["exact", "estimate"] | Float[Array | np.ndarray, " n"] | None = None,
    key: PRNGKeyArray | None = None,
    num_probes: Integer | None = None,
    tol: Number = 1e-6,
    max_steps: Integer | None = None,
    progress: bool = False,
) -> LowRankDiagonal:
    """A symmetric operator's top `rank` eigenpairs, and optionally the diagonal of the
    rest, as a `zm.LowRankDiagonal`: `U diag(s) U^T + diag(d)`.

    Use it for a Laplace posterior whose precision is a network's Gauss-Newton matrix
    `G` (or Hessian) plus a prior's: `zm.low_rank(G, r)` keeps the `r` directions the
    data constrain most, and `diagonal=` the diagonal of what they leave out, so that
    the posterior's precision has `G`'s diagonal exactly where the low-rank part alone
    would drop the rest of the curvature to the prior. The result's `solve`, `logdet`,
    `marginal_variances` and `sample` with `damping=` the prior's precision are then
    exact for that approximation, and cheap.

    The eigenpairs are `zm.eigsh(operator, rank, which="LA")`'s; eigenvalues below zero
    (an indefinite Hessian's, or rounding about a singular matrix's zeros) are clipped
    at 0, since a precision's must not be negative. The diagonal remainder
    `d = diag(A - U diag(s) U^T)` is clipped at 0 too: exact, it is `>= 0` for a
    positive semi-definite `A`, but rounding or an estimate can take it below. Where it
    is not clipped, the result's diagonal equals the operator's.

    **Arguments:**

    - `operator`: a symmetric real operator: `transform.operator(x, *args)` of
      `zm.BatchedGGN` or `zm.BatchedHessian` (or a `zm.Microbatcher` of one), or any
      lineax operator that `lx.is_symmetric` accepts. A pytree of variables is raveled:
      the result works on flat vectors, in the variables' raveled order. Where the
      variables are sharded over several devices, the result is held leaf by leaf
      instead (see `zm.LowRankDiagonal`): `U` a leaf `(rank, *variable.shape)` per
      variable and `d` (the diagonal part too) the variables' structure, each laid out
      like its variable, and its vectors too.
    - `rank`: how many eigenpairs, `0 <= rank < n`; `0` keeps the diagonal alone.
    - `diagonal`: the diagonal part `d`:
        - `None` (the default): none, `d = 0`;
        - `"exact"`: `diag(A)` from `zm.diagonal(operator)` (`n` products, in the
          blocks of the operator's transform), less the low-rank part's;
        - `"estimate"`: `diag(A - U diag(s) U^T)` by Hutchinson's estimator with
          `num_probes` random sign probes: `zm.diagonal(operator, method="hutchinson")`
          less the same probes' estimate for the low-rank part (the estimator is linear
          in the operator), so that the top eigenpairs are taken out exactly, as
          Diag++'s sketch takes out an approximation of them. `num_probes` products;
        - an `(n,)` array: `diag(A)` already computed (by `zm.diagonal`, say), less the
          low-rank part's.
    - `key`: a `jax.random` key: with `"estimate"`, required (split between eigsh's
      start and the probes); otherwise eigsh's start, `jax.random.key(0)` by default.
    - `num_probes`: the probes of `"estimate"`, at least 2.
    - `tol`, `max_steps`, `progress`: `zm.eigsh`'s.

    **Returns:**

    A `zm.LowRankDiagonal` in the operator's dtype, `s` ascending as `zm.eigsh` returns
    the eigenvalues.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import zodmem as zm

        def predict(w, inputs, targets):
            return jnp.tanh(inputs @ w)

        inputs = jax.random.normal(jax.random.key(0), (8, 20))
        targets = jnp.zeros(8)
        G = zm.BatchedGGN(predict, zm.losses.SquaredError()).operator(
            jnp.full(20, 0.1), inputs, targets)
        posterior = zm.low_rank(G, 4, diagonal="exact")
        assert jnp.allclose(posterior.diagonal(), zm.diagonal(G), rtol=1e-4, atol=1e-6)
        std = jnp.sqrt(posterior.marginal_variances(damping=1.0))  # a prior precision 1
        draws = posterior.sample(jax.random.key(1), (100,), damping=1.0)  # (100, 20)
        ```
    """
    owner = "zm.low_rank"
    space, view = symmetric_space(operator, owner)
    n, dtype = view.size, view.dtype
    rank = check_int(rank, "rank", owner=owner, minimum=0)
    if rank >= n:
        raise ValueError(
            f"{owner}: `rank` must be an int with 0 <= rank < n = {n} (the operator's size), "
            f"got rank={rank}; for the whole matrix, use jnp.linalg.eigh(operator.as_matrix())."
        )
    given, method = _diagonal_argument(diagonal, n, dtype, owner)
    key = check_key(key, owner=owner, optional=True)
    if method == "estimate":
        if key is None:
            raise TypeError(
                f"{owner}: diagonal='estimate' draws random probes and needs a `key`, e.g. "
                f"key=jax.random.key(0); got key=None."
            )
        if num_probes is None:
            raise TypeError(
                f"{owner}: diagonal='estimate' needs `num_probes`, the number of random "
                f"probes (products with the operator), at least 2; got num_probes=None."
            )
        num_probes = check_int(num_probes, "num_probes", owner=owner, minimum=2)
        if space.sharded and space.explicit:
            raise ValueError(
                f"{owner}: diagonal='estimate' takes Hutchinson's products with the "
                "low-rank part held leaf by leaf, which the variables' Explicit mesh axes "
                "do not yet take; give diagonal='exact' (or the diagonal as an array), or "
                "lay the variables out over Auto axes."
            )
        key, probe_key = jax.random.split(key)

    if rank == 0:
        vectors = space.zeros(0) if space.sharded else jnp.zeros((n, 0), dtype)
        values = jnp.zeros((0,), dtype)
    else:
        values, vectors = eigenpairs(
            operator, rank, owner=owner, tol=tol, max_steps=max_steps, key=key, progress=progress
        )
        values = jnp.maximum(values, 0)
    zeros = jnp.zeros((n,), dtype)
    if space.sharded:
        # Held leaf by leaf, each leaf laid out like its variable; one array replicated
        # over the devices is held flat, as on one device.
        zeros = space.zeros()
        if not is_leafwise(zeros):
            vectors, zeros = space.to_flat(vectors).T, space.to_flat(zeros)
    lowrank = LowRankDiagonal(vectors, values, zeros)

    def held(d):  # a diagonal as the result holds `d`: flat, or laid out leaf by leaf
        flat = eqx.is_array(d) and d.shape == (n,)
        if is_leafwise(zeros):
            return space.constrain(space.from_flat(d)) if flat else d
        return d if flat else space.to_flat(d)

    if method is None and given is None:
        return lowrank
    if method == "estimate":
        probes = dict(method="hutchinson", num_probes=num_probes, key=probe_key)
        whole, _ = diagonal_of(operator, **probes)
        part, _ = diagonal_of(lowrank, **probes)
        remainder = jax.tree_util.tree_map(jnp.subtract, held(whole), held(part))
    else:
        whole = held(diagonal_of(operator) if given is None else given)
        remainder = jax.tree_util.tree_map(jnp.subtract, whole, held(lowrank.diagonal()))
    return LowRankDiagonal(vectors, values, jax.tree_util.tree_map(_nonnegative, remainder))


def _nonnegative(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, 0)


def _diagonal_argument(diagonal: Any, n: int, dtype: Any, owner: str) -> tuple:
    """`(given, method)` of low_rank's `diagonal=`: an `(n,)` array checked, or the name
    of a method; refused in words otherwise."""
    given, method = None, diagonal if isinstance(diagonal, str) else None
    if eqx.is_array(diagonal) or isinstance(diagonal, np.ndarray):
        given = jnp.asarray(diagonal)
        if given.shape != (n,):
            raise ValueError(
                f"{owner}: `diagonal` given as an array must be the operator's diagonal, of "
                f"shape ({n},), got shape {given.shape}."
            )
        check_dtype(given, "diagonal", dtype, owner=owner)
    elif not (diagonal is None or isinstance(diagonal, str) and diagonal in _DIAGONALS):
        raise ValueError(
            f"{owner}: `diagonal` must be None, 'exact', 'estimate' or an ({n},) array of the "
            f"operator's diagonal; got {described(diagonal)}."
        )
    return given, method
