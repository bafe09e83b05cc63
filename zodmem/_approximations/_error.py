"""`approximation_error`: how far an approximate curvature operator (KFAC, EKFAC, low
rank, a diagonal) is from the exact one, in products on random vectors and in the top
eigenvalues."""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import Integer, check_int, check_key, typechecked
from .._estimators._eigsh import eigsh
from .._operators._flat import flat_view
from .._traceback import public

__all__ = ["ApproximationError", "approximation_error"]


class ApproximationError(NamedTuple):
    """What `zm.approximation_error` measured: relative errors of an approximate
    operator's products and top eigenvalues against the exact operator's.

    - `products`: `(num_vectors,)`, `|(approx - exact) v| / |exact v|` for each random
      vector `v` (standard normal entries).
    - `eigenvalues`: `(k,)`, `|approx_eigenvalues - exact_eigenvalues| / max|exact_eigenvalues|`,
      the `i`-th largest of one against the `i`-th largest of the other, relative to the
      spectrum's scale (the largest magnitude among the exact top `k`), not to each
      eigenvalue: an eigenvalue at zero, found by each as a different rounding error,
      then counts as no error rather than as a ratio of two roundings. (Where every
      exact one is zero, the errors are absolute.)
    - `approx_eigenvalues`, `exact_eigenvalues`: `(k,)`, the top `k`, largest first.

    !!! example

        ```python
        import jax, jax.numpy as jnp, lineax as lx
        import zodmem as zm

        exact = lx.MatrixLinearOperator(jnp.diag(jnp.array([4.0, 2.0, 1.0])), lx.symmetric_tag)
        approx = lx.MatrixLinearOperator(jnp.diag(jnp.array([4.0, 1.0, 1.0])), lx.symmetric_tag)
        error = zm.approximation_error(approx, exact, key=jax.random.key(0), k=2)
        assert jnp.allclose(error.eigenvalues, jnp.array([0.0, 0.25]), atol=1e-4)
        ```
    """

    products: Float[Array, " num_vectors"]
    eigenvalues: Float[Array, " k"]
    approx_eigenvalues: Float[Array, " k"]
    exact_eigenvalues: Float[Array, " k"]


@public
@typechecked
def approximation_error(
    approx: lx.AbstractLinearOperator,
    exact: lx.AbstractLinearOperator,
    *,
    key: PRNGKeyArray,
    num_vectors: Integer = 8,
    k: Integer = 4,
) -> ApproximationError:
    """How well `approx` approximates `exact`: relative errors of products on random
    vectors and of the top `k` eigenvalues.

    Use it to choose a curvature approximation (`zm.KFAC`, `zm.EKFAC`, `zm.low_rank`, a
    diagonal) for a model: `exact` is `zm.BatchedGGN(fn, loss).operator(x, *args)`,
    whose products cost a forward and backward pass each. The products take
    `num_vectors` products of each operator; the eigenvalues are `zm.eigsh`'s (`k`
    largest) of each.

    **Arguments:**

    - `approx`, `exact`: symmetric lineax operators on the same variables, flat (as
      `zm.KroneckerFactored`) or a pytree of them (as `zm.BatchedGGN`'s operator of a
      model), raveled in leaf order; `n` their number.
    - `key`: a `jax.random` key, for the vectors and eigsh's starts.
    - `num_vectors`: how many random vectors, at least 1.
    - `k`: how many eigenvalues, `0 <= k < n` (`0`: none).

    **Returns:**

    An `ApproximationError`: `.products` `(num_vectors,)` and `.eigenvalues` `(k,)`
    relative errors, and the eigenvalues themselves. Each eigenvalue's error is relative
    to the largest magnitude among the exact top `k` eigenvalues (the spectrum's scale),
    so the zeros of a low-rank operator, each a rounding error, show no error.

    !!! example

        ```python
        import jax, jax.numpy as jnp, equinox as eqx
        import zodmem as zm

        model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
        inputs = jax.random.normal(jax.random.key(1), (32, 3))
        targets = jnp.zeros((32, 2))
        predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
        loss = zm.losses.SquaredError()
        exact = zm.BatchedGGN(predict, loss).operator(model, inputs, targets)
        kfac = zm.KFAC(predict, loss)(model, inputs, targets)
        error = zm.approximation_error(kfac, exact, key=jax.random.key(2), k=3)
        assert error.products.shape == (8,) and error.eigenvalues.shape == (3,)
        ```
    """
    owner = "zm.approximation_error"
    # Their sizes and dtype only: the products are built in `_product_errors`' program.
    approx_view, exact_view = flat_view(approx, owner), flat_view(exact, owner)
    n, m, dtype = approx_view.size, exact_view.size, approx_view.dtype
    if n != m:
        raise ValueError(
            f"{owner}: `approx` takes vectors of size {n} and `exact` of size {m}; they must "
            "be operators on the same variables."
        )
    key = check_key(key, owner=owner)
    num_vectors = check_int(num_vectors, "num_vectors", owner=owner, minimum=1)
    k = check_int(k, "k", owner=owner, minimum=0)
    if k >= n:
        raise ValueError(f"{owner}: `k` must be below n = {n}, the operators' size; got k={k}.")
    vector_key, approx_key, exact_key = jax.random.split(key, 3)
    vectors = jax.random.normal(vector_key, (num_vectors, n), dtype)
    products = _product_errors(approx, exact, vectors)
    if k == 0:
        empty = jnp.zeros((0,), dtype)
        return ApproximationError(products, empty, empty, empty)
    approx_values = eigsh(approx, k, key=approx_key)[0][::-1]
    exact_values = eigsh(exact, k, key=exact_key)[0][::-1]
    # The spectrum's scale, not each eigenvalue: a zero eigenvalue is found as rounding.
    scale = jnp.max(jnp.abs(exact_values))
    errors = jnp.abs(approx_values - exact_values) / jnp.where(scale > 0, scale, 1)
    return ApproximationError(products, errors, approx_values, exact_values)


@eqx.filter_jit
def _product_errors(approx: Any, exact: Any, vectors: jax.Array) -> jax.Array:
    """`|(approx - exact) v| / |exact v|` for each row `v` of `vectors`: one program, the
    products taken one vector at a time."""
    owner = "zm.approximation_error"
    approx_product = flat_view(approx, owner).linear()
    exact_product = flat_view(exact, owner).linear()

    def error(vector):
        reference = exact_product(vector)
        return jnp.linalg.norm(approx_product(vector) - reference) / jnp.linalg.norm(reference)

    return jax.lax.map(error, vectors)
