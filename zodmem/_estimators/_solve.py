"""Inverse products of a curvature: `solve` (`(A + damping I)^{-1} b` by an iterative
solver, products only) and `marginal_variances` (a few diagonal entries of that
inverse). A dense matrix's inverse is `zm.covariance`'s (`_covariance.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Inexact, Int, PyTree

from .._checks import Integer, Memory, RealScalar, check_int, described, typechecked
from .._engine._sharding import explicit_mesh
from .._operators._arguments import check_dtype, check_real
from .._operators._base import AbstractOperator
from .._operators._flat import FlatView, flat_view
from .._operators._operator import BlockedOperator, check_leaves, variables_of
from .._pytree import is_traced
from .._traceback import public
from ._cg import bar_label, laid_out_columns, laid_out_entries, laid_out_solve
from ._lanczos import symmetric_space
from ._probes import AbstractColumns, ProbeOptions, run_probes

__all__ = ["solve", "marginal_variances"]

# GMRES keeps this many vectors of size n as its Krylov basis between restarts.
_GMRES_RESTART = 50


# -- checks ------------------------------------------------------------------------------


def _check_solver(solver: Any, *, owner: str) -> None:
    if solver is not None and not isinstance(solver, lx.AbstractLinearSolver):
        raise TypeError(
            f"{owner}: `solver` must be None (chosen from the operator's tags) or a lineax "
            f"solver such as `lx.CG(rtol=1e-6, atol=1e-6)`, got {described(solver)}."
        )


def _read_rhs(
    operator: Any, view: Any, b: Any, *, owner: str, flatten: bool = True
) -> tuple[Any, str]:
    """`(rhs, form)`: `b` as a flat `(n,)` or `(n, k)` array and the form it came in,
    `"flat"`, `"columns"` or `"tree"` (a pytree shaped like the input structure; for a
    zodmem operator also the whole of `x`, whose other leaves are ignored, as `mv` reads).
    Without `flatten`, a tree comes back checked and shaped like the input structure."""
    n, dtype = view.size, view.dtype
    leaves, treedef = jax.tree_util.tree_flatten(view.structure)
    if eqx.is_array(b) and jnp.ndim(b) in (1, 2) and jnp.shape(b)[0] == n:
        if not (jnp.ndim(b) == 2 and treedef.num_leaves == 1 and b.shape == leaves[0].shape):
            check_dtype(b, "b", dtype, owner=owner, expected="the operator's vectors are")
            return jnp.asarray(b), "flat" if jnp.ndim(b) == 1 else "columns"
    if isinstance(operator, BlockedOperator):
        b = variables_of(b, operator.x, treedef)
    given = jax.tree_util.tree_structure(b)
    if given != treedef:
        got = f"an array of shape {jnp.shape(b)}" if eqx.is_array(b) else f"structure {given}"
        raise ValueError(
            f"{owner}: `b` must be a flat vector of shape ({n},), an ({n}, k) array of k "
            f"right-hand sides, or a pytree shaped like {view.structure}, but got {got}."
        )
    check_leaves(b, leaves, "b", owner=owner)
    if not flatten:
        return b, "tree"
    pieces = [jnp.ravel(leaf).astype(dtype) for leaf in jax.tree_util.tree_leaves(b)]
    return jnp.concatenate(pieces) if pieces else jnp.zeros((0,), dtype), "tree"


# -- solve -------------------------------------------------------------------------------


def _default_solver(tags: frozenset, rtol: float, atol: float, max_steps: int | None) -> Any:
    if lx.positive_semidefinite_tag in tags or lx.negative_semidefinite_tag in tags:
        return lx.CG(rtol=rtol, atol=atol, max_steps=max_steps)
    # Symmetric indefinite (a Hessian away from a minimum) or not symmetric: CG may divide
    # by a vanishing curvature; GMRES with a basis of restart vectors converged most often on
    # symmetric indefinite matrices (the comparison is in CHANGELOG.md).
    return lx.GMRES(rtol=rtol, atol=atol, max_steps=max_steps, restart=_GMRES_RESTART)


# What went wrong, as a code: 0 none, then one per message of `_failure_messages`.
_MAX_STEPS, _BROKE_DOWN, _NONFINITE = 1, 2, 3


def _failure_code(result: Any) -> jax.Array:
    return jnp.select(
        [
            result == lx.RESULTS.successful,
            result == lx.RESULTS.max_steps_reached,
            result == lx.RESULTS.nonfinite_input,
        ],
        [0, _MAX_STEPS, _NONFINITE],
        _BROKE_DOWN,
    )


def _failure_messages(owner: str, solver: Any, max_steps: int | None) -> tuple[str, ...]:
    name = type(solver).__name__
    steps = "the default 10 n" if max_steps is None else str(max_steps)
    return (
        f"{owner}: the {name} solve did not converge within max_steps={steps} steps. "
        f"Raise `max_steps`, loosen `rtol`/`atol`, or add `damping` > 0: a larger damping "
        f"makes the matrix better conditioned (and a singular one solvable).",
        f"{owner}: the {name} solve broke down or stagnated: the matrix plus damping may be "
        f"singular, or not positive definite where the solver needs it. Add `damping` > 0, "
        f"or choose another `solver=`.",
        f"{owner}: the solve met NaN or inf: `b`, `damping` or the operator's products "
        f"hold non-finite values.",
    )


@eqx.filter_jit
def _solve_flat(operator, rhs, damping, tags, solver):
    """The solution for the flat right-hand side `rhs` and its failure code (the
    operator already checked to be square)."""
    # A zodmem operator keeps one linearisation for every product of the solve, unless
    # its transform recomputes per product (a Microbatcher's data).
    view = flat_view(lx.linearise(operator), "zm.solve")
    return _damped_solve(view.linear(), rhs, damping, tags, solver)


def _damped_solve(product: Callable, b: jax.Array, damping: Any, tags: frozenset, solver: Any):
    """The solution of `(A + damping I) y = b`, `A` given by its `product`, and the
    failure code of the solve."""
    # Built on flat vectors with explicit tags: lineax's `damping * IdentityLinearOperator`
    # cannot tell the sign of a traced damping, and would drop the semi-definite tag.
    structure = jax.ShapeDtypeStruct(b.shape, b.dtype)
    damped = lx.FunctionLinearOperator(lambda v: product(v) + damping * v, structure, tuple(tags))
    solution = lx.linear_solve(damped, b, solver, throw=False)
    return solution.value, _failure_code(solution.result)


class Solves(AbstractColumns):
    """The solves with the columns of a matrix of right-hand sides, in blocks of columns:
    each block's solutions as columns, and its failure codes as a row."""

    matrix: jax.Array
    damping: jax.Array
    tags: frozenset = eqx.field(static=True)
    solver: Any = eqx.field(static=True)
    what: ClassVar[str] = "right-hand sides"

    def block(self, view: FlatView, product: Callable, start: Any, size: int) -> Any:
        def one(b):
            return _damped_solve(product, b, self.damping, self.tags, self.solver)

        values, codes = jax.vmap(one, in_axes=1, out_axes=(1, 0))(self.columns(start, size))
        return values, codes[None]


