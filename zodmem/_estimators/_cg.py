"""Conjugate gradients over the vectors of a `VectorSpace`, each a pytree laid out like
the operator's variables: `zm.solve` and `zm.marginal_variances` of an operator whose
variables lie over Explicit mesh axes, where the vectors lineax's solvers make inside a
solve carry no layout in their type and cannot meet the operator's products.

The iteration and its stopping rule are `lx.CG`'s, so that a solve gives the same
answer, within its tolerance, whichever axes the model is laid out over: the residual
recomputed from a product every 10 steps, and convergence when every entry of the
residual is within `atol + rtol * |b|` and every entry of the last step within
`atol + rtol * |y|`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._engine._progress import progress_bar
from .._operators._flat import FlatView
from .._operators._operator import BlockedOperator
from .._operators._options import options_of
from .._operators._vectors import VectorSpace
from ._lanczos import space_product

__all__ = [
    "bar_label",
    "conjugate_gradients",
    "laid_out_columns",
    "laid_out_entries",
    "laid_out_solve",
]

# Every this many steps the residual is recomputed from a product, as `lx.CG` does.
_STABILISE_EVERY = 10


def _max_norm(space: VectorSpace, vector: Any) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in space.leaves(vector)]))


def conjugate_gradients(
    space: VectorSpace,
    product: Callable[[Any], Any],
    b: Any,
    *,
    rtol: float,
    atol: float,
    max_steps: int | None,
) -> tuple[Any, jax.Array]:
    """`(y, code)`: the solution of `A y = b`, `A` positive semi-definite given by its
    `product` on vectors of `space`, and its failure code, numbered as `_solve.py`
    numbers its messages: 0 none, 1 the steps ran out (a `max_steps` given), 2 a
    breakdown (or the default 10 n steps spent, as lineax reports it), 3 NaN or inf."""
    steps = 10 * space.size if max_steps is None else max_steps
    rcond = space.size * jnp.finfo(space.dtype).eps

    def scale(vector: Any) -> Any:
        return space.map(lambda x: atol + rtol * jnp.abs(x), vector)

    b_scale = scale(b)

    def not_converged(r: Any, diff: Any, y: Any) -> jax.Array:
        residual = _max_norm(space, space.map(jnp.divide, r, b_scale))
        step = _max_norm(space, space.map(jnp.divide, diff, scale(y)))
        return (residual > 1) | (step > 1)

    def going(state: tuple) -> jax.Array:
        diff, y, r, _, gamma, step, broke = state
        return (gamma > 0) & (step < steps) & ~broke & not_converged(r, diff, y)

    def body(state: tuple) -> tuple:
        _, y, r, p, gamma, step, _ = state
        image = product(p)
        inner = space.dot(image, p)
        broke = ~(jnp.abs(inner) > 100 * rcond * jnp.abs(gamma))
        alpha = gamma / jnp.where(broke, 1, inner)
        diff = space.scale(alpha, p)
        y = space.axpy(1, diff, y)
        step = step + 1
        r = jax.lax.cond(
            step % _STABILISE_EVERY == 0,
            lambda: space.axpy(-1, product(y), b),
            lambda: space.axpy(-alpha, image, r),
        )
        gamma_next = space.dot(r, r)
        p = space.axpy(gamma_next / gamma, p, r)
        return diff, y, r, p, gamma_next, step, broke

    zero = space.zeros()
    start = (space.map(lambda x: jnp.full_like(x, jnp.inf), zero), zero, b, b, space.dot(b, b))
    diff, y, r, _, gamma, step, broke = jax.lax.while_loop(
        going, body, (*start, jnp.asarray(0), jnp.asarray(False))
    )
    finite = jnp.isfinite(gamma) & jnp.isfinite(space.dot(y, y))
    ran_out = (step >= steps) & not_converged(r, diff, y)
    code = jnp.select([~finite, broke, ran_out], [3, 2, 2 if max_steps is None else 1], 0)
    return y, code


@eqx.filter_jit
def laid_out_solve(
    view: FlatView, space: VectorSpace, b: Any, damping: Any, sign: int, settings: tuple
) -> tuple[Any, jax.Array]:
    """`(y, code)`: `(A + damping I) y = b` for `b` a vector of `space` (laid out like
    the variables), by CG on `sign * (A + damping I)` (`sign = -1` for a negative
    semi-definite one); `settings` are `(rtol, atol, max_steps)`."""
    product = space_product(view, space)
    rtol, atol, max_steps = settings

    def damped(vector: Any) -> Any:
        return space.scale(sign, space.axpy(damping, vector, product(vector)))

    b = space.scale(sign, space.as_vector(b))
    return conjugate_gradients(space, damped, b, rtol=rtol, atol=atol, max_steps=max_steps)


def bar_label(operator: Any, progress: bool | None, owner: str) -> str | None:
    """The label of the bar of a solve's columns on Explicit axes (`progress=None`: as
    the operator's transform says), or `None` for no bar."""
    if progress is None:
        transform = operator.transform if isinstance(operator, BlockedOperator) else None
        progress = options_of(transform).progress
    return f"{owner} columns" if progress else None


def _one_by_one(label: str | None, items: jax.Array, solve_one: Callable) -> tuple:
    """`solve_one(item) -> (result, code)` of each of `items` (along their first axis),
    one after another in one loop, stacked; a bar of them where `label`, each step
    reported once its code (a scalar of the solve, which a share of a vector is not)
    is computed."""
    bar = progress_bar(label, items.shape[0], unit="column")
    bar.start()

    def step(done: Any, item: Any) -> tuple:
        result, code = solve_one(item)
        bar.done(done + 1, code)
        return done + 1, (result, code)

    return jax.lax.scan(step, jnp.asarray(0, jnp.int32), items)[1]


@eqx.filter_jit
def laid_out_columns(
    view: FlatView,
    space: VectorSpace,
    columns: jax.Array,
    damping: Any,
    sign: int,
    settings: tuple,
    label: str | None,
) -> tuple[jax.Array, jax.Array]:
    """`(solutions, codes)`: the solves of the `k` columns of `columns` `(n, k)`, one
    after another in one loop, each laid out like the variables for its solve and flat
    again after (`(n, k)` and `(k,)`); a bar of the columns where `label`."""

    def column(b: jax.Array) -> tuple:
        y, code = laid_out_solve(view, space, space.from_flat(b), damping, sign, settings)
        return space.to_flat(y), code

    solutions, codes = _one_by_one(label, columns.T, column)
    return solutions.T, codes


@eqx.filter_jit
def laid_out_entries(
    view: FlatView,
    space: VectorSpace,
    indices: jax.Array,
    damping: Any,
    sign: int,
    settings: tuple,
    label: str | None,
) -> tuple[jax.Array, jax.Array]:
    """`(entries, codes)`: `[(A + damping I)^{-1}]_ii` for each of `indices`, each from
    the solve with the unit vector `e_i` laid out like the variables, read by an inner
    product (no vector gathered); a bar of the unit vectors where `label`."""

    def entry(index: Any) -> tuple:
        unit = space.unit(index)
        y, code = laid_out_solve(view, space, unit, damping, sign, settings)
        return space.dot(unit, y), code

    return _one_by_one(label, indices, entry)
