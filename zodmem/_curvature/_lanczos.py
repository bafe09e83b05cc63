"""Lanczos on a symmetric operator: its extreme eigenpairs (`eigsh`); the spectral
density by stochastic Lanczos quadrature builds on its step (`_spectral.py`).

Both keep the whole Krylov basis, one preallocated `(steps, n)` buffer, and orthogonalise
every new vector against all of it (two passes of classical Gram-Schmidt), so the
tridiagonal matrix stays faithful in floating point: no spurious copies of converged
eigenvalues, at the price of `steps * n` numbers of memory and `4 * steps * n` flops a
step beside the product. Every loop is a `lax` loop inside one compiled program, with
the operator's product traced once in its body; `eigsh`'s convergence checks call back
to the host for the wanted eigenpairs of the tridiagonal matrix.

One start vector finds one copy of each eigenvalue, and the copies of a tight cluster
only slowly, while the residuals of the copies it has found are already small: `eigsh`
therefore locks its converged pairs into the first rows of the buffer and checks them
with a second run, from a fresh random start in their orthogonal complement, which must
find nothing larger than the `k`-th (and, where it does, relocks and checks again).
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

from .._checks import check_bool, check_choice, check_int, check_key, described
from .._engine._layout import canonical_body
from .._engine._progress import progress_bar
from .._traceback import public
from ._flat import FlatView, flat_view
from ._random import hashed_bits, key_seed

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
    """A unit vector of standard normal entries, drawn from the words of `key`."""
    return _normal_direction(key_seed(key), 0, n, dtype)


def _normal_direction(seed: Any, draw: Any, n: int, dtype: Any) -> jax.Array:
    """Unit vector number `draw` of standard normal entries (Box-Muller over hashed
    words) for the 32-bit `seed`: uniform on the sphere, as a random start must be."""
    # In (0, 1], so that the logarithm is finite.
    u1 = (hashed_bits(n, 2 * draw, seed).astype(dtype) + 1) * 2.0**-32
    u2 = hashed_bits(n, 2 * draw + 1, seed).astype(dtype) * 2.0**-32
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
    return _step_with_image(product, basis, j, vector, fresh, norm)[:-1]


def _step_with_image(
    product: Callable,
    basis: jax.Array,
    j: Any,
    vector: jax.Array,
    fresh: Any,
    norm: Any,
) -> tuple:
    """`_step`, and last the product of the step's vector (its image)."""

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
    return basis, alpha, beta, residual / jnp.where(broke, 1, beta), broke, norm, image


def _tridiagonal(alphas: jax.Array, betas: jax.Array) -> jax.Array:
    return jnp.diag(alphas) + jnp.diag(betas, 1) + jnp.diag(betas, -1)


# -- eigsh ----------------------------------------------------------------------------------


def _host_ritz(
    alphas: Any,
    betas: Any,
    couplings: Any,
    locked_residuals: Any,
    m: Any,
    start: Any,
    k: int,
) -> tuple:
    """`_ritz` on the host, with NumPy arrays."""
    alphas, betas = np.asarray(alphas), np.asarray(betas)
    couplings, locked_residuals = np.asarray(couplings), np.asarray(locked_residuals)
    m, start, dtype = int(m), int(start), alphas.dtype
    values = np.full(k, -np.inf, dtype)
    vectors = np.zeros((alphas.shape[0], k), dtype)
    residuals = np.full(k, np.inf, dtype)
    found = min(k, m)
    pairs = _largest_pairs(alphas[:m], betas[: m - 1], found)
    values[k - found :], vectors[:m, k - found :] = pairs
    # A pair's residual has a part along the next Lanczos vector, one along the locked
    # Ritz vectors (the products with them that the tridiagonal matrix leaves out),
    # orthogonal to it, and the locked vectors' own residuals in the pair's shares of them.
    shares = pairs[1]
    along_next = betas[m - 1] * shares[m - 1]
    along_locked = np.linalg.norm(couplings[:m].T @ shares, axis=0)
    locked = min(k, m)
    inherited = locked_residuals[:locked] @ np.abs(shares[:locked])
    residuals[k - found :] = np.hypot(along_next, along_locked) + inherited
    top, top_vector = _largest_pairs(alphas[start:m], betas[start : m - 1], 1)
    top_residual = np.abs(betas[m - 1] * top_vector[-1, 0])
    low = _smallest_value(alphas[:m], betas[: m - 1])
    scalars = (top[0], top_residual, low)
    return (values, vectors, residuals, *(np.asarray(x, dtype) for x in scalars))


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