def _raise_or_flag(value: Any, code: jax.Array, messages: tuple[str, ...]) -> Any:
    """Raise the message of the first failure; traced, flag it with `eqx.error_if`."""
    if is_traced(code):
        worst = jnp.max(code) if jnp.ndim(code) else code
        return eqx.branched_error_if(value, worst > 0, jnp.maximum(worst - 1, 0), messages)
    worst = int(np.max(np.asarray(code))) if np.size(code) else 0
    if worst > 0:
        raise RuntimeError(messages[worst - 1])
    return value


def _checked(operator, damping, rtol, atol, max_steps, solver, owner):
    """`(damping, tags, solver, settings)`: the solve's options checked, the tags of
    `A + damping I` and the solver they choose (`settings`: `(rtol, atol, max_steps)`)."""
    rtol = check_real(rtol, "rtol", owner=owner)
    atol = check_real(atol, "atol", owner=owner)
    if is_traced(rtol) or is_traced(atol):
        raise TypeError(f"{owner}: `rtol` and `atol` must be Python or NumPy numbers.")
    max_steps = check_int(max_steps, "max_steps", owner=owner, minimum=1, optional=True)
    _check_solver(solver, owner=owner)
    damping = check_real(damping, "damping", owner=owner, minimum=None)
    if solver is None and rtol == 0 and atol == 0 and max_steps is None:
        raise ValueError(
            f"{owner}: with rtol=0 and atol=0 the solve never converges; give a tolerance "
            f"> 0 or `max_steps`."
        )
    semidefinite = lx.is_positive_semidefinite(operator) or lx.is_negative_semidefinite(operator)
    psd = lx.is_positive_semidefinite(operator)
    tags = {lx.symmetric_tag} if lx.is_symmetric(operator) else set()
    if is_traced(damping):
        # Unknown sign: taken as keeping the operator's definiteness, and checked when run.
        if semidefinite:
            tags.add(lx.positive_semidefinite_tag if psd else lx.negative_semidefinite_tag)
            wrong = damping < 0 if psd else damping > 0
            damping = eqx.error_if(
                damping,
                wrong,
                f"{owner}: `damping` has the wrong sign for this semi-definite operator: "
                f"the shifted matrix is not semi-definite, and CG would be wrong.",
            )
    else:
        if psd and damping < 0:
            raise ValueError(
                f"{owner}: `damping` must be >= 0 for a positive semi-definite operator, got "
                f"damping={damping}: A + damping I would be indefinite, and CG wrong. To "
                f"shift it anyway, solve with the operator untagged, "
                f"`lx.FunctionLinearOperator(operator.mv, operator.in_structure())`."
            )
        if psd:
            tags.add(lx.positive_semidefinite_tag)
        elif lx.is_negative_semidefinite(operator) and damping <= 0:
            tags.add(lx.negative_semidefinite_tag)
    tags = frozenset(tags)
    if solver is None:
        solver = _default_solver(tags, rtol, atol, max_steps)
    return damping, tags, solver, (rtol, atol, max_steps)


