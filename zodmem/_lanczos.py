"""Lanczos on a symmetric operator: its extreme eigenpairs (`eigsh`); the spectral
density by stochastic Lanczos quadrature builds on its step (`_spectral.py`).

Both keep the whole Krylov basis, one preallocated `(steps, n)` buffer, and orthogonalise
every new vector against all of it (two passes of classical Gram-Schmidt), so the
tridiagonal matrix stays faithful in floating point: no spurious copies of converged
eigenvalues, at the price of `steps * n` numbers of memory and `4 * steps * n` flops a
step beside the product. Every loop is a `lax` loop inside one compiled program, with
the operator's product traced once in its body; `eigsh`'s convergence checks call back
to the host for the wanted eigenpairs of the tridiagonal matrix.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import scipy.linalg

from ._checks import check_bool, check_choice, check_int, check_key, described
from ._compiled import lean_call
from ._flat import FlatView, flat_view
from ._operator import vector_options
from ._progress import progress_bar
from ._random import hashed_bits, key_seed
from ._traceback import public

__all__ = ["EigshInfo", "eigsh"]

# Steps between convergence checks: each one calls back to the host (a fraction of a
# product's time), and a check every step would add that to every product.
_CHECK_EVERY = 4
# A step whose new direction is this many rounding errors of the operator's norm (or
# less) has found an invariant subspace.
_BREAKDOWN = 10.0
# Rows of the Krylov basis a pass of Gram-Schmidt reads at a time.
_CHUNK = 16
# A pass of Gram-Schmidt that leaves less than this fraction of a vector's norm is
# repeated once ("twice is enough").
_TWICE = 2**-0.5


class EigshInfo(NamedTuple):
    """What `eigsh(..., return_info=True)` reports beside the eigenpairs.

    - `num_products`: the number of products with the operator (Lanczos steps) taken.
    - `converged`: whether all `k` wanted pairs met the tolerance.
    - `residual_norms`: the `k` residual norms `|A y - theta y|`, in the order of the
      eigenvalues, as the Lanczos recurrence gives them (`|beta_m s_{m,i}|`).
    """

    num_products: jax.Array
    converged: jax.Array
    residual_norms: jax.Array


# -- checks -------------------------------------------------------------------------------


def _view_of(operator: Any, owner: str) -> FlatView:
    """The operator as flat vectors, refused unless it is real and symmetric."""
    view = flat_view(operator, owner)
    if jnp.issubdtype(view.dtype, jnp.complexfloating):
        raise TypeError(
            f"{owner}: `operator` has the complex dtype {view.dtype}; only real symmetric "
            "operators are supported (float32 or float64)."
        )
    if not jnp.issubdtype(view.dtype, jnp.floating):
        raise TypeError(
            f"{owner}: `operator` has dtype {view.dtype}; only real floating operators "
            "(float32 or float64) are supported."
        )
    if not lx.is_symmetric(operator):
        raise ValueError(
            f"{owner}: `operator` must be symmetric, but {type(operator).__name__} does not "
            "say it is. If it is, tag it: `lx.TaggedLinearOperator(operator, "
            "lx.symmetric_tag)` (or build it with `lx.symmetric_tag`, as in "
            "`lx.MatrixLinearOperator(A, lx.symmetric_tag)`)."
        )
    return view


def _budgeted(operator: Any) -> bool:
    """Whether `operator` is a zodmem operator whose transform has a memory budget."""
    transform = getattr(operator, "transform", None)
    return transform is not None and vector_options(transform)["max_memory"] is not None


def _check_key(key: Any, owner: str) -> jax.Array:
    """`key` checked, `jax.random.key(0)` where it is `None`."""
    key = check_key(key, owner=owner, optional=True)
    return jax.random.key(0) if key is None else key


def _check_positive(value: Any, name: str, owner: str, *, optional: bool = False) -> Any:
    """A positive finite real number (or None when `optional`), as a Python float."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        allowed = "a positive number" + (" or None" if optional else "")
        raise TypeError(f"{owner}: `{name}` must be {allowed}, got {described(value)}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: `{name}` must be a positive finite number, got {value!r}.")
    return float(value)


# -- the Lanczos step ---------------------------------------------------------------------


def _orthogonalise(basis: jax.Array, vector: jax.Array) -> jax.Array:
    """`vector` less its components along the rows of `basis` (rows not yet used are
    zero): classical Gram-Schmidt twice, which leaves it orthogonal to working precision."""
    vector = vector - basis.T @ (basis @ vector)
    return vector - basis.T @ (basis @ vector)