def _smallest_value(diagonal: np.ndarray, couplings: np.ndarray) -> Any:
    """The smallest eigenvalue of a symmetric tridiagonal matrix (by bisection)."""
    if diagonal.shape[0] == 1:
        return diagonal[0]
    return scipy.linalg.eigvalsh_tridiagonal(
        diagonal, couplings, select="i", select_range=(0, 0), check_finite=False
    )[0]


class _State(NamedTuple):
    m: Any  # rows of the basis in use
    products: Any  # products made (Lanczos steps), in all runs
    basis: jax.Array
    alphas: jax.Array
    betas: jax.Array
    couplings: jax.Array  # `(max_steps, k)`: each row's products with the locked rows
    locked_residuals: jax.Array  # the residual norms of the locked rows (0 before a lock)
    locks: Any
    vector: jax.Array
    fresh: Any  # the next step starts a run from a new random direction
    start: Any  # the first row of the latest run (0: the run from the start vector)
    norm: Any
    low: Any  # the smallest Ritz value seen: where the spectrum begins, near enough
    converged: Any
    values: jax.Array
    vectors: jax.Array
    residuals: jax.Array


def _ritz(state: _State, k: int) -> tuple:
    """The `k` largest Ritz values of the rows in use (ascending), their eigenvectors
    of the Rayleigh-Ritz matrix (as `(max_steps, k)`) and bounds on their residual
    norms; the largest Ritz value of the latest run (rows `start` on, decoupled from the
    rows before), and its residual norm; and the smallest Ritz value.

    The Rayleigh-Ritz matrix is the tridiagonal one: the locked rows are Ritz vectors
    (their values on the diagonal, uncoupled), and their products with the rows after,
    about their residuals in size, count in the residual bounds instead.

    Computed on the host, a call back from the compiled loop at each check: the
    tridiagonal eigensolvers there take only the wanted pairs and use no threaded
    BLAS, where a dense `eigh` in the program (LAPACK's syevd on CPU) wakes BLAS
    threads that contend with XLA's own once the basis grows.
    """
    dtype = state.alphas.dtype
    scalar = jax.ShapeDtypeStruct((), dtype)
    shapes = (
        jax.ShapeDtypeStruct((k,), dtype),
        jax.ShapeDtypeStruct((state.alphas.shape[0], k), dtype),
        jax.ShapeDtypeStruct((k,), dtype),
        scalar,
        scalar,
        scalar,
    )
    # Under `jax.vmap` (the pairs of a batch of operators), one call per operator.
    return jax.pure_callback(
        functools.partial(_host_ritz, k=k),
        shapes,
        state.alphas,
        state.betas,
        state.couplings,
        state.locked_residuals,
        state.m,
        state.start,
        vmap_method="sequential",
    )


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
    seed = key_seed(key)
    # A run of p steps from a random start whose largest Ritz value falls short of the
    # k-th found one by a fraction f of the spectrum's width below it hides a larger
    # eigenvalue with a chance under 1.648 sqrt(n) exp(-(2p - 1) sqrt(f)) (Kuczynski and
    # Wozniakowski): under `_MISS_CHANCE` once `(2p - 1) sqrt(f)` reaches this.
    assurance = math.log(1.648 * math.sqrt(n) / _MISS_CHANCE)

    def fresh_direction(state):
        # A normal vector, orthogonal to the rows in use: a run from it is Lanczos on
        # the operator restricted to their complement.
        drawn = _normal_direction(seed, state.products, n, dtype)
        drawn = drawn - _projection(state.basis, state.m - 1, drawn)
        return _normalised(drawn - _projection(state.basis, state.m - 1, drawn))

    def step(state):
        j = state.m
        vector = jax.lax.cond(state.fresh, fresh_direction, lambda state: state.vector, state)
        basis, alpha, beta, vector, broke, norm, image = _step_with_image(
            lambda v: sign * product(v), state.basis, j, vector, False, state.norm
        )
        coupling = jnp.where(state.locks > 0, basis[:k] @ image, 0)
        return state._replace(
            m=j + 1,
            products=state.products + 1,
            basis=basis,
            alphas=state.alphas.at[j].set(alpha),
            betas=state.betas.at[j].set(beta),
            couplings=state.couplings.at[j].set(coupling),
            vector=vector,
            fresh=broke,
            start=jnp.where(state.fresh, j, state.start),
            norm=norm,
        )

    def lock(state):
        # The k pairs become the first rows, with their values and residuals; the next
        # run starts afresh in their complement (the rows after are left, unread).
        ritz_vectors = state.basis.T @ state.vectors
        zeros = jnp.zeros_like(state.alphas)
        return state._replace(
            m=jnp.asarray(k, jnp.int32),
            basis=state.basis.at[:k].set(ritz_vectors.T),
            alphas=zeros.at[:k].set(state.values),
            betas=zeros,
            couplings=jnp.zeros_like(state.couplings),
            locked_residuals=state.residuals,
            locks=state.locks + 1,
            fresh=jnp.asarray(True),
            start=jnp.asarray(k, jnp.int32),
            vectors=jnp.eye(max_steps, k, dtype=dtype),
        )

    def steps_and_check(state):
        # The steps up to the next check run in a loop of their own: the check is then
        # no branch inside every step's loop, which keeps the program small.
        # No check before 3k steps: the k wanted pairs seldom converge sooner, and each
        # check costs a host round trip.
        stop = jnp.minimum(jnp.maximum(state.m + _CHECK_EVERY, 3 * k), max_steps)
        state = jax.lax.while_loop(lambda state: state.m < stop, canonical_body(step), state)
        values, vectors, residuals, top, top_residual, low = _ritz(state, k)
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
        state = jax.lax.cond(relock, lock, lambda state: state, state)
        # The bar counts products; a run that ends fills it.
        count = jnp.where(unfinished(state), jnp.minimum(state.products, max_steps - 1), max_steps)
        bar.done(count, residuals)
        return state

    def unfinished(state):
        return ~state.converged & (state.m < max_steps)

    init = _State(
        m=jnp.asarray(0, jnp.int32),
        products=jnp.asarray(0, jnp.int32),
        basis=jnp.zeros((max_steps, n), dtype),
        alphas=jnp.zeros(max_steps, dtype),
        betas=jnp.zeros(max_steps, dtype),
        couplings=jnp.zeros((max_steps, k), dtype),
        locked_residuals=jnp.zeros(k, dtype),
        locks=jnp.asarray(0, jnp.int32),
        vector=_normal_start(key, n, dtype),
        fresh=jnp.asarray(False),
        start=jnp.asarray(0, jnp.int32),
        norm=jnp.zeros((), dtype),
        low=jnp.asarray(jnp.inf, dtype),
        converged=jnp.asarray(False),
        values=jnp.zeros(k, dtype),
        vectors=jnp.zeros((max_steps, k), dtype),
        residuals=jnp.full(k, jnp.inf, dtype),
    )
    bar = progress_bar("zm.eigsh steps" if progress else None, max_steps, unit="step")
    bar.start()
    state = jax.lax.while_loop(unfinished, canonical_body(steps_and_check), init)
    eigenvectors = state.basis.T @ state.vectors
    # Ascending for A: the largest of -A, negated, come in descending order.
    smallest = sign < 0
    values = jnp.where(smallest, -state.values[::-1], state.values)
    eigenvectors = jnp.where(smallest, eigenvectors[:, ::-1], eigenvectors)
    residuals = jnp.where(smallest, state.residuals[::-1], state.residuals)
    return values, eigenvectors, EigshInfo(state.products, state.converged, residuals)


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
      operator, like `x`'s variables) instead of as flat columns.
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
    `info.converged` false.

    **Cost:** as many products as steps, and memory for the basis, `max_steps * n`
    numbers, beside one product's. Each step also orthogonalises against the basis
    (`4 * max_steps * n` flops). For `k >= 2` the check adds a run of its own: the
    fewer steps the clearer the `k`-th eigenvalue stands above the rest (a dozen or so
    for a few outliers), up to about as many as the first run where it lies in a dense
    part of the spectrum, and a run more for each missed copy it finds. One compiled
    program per operator type, shapes, `k` and `max_steps` (not per `which`, `tol` or
    `key`).

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