def _solve(operator, b_flat, damping, rtol, atol, max_steps, solver, view, options):
    """The checked solve of flat `(n,)` or `(n, k)` right-hand sides; the columns of
    the latter in blocks, as `options` (which name the caller too) say."""
    owner = options.owner
    damping, tags, solver, _ = _checked(operator, damping, rtol, atol, max_steps, solver, owner)
    damping = jnp.asarray(damping, view.dtype)
    if b_flat.ndim == 2 and b_flat.shape[1] == 0:
        return b_flat
    if b_flat.ndim == 1:
        value, code = _solve_flat(operator, b_flat, damping, tags, solver)
    else:
        # The engine builds the product once in its own trace (linearised there, on each
        # device of a split), not through a linearisation made out here.
        job = Solves(b_flat, damping, tags, solver)
        # Solves stay on one device: lineax's solves do not take the vectors a
        # `shard_map` types with its manual mesh.
        value, code = run_probes(view, job, options, spread=False)
    return _raise_or_flag(value, code, _failure_messages(owner, solver, max_steps))


# -- on Explicit mesh axes ---------------------------------------------------------------


def _laid_out_settings(operator, damping, rtol, atol, max_steps, solver, owner):
    """`(space, damping, sign, settings, messages)` of a solve by zodmem's own CG on
    vectors laid out like the variables, refused in words where it does not apply."""
    damping, tags, chosen, settings = _checked(
        operator, damping, rtol, atol, max_steps, solver, owner
    )
    if solver is not None or not isinstance(chosen, lx.CG):
        why = (
            f"`solver={solver!r}` was given"
            if solver is not None
            else "the operator is not tagged positive (or negative) semi-definite, which CG needs"
        )
        raise ValueError(
            f"{owner}: on Explicit mesh axes the solve is zodmem's own conjugate gradients on "
            f"vectors laid out like the variables (lineax's solvers make vectors there that "
            f"are not typed like the operator's products), and {why}. Leave `solver=None` "
            "and give a positive semi-definite operator (a Gauss-Newton matrix, or a "
            "lineax operator tagged `lx.positive_semidefinite_tag`), or lay the model out "
            "over Auto axes (`jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))`)."
        )
    space, _ = symmetric_space(operator, owner)
    sign = -1 if lx.negative_semidefinite_tag in tags else 1
    damping = jnp.asarray(damping, space.dtype)
    return space, damping, sign, settings, _failure_messages(owner, chosen, max_steps)


