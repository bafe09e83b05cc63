"""Traces of functions of a symmetric operator, `tr f(A)`, by stochastic Lanczos
quadrature (`trace_function`), and the log-determinant `tr log(A + damping I)`
(`logdet`): the Lanczos matrices of the spectral density's random sign probes
(`_spectral.Quadrature`), each giving one sample `n * sum_j w_j f(theta_j)` of its Gauss
rule, and the samples' mean and standard error. For log, inv and sqrt, each probe's
Gauss rule and its Gauss-Radau rule at a lower bound of the spectrum bracket the probe's
quadratic form: the sample is their midpoint, and the brackets' mean half-width is added
to the error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jax.sharding import NamedSharding
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import Integer, Memory, RealScalar, check_int, check_key, described, typechecked
from .._operators._arguments import check_real, is_traced
from .._traceback import public
from ._lanczos import symmetric_space, tridiagonal
from ._probes import ProbeOptions
from ._spectral import quadrature_rules

__all__ = ["logdet", "trace_function"]

# The functions known by name; each is defined on positive numbers only.
_NAMED = {"log": jnp.log, "inv": jnp.reciprocal, "sqrt": jnp.sqrt}
_STEPS = 30  # the default number of Lanczos steps per probe, where the size allows


def _check_function(function: Any, owner: str) -> Callable:
    allowed = ", ".join(repr(name) for name in _NAMED) + " or a callable"
    if isinstance(function, str):
        if function not in _NAMED:
            raise ValueError(f"{owner}: `function` must be one of {allowed}; got {function!r}.")
        return _NAMED[function]
    if not callable(function):
        raise TypeError(f"{owner}: `function` must be one of {allowed}; got {described(function)}.")
    return function


def _positive(
    estimate: tuple, lowest: jax.Array, bound: jax.Array, name: str, damping: Any, owner: str
) -> tuple:
    """The estimate, refused where a Ritz value of the damped operator is not positive
    (`name`, log, inv or sqrt, is undefined there, or its quadrature unreliable near a
    pole), or where no positive lower bound of its spectrum is known (for sqrt, none at
    or above zero): an eigenvalue at or below zero may then remain unfound, and the
    quadrature's error has no bound. Concrete, at once; traced, as the program runs."""
    what = "log det" if owner == "zm.logdet" else f"function={name!r}"
    advice = (
        f"{what} needs a positive definite operator: give one, or add `damping` > 0 "
        "(a positive semi-definite curvature, such as a Gauss-Newton matrix, needs it)."
    )
    unbounded = (
        "no positive lower bound of its spectrum is known: its smallest Ritz value less "
        "that Ritz value's residual is not above zero, so an eigenvalue at or below zero "
        "may remain unfound and the quadrature's error has no bound. Raise `num_steps` "
        "until the smallest Ritz value converges, or add `damping` > 0 (the spectrum of a "
        "positive semi-definite operator plus damping lies at or above the damping)."
    )
    allowed = (lambda b: b >= 0) if name == "sqrt" else (lambda b: b > 0)
    if is_traced(lowest) or is_traced(damping):
        estimate = eqx.error_if(
            estimate,
            lowest <= 0,
            f"{owner}: a Ritz value of the operator plus damping is <= 0, so it is not "
            f"positive definite. {advice}",
        )
        return eqx.error_if(
            estimate, ~allowed(bound), f"{owner}: for the operator plus damping, {unbounded}"
        )
    lowest, bound = float(lowest), float(bound)
    if not lowest > 0:
        raise ValueError(
            f"{owner}: the operator plus damping (damping={damping!r}) is not positive "
            f"definite: its smallest Ritz value is {lowest:.6g}. {advice}"
        )
    if not allowed(bound):
        raise ValueError(
            f"{owner}: for the operator plus damping (damping={damping!r}), {unbounded} "
            f"Its smallest Ritz value is {lowest:.6g}, and that less its residual {bound:.6g}."
        )
    return estimate