def _projection(basis: jax.Array, j: Any, vector: jax.Array) -> jax.Array:
    """`basis.T @ (basis @ vector)` over rows `0..j` only (the rows after are zero), in
    chunks of `_CHUNK` rows: a step reads the part of the basis it has filled, not all
    of it, and each pass costs as much as a product here."""
    rows, n = basis.shape
    size = min(_CHUNK, rows)

    def chunk(c, total):
        start = jnp.minimum(c * size, rows - size)  # the last chunk may overlap the one before
        block = jax.lax.dynamic_slice_in_dim(basis, start, size, axis=0)
        index = start + jnp.arange(size)
        coefficients = jnp.where((index >= c * size) & (index <= j), block @ vector, 0)
        return total + block.T @ coefficients

    return jax.lax.fori_loop(0, j // size + 1, chunk, jnp.zeros_like(vector))


def _normalised(vector: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(vector)
    return vector / jnp.where(norm > 0, norm, 1)


def _direction(j: Any, n: int, dtype: Any) -> jax.Array:
    """A pseudo-random vector of `n` entries in [-1, 1), different for each `j`: the
    new direction after a breakdown (a branch that seldom runs)."""
    return hashed_bits(n, j).astype(dtype) * 2.0**-31 - 1


def _normal_start(key: jax.Array, n: int, dtype: Any) -> jax.Array:
    """A unit vector of standard normal entries (Box-Muller over hashed words), drawn
    from the words of `key`."""
    seed = key_seed(key)
    # In (0, 1], so that the logarithm is finite.
    u1 = (hashed_bits(n, 0, seed).astype(dtype) + 1) * 2.0**-32
    u2 = hashed_bits(n, 1, seed).astype(dtype) * 2.0**-32
    return _normalised(jnp.sqrt(-2 * jnp.log(u1)) * jnp.cos(2 * math.pi * u2))


def _step(
    product: Callable,
    basis: jax.Array,
    j: Any,
    vector: jax.Array,
    fresh: Any,
    norm: Any,
) -> tuple:
    """Lanczos step `j` from the unit `vector`, orthogonal to rows `0..j-1` of `basis`;
    with `fresh` true, from a new pseudo-random direction (`_direction(j)`) orthogonal
    to them instead, the way to go on once the Krylov space is exhausted.

    Returns `(basis, alpha, beta, next_vector, broke, norm)`: the step's unit vector
    stored as row `j`, the diagonal entry `alpha`, the coupling `beta` to
    `next_vector`, whether the Krylov space broke down here (then `beta` is 0 and the
    next step must be `fresh`), and the running estimate of the operator's norm (the
    largest norm of a product seen).
    """

    def draw(vector):
        drawn = _direction(j, vector.shape[0], basis.dtype)
        return _normalised(_orthogonalise(basis, drawn))

    vector = jax.lax.cond(fresh, draw, lambda vector: vector, vector)
    basis = jax.lax.dynamic_update_index_in_dim(basis, vector, j, axis=0)
    image = product(vector).astype(basis.dtype)
    norm = jnp.maximum(norm, jnp.linalg.norm(image))
    # The three-term recurrence first (its two projections read two rows, not the
    # basis), then one pass of classical Gram-Schmidt against the whole basis, and a
    # second only where that pass removed much (Daniel, Gragg, Kaufman and Stewart's
    # test): each pass reads all of the basis, which costs as much as a product here.
    alpha = jnp.vdot(vector, image)
    previous = basis[jnp.maximum(j - 1, 0)]
    coupling = jnp.where(j > 0, jnp.vdot(previous, image), 0)
    residual = image - alpha * vector - coupling * previous
    before = jnp.linalg.norm(residual)
    residual = residual - _projection(basis, j, residual)
    again = jnp.linalg.norm(residual) < _TWICE * before
    residual = jax.lax.cond(again, lambda r: r - _projection(basis, j, r), lambda r: r, residual)
    beta = jnp.linalg.norm(residual)
    broke = beta <= _BREAKDOWN * jnp.finfo(basis.dtype).eps * norm
    beta = jnp.where(broke, 0, beta)
    return basis, alpha, beta, residual / jnp.where(broke, 1, beta), broke, norm


def _tridiagonal(alphas: jax.Array, betas: jax.Array) -> jax.Array:
    return jnp.diag(alphas) + jnp.diag(betas, 1) + jnp.diag(betas, -1)


# -- eigsh ----------------------------------------------------------------------------------


def _host_ritz(alphas: Any, betas: Any, m: Any, start: Any, k: int) -> tuple:
    """`_ritz` on the host, with NumPy arrays."""
    alphas, betas = np.asarray(alphas), np.asarray(betas)
    m, start, dtype = int(m), int(start), alphas.dtype
    values = np.full(k, -np.inf, dtype)
    vectors = np.zeros((alphas.shape[0], k), dtype)
    residuals = np.full(k, np.inf, dtype)
    found = min(k, m)
    pairs = _largest_pairs(alphas[:m], betas[: m - 1], found)
    values[k - found :], vectors[:m, k - found :] = pairs
    residuals[k - found :] = np.abs(betas[m - 1] * pairs[1][m - 1])
    top, top_vector = _largest_pairs(alphas[start:m], betas[start : m - 1], 1)
    top_residual = np.abs(betas[m - 1] * top_vector[-1, 0])
    return values, vectors, residuals, top[0].astype(dtype), top_residual.astype(dtype)


def _largest_pairs(diagonal: np.ndarray, couplings: np.ndarray, count: int) -> tuple:
    """The `count` largest eigenpairs of a symmetric tridiagonal matrix (ascending)."""
    size = diagonal.shape[0]
    if size == 1:
        return diagonal.copy(), np.ones((1, 1), diagonal.dtype)
    try:
        # Bisection and inverse iteration (LAPACK's stebz and stein): no BLAS threads,
        # and only the wanted pairs.
        values, vectors = scipy.linalg.eigh_tridiagonal(
            diagonal,
            couplings,
            select="i",
            select_range=(size - count, size - 1),
            check_finite=False,
        )
    except np.linalg.LinAlgError:  # inverse iteration failed: the dense solver
        dense = np.diag(diagonal) + np.diag(couplings, 1) + np.diag(couplings, -1)
        values, vectors = np.linalg.eigh(dense)
        values, vectors = values[size - count :], vectors[:, size - count :]
    return values.astype(diagonal.dtype), vectors.astype(diagonal.dtype)


def _ritz(alphas: jax.Array, betas: jax.Array, m: Any, k: int, start: Any) -> tuple:
    """The `k` largest Ritz values of the first `m` steps (ascending), their
    eigenvectors of the tridiagonal matrix (as `(max_steps, k)`) and their residual
    norms; then the largest Ritz value of the steps since the last restart (`start`
    on; that block is decoupled from the earlier ones) and its residual norm.

    Computed on the host, a call back from the compiled loop at each check: the
    tridiagonal eigensolvers there take only the wanted pairs and use no threaded
    BLAS, where a dense `eigh` in the program (LAPACK's syevd on CPU) wakes BLAS
    threads that contend with XLA's own from about 70 steps on, at up to 0.1 s a call.
    """
    dtype = alphas.dtype
    shapes = (
        jax.ShapeDtypeStruct((k,), dtype),
        jax.ShapeDtypeStruct((alphas.shape[0], k), dtype),
        jax.ShapeDtypeStruct((k,), dtype),
        jax.ShapeDtypeStruct((), dtype),
        jax.ShapeDtypeStruct((), dtype),
    )
    # Under `jax.vmap` (the pairs of a batch of operators), one call per operator.
    return jax.pure_callback(
        functools.partial(_host_ritz, k=k),
        shapes,
        alphas,
        betas,
        m,
        start,
        vmap_method="sequential",
    )


class _State(NamedTuple):
    m: Any  # steps taken (products made)
    basis: jax.Array
    alphas: jax.Array
    betas: jax.Array
    vector: jax.Array
    fresh: Any  # the next step starts from a new random direction
    start: Any  # the first step since the last restart
    norm: Any
    converged: Any
    values: jax.Array
    vectors: jax.Array
    residuals: jax.Array


def _eigsh(
    view: FlatView,
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
    n, dtype = view.size, view.dtype
    floor = jnp.finfo(dtype).eps ** (2 / 3)
    product = view.linear()  # built once: a kept linearisation serves every step

    def step(state):
        j = state.m
        basis, alpha, beta, vector, broke, norm = _step(
            lambda v: sign * product(v),
            state.basis,
            j,
            state.vector,
            state.fresh,
            state.norm,
        )
        alphas = state.alphas.at[j].set(alpha)
        betas = state.betas.at[j].set(beta)
        return state._replace(
            m=j + 1,
            basis=basis,
            alphas=alphas,
            betas=betas,
            vector=vector,
            fresh=broke,
            start=jnp.where(state.fresh, j, state.start),
            norm=norm,
        )

    def steps_and_check(state):
        # The steps up to the next check run in a loop of their own: the check is then
        # no branch inside every step's loop, which keeps the program small.
        # No check before 3k steps: the k wanted pairs seldom converge sooner, and each
        # check costs a host round trip.
        stop = jnp.minimum(jnp.maximum(state.m + _CHECK_EVERY, 3 * k), max_steps)
        state = jax.lax.while_loop(lambda state: state.m < stop, step, state)
        values, vectors, residuals, top, top_residual = _ritz(
            state.alphas, state.betas, state.m, k, state.start
        )
        bound = tol * jnp.maximum(jnp.abs(values), floor * state.norm)
        # After a breakdown, the pairs found so far are exact, but wanted ones may lie
        # outside the exhausted space: decide only once the largest eigenvalue of the
        # new direction's space has converged too (or no steps are left).
        top_bound = tol * jnp.maximum(jnp.abs(top), floor * state.norm)
        restarted = (state.start > 0) | state.fresh
        decided = ~restarted | ((top_residual <= top_bound) & ~state.fresh)
        decided = decided | (state.m == max_steps)
        converged = decided & (state.m >= k) & jnp.all(residuals <= bound)
        # The bar counts steps; a converged run fills it at once.
        bar.done(jnp.where(converged, max_steps, state.m), residuals)
        return state._replace(
            converged=converged, values=values, vectors=vectors, residuals=residuals
        )

    def unfinished(state):
        return ~state.converged & (state.m < max_steps)

    init = _State(
        m=jnp.asarray(0, jnp.int32),
        basis=jnp.zeros((max_steps, n), dtype),
        alphas=jnp.zeros(max_steps, dtype),
        betas=jnp.zeros(max_steps, dtype),
        vector=_normal_start(key, n, dtype),
        fresh=jnp.asarray(False),
        start=jnp.asarray(0, jnp.int32),
        norm=jnp.zeros((), dtype),
        converged=jnp.asarray(False),
        values=jnp.zeros(k, dtype),
        vectors=jnp.zeros((max_steps, k), dtype),
        residuals=jnp.full(k, jnp.inf, dtype),
    )
    bar = progress_bar("zm.eigsh steps" if progress else None, max_steps, unit="step")
    bar.start()
    state = jax.lax.while_loop(unfinished, steps_and_check, init)
    eigenvectors = state.basis.T @ state.vectors
    # Ascending for A: the largest of -A, negated, come in descending order.
    smallest = sign < 0
    values = jnp.where(smallest, -state.values[::-1], state.values)
    eigenvectors = jnp.where(smallest, eigenvectors[:, ::-1], eigenvectors)
    residuals = jnp.where(smallest, state.residuals[::-1], state.residuals)
    return values, eigenvectors, EigshInfo(state.m, state.converged, residuals)


_eigsh_jit = eqx.filter_jit(_eigsh)


def _default_max_steps(n: int, k: int) -> int:
    return min(n, max(100, 10 * k))


@public
def eigsh(
    operator: Any,
    k: Any,
    *,
    which: Any = "LA",
    tol: Any = 1e-6,
    max_steps: Any = None,
    key: Any = None,
    pytree: Any = False,
    return_info: Any = False,
    progress: Any = False,
) -> Any:
    """The `k` largest or smallest eigenvalues of a symmetric operator, and their
    eigenvectors, from its products with vectors only.

    Use it for the top of a Hessian's or Gauss-Newton matrix's spectrum (sharpness, the
    directions of largest curvature) or its most negative eigenvalues, where the
    `(n, n)` matrix does not fit: it follows `scipy.sparse.linalg.eigsh`'s convention.
    The method is Lanczos with full reorthogonalisation from a random start, in one
    compiled loop that stops as soon as the `k` wanted Ritz pairs `(theta_i, y_i)` have
    converged:

    `|A y_i - theta_i y_i| = |beta_m s_{m,i}| <= tol * max(|theta_i|, eps**(2/3) * |A|)`

    with `beta_m` the last Lanczos coupling, `s_{m,i}` the last entry of the tridiagonal
    matrix's eigenvector, `eps` the dtype's rounding unit and `|A|` the largest norm of
    a product seen (the floor lets eigenvalues at 0 converge). Convergence is checked
    every 4 steps and at the last one, by the wanted eigenpairs of the tridiagonal
    matrix, computed on the host (a call back from the loop that takes a fraction of a
    product's time; nothing else leaves the device). A breakdown (an invariant Krylov
    space) goes on from a new pseudo-random direction orthogonal to the basis, and then
    the pairs are taken as converged only once the largest one of the new space has
    converged too: eigenvalues outside the space so far may still be wanted.

    **Arguments:**

    - `operator`: a symmetric real operator: a zodmem curvature operator
      (`zm.BatchedHessian(f).operator(x, *args)`, `zm.BatchedGGN(fn, loss).operator(...)`,
      one wrapped in `zm.Microbatcher`) or any `lineax` operator that `lx.is_symmetric`
      accepts.
    - `k`: how many eigenpairs, `1 <= k < n` (`n` the operator's size).
    - `which`: `"LA"` for the largest (algebraic) eigenvalues, `"SA"` for the smallest.
    - `tol`: the relative residual tolerance above.
    - `max_steps`: the most Lanczos steps (products), `k + 1 <= max_steps <= n`; by
      default `min(n, max(100, 10 * k))`, enough for the top 5 of a typical network's
      Hessian to converge to `1e-6`. It sizes the basis: `max_steps * n` numbers.
    - `key`: a `jax.random` key, whose words seed the pseudo-random normal start
      vector (default `jax.random.key(0)`).
    - `pytree`: return the eigenvectors shaped like the operator's input (for a zodmem
      operator, like `x`'s variables) instead of as flat columns.
    - `return_info`: also return an `EigshInfo`, and never raise for non-convergence.
    - `progress`: a progress bar of the Lanczos steps on stderr, out of `max_steps` (filled
      when the pairs converge).

    **Returns:**

    `(eigenvalues, eigenvectors)`: the `k` eigenvalues in ascending order (both for
    `"LA"` and `"SA"`, as scipy), and the eigenvectors as an `(n, k)` array of unit
    columns (column `i` for eigenvalue `i`; signs are arbitrary), or with `pytree=True`
    a pytree like the input whose leaves have a leading axis of `k` (eigenvector `i`
    is `jax.tree_util.tree_map(lambda leaf: leaf[i], eigenvectors)`). Both in the
    operator's dtype. With `return_info=True`, `(eigenvalues, eigenvectors, info)`.

    Not converged within `max_steps`, it raises (an `EquinoxRuntimeError`, eagerly and
    under `jax.jit` alike) unless `return_info=True`, which returns the current Ritz
    pairs with `info.converged` false.

    **Cost:** as many products as steps (at most `max_steps`), and memory for the basis,
    `max_steps * n` numbers, beside one product's. Each step also orthogonalises against
    the basis (`4 * max_steps * n` flops). One compiled program per operator type,
    shapes, `k` and `max_steps` (not per `which`, `tol` or `key`). For a zodmem operator
    whose transform has a `max_memory`, on a CPU, the program is compiled with XLA's
    older fusion emitters: the compiler's heap, part of the process's peak while it
    compiles, is then about a third (on the benchmarks page's network, 20-30 MB against
    75-110 MB), for steps up to a tenth slower.

    !!! warning

        One start vector finds one copy of each eigenvalue: an eigenvalue of
        multiplicity 2 or more among the wanted ones (exactly repeated, not merely
        close) may be returned once, and the next one in its place. Only where the
        Krylov space is exhausted (a breakdown, as for an operator with few distinct
        eigenvalues) do the restarts find the other copies, at the price of more
        steps, up to `n`.

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
    owner = "zm.eigsh"
    view = _view_of(operator, owner)
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
    tol = _check_positive(tol, "tol", owner)
    max_steps = check_int(max_steps, "max_steps", owner=owner, optional=True)
    if max_steps is None:
        max_steps = _default_max_steps(n, k)
    elif not k + 1 <= max_steps <= n:
        raise ValueError(
            f"{owner}: `max_steps` must be an int with k + 1 = {k + 1} <= max_steps <= n = "
            f"{n}, got max_steps={max_steps}."
        )
    key = _check_key(key, owner)
    check_bool(pytree, "pytree", owner=owner)
    check_bool(return_info, "return_info", owner=owner)
    check_bool(progress, "progress", owner=owner)

    sign = jnp.asarray(1 if which == "LA" else -1, view.dtype)
    inputs = (view, key, jnp.asarray(tol, view.dtype), sign, k, max_steps, progress)
    if _budgeted(operator):
        # Under a budget the compiler's own heap counts: the program is compiled lean.
        values, vectors, info = lean_call(_eigsh, *inputs)
    else:
        values, vectors, info = _eigsh_jit(*inputs)
    if not return_info:
        values = eqx.error_if(
            values,
            ~info.converged,
            f"{owner}: the {k} eigenpairs did not converge to tol={tol} within "
            f"max_steps={max_steps} Lanczos steps. Give a larger `max_steps` (at most "
            f"n = {n}) or `tol`, or pass `return_info=True` for the partial result and "
            "its residual norms.",
        )
    if pytree:
        vectors = view.unflatten(vectors.T)
    return (values, vectors, info) if return_info else (values, vectors)