def _solve_laid_out(operator, view, b, damping, rtol, atol, max_steps, solver, owner, progress):
    """`solve` where the operator's arrays or `b` lie over Explicit mesh axes: the
    solution laid out like the variables, in the form of `b` (columns in one loop)."""
    space, damping, sign, settings, messages = _laid_out_settings(
        operator, damping, rtol, atol, max_steps, solver, owner
    )
    b, form = _read_rhs(operator, view, b, owner=owner, flatten=False)
    if form == "tree":
        y, code = laid_out_solve(view, space, b, damping, sign, settings)
        return _raise_or_flag(space.as_input(y), code, messages)
    columns = b[:, None] if form == "flat" else b
    if columns.shape[1] == 0:
        return b
    label = bar_label(operator, progress, owner) if form == "columns" else None
    value, codes = laid_out_columns(view, space, columns, damping, sign, settings, label)
    value = value[:, 0] if form == "flat" else value
    return _raise_or_flag(value, codes, messages)


@public
@typechecked
def solve(
    operator: lx.AbstractLinearOperator,
    b: Inexact[Array | np.ndarray, " n"] | Inexact[Array | np.ndarray, "n k"] | PyTree,
    *,
    damping: RealScalar = 0.0,
    rtol: RealScalar = 1e-6,
    atol: RealScalar = 1e-6,
    max_steps: Integer | None = None,
    solver: lx.AbstractLinearSolver | None = None,
    max_memory: Memory = None,
    batch_size: Integer | None = None,
    progress: bool | None = None,
) -> Inexact[Array, " n"] | Inexact[Array, "n k"] | PyTree[Inexact[Array, "..."]]:
    """The solution `y` of `(A + damping I) y = b`, from products with `A` only.

    `A` is a square linear operator: a curvature's, `transform.operator(x, *args)` of
    `zm.BatchedHessian`, `zm.BatchedGGN` or a `zm.Microbatcher` around one, or any square
    `lineax` operator. The matrix is never formed: an iterative lineax solver takes one
    product per step (a Hessian-vector or Gauss-Newton-vector product). Use it for
    Newton and natural-gradient steps, influence functions, or Laplace posteriors' means.

    A zodmem operator with an exact solve of its own (`zm.KFAC`'s and `zm.EKFAC`'s
    `KroneckerFactored`, `zm.BlockDiagonal`, `zm.LowRankDiagonal`) is solved by it, with
    no iterations, unless `solver` is given; `rtol`, `atol`, `max_steps` and the block
    options are then not read. For any other operator the solver follows its tags:
    conjugate gradients (`lx.CG`) for a positive
    semi-definite operator (a Gauss-Newton or Fisher matrix) with `damping >= 0`; GMRES
    (`lx.GMRES`, restarted every 50 steps) otherwise, since CG is unsafe on a symmetric
    indefinite matrix such as a Hessian away from a minimum. A singular positive
    semi-definite matrix (a model with more parameters than data) becomes solvable with
    `damping > 0`.

    **Arguments:**

    - `operator`: the square linear operator `A`.
    - `b`: the right-hand side: a flat vector `(n,)`; a pytree shaped like the operator's
      input (for a zodmem operator, like the variables of `x`; the whole of `x` also
      works, its other leaves ignored); or an `(n, k)` array of `k` right-hand sides,
      one per column, solved together under `jax.vmap`. Its dtype must be the operator's.
    - `damping`: `lambda >= 0` added to the diagonal (a Python number or a 0-d array,
      traced too). Default 0. Negative values are refused for a positive semi-definite
      operator (CG would be wrong on the shifted, indefinite matrix); on other operators
      any real shift is allowed.
    - `rtol`, `atol`: the solver stops when every entry of the residual is within
      `atol + rtol * |b|` (and the last step as small relative to the solution), as
      lineax measures it. Defaults 1e-6 both; looser (say 1e-4) suits float32.
    - `max_steps`: the most steps; `None` is lineax's default, 10 n (CG: one product a
      step; GMRES: a restart cycle of up to 50 products a step).
    - `solver`: a lineax solver instead of the choice above; its own tolerances then
      apply, and `rtol`, `atol` and `max_steps` are not read.
    - `max_memory`, `batch_size`, `progress`: for `k` right-hand sides, the columns
      solved together (vmapped) per block: `batch_size` of them, or as many as fit the
      budget, with a bar of the blocks. As for `zm.diagonal`: left out, the options of
      the operator's transform. The solves run on one device (lineax's solves do not
      take vectors split over a `shard_map`'s devices), whatever the transform's
      `sharding`. On Explicit mesh axes: zodmem's own CG, semi-definite operators only,
      the columns one after another in one loop (`progress`: a bar of them).

    **Returns:**

    The solution in the form of `b`: a flat vector, a pytree shaped like the operator's
    input (for the whole of `x`, its variables, with `None` elsewhere, as `mv` returns),
    or an `(n, k)` array.

    **Cost:** one product per CG step, at most about `10 n` steps unless `max_steps`
    says otherwise, far fewer on a well-conditioned matrix. Memory: a few vectors of size
    `n` for CG (51 for GMRES) per right-hand side, plus one product's memory, for each
    column of a block; a zodmem operator keeps one linearisation of `fn` for the whole
    solve.

    A solve that does not converge raises a `RuntimeError` that says what to change
    (`max_steps`, `rtol`/`atol`, `damping`); under `jax.jit` the same message is raised
    through `eqx.error_if` when the compiled call runs.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def model(params, t, y):
            return params["a"] * jnp.tanh(params["w"] * t)

        params = {"a": jnp.ones(3), "w": jnp.arange(3.0)}
        t, y = jnp.linspace(-1, 1, 8)[:, None], jnp.zeros((8, 3))
        G = zm.BatchedGGN(model, zm.losses.SquaredError()).operator(params, t, y)
        step = zm.solve(G, params, damping=1e-3)     # like params: {"a": ..., "w": ...}
        ```
    """
    owner = "zm.solve"
    if solver is None and isinstance(operator, AbstractOperator) and operator.solves_exactly:
        return _exactly(operator, b, damping)
    view = flat_view(operator, owner)
    if explicit_mesh((operator, b)) is not None:
        return _solve_laid_out(
            operator, view, b, damping, rtol, atol, max_steps, solver, owner, progress
        )
    rhs, form = _read_rhs(operator, view, b, owner=owner)
    options = ProbeOptions(owner, max_memory, batch_size, progress=progress)
    value = _solve(operator, rhs, damping, rtol, atol, max_steps, solver, view, options)
    return view.laid_out(value) if form == "tree" else value