def _rule_sums(
    nodes: jax.Array, weights: jax.Array, function: Callable, size: int, owner: str
) -> jax.Array:
    """Each probe's sample `size * sum_j w_j f(theta_j)` (the probe has norm
    `sqrt(size)`), from rules `(num_probes, nodes)`."""
    values = function(nodes)
    if jnp.shape(values) != nodes.shape:
        raise ValueError(
            f"{owner}: `function` must map the Ritz values elementwise, an array of shape "
            f"{nodes.shape} to one of the same shape, but it returned shape "
            f"{jnp.shape(values)}."
        )
    if jnp.issubdtype(jnp.result_type(values), jnp.complexfloating):
        raise TypeError(
            f"{owner}: `function` must return real values, but it returned "
            f"{jnp.result_type(values)}."
        )
    return size * jnp.sum(weights * jnp.asarray(values).astype(nodes.dtype), axis=1)


def _radau(
    alphas: jax.Array, betas: jax.Array, nodes: jax.Array, last_row: jax.Array, bound: Any
) -> tuple[jax.Array, jax.Array]:
    """One probe's Gauss-Radau rule with a node prescribed at `bound`, at or below the
    spectrum (Golub and Meurant, "Matrices, Moments and Quadrature"): the tridiagonal
    matrix grown by a row, coupled by the Lanczos run's last `beta` and with the
    diagonal entry that puts an eigenvalue at `bound`. `nodes` and `last_row` are the
    Gauss rule's nodes and its eigenvectors' last entries; no product is needed."""
    residuals = betas[-1] * last_row  # each Ritz pair's residual, beta_m s_{m,j}
    # The last entry of (T - bound I)^{-1} beta_m^2 e_m, by T's eigenpairs; a pair with
    # no residual (an exhausted Krylov space) adds nothing, even at the bound itself.
    gaps = jnp.where(residuals == 0, 1, nodes - bound)
    shift = jnp.sum(jnp.where(residuals == 0, 0, residuals**2 / gaps))
    m = alphas.shape[0]
    grown = jnp.pad(tridiagonal(alphas, betas[:-1]), ((0, 1), (0, 1)))
    grown = grown.at[m, m - 1].set(betas[-1]).at[m - 1, m].set(betas[-1])
    grown = grown.at[m, m].set(bound + shift)
    radau_nodes, vectors = jnp.linalg.eigh(grown)
    # The node at the bound comes back a rounding below it, where sqrt is undefined.
    return jnp.maximum(radau_nodes, bound), vectors[0] ** 2


def _mean_and_error(samples: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The samples' mean and its standard error (their standard deviation over the
    square root of their number)."""
    count = samples.shape[0]
    mean = jnp.mean(samples)
    # Deviations from the mean, not sums of squares: a trace far larger than the
    # samples' spread would lose the spread to rounding.
    spread = jnp.sum((samples - mean) ** 2)
    return mean, jnp.sqrt(spread / (count * (count - 1)))


@eqx.filter_jit
def _estimate(
    alphas: jax.Array,
    betas: jax.Array,
    damping: Any,
    function: Callable,
    bracket: bool,
    size: int,
    owner: str,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The estimate and its error from the probes' Lanczos matrices, the smallest Ritz
    value of the damped operator, and the lower bound of its spectrum that the Radau
    rules take (without `bracket`, that Ritz value). The damping shifts the matrices'
    diagonals: Lanczos on `A + damping I` from the same probe gives the same basis.

    With `bracket` (`function` one whose derivatives of each order keep one sign above
    zero: log, inv, sqrt), each probe's Gauss rule and its Gauss-Radau rule at the bound
    lie on either side of the probe's quadratic form: the sample is their midpoint, and
    the mean of their half-widths, a bound on the quadrature's error in the mean, is
    added to the standard error."""
    dtype = alphas.dtype
    shift = jnp.asarray(damping, dtype)
    raw, vectors = jnp.linalg.eigh(jax.vmap(tridiagonal)(alphas, betas[:, :-1]))
    nodes = raw + shift
    gauss = _rule_sums(nodes, vectors[:, 0, :] ** 2, function, size, owner)
    lowest = jnp.min(nodes)
    if not bracket:
        return *_mean_and_error(gauss), lowest, lowest
    # The smallest Ritz value less its residual: below the spectrum once that Ritz value
    # has converged to the smallest eigenvalue.
    below = jnp.min(nodes[:, 0] - jnp.abs(betas[:, -1] * vectors[:, -1, 0]))
    # The operator is taken positive semi-definite unless a Ritz value below zero shows
    # otherwise: its damped spectrum then lies at or above the damping.
    bound = jnp.where(jnp.min(raw) >= 0, jnp.maximum(below, shift), below)
    radau = jax.vmap(_radau, in_axes=(0, 0, 0, 0, None))(
        alphas + shift, betas, nodes, vectors[:, -1, :], bound
    )
    other = _rule_sums(*radau, function, size, owner)
    mean, error = _mean_and_error((gauss + other) / 2)
    return mean, error + jnp.mean(jnp.abs(gauss - other)) / 2, lowest, bound


