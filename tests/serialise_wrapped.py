"""Wrappers assigned at the top level of this module around a function of another one.

Each wrapper's `__module__` and `__qualname__` are those of the wrapped function
(`serialise_functions:loss`), so only the names bound here find them again.
"""

import jax
from serialise_functions import loss

grad_loss = jax.grad(loss)
jitted_loss = jax.jit(loss)