def _exactly(operator: AbstractOperator, b: Any, damping: Any) -> Any:
    """The operator's own exact solve of `b` (an `(n, k)` array column by column)."""
    if eqx.is_array(b) and jnp.ndim(b) == 2:
        return jax.vmap(lambda c: operator.solve(c, damping=damping), in_axes=1, out_axes=1)(b)
    return operator.solve(b, damping=damping)


# -- marginal variances ------------------------------------------------------------------


def _read_indices(indices: Any, n: int, *, owner: str) -> jax.Array:
    """`indices` as a 1-d int array, each checked to lie in `[0, n)` (at run time when
    traced). The annotation admits only such arrays and sequences of ints; these words
    say which entry or dtype it refused."""
    if eqx.is_array(indices):
        array = indices
    else:
        if isinstance(indices, (str, bytes)) or not hasattr(indices, "__len__"):
            raise TypeError(
                f"{owner}: `indices` must be a sequence of ints or a 1-d int array, got "
                f"{described(indices)}."
            )
        # One by one: a bool is an int to the annotation, but no index.
        values = [check_int(i, "indices[...]", owner=owner) for i in indices]
        array = np.asarray(values, dtype=np.int64 if values else np.int32)
    if not jnp.issubdtype(array.dtype, jnp.integer) or jnp.ndim(array) != 1:
        raise TypeError(
            f"{owner}: `indices` must be a 1-d array of ints, got dtype {array.dtype} and "
            f"shape {jnp.shape(array)}."
        )
    if is_traced(array):
        outside = jnp.any((array < 0) | (array >= n))
        return eqx.error_if(array, outside, f"{owner}: `indices` must lie in [0, {n}).")
    outside = [int(i) for i in np.asarray(array) if not 0 <= int(i) < n]
    if outside:
        raise ValueError(
            f"{owner}: `indices` must lie in [0, {n}) (the operator's size), got {outside[0]}."
        )
    return jnp.asarray(array)