def _trace_function(
    operator: Any,
    function: Any,
    num_probes: Any,
    num_steps: Any,
    key: Any,
    damping: Any,
    options: ProbeOptions,
) -> tuple[jax.Array, jax.Array]:
    owner = options.owner
    space, view = symmetric_space(operator, owner)
    apply = _check_function(function, owner)
    num_probes = check_int(num_probes, "num_probes", owner=owner, minimum=2, allowed="an int >= 2")
    if num_steps is None:
        num_steps = min(_STEPS, view.size)
    num_steps = check_int(num_steps, "num_steps", owner=owner, minimum=1)
    if num_steps > view.size:
        raise ValueError(
            f"{owner}: `num_steps` must be at most the operator's size {view.size}, got "
            f"num_steps={num_steps}."
        )
    key = check_key(key, owner=owner)
    damping = check_real(damping, "damping", owner=owner, minimum=None)
    alphas, betas = quadrature_rules(
        view, space, key, num_probes, num_steps, options, tridiagonals=True
    )
    shift = damping if is_traced(damping) else jnp.asarray(damping, view.dtype)
    named = isinstance(function, str)
    mean, error, lowest, bound = _estimate(alphas, betas, shift, apply, named, view.size, owner)
    if named:
        return _positive((mean, error), lowest, bound, function, damping, owner)
    return mean, error


