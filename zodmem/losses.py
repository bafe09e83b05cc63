"""Losses for `zm.BatchedGGN` whose curvature on the outputs has a closed form: each is
a negative log-likelihood, and its product is the Fisher information of that
likelihood, so that `zm.BatchedGGN(fn, loss)` gives the Fisher information matrix.

!!! example

    ```python
    import jax.numpy as jnp
    import zodmem as zm

    def predict(w, inputs, targets):
        return inputs @ w

    inputs, targets = jnp.ones((5, 3)), jnp.zeros(5)
    F = zm.BatchedGGN(predict, zm.losses.SquaredError())(jnp.ones(3), inputs, targets)
    ```
"""

from ._transforms._losses import (
    AbstractLoss as AbstractLoss,
    GaussianNLL as GaussianNLL,
    PoissonNLL as PoissonNLL,
    SoftmaxCrossEntropy as SoftmaxCrossEntropy,
    SquaredError as SquaredError,
)

__all__ = ["AbstractLoss", "GaussianNLL", "PoissonNLL", "SoftmaxCrossEntropy", "SquaredError"]
