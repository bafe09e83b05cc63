"""The extreme eigenpairs of a symmetric operator by Lanczos (`eigsh`), in one compiled
loop with the operator's product traced once in its body; each convergence check calls
back to the host for the wanted eigenpairs of the tridiagonal matrix (`_ritz.py`).

One start vector finds one copy of each eigenvalue, and the copies of a tight cluster
only slowly, while the residuals of the copies it has found are already small: `eigsh`
therefore locks its converged pairs into the first rows of the buffer and checks them
with a second run, from a fresh random start in their orthogonal complement, which must
find nothing larger than the `k`-th (and, where it does, relocks and checks again).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._checks import Integer, Number, check_bool, check_choice, check_int, typechecked
from .._engine._layout import canonical_body
from .._engine._progress import progress_bar
from .._operators._arguments import check_positive, is_traced, key_or_default
from .._operators._flat import FlatView
from .._operators._vectors import VectorSpace
from .._plan._memory import format_bytes
from .._traceback import public
from ._eigsh_steps import LanczosState, initial_state, redrawn, relocked, run_step
from ._held import operator_budget, run_within_budget
from ._lanczos import space_product, symmetric_space
from ._random import key_seed
from ._ritz import ritz_pairs

__all__ = ["EigshInfo", "eigenpairs", "eigsh"]

# Steps between convergence checks: each one calls back to the host (a fraction of a
# product's time), and a check every step would add that to every product.
_CHECK_EVERY = 4
# The chance, for the worst spectrum, that a check run passes over an eigenvalue larger
# than the k-th found one (Kuczynski and Wozniakowski's bound for a random start).
_MISS_CHANCE = 1e-3


class EigshInfo(NamedTuple):
    """What `eigsh(..., return_info=True)` reports beside the eigenpairs.

    - `num_products`: the number of products with the operator (Lanczos steps) taken,
      the check runs' included.
    - `converged`: whether all `k` wanted pairs met the tolerance and passed the check
      for missed copies.
    - `residual_norms`: the `k` residual norms `|A y - theta y|`, in the order of the
      eigenvalues, as the Lanczos recurrence gives them (`|beta_m s_{m,i}|`, and for
      pairs of a check run bounds that count its products with the locked pairs).
    """

    num_products: Int[Array, ""]
    converged: Bool[Array, ""]
    residual_norms: Float[Array, " k"]


def _checked(state: LanczosState, space: VectorSpace, k: int, tol: jax.Array) -> LanczosState:
    """The state after a convergence check: its `k` Ritz pairs, whether they met `tol`
    and passed the check for missed copies, and where that check found a missed copy
    (or none was made yet), the best `k` pairs locked again."""
    n, dtype = space.size, space.dtype
    floor = jnp.finfo(dtype).eps ** (2 / 3)
    # A run of p steps from a random start whose largest Ritz value falls short of the
    # k-th found one by a fraction f of the spectrum's width below it hides a larger
    # eigenvalue with a chance under 1.648 sqrt(n) exp(-(2p - 1) sqrt(f)) (Kuczynski and
    # Wozniakowski): under `_MISS_CHANCE` once `(2p - 1) sqrt(f)` reaches this.
    assurance = math.log(1.648 * math.sqrt(n) / _MISS_CHANCE)
    arrays = (state.alphas, state.betas, state.couplings, state.locked_residuals)
    # The host's tridiagonal solvers fail on NaN or inf; the loop ends on such a state,
    # and the caller refuses it in words.
    arrays = tuple(jnp.where(state.finite, array, 0) for array in arrays)
    values, vectors, residuals, top, top_residual, low = ritz_pairs(
        *arrays, state.m, state.start, k
    )
    low = jnp.minimum(state.low, low)
    bound = tol * jnp.maximum(jnp.abs(values), floor * state.norm)
    paired = (state.m >= k) & jnp.all(residuals <= bound)
    # A run from a fresh direction (after a breakdown or a lock) is a check: the
    # operator in the complement of the rows before it has no eigenvalue above its
    # largest Ritz value, once that has converged or, short of the k-th found one,
    # once the run is long enough that a larger one would have shown.
    kth = values[0]
    top_bound = tol * jnp.maximum(jnp.abs(top), floor * state.norm)
    shortfall = jnp.maximum(kth - top, 0) / jnp.maximum(kth - low, jnp.finfo(dtype).tiny)
    long_enough = (2 * (state.m - state.start) - 1) * jnp.sqrt(shortfall) >= assurance
    checked = (state.start > 0) & ((top_residual <= top_bound) | long_enough)
    found_nothing = checked & (top <= kth + bound[0])
    # The largest eigenvalue needs no check: a missed copy of it changes no value.
    unchecked = (state.start == 0) & ~state.fresh if k == 1 else False
    whole = state.m == n  # the rows span the space
    converged = paired & (found_nothing | unchecked | whole)
    # The check found a missed copy (or none was made yet): lock the best k again.
    relock = paired & ~converged & ~state.fresh & ((state.start == 0) | checked)
    relock = relock & (state.locks <= k)
    state = state._replace(
        converged=converged, values=values, vectors=vectors, residuals=residuals, low=low
    )
    return relocked(state, space, k, relock)


def _eigsh(
    view: FlatView,
    space: VectorSpace,
    key: jax.Array,
    tol: jax.Array,
    sign: jax.Array,
    k: int,
    max_steps: int,
    progress: bool = False,
) -> tuple:
    """The Lanczos iteration of `eigsh`, compiled once per operator type and shapes:
    the `k` largest eigenpairs of `sign * A` (so `sign = -1` gives the smallest of `A`,
    with the same program)."""
    product = space_product(view, space)  # built once: a kept linearisation serves every step
    seed = key_seed(key)

    def step(state):
        return run_step(state, space, lambda vector: space.scale(sign, product(vector)), k)

    def steps_and_check(state):
        # The steps up to the next check run in a loop of their own: the check is then
        # no branch inside every step's loop, which keeps the program small.
        # No check before 3k steps: the k wanted pairs seldom converge sooner, and each
        # check costs a host round trip. A breakdown ends the steps early.
        state = redrawn(state, space, seed)
        stop = jnp.minimum(jnp.maximum(state.m + _CHECK_EVERY, 3 * k), max_steps)
        going = lambda state: (state.m < stop) & state.finite & ~state.fresh  # noqa: E731
        state = jax.lax.while_loop(going, canonical_body(step), state)
        state = _checked(state, space, k, tol)
        # The bar counts products; a run that ends fills it.
        count = jnp.where(unfinished(state), jnp.minimum(state.products, max_steps - 1), max_steps)
        bar.done(count, state.residuals)
        return state

    def unfinished(state):
        return ~state.converged & (state.m < max_steps) & state.finite

    init = initial_state(space, key, k, max_steps)
    bar = progress_bar("zm.eigsh steps" if progress else None, max_steps, unit="step")
    bar.start()
    state = jax.lax.while_loop(unfinished, canonical_body(steps_and_check), init)
    # A block of `k` vectors, laid out like the basis.
    eigenvectors = space.constrain(space.combine(state.basis, state.vectors), block=True)
    # Ascending for A: the largest of -A, negated, come in descending order.
    smallest = sign < 0
    values = jnp.where(smallest, -state.values[::-1], state.values)
    eigenvectors = space.map(lambda y: jnp.where(smallest, y[::-1], y), eigenvectors)
    residuals = jnp.where(smallest, state.residuals[::-1], state.residuals)
    info = EigshInfo(state.products, state.converged & state.finite, residuals)
    return values, eigenvectors, info, state.finite


def _default_max_steps(n: int, k: int) -> int:
    return min(n, max(100, 10 * k))


# The eigenvalues, ascending, and the eigenvectors: flat columns, or a pytree whose leaves
# have a leading axis of `k`.
Eigenpairs = (
    tuple[Float[Array, " k"], Float[Array, "n k"] | PyTree[Float[Array, "k ..."]]]
    | tuple[Float[Array, " k"], Float[Array, "n k"] | PyTree[Float[Array, "k ..."]], EigshInfo]
)


@public
@typechecked
def eigsh(
    operator: lx.AbstractLinearOperator,
    k: Integer,
    *,
    which: Literal["LA", "SA"] = "LA",
    tol: Number = 1e-6,
    max_steps: Integer | None = None,
    key: PRNGKeyArray | None = None,
    pytree: bool = False,
    return_info: bool = False,
    progress: bool = False,
) -> Eigenpairs:
    """The `k` largest or smallest eigenvalues of a symmetric operator, and their
    eigenvectors, from its products with vectors only.

    Use it for the top of a Hessian's or Gauss-Newton matrix's spectrum (sharpness, the
    directions of largest curvature) or its most negative eigenvalues, where the
    `(n, n)` matrix does not fit: it follows `scipy.sparse.linalg.eigsh`'s convention.
    The method is Lanczos with full reorthogonalisation from a random start, in one
    compiled loop. Its `k` wanted Ritz pairs `(theta_i, y_i)` have converged when

    `|A y_i - theta_i y_i| = |beta_m s_{m,i}| <= tol * max(|theta_i|, eps**(2/3) * |A|)`

    with `beta_m` the last Lanczos coupling, `s_{m,i}` the last entry of the tridiagonal
    matrix's eigenvector, `eps` the dtype's rounding unit and `|A|` the largest norm of
    a product seen (the floor lets eigenvalues at 0 converge). Convergence is checked
    every 4 steps and at the last one, by the wanted eigenpairs of the tridiagonal
    matrix, computed on the host (a call back from the loop that takes a fraction of a
    product's time; nothing else leaves the device).

    Small residuals do not show that no wanted eigenvalue is missing: one start vector
    finds one copy of a repeated eigenvalue, and the copies of a tight cluster only
    after many steps, while the residuals of those it has found are small already. So for
    `k >= 2` the converged pairs are locked (kept as the first rows of the basis) and
    checked by a second Lanczos run from a fresh random start orthogonal to them, on
    the operator in their complement. They pass once that run's largest Ritz value has
    converged to no more than the `k`-th eigenvalue found (plus its tolerance), or lies
    so far below it, for the run's length, that a larger eigenvalue would have shown
    but with a chance under `1e-3` whatever the spectrum (Kuczynski and Wozniakowski's
    bound for Lanczos from a random start). Where the run finds a larger one (a missed
    copy), the best `k` pairs of both runs are locked and checked again. A breakdown
    (an invariant Krylov space) goes on in the same way, from a fresh random direction
    orthogonal to the basis.

    **Arguments:**

    - `operator`: a symmetric real operator: a zodmem curvature operator
      (`zm.BatchedHessian(f).operator(x, *args)`, `zm.BatchedGGN(fn, loss).operator(...)`,
      one wrapped in `zm.Microbatcher`) or any `lineax` operator that `lx.is_symmetric`
      accepts.
    - `k`: how many eigenpairs, `1 <= k < n` (`n` the operator's size).
    - `which`: `"LA"` for the largest (algebraic) eigenvalues, `"SA"` for the smallest.
    - `tol`: the relative residual tolerance above.
    - `max_steps`: the size of the basis, `max_steps * n` numbers, and so the most
      Lanczos steps (products) of a run: the first one, and each check, which starts
      again from the `k` locked pairs; `k + 1 <= max_steps <= n`. By default
      `min(n, max(100, 10 * k))`, enough for the top 5 of a typical network's Hessian
      to converge to `1e-6` and be checked.
    - `key`: a `jax.random` key, whose words seed the pseudo-random normal start
      vector (default `jax.random.key(0)`).
    - `pytree`: return the eigenvectors shaped like the operator's input (for a zodmem
      operator, like `x`'s variables) instead of as flat columns. Where the variables
      are sharded over several devices, they always come back so, each leaf laid out
      like its variable (never gathered): the basis there is stored leaf by leaf,
      `(max_steps, *leaf.shape)` and sharded as the leaf.
    - `return_info`: also return an `EigshInfo`, and never raise for non-convergence.
    - `progress`: a progress bar of the Lanczos steps on stderr, out of `max_steps` (filled
      when the iteration ends).

    **Returns:**

    `(eigenvalues, eigenvectors)`: the `k` eigenvalues in ascending order (both for
    `"LA"` and `"SA"`, as scipy), and the eigenvectors as an `(n, k)` array of unit
    columns (column `i` for eigenvalue `i`; signs are arbitrary), or with `pytree=True`
    a pytree like the input whose leaves have a leading axis of `k` (eigenvector `i`
    is `jax.tree_util.tree_map(lambda leaf: leaf[i], eigenvectors)`). Both in the
    operator's dtype. With `return_info=True`, `(eigenvalues, eigenvectors, info)`.

    Converged, the pairs' residuals are within `tol`, and every eigenvalue larger than
    the `k`-th returned one by more than its tolerance is among those returned, as often
    as it occurs (but for the check's chance of `1e-3`): a wanted eigenvalue of
    multiplicity 2 or more comes back as many times, and a cluster of wanted eigenvalues
    comes back whole, however tight. For `k = 1` no check runs: a missed copy of the
    largest eigenvalue changes no value. Not converged, or not checked, within a run of
    `max_steps` steps, it raises (an `EquinoxRuntimeError`, eagerly and under `jax.jit`
    alike) unless `return_info=True`, which returns the current Ritz pairs with
    `info.converged` false. A product that is NaN or inf (say, of an operator with a NaN
    parameter) ends the iteration and raises whatever `return_info`: a `ValueError`
    eagerly, an `EquinoxRuntimeError` under `jax.jit` when the program runs.

    **Cost:** as many products as steps, and memory for the basis, `max_steps * n`
    numbers, beside one product's. Each step also orthogonalises against the basis
    (`4 * max_steps * n` flops). For `k >= 2` the check adds a run of its own: the
    fewer steps the clearer the `k`-th eigenvalue stands above the rest (a dozen or so
    for a few outliers), up to about as many as the first run where it lies in a dense
    part of the spectrum, and a run more for each missed copy it finds. One compiled
    program per operator type, shapes, `k` and `max_steps` (not per `which`, `tol` or
    `key`). Where the operator's transform has a `max_memory`, that program is compiled
    first and, where XLA counts it over the budget on a device (the basis, each device's
    share of it where the variables are sharded, beside a product), refused before it
    runs with a `zm.MemoryBudgetError` naming the least budget that holds it.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def loss(w):
            return jnp.sum(jnp.arange(1.0, 31.0) * w**2) + jnp.sum(w) ** 2

        op = zm.BatchedHessian(loss).operator(jnp.zeros(30))
        values, vectors = zm.eigsh(op, 3)  # the 3 largest, ascending
        assert vectors.shape == (30, 3)
        ```
    """
    return eigenpairs(
        operator,
        k,
        owner="zm.eigsh",
        which=which,
        tol=tol,
        max_steps=max_steps,
        key=key,
        pytree=pytree,
        return_info=return_info,
        progress=progress,
    )


def eigenpairs(
    operator: Any,
    k: Any,
    *,
    owner: str,
    which: Any = "LA",
    tol: Any = 1e-6,
    max_steps: Any = None,
    key: Any = None,
    pytree: Any = False,
    return_info: Any = False,
    progress: Any = False,
) -> Any:
    """`eigsh` for a caller `owner` (`"zm.eigsh"`, `"zm.low_rank"`) that its messages name.
    The caller's annotations check the arguments' types; these take anything, so that
    the checks below word a refusal where they say more."""
    space, view = symmetric_space(operator, owner)
    n = view.size
    if n < 2:
        raise ValueError(f"{owner}: `operator` has size {n}; eigsh needs a size of at least 2.")
    k = check_int(k, "k", owner=owner, minimum=1)
    if k >= n:
        raise ValueError(
            f"{owner}: `k` must be an int with 1 <= k < n = {n} (the operator's size), got "
            f"k={k}; for all the eigenvalues, use jnp.linalg.eigh(operator.as_matrix())."
        )
    check_choice(which, "which", ("LA", "SA"), owner=owner)
    tol = check_positive(tol, "tol", owner)
    max_steps = check_int(max_steps, "max_steps", owner=owner, optional=True)
    if max_steps is None:
        max_steps = _default_max_steps(n, k)
    elif not k + 1 <= max_steps <= n:
        raise ValueError(
            f"{owner}: `max_steps` must be an int with k + 1 = {k + 1} <= max_steps <= n = "
            f"{n}, got max_steps={max_steps}."
        )
    key = key_or_default(key, owner)
    # Their own words for `pytree` and `return_info`, which other estimators lack.
    check_bool(pytree, "pytree", owner=owner)
    check_bool(return_info, "return_info", owner=owner)

    sign = jnp.asarray(1 if which == "LA" else -1, view.dtype)
    inputs = (view, space, key, jnp.asarray(tol, view.dtype), sign, k, max_steps, progress)
    held = (
        f"a basis of max_steps={max_steps} vectors of n={n:,}, "
        f"{format_bytes(space.bytes_per_device(max_steps))} of it"
    )
    budget = operator_budget(view.operator)
    values, vectors, info, finite = run_within_budget(
        _eigsh, inputs, budget=budget, owner=owner, held=held
    )
    values = _finite(values, finite, owner)
    if not return_info:
        message = (
            f"{owner}: the {k} eigenpairs did not converge to tol={tol} within "
            f"max_steps={max_steps} Lanczos steps. Give a larger `max_steps` (at most "
            f"n = {n}) or `tol`, or pass `return_info=True` for the partial result and "
            "its residual norms."
        )
        values = _refused_unless(values, info.converged, message, eqx.EquinoxRuntimeError)
    if space.sharded:
        pass  # already a pytree like the variables, each leaf laid out like its variable
    elif pytree:
        vectors = view.unflatten(vectors)
    else:
        vectors = vectors.T
    return (values, vectors, info) if return_info else (values, vectors)


def _finite(values: jax.Array, finite: jax.Array, owner: str) -> jax.Array:
    """`values`, refused where a product of the operator was NaN or inf: Lanczos on it
    has no meaning. Concrete, at once (a ValueError); traced, when the program runs."""
    message = (
        f"{owner}: the operator's products with vectors are not finite (NaN or inf), so "
        "it has no eigenpairs to find. Check the operator's parameters and data (the point "
        "`x` and the arguments of its function) for NaN or inf values."
    )
    return _refused_unless(values, finite, message, ValueError)


def _refused_unless(values: jax.Array, ok: jax.Array, message: str, error: type) -> jax.Array:
    """`values` where `ok`; else `error(message)`, raised here where `ok` is concrete (no
    program compiled for the check), or by `eqx.error_if` when a traced program runs."""
    if is_traced(ok):
        return eqx.error_if(values, ~ok, message)
    if not bool(ok):
        raise error(message)
    return values
