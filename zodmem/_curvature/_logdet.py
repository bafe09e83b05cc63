"""Traces of functions of a symmetric operator, `tr f(A)`, by stochastic Lanczos
quadrature (`trace_function`), and the log-determinant `tr log(A + damping I)`
(`logdet`): the Gauss rules of the spectral density's random sign probes
(`_spectral.Quadrature`), each giving one sample `n * sum_j w_j f(theta_j)`, and the
samples' mean and standard error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import check_int, check_key, described
from .._traceback import public
from ._arguments import check_real, is_traced
from ._diagonal import _mean_and_error
from ._flat import symmetric_view
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


@eqx.filter_jit
def _samples(
    nodes: jax.Array, weights: jax.Array, damping: Any, function: Callable, size: int, owner: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each probe's quadrature `size * sum_j w_j f(theta_j + damping)` (the probe has
    norm `sqrt(size)`), their mean and summed squared deviations from it, and the
    smallest shifted node. The shift is applied to the nodes: Lanczos on `A + damping I`
    from the same probe gives the same basis, and the tridiagonal's diagonal shifted."""
    dtype = nodes.dtype
    shifted = nodes + jnp.asarray(damping, dtype)
    values = function(shifted)
    if jnp.shape(values) != shifted.shape:
        raise ValueError(
            f"{owner}: `function` must map the Ritz values elementwise, an array of shape "
            f"{shifted.shape} to one of the same shape, but it returned shape "
            f"{jnp.shape(values)}."
        )
    if jnp.issubdtype(jnp.result_type(values), jnp.complexfloating):
        raise TypeError(
            f"{owner}: `function` must return real values, but it returned "
            f"{jnp.result_type(values)}."
        )
    samples = size * jnp.sum(weights * jnp.asarray(values).astype(dtype), axis=1)
    mean = jnp.mean(samples)
    # Deviations from the mean, not sums of squares: a trace far larger than the
    # samples' spread would lose the spread to rounding.
    spread = jnp.sum((samples - mean) ** 2)
    return mean, spread, jnp.min(shifted)


def _positive(estimate: tuple, lowest: jax.Array, name: str, damping: Any, owner: str) -> tuple:
    """The estimate, refused where a Ritz value of the damped operator is not positive:
    `name` (log, inv, sqrt) is undefined there, or its quadrature unreliable near a
    pole. Concrete, at once; traced, as the program runs."""
    what = "log det" if owner == "zm.logdet" else f"function={name!r}"
    advice = (
        f"{what} needs a positive definite operator: give one, or add `damping` > 0 "
        "(a positive semi-definite curvature, such as a Gauss-Newton matrix, needs it)."
    )
    if is_traced(lowest) or is_traced(damping):
        return eqx.error_if(
            estimate,
            lowest <= 0,
            f"{owner}: a Ritz value of the operator plus damping is <= 0, so it is not "
            f"positive definite. {advice}",
        )
    lowest = float(lowest)
    if not lowest > 0:
        raise ValueError(
            f"{owner}: the operator plus damping (damping={damping!r}) is not positive "
            f"definite: its smallest Ritz value is {lowest:.6g}. {advice}"
        )
    return estimate


def _trace_function(
    operator: Any,
    function: Any,
    *,
    owner: str,
    num_probes: Any,
    num_steps: Any,
    key: Any,
    damping: Any,
    max_memory: Any,
    batch_size: Any,
    sharding: Any,
    progress: Any,
) -> tuple[jax.Array, jax.Array]:
    view = symmetric_view(operator, owner)
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
    options = dict(max_memory=max_memory, batch_size=batch_size, sharding=sharding)
    nodes, weights = quadrature_rules(
        view, key, num_probes, num_steps, owner=owner, progress=progress, **options
    )
    shift = damping if is_traced(damping) else jnp.asarray(damping, view.dtype)
    mean, spread, lowest = _samples(nodes, weights, shift, apply, view.size, owner)
    estimate = _mean_and_error((num_probes, mean, spread), num_probes)
    if isinstance(function, str):
        estimate = _positive(estimate, lowest, function, damping, owner)
    return estimate


@public
def trace_function(
    operator: Any,
    function: Any,
    *,
    num_probes: Any,
    num_steps: Any = None,
    key: Any,
    damping: Any = 0.0,
    max_memory: Any = None,
    batch_size: Any = None,
    sharding: Any = None,
    progress: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
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

    `(estimate, standard_error)`, two scalars in the operator's dtype.

    **Cost:** `num_probes * num_steps` products; memory for one block's Lanczos bases,
    `num_steps * n` numbers a probe, beside the products' own.

    !!! warning

        The standard error counts the probes' randomness only, not the quadrature's
        error, which falls as `num_steps` grows, fast for a well-conditioned operator
        and slowly for an ill-conditioned one (or for `f` with a pole near its
        smallest eigenvalue, as `"inv"` and `"log"` have at 0). Where it matters,
        check that the estimate does not move with more steps.

    !!! warning

        For `"log"`, `"inv"` and `"sqrt"`, a Ritz value of `A + damping I` at or below
        zero (the operator is not positive definite) raises a `ValueError`; under
        `jax.jit` the same message is raised when the program runs. A positive
        semi-definite curvature (a Gauss-Newton matrix) needs `damping > 0`.

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
    return _trace_function(
        operator,
        function,
        owner="zm.trace_function",
        num_probes=num_probes,
        num_steps=num_steps,
        key=key,
        damping=damping,
        max_memory=max_memory,
        batch_size=batch_size,
        sharding=sharding,
        progress=progress,
    )


@public
def logdet(
    operator: Any,
    *,
    num_probes: Any,
    num_steps: Any = None,
    key: Any,
    damping: Any = 0.0,
    max_memory: Any = None,
    batch_size: Any = None,
    sharding: Any = None,
    progress: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
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
        below zero raises a `ValueError` (under `jax.jit`, when the program runs). The
        standard error counts the probes' randomness, not the quadrature's error:
        raise `num_steps` for an ill-conditioned operator.

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
    return _trace_function(
        operator,
        "log",
        owner="zm.logdet",
        num_probes=num_probes,
        num_steps=num_steps,
        key=key,
        damping=damping,
        max_memory=max_memory,
        batch_size=batch_size,
        sharding=sharding,
        progress=progress,
    )