@public
@typechecked
def marginal_variances(
    operator: lx.AbstractLinearOperator,
    indices: Int[Array | np.ndarray, " k"] | Sequence[Integer],
    *,
    damping: RealScalar = 0.0,
    rtol: RealScalar = 1e-6,
    atol: RealScalar = 1e-6,
    max_steps: Integer | None = None,
    solver: lx.AbstractLinearSolver | None = None,
    max_memory: Memory = None,
    batch_size: Integer | None = None,
    progress: bool | None = None,
) -> Inexact[Array, " k"]:
    """A few diagonal entries `[(A + damping I)^{-1}]_ii` of the inverse, by solving with
    the unit vectors `e_i`.

    When `A` is a Fisher information matrix (`zm.BatchedGGN` of a negative
    log-likelihood), these are the marginal variances of those parameters, their
    Cramér-Rao bounds: the squares of their standard errors, for `k` chosen parameters
    at the cost of `k` solves, never the `n x n` inverse (`zm.covariance` gives all of
    them from the dense matrix).

    **Arguments:**

    - `operator`: a square linear operator, as for `zm.solve`.
    - `indices`: the flat parameter indices `i` (in the raveled order of the variables,
      `0 <= i < n`): a sequence of ints or a 1-d int array (traced ones are checked when
      the call runs).
    - `damping`, `rtol`, `atol`, `max_steps`, `solver`, `max_memory`, `batch_size`,
      `progress`: as for `zm.solve` (the unit vectors are its `k` columns).

    **Returns:**

    A 1-d array of the `k` entries, in the operator's dtype.

    **Cost:** `k` solves (`zm.solve` with an `(n, k)` array of unit vectors), in blocks
    of right-hand sides solved together: memory for one block's.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def loss(w, x):
            return jnp.sum(jnp.logaddexp(0.0, x @ w)) + 0.5 * jnp.sum(w**2)

        x = jnp.linspace(-1, 1, 12).reshape(4, 3)
        H = zm.BatchedHessian(loss).operator(jnp.zeros(3), x)
        zm.marginal_variances(H, [0, 2])   # the variances of w[0] and w[2], shape (2,)
        ```
    """
    owner = "zm.marginal_variances"
    view = flat_view(operator, owner)
    indices = _read_indices(indices, view.size, owner=owner)
    k = indices.shape[0]
    if k == 0:
        return jnp.zeros((0,), view.dtype)
    if explicit_mesh(operator) is not None:
        space, damping, sign, settings, messages = _laid_out_settings(
            operator, damping, rtol, atol, max_steps, solver, owner
        )
        label = bar_label(operator, progress, owner)
        entries, codes = laid_out_entries(view, space, indices, damping, sign, settings, label)
        return _raise_or_flag(entries, codes, messages)
    units = jax.nn.one_hot(indices, view.size, dtype=view.dtype).T
    options = ProbeOptions(owner, max_memory, batch_size, progress=progress)
    solutions = _solve(operator, units, damping, rtol, atol, max_steps, solver, view, options)
    return solutions[indices, jnp.arange(k)]
