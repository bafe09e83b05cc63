"""The state of `eigsh`'s Lanczos iteration and its moves: a step, the draw of a fresh
direction where a run starts, and the locking of converged pairs. Every move keeps the
basis out of branches and loops of its own: XLA copies a buffer that a branch or an
inner loop reads beside an in-place write, and the basis is the iteration's largest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._operators._vectors import VectorSpace
from ._lanczos import lanczos_step, normal_start, orthogonalised

__all__ = ["LanczosState", "initial_state", "run_step", "redrawn", "relocked"]


class LanczosState(NamedTuple):
    m: Any  # rows of the basis in use
    products: Any  # products made (Lanczos steps), in all runs
    basis: Any  # a block of `max_steps` vectors
    locked_rows: Any  # a copy of its first `k` rows once they are locked pairs
    alphas: jax.Array
    betas: jax.Array
    couplings: jax.Array  # `(max_steps, k)`: each row's products with the locked rows
    locked_residuals: jax.Array  # the residual norms of the locked rows (0 before a lock)
    locks: Any
    vector: Any
    fresh: Any  # the next step starts a run from a new random direction
    start: Any  # the first row of the latest run (0: the run from the start vector)
    norm: Any
    low: Any  # the smallest Ritz value seen: where the spectrum begins, near enough
    finite: Any  # every product so far was finite (a NaN or inf one ends the iteration)
    converged: Any
    values: jax.Array
    vectors: jax.Array
    residuals: jax.Array


def initial_state(space: VectorSpace, key: jax.Array, k: int, max_steps: int) -> LanczosState:
    """No rows in use yet, and a random start vector drawn from `key`."""
    dtype = space.dtype
    return LanczosState(
        m=jnp.asarray(0, jnp.int32),
        products=jnp.asarray(0, jnp.int32),
        basis=space.zeros(max_steps),
        locked_rows=space.zeros(k),
        alphas=jnp.zeros(max_steps, dtype),
        betas=jnp.zeros(max_steps, dtype),
        couplings=jnp.zeros((max_steps, k), dtype),
        locked_residuals=jnp.zeros(k, dtype),
        locks=jnp.asarray(0, jnp.int32),
        vector=normal_start(space, key),
        fresh=jnp.asarray(False),
        start=jnp.asarray(0, jnp.int32),
        norm=jnp.zeros((), dtype),
        low=jnp.asarray(jnp.inf, dtype),
        finite=jnp.asarray(True),
        converged=jnp.asarray(False),
        values=jnp.zeros(k, dtype),
        vectors=jnp.zeros((max_steps, k), dtype),
        residuals=jnp.full(k, jnp.inf, dtype),
    )


def run_step(state: LanczosState, space: VectorSpace, product: Callable, k: int) -> LanczosState:
    """Lanczos step `state.m` from the state's vector; its image's products with the
    locked rows are kept as the row's couplings. A breakdown sets `fresh`, which ends
    the loop of steps: the next run's direction is drawn outside it (`redrawn`)."""
    j = state.m
    basis, alpha, beta, vector, broke, norm, image = lanczos_step(
        space, product, state.basis, j, state.vector, False, state.norm
    )
    # The locked rows from their own copy: a slice of the basis beside the write of
    # this step's row would make XLA copy the whole basis at every step.
    coupling = jnp.where(state.locks > 0, space.block_dot(state.locked_rows, image), 0)
    return state._replace(
        m=j + 1,
        products=state.products + 1,
        basis=basis,
        alphas=state.alphas.at[j].set(alpha),
        betas=state.betas.at[j].set(beta),
        couplings=state.couplings.at[j].set(coupling),
        vector=vector,
        fresh=broke,
        norm=norm,
        finite=state.finite & jnp.isfinite(alpha) & jnp.isfinite(beta),
    )


def redrawn(state: LanczosState, space: VectorSpace, seed: Any) -> LanczosState:
    """Where a run starts (`fresh`, after a breakdown or a lock), its direction: a
    normal vector orthogonal to the rows in use, so that the run is Lanczos on the
    operator restricted to their complement. Drawn between the loops of steps, never
    inside one: a branch that reads the basis inside the steps' loop would make XLA
    copy the basis at every step."""

    def fresh_direction(state):
        drawn = space.normal(seed, state.products)
        return space.normalised(orthogonalised(space, state.basis, state.m - 1, drawn))

    vector = jax.lax.cond(state.fresh, fresh_direction, lambda state: state.vector, state)
    start = jnp.where(state.fresh, state.m, state.start)
    return state._replace(vector=vector, start=start, fresh=jnp.asarray(False))


def relocked(state: LanczosState, space: VectorSpace, k: int, relock: jax.Array) -> LanczosState:
    """Where `relock`, the `k` pairs as the first rows, with their values and residuals,
    the next run starting afresh in their complement (the rows after are left, unread);
    else the state as it is. Only the `k` rows pass through a branch: a branch over the
    whole basis would copy it at every check."""
    max_steps, dtype = state.alphas.shape[0], state.alphas.dtype
    rows = jax.lax.cond(
        relock,
        lambda: space.combine(state.basis, state.vectors),
        lambda: space.map(lambda b: b[:k], state.basis),
    )
    zeros = jnp.zeros_like(state.alphas)
    locked = state._replace(
        m=jnp.asarray(k, jnp.int32),
        alphas=zeros.at[:k].set(state.values),
        betas=zeros,
        couplings=jnp.zeros_like(state.couplings),
        locked_residuals=state.residuals,
        locks=state.locks + 1,
        fresh=jnp.asarray(True),
        start=jnp.asarray(k, jnp.int32),
        vectors=jnp.eye(max_steps, k, dtype=dtype),
    )
    small = jax.tree_util.tree_map(
        lambda new, old: jnp.where(relock, new, old),
        locked._replace(basis=None, locked_rows=None, vector=None),
        state._replace(basis=None, locked_rows=None, vector=None),
    )
    basis = space.map(lambda b, y: b.at[:k].set(y), state.basis, rows)
    return small._replace(basis=basis, locked_rows=rows, vector=state.vector)
