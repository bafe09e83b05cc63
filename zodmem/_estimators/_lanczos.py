"""The Lanczos step on a symmetric operator, shared by `eigsh` (its extreme eigenpairs,
`_eigsh.py`) and the stochastic Lanczos quadrature of the spectral density and of traces
of matrix functions (`_spectral.py`, `_logdet.py`).

Both keep the whole Krylov basis, one preallocated block of `steps` vectors (a
`(steps, n)` buffer for a model on one device; leaf by leaf, `(steps, *leaf.shape)` and
sharded as the leaf, for variables sharded over devices), and orthogonalise every new
vector against all of it (two passes of classical Gram-Schmidt), so the
tridiagonal matrix stays faithful in floating point: no spurious copies of converged
eigenvalues, at the price of `steps * n` numbers of memory and `4 * steps * n` flops a
step beside the product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import lineax as lx

from .._operators._flat import FlatView, symmetric_view
from .._operators._operator import BlockedOperator
from .._operators._vectors import VectorSpace, key_seed, vector_space

__all__ = [
    "lanczos_step",
    "normal_start",
    "orthogonalised",
    "projection",
    "space_product",
    "symmetric_space",
    "tridiagonal",
]

# A step whose new direction is this many rounding errors of the operator's norm (or
# less) has found an invariant subspace.
_BREAKDOWN = 10.0
# A pass of Gram-Schmidt that leaves less than this fraction of a vector's norm is
# repeated once ("twice is enough").
_TWICE = 2**-0.5
# Rows of a sharded Krylov basis a pass of Gram-Schmidt reads at a time.
_CHUNK = 16


def projection(space: VectorSpace, basis: Any, j: Any, vector: Any) -> Any:
    """`sum_i <basis_i, vector> basis_i` over rows `0..j` only (the rows after count
    as zero). The basis is a block of vectors of `space` (leaves `(rows, *leaf.shape)`).

    On one device every row is read, filled or not, in two products with the whole
    block and no loop: a loop over the filled rows takes the basis into a loop of its
    own, and XLA then copies the basis twice at every Lanczos step. Where the vectors
    are sharded over devices, the rows are read in chunks of `_CHUNK`, as far as they
    are filled: there the whole block's products hold more per device than the copies
    cost."""
    rows = jax.tree_util.tree_leaves(basis)[0].shape[0]
    if not space.sharded:
        coefficients = jnp.where(jnp.arange(rows) <= j, space.block_dot(basis, vector), 0)
        return space.combine(basis, coefficients)
    size = min(_CHUNK, rows)

    def chunk(c, total):
        start = jnp.minimum(c * size, rows - size)  # the last chunk may overlap the one before
        block = space.map(lambda b: jax.lax.dynamic_slice_in_dim(b, start, size, axis=0), basis)
        index = start + jnp.arange(size)
        coefficients = jnp.where(
            (index >= c * size) & (index <= j), space.block_dot(block, vector), 0
        )
        return space.axpy(1, space.combine(block, coefficients), total)

    return jax.lax.fori_loop(0, j // size + 1, chunk, space.map(jnp.zeros_like, vector))


def orthogonalised(space: VectorSpace, basis: Any, j: Any, vector: Any) -> Any:
    """`vector` less its components along rows `0..j` of `basis`: classical Gram-Schmidt
    twice, which leaves it orthogonal to working precision."""
    vector = space.axpy(-1, projection(space, basis, j, vector), vector)
    return space.axpy(-1, projection(space, basis, j, vector), vector)


def symmetric_space(operator: Any, owner: str) -> tuple[VectorSpace, FlatView]:
    """`(space, view)` of a real symmetric operator (refused in words naming `owner`
    otherwise): its vectors leaf by leaf where its variables are sharded over devices,
    else through one flat leaf, and its flat view."""
    view = symmetric_view(operator, owner)
    space = vector_space(operator, owner)
    return (space if space.sharded else space.flat()), view


def space_product(view: FlatView, space: VectorSpace | None, strategy: Any = None) -> Callable:
    """The operator's product as a function of vectors of `space`, built once (outside
    any loop: a kept linearisation serves every product): through flat vectors on one
    device (or without a `space`), else leaf by leaf with `operator.mv`, its result
    pinned to the layout. `strategy` (`"linearize"` or `"recompute"`) overrides a
    zodmem operator's."""
    if space is None or not space.sharded:
        return view.linear(strategy)
    operator = view.operator
    if isinstance(operator, BlockedOperator):
        operator = operator.with_strategy(strategy)
    operator = lx.linearise(operator)
    return lambda vector: space.as_vector(operator.mv(space.as_input(vector)))


def normal_start(space: VectorSpace, key: jax.Array) -> Any:
    """A unit vector of standard normal entries, drawn from the words of `key`."""
    return space.normal(key_seed(key), 0)


def lanczos_step(
    space: VectorSpace,
    product: Callable,
    basis: Any,
    j: Any,
    vector: Any,
    fresh: Any,
    norm: Any,
) -> tuple:
    """Lanczos step `j` from the unit `vector`, orthogonal to rows `0..j-1` of `basis`
    (vectors of `space`, stored leaf by leaf); with `fresh` true, from a new
    pseudo-random direction (`space.uniform(j)`) orthogonal to them instead, the way to
    go on once the Krylov space is exhausted.

    Returns `(basis, alpha, beta, next_vector, broke, norm, image)`: the step's unit
    vector stored as row `j`, the diagonal entry `alpha`, the coupling `beta` to
    `next_vector`, whether the Krylov space broke down here (then `beta` is 0 and the
    next step must be `fresh`), the running estimate of the operator's norm (the
    largest norm of a product seen), and the product of the step's vector (its image).
    """

    def draw(vector):
        return space.normalised(orthogonalised(space, basis, j - 1, space.uniform(j)))

    if fresh is not False:  # a known False stages no branch, which would copy the basis
        vector = jax.lax.cond(fresh, draw, lambda vector: vector, vector)
    basis = space.set_row(basis, j, vector)
    image = space.map(lambda x: x.astype(space.dtype), product(vector))
    norm = jnp.maximum(norm, space.norm(image))
    # The three-term recurrence first (its two projections read two rows, not the
    # basis), then one pass of classical Gram-Schmidt against the whole basis, and a
    # second only where that pass removed much (Daniel, Gragg, Kaufman and Stewart's
    # test): each pass reads all of the basis, which costs as much as a product here.
    alpha = space.dot(vector, image)
    previous = space.row(basis, jnp.maximum(j - 1, 0))
    coupling = jnp.where(j > 0, space.dot(previous, image), 0)
    residual = space.axpy(-coupling, previous, space.axpy(-alpha, vector, image))
    before = space.norm(residual)
    residual = space.axpy(-1, projection(space, basis, j, residual), residual)
    again = space.norm(residual) < _TWICE * before

    def second_pass(r):
        return space.axpy(-1, projection(space, basis, j, r), r)

    residual = jax.lax.cond(again, second_pass, lambda r: r, residual)
    beta = space.norm(residual)
    broke = beta <= _BREAKDOWN * jnp.finfo(space.dtype).eps * norm
    beta = jnp.where(broke, 0, beta)
    next_vector = space.scale(1 / jnp.where(broke, 1, beta), residual)
    return basis, alpha, beta, next_vector, broke, norm, image


def tridiagonal(alphas: jax.Array, betas: jax.Array) -> jax.Array:
    return jnp.diag(alphas) + jnp.diag(betas, 1) + jnp.diag(betas, -1)
