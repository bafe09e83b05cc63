"""Losses whose Hessian on the outputs `zm.BatchedGGN` applies in closed form.

Each is the negative log-likelihood of a common likelihood, summed over its elements,
and its `hessian_product` is the Fisher information of that likelihood with respect to
the outputs, applied to a tangent of the outputs: `BatchedGGN` with one of them gives
the Fisher information matrix of the parameters, `J^T F J`. With `reduction="mean"`
each is divided by the number of examples, the length of the outputs' leading axis.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.scipy.special import gammaln
from jaxtyping import ArrayLike, PRNGKeyArray, PyTree, Real

from .._checks import described, typechecked_constructor
from ._loss_base import (
    AbstractLoss,
    check_loss_options,
    check_shapes,
    checked_labels,
    diagonal_sqrt,
    one_array,
    output_shapes,
    reduced,
    targets_of,
)

__all__ = [
    "AbstractLoss",
    "GaussianNLL",
    "PoissonNLL",
    "SoftmaxCrossEntropy",
    "SquaredError",
]


@typechecked_constructor
class SquaredError(AbstractLoss):
    """Half the weighted squared error, summed over every entry of the outputs, or that
    sum averaged over the examples.

    With `reduction="sum"` (the default) the loss is
    `0.5 * sum(weights * (outputs - targets)**2)`, or with a covariance
    `0.5 * sum(r @ inv(covariance) * r)`, `r = outputs - targets`, over the last axis.
    With `reduction="mean"` it is that sum divided by `N = outputs.shape[0]`, the
    number of examples. It is the negative log-likelihood (up to a constant) of Gaussian
    outputs with precisions `weights` or covariance `covariance`, so `zm.BatchedGGN`
    with it gives the Fisher information `J^T Σ^{-1} J` (divided by `N` for the mean);
    its Hessian is `diag(weights)` or `inv(covariance)` (per example), applied in
    closed form.

    **Arguments:**

    - `weights`: an array that broadcasts against the outputs (a precision per output,
      or per column), or `None` (all ones).
    - `covariance`: instead of `weights`, a `(k, k)` covariance of the `k` entries of
      the outputs' last axis, shared by every example (symmetric positive definite).
    - `targets`: where the targets are among the call's data arguments (those after
      `x`): an int position (`-1`, the default: the last), a str keyword name, or `None`
      when `fn` returns the residuals themselves.
    - `reduction`: `"sum"` (the default), or `"mean"`: the sum divided by the number of
      examples, the length of the outputs' leading axis (outputs of shape `(N,)` are
      `N` examples of one entry; scalar outputs, with no examples axis, are refused).

    !!! tip "Other libraries' conventions"

        For outputs of shape `(N, C)` (`C = 1` for outputs of shape `(N,)`):

        - `torch.nn.MSELoss()` is `mean((outputs - targets)**2)` over all `N * C`
          entries, without the half: `SquaredError(weights=2 / C, reduction="mean")`,
          or `SquaredError(weights=2 / (N * C))`. Only the first holds over
          microbatches (`zm.Microbatcher(..., accumulator="mean")`), since it does not
          depend on the batch's size.
        - `torch.nn.MSELoss(reduction="sum")` is `SquaredError(weights=2.0)`.
        - laplax's `loss_fn="mse"` gives the GGN `sum_i J_i^T (2 I) J_i` over the
          examples: `SquaredError(weights=2.0)` (times laplax's
          `num_total_samples / num_curv_samples` where those are given).

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def predict(w, inputs, targets):
            return inputs @ w

        inputs, targets = jnp.ones((5, 3)), jnp.zeros(5)
        loss = zm.losses.SquaredError(weights=jnp.full(5, 2.0))
        G = zm.BatchedGGN(predict, loss)(jnp.ones(3), inputs, targets)  # 2 * X^T X
        mean = zm.losses.SquaredError(weights=2.0, reduction="mean")
        G_mean = zm.BatchedGGN(predict, mean)(jnp.ones(3), inputs, targets)  # G / 5
        ```
    """

    weights: Real[ArrayLike, "..."] | None = None
    covariance: Real[ArrayLike, "..."] | None = None
    targets: int | str | None = eqx.field(default=-1, static=True)
    reduction: Literal["sum", "mean"] = eqx.field(default="sum", static=True)

    def __check_init__(self):
        check_loss_options(self, optional_targets=True)
        if self.weights is not None and self.covariance is not None:
            raise ValueError(
                "SquaredError: give at most one of `weights` and `covariance`: weights "
                "are the diagonal of the precision, the inverse of a covariance."
            )
        if self.covariance is not None:
            shape = jnp.shape(self.covariance)
            if len(shape) != 2 or shape[0] != shape[1]:
                raise ValueError(
                    "SquaredError: `covariance` must be a square (k, k) matrix over the last "
                    f"axis of the outputs, got shape {shape}."
                )

    def _residuals(self, outputs: Any, args: tuple, kwargs: dict) -> Any:
        outputs = one_array(outputs, "SquaredError", "the predictions")
        targets = targets_of(self.targets, args, kwargs, "SquaredError")
        if targets is None:
            return outputs
        check_shapes(outputs, targets, "SquaredError", "predictions")
        return outputs - targets

    def _precision(self, vector: Any) -> Any:
        """The Hessian, `diag(weights)` or `inv(covariance)` per example, times `vector`."""
        if self.covariance is not None:
            k = self.covariance.shape[0]
            if vector.ndim == 0 or vector.shape[-1] != k:
                raise TypeError(
                    f"SquaredError: `covariance` is ({k}, {k}), for outputs whose last axis "
                    f"has {k} entries, but the outputs have shape {vector.shape}."
                )
            factor = jax.scipy.linalg.cho_factor(self.covariance)
            columns = vector.reshape(-1, k).T
            return jax.scipy.linalg.cho_solve(factor, columns).T.reshape(vector.shape)
        if self.weights is None:
            return vector
        return self.weights * vector

    def __call__(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        r = self._residuals(outputs, args, kwargs)
        total = 0.5 * jnp.sum(r * self._precision(r))
        return reduced(total, r, self.reduction, "SquaredError")

    def hessian_product(self, outputs: PyTree, tangents: PyTree, *args: Any, **kwargs: Any) -> Any:
        self._residuals(outputs, args, kwargs)
        product = reduced(self._precision(tangents), outputs, self.reduction, "SquaredError")
        return product.astype(tangents.dtype)

    def hessian_sqrt(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        if self.covariance is not None:
            return super().hessian_sqrt(outputs, *args, **kwargs)
        ones = jnp.ones_like(one_array(outputs, "SquaredError", "the predictions"))
        diagonal = self.hessian_product(outputs, ones, *args, **kwargs)
        return diagonal_sqrt(jnp.broadcast_to(diagonal, outputs.shape))

    def sample(self, outputs: PyTree, key: PRNGKeyArray) -> Any:
        """Targets `outputs + noise`, the noise Gaussian with precisions `weights` (none
        where a weight is zero) or covariance `covariance`."""
        if self.targets is None:
            raise TypeError(
                "SquaredError: targets=None says `fn` returns residuals, so there are no "
                "targets to draw; return predictions and pass the targets instead."
            )
        outputs = one_array(outputs, "SquaredError", "the predictions")
        noise = jax.random.normal(key, outputs.shape, outputs.dtype)
        if self.covariance is not None:
            return outputs + noise @ jnp.linalg.cholesky(self.covariance).T.astype(outputs.dtype)
        if self.weights is None:
            return outputs + noise
        weights = jnp.broadcast_to(self.weights, outputs.shape)
        scale = jnp.where(weights > 0, jax.lax.rsqrt(jnp.where(weights > 0, weights, 1)), 0)
        return outputs + (noise * scale).astype(outputs.dtype)


@typechecked_constructor
class GaussianNLL(AbstractLoss):
    """The negative log-likelihood of targets under Gaussians whose means and log-variances
    are the outputs: `0.5 * sum(log_var + (targets - mean)**2 * exp(-log_var) + log(2π))`
    over every entry, or with `reduction="mean"` that sum divided by the number of
    examples, `mean.shape[0]`.

    `fn` returns the pair `(mean, log_variance)`, two arrays of the targets' shape. The
    product is the Fisher information, `exp(-log_var)` on the means and `1/2` on the
    log-variances (no cross terms; divided by the number of examples for the mean): the
    expectation over the targets of the loss's Hessian, which itself depends on the
    targets and need not be positive. For targets of shape `(N,)`,
    `torch.nn.GaussianNLLLoss(full=True)` with `var = exp(log_var)` is this loss with
    `reduction="mean"` (torch clamps the variances at its `eps`).

    **Arguments:**

    - `targets`: where the targets are among the call's data arguments: an int position
      (`-1`, the default: the last) or a str keyword name.
    - `reduction`: `"sum"` (the default), or `"mean"`: the sum divided by the number of
      examples, the length of the outputs' leading axis (scalar outputs are refused).

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def predict(w, inputs, targets):
            return inputs @ w[:2], inputs @ w[2:]   # mean, log-variance

        inputs, targets = jnp.ones((4, 2)), jnp.zeros(4)
        F = zm.BatchedGGN(predict, zm.losses.GaussianNLL())(jnp.zeros(4), inputs, targets)
        ```
    """

    targets: int | str = eqx.field(default=-1, static=True)
    reduction: Literal["sum", "mean"] = eqx.field(default="sum", static=True)

    def __check_init__(self):
        check_loss_options(self)

    def _pair(self, outputs: Any) -> tuple[Any, Any]:
        if not (isinstance(outputs, (tuple, list)) and len(outputs) == 2):
            raise TypeError(
                "GaussianNLL: the outputs of `fn` must be a pair (mean, log_variance) of "
                f"arrays of the targets' shape, but they are {output_shapes(outputs)}."
            )
        mean, log_variance = outputs
        if jnp.shape(mean) != jnp.shape(log_variance):
            raise TypeError(
                f"GaussianNLL: the mean has shape {jnp.shape(mean)} and the log-variance "
                f"{jnp.shape(log_variance)}; they must be the same."
            )
        return mean, log_variance

    def __call__(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        mean, log_variance = self._pair(outputs)
        targets = targets_of(self.targets, args, kwargs, "GaussianNLL")
        check_shapes(mean, targets, "GaussianNLL", "means")
        squared = (targets - mean) ** 2 * jnp.exp(-log_variance)
        total = 0.5 * jnp.sum(log_variance + squared + math.log(2 * math.pi))
        return reduced(total, mean, self.reduction, "GaussianNLL")

    def hessian_product(self, outputs: PyTree, tangents: PyTree, *args: Any, **kwargs: Any) -> Any:
        mean, log_variance = self._pair(outputs)
        d_mean, d_log_variance = tangents
        on_mean = jnp.exp(-log_variance) * d_mean
        on_mean, on_log_variance = reduced(
            (on_mean, 0.5 * d_log_variance), mean, self.reduction, "GaussianNLL"
        )
        return type(tangents)(
            (on_mean.astype(d_mean.dtype), on_log_variance.astype(d_log_variance.dtype))
        )

    def hessian_sqrt(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        mean, log_variance = self._pair(outputs)
        ones = type(outputs)((jnp.ones_like(mean), jnp.ones_like(log_variance)))
        return diagonal_sqrt(self.hessian_product(outputs, ones, *args, **kwargs))

    def sample(self, outputs: PyTree, key: PRNGKeyArray) -> Any:
        """Targets `mean + exp(log_variance / 2) * noise`, the noise standard normal."""
        mean, log_variance = self._pair(outputs)
        noise = jax.random.normal(key, jnp.shape(mean), jnp.result_type(mean))
        return mean + jnp.exp(log_variance / 2) * noise


@typechecked_constructor
class PoissonNLL(AbstractLoss):
    """The negative log-likelihood of counts under Poisson distributions whose log-rates
    (or rates) are the outputs: `sum(rate - targets * log(rate) + gammaln(targets + 1))`
    over every entry, or with `reduction="mean"` that sum divided by the number of
    examples, `outputs.shape[0]`.

    The product is the Fisher information (divided by the number of examples for the
    mean): `rate` on log-rates (there it is the loss's Hessian too), `1 / rate` on rates
    (the expectation of the Hessian, `targets / rate**2`, over the counts).
    `torch.nn.PoissonNLLLoss()` leaves out `gammaln(targets + 1)`, which changes no
    curvature, and averages over all `N * C` entries of `(N, C)` outputs: its GGN is
    this loss's with `reduction="mean"` divided by `C`.

    **Arguments:**

    - `targets`: where the counts are among the call's data arguments: an int position
      (`-1`, the default: the last) or a str keyword name.
    - `log_rate`: the outputs are log-rates (`True`, the default) or rates (`False`).
    - `reduction`: `"sum"` (the default), or `"mean"`: the sum divided by the number of
      examples, the length of the outputs' leading axis (scalar outputs are refused).

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def log_rates(w, inputs, counts):
            return inputs @ w

        inputs, counts = jnp.ones((6, 2)), jnp.arange(6.0)
        F = zm.BatchedGGN(log_rates, zm.losses.PoissonNLL())(jnp.zeros(2), inputs, counts)
        ```
    """

    targets: int | str = eqx.field(default=-1, static=True)
    log_rate: bool = eqx.field(default=True, static=True)
    reduction: Literal["sum", "mean"] = eqx.field(default="sum", static=True)

    def __check_init__(self):
        check_loss_options(self)
        if not isinstance(self.log_rate, bool):
            raise TypeError(
                f"PoissonNLL: `log_rate` must be True or False, got {described(self.log_rate)}."
            )

    def __call__(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        outputs = one_array(outputs, "PoissonNLL", "log-rates" if self.log_rate else "rates")
        counts = targets_of(self.targets, args, kwargs, "PoissonNLL")
        check_shapes(outputs, counts, "PoissonNLL", "rates")
        if self.log_rate:
            rate, log_rate = jnp.exp(outputs), outputs
        else:
            rate, log_rate = outputs, jnp.log(outputs)
        total = jnp.sum(rate - counts * log_rate + gammaln(counts + 1.0))
        return reduced(total, outputs, self.reduction, "PoissonNLL")

    def hessian_product(self, outputs: PyTree, tangents: PyTree, *args: Any, **kwargs: Any) -> Any:
        outputs = one_array(outputs, "PoissonNLL", "log-rates" if self.log_rate else "rates")
        fisher = jnp.exp(outputs) if self.log_rate else 1 / outputs
        product = reduced(fisher * tangents, outputs, self.reduction, "PoissonNLL")
        return product.astype(tangents.dtype)

    def hessian_sqrt(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        ones = jnp.ones_like(one_array(outputs, "PoissonNLL", "log-rates or rates"))
        return diagonal_sqrt(self.hessian_product(outputs, ones, *args, **kwargs))

    def sample(self, outputs: PyTree, key: PRNGKeyArray) -> Any:
        """Counts drawn from the Poisson distributions, in the outputs' dtype."""
        outputs = one_array(outputs, "PoissonNLL", "log-rates" if self.log_rate else "rates")
        rate = jnp.exp(outputs) if self.log_rate else outputs
        return jax.random.poisson(key, rate, outputs.shape).astype(outputs.dtype)


@typechecked_constructor
class SoftmaxCrossEntropy(AbstractLoss):
    """The cross-entropy of labels under the softmax of logits, summed over examples:
    `-sum(labels * log_softmax(logits))` over every entry, the classes on the last axis;
    or with `reduction="mean"` that sum divided by the number of examples,
    `logits.shape[0]`.

    The labels are class indices (an integer array of the logits' shape without its last
    axis) or probabilities (the logits' shape, each example's summing to one). The
    product is `(diag(p) - p p^T) u` per example, `p = softmax(logits)` (divided by the
    number of examples for the mean): the Hessian of the loss and the Fisher information
    of the categorical likelihood. For logits of shape `(N, C)`,
    `torch.nn.CrossEntropyLoss()` is this loss with `reduction="mean"`.

    **Arguments:**

    - `targets`: where the labels are among the call's data arguments: an int position
      (`-1`, the default: the last) or a str keyword name.
    - `reduction`: `"sum"` (the default), or `"mean"`: the sum divided by the number of
      examples, the length of the logits' leading axis. The examples axis comes before
      the classes, so logits of shape `(C,)` (one example) are refused for the mean.

    !!! warning

        The product takes probabilities as labels to sum to one per example: the loss's
        Hessian is `diag(p) - p p^T` times that sum. Labels whose sums are further from 1
        than the rounding of their dtype allows (`max(sqrt(eps), 2 * C * eps)` for `C`
        classes) are refused: with a ValueError where they are concrete, and through
        `eqx.error_if` (an `EquinoxRuntimeError` when the compiled call runs) where they
        are traced, as inside `BatchedGGN`'s compiled call or a `Microbatcher`. For labels
        that are not probabilities, pass the loss as a plain function. Class indices
        outside `[0, C)` (negative ones too) are refused the same way, by the loss and by
        its product: the loss would be NaN, and an empirical Fisher (`zm.KFAC(...,
        fisher="empirical")`) would take the example's gradient as zero.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def logits(w, inputs, labels):
            return inputs @ w.reshape(2, 3)

        inputs, labels = jnp.ones((4, 2)), jnp.asarray([0, 2, 1, 1])
        F = zm.BatchedGGN(logits, zm.losses.SoftmaxCrossEntropy())(jnp.zeros(6), inputs, labels)
        # The mean cross-entropy over the 4 examples: the Fisher matrix of their mean.
        mean = zm.losses.SoftmaxCrossEntropy(reduction="mean")
        assert jnp.allclose(zm.BatchedGGN(logits, mean)(jnp.zeros(6), inputs, labels), F / 4)
        ```
    """

    targets: int | str = eqx.field(default=-1, static=True)
    reduction: Literal["sum", "mean"] = eqx.field(default="sum", static=True)

    def __check_init__(self):
        check_loss_options(self)

    def _logits(self, outputs: Any) -> Any:
        outputs = one_array(outputs, "SoftmaxCrossEntropy", "the logits, classes last")
        if outputs.ndim == 0:
            raise TypeError(
                "SoftmaxCrossEntropy: the logits must have the classes on their last axis, "
                "but `fn` returns a scalar."
            )
        return outputs

    def __call__(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        logits = self._logits(outputs)
        labels = targets_of(self.targets, args, kwargs, "SoftmaxCrossEntropy")
        log_p = jax.nn.log_softmax(logits, axis=-1)
        if jnp.issubdtype(jnp.result_type(labels), jnp.integer):
            if jnp.shape(labels) != logits.shape[:-1]:
                raise TypeError(
                    f"SoftmaxCrossEntropy: integer labels (class indices) must have the "
                    f"logits' shape without its last axis, {logits.shape[:-1]}, but have "
                    f"shape {jnp.shape(labels)}."
                )
            labels = checked_labels(labels, logits, self.targets, labels)
            picked = jnp.take_along_axis(log_p, jnp.asarray(labels)[..., None], axis=-1)
            total = -jnp.sum(picked)
        else:
            check_shapes(logits, labels, "SoftmaxCrossEntropy", "logits")
            total = -jnp.sum(labels * log_p)
        return reduced(total, logits, self.reduction, "SoftmaxCrossEntropy", classes=True)

    def hessian_product(self, outputs: PyTree, tangents: PyTree, *args: Any, **kwargs: Any) -> Any:
        logits = self._logits(outputs)
        p = jax.nn.softmax(logits, axis=-1)
        product = p * tangents - p * jnp.sum(p * tangents, axis=-1, keepdims=True)
        product = reduced(product, logits, self.reduction, "SoftmaxCrossEntropy", classes=True)
        labels = targets_of(self.targets, args, kwargs, "SoftmaxCrossEntropy")
        return checked_labels(labels, logits, self.targets, product.astype(tangents.dtype))

    def hessian_sqrt(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        # Column c is sqrt(p_c) (e_c - p): their outer products sum to diag(p) - p p^T.
        logits = self._logits(outputs)
        p = jax.nn.softmax(logits, axis=-1)
        units = jnp.eye(logits.shape[-1], dtype=p.dtype)
        columns = jnp.sqrt(p)[..., None] * (units - p[..., None, :])
        scale = reduced(
            jnp.ones((), p.dtype), logits, self.reduction, "SoftmaxCrossEntropy", classes=True
        )
        return jnp.moveaxis(columns, -2, 0) * jnp.sqrt(scale)

    def sample(self, outputs: PyTree, key: PRNGKeyArray) -> Any:
        """Class indices drawn from the softmax of the logits (integer labels)."""
        return jax.random.categorical(key, self._logits(outputs), axis=-1)