@public
@typechecked
def trace_function(
    operator: lx.AbstractLinearOperator,
    function: Literal["log", "inv", "sqrt"] | Callable[[Array], Array],
    *,
    num_probes: Integer,
    num_steps: Integer | None = None,
    key: PRNGKeyArray,
    damping: RealScalar = 0.0,
    max_memory: Memory = None,
    batch_size: Integer | None = None,
    sharding: NamedSharding | None = None,
    progress: bool | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The trace of a function of a symmetric operator, `tr f(A + damping I)`, estimated
    by stochastic Lanczos quadrature (Ubaru, Chen and Saad, 2017) from products with
    vectors only.

    Use it for the traces that the dense matrix would give through its eigenvalues,
    `sum_i f(lambda_i)`, where the matrix is too large to diagonalise: `tr A^{-1}` (the
    total variance of a Laplace posterior), `tr sqrt(A)`, `log det A` (see `zm.logdet`).
    Each of `num_probes` Rademacher probes `g` gives a Gauss quadrature rule of
    `num_steps` nodes `theta_j` and weights `w_j` (`zm.spectral_density`'s rules:
    Lanczos from `g / |g|`), and the sample `n * sum_j w_j f(theta_j)`, an estimate of
    `g^T f(A) g`; the estimate is the samples' mean and the standard error their
    standard deviation over `sqrt(num_probes)`. With `num_steps = n` each rule is exact
    and the estimate is Hutchinson's, the mean of `g^T f(A) g`.

    For `"log"`, `"inv"` and `"sqrt"` the error also bounds the quadrature's. These
    functions' derivatives of each order keep one sign above zero, so each probe's Gauss
    rule and its Gauss-Radau rule with a node prescribed at a lower bound `a` of the
    spectrum of `A + damping I` lie on either side of `g^T f(A + damping I) g` (Golub and
    Meurant, *Matrices, Moments and Quadrature*: for log and sqrt the Gauss rule above and
    the Radau rule below, for inv the other way). The Radau rule is the Lanczos
    tridiagonal matrix grown by one row, from the run's last coupling, so it costs no
    product. Each sample is then the midpoint of the two rules, and the error returned is
    the samples' standard error plus the mean of the brackets' half-widths: for `z >= 1` the
    truth lies within `z` errors of the estimate at least as often as the probes' mean
    alone lies within `z` standard errors of its expectation. The bound `a` is the damping (the
    operator taken positive semi-definite) or, where larger, the smallest Ritz value
    less its residual `|beta_m s_{m,1}|` (below the spectrum once that Ritz value has
    converged to the smallest eigenvalue); where a Ritz value below zero shows the
    operator indefinite, only the latter. Where no `a > 0` is known (for `"sqrt"`, none
    `>= 0`) the call is refused (see below): an eigenvalue at or below zero may remain
    unfound, and nothing bounds the quadrature's error.

    **Arguments:**

    - `operator`: a symmetric real operator: `transform.operator(x, *args)` of
      `zm.BatchedHessian` or `zm.BatchedGGN` (or either wrapped in `zm.Microbatcher`),
      or any symmetric `lineax` operator, such as `lx.MatrixLinearOperator(A,
      lx.symmetric_tag)`.
    - `function`: `"log"`, `"inv"` (`1 / x`) or `"sqrt"`, each of which needs the
      damped operator positive definite; or any callable that maps an array of Ritz
      values elementwise (in the operator's dtype, traced; `jnp.exp`,
      `lambda x: x ** 2`), taken on any symmetric operator.
    - `num_probes`: the number of random sign probes, at least 2; probe `i` is a hash
      of `i` and the key's words, whatever the blocks.
    - `num_steps`: the Lanczos steps (products, and nodes) per probe, `1 <= num_steps
      <= n`; by default 30, or `n` where it is smaller.
    - `key`: a `jax.random.key` for the probes.
    - `damping`: `lambda` added to the diagonal, `f(A + lambda I)` (a Python number or a
      0-d array, traced under `jax.jit` if need be); it costs no product.
    - `batch_size`, `max_memory`: at most one: the probes per block (their Lanczos
      recurrences vmapped side by side), given, or as many as fit the budget, planned
      as any transform's blocks. By default the options of the operator's transform,
      or for any other operator all probes in one block.
    - `sharding`: a `NamedSharding` whose first entry names the mesh axes that split the
      probes over devices; by default the operator's transform's.
    - `progress`: a progress bar of the blocks of probes done; by default the
      transform's.

    **Returns:**

    `(estimate, standard_error)`, two scalars in the operator's dtype. For `"log"`,
    `"inv"` and `"sqrt"` the `standard_error` is the probes' standard error plus the
    bound on the quadrature's error above.

    **Cost:** `num_probes * num_steps` products; memory for one block's Lanczos bases,
    `num_steps * n` numbers a probe, beside the products' own.

    !!! warning

        For a callable `function` the standard error counts the probes' randomness
        only, not the quadrature's error, which falls as `num_steps` grows, fast for a
        well-conditioned operator and slowly for an ill-conditioned one (or for `f`
        with a pole near its smallest eigenvalue). Where it matters, check that the
        estimate does not move with more steps. For the named functions the bound
        grows wide where the quadrature has not converged: raise `num_steps` (or
        `damping`) until the error is small enough.

    !!! warning

        For `"log"`, `"inv"` and `"sqrt"`, a Ritz value of `A + damping I` at or below
        zero (the operator is not positive definite), or no lower bound `a > 0` of its
        spectrum (`a >= 0` for `"sqrt"`: the smallest Ritz value has not converged
        within its residual of zero, as for an undamped operator with eigenvalues near
        zero, or one with a negative eigenvalue the steps have not found), raises a
        `ValueError` that says which; under `jax.jit` the same message is raised when
        the program runs. A positive semi-definite curvature (a Gauss-Newton matrix)
        needs `damping > 0`. The bound takes the operator positive semi-definite unless
        a Ritz value below zero shows it is not: an indefinite operator whose negative
        eigenvalues the steps have not found, made definite by `damping`, gets an error
        that may not bound its quadrature.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import lineax as lx
        import zodmem as zm

        A = jnp.diag(jnp.linspace(1.0, 4.0, 40))
        op = lx.MatrixLinearOperator(A, lx.symmetric_tag)
        estimate, error = zm.trace_function(op, "inv", num_probes=20, num_steps=10,
                                            key=jax.random.key(0))
        assert abs(estimate - jnp.sum(1 / jnp.diag(A))) < 1e-3
        # Any elementwise function of the Ritz values:
        squares, _ = zm.trace_function(op, lambda x: x**2, num_probes=20, num_steps=10,
                                       key=jax.random.key(0))
        ```
    """
    options = ProbeOptions("zm.trace_function", max_memory, batch_size, sharding, progress)
    return _trace_function(operator, function, num_probes, num_steps, key, damping, options)


@public
@typechecked
def logdet(
    operator: lx.AbstractLinearOperator,
    *,
    num_probes: Integer,
    num_steps: Integer | None = None,
    key: PRNGKeyArray,
    damping: RealScalar = 0.0,
    max_memory: Memory = None,
    batch_size: Integer | None = None,
    sharding: NamedSharding | None = None,
    progress: bool | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The log-determinant of a symmetric positive definite operator, `log det(A +
    damping I)`, estimated by stochastic Lanczos quadrature from products only.

    Use it where a dense Cholesky factor or `slogdet` is out of reach: the
    normalising constant of a Laplace approximation, `log det(H + lambda I)` for a
    network's Gauss-Newton or Hessian matrix `H` and a Gaussian prior of precision
    `lambda`, or a Gaussian process's evidence. It is
    `zm.trace_function(operator, "log", ...)`: see there for the method and the options.

    **Arguments:** as for `zm.trace_function`, without `function`.

    **Returns:**

    `(estimate, standard_error)`, two scalars in the operator's dtype.

    !!! warning

        The operator plus `damping` must be positive definite: a Ritz value at or
        below zero, or no positive lower bound of its spectrum from the Lanczos runs
        (see `zm.trace_function`), raises a `ValueError` (under `jax.jit`, when the
        program runs). The error returned is the probes' standard error plus a bound on
        the quadrature's error (from each probe's Gauss and Gauss-Radau rules): it is
        wide where `num_steps` is too few for an ill-conditioned operator; raise it.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import zodmem as zm

        def loss(w, x, y):
            return jnp.sum(jax.nn.softplus(-y * (x @ w)))

        w = jnp.zeros(20)
        x = jax.random.normal(jax.random.key(1), (50, 20))
        y = jnp.sign(jax.random.normal(jax.random.key(2), (50,)))
        op = zm.BatchedHessian(loss).operator(w, x, y)
        estimate, error = zm.logdet(op, num_probes=30, num_steps=20, damping=1.0,
                                    key=jax.random.key(0))
        H = jax.hessian(loss)(w, x, y)
        exact = jnp.linalg.slogdet(H + jnp.eye(20))[1]
        assert abs(estimate - exact) < 4 * error
        ```
    """
    options = ProbeOptions("zm.logdet", max_memory, batch_size, sharding, progress)
    return _trace_function(operator, "log", num_probes, num_steps, key, damping, options)
