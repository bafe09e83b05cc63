"""Losses for `zm.BatchedGGN` whose curvature on the outputs has a closed form: each is
a negative log-likelihood, and its product is the Fisher information of that
likelihood, so that `zm.BatchedGGN(fn, loss)` gives the Fisher information matrix (each
loss's own page has an example of that). A loss is also a function of the outputs and
the call's data arguments, its targets among them:

!!! example

    ```python
    import jax.numpy as jnp
    import zodmem as zm

    loss = zm.losses.SoftmaxCrossEntropy(reduction="mean")
    logits, labels = jnp.zeros((4, 3)), jnp.asarray([0, 2, 1, 1])
    assert jnp.allclose(loss(logits, labels), jnp.log(3.0))  # the mean over 4 examples
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
