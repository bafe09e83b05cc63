"""`SerialisationError`, raised by every layer of save and load."""

from __future__ import annotations

__all__ = ["SerialisationError"]


class SerialisationError(ValueError):
    """A transform could not be saved, or a file could not be loaded.

    Raised by [`zodmem.save`][] when the stack holds something that cannot be
    written faithfully (a lambda, a locally defined function, an object with no
    import path), and by [`zodmem.load`][] when the file is truncated or corrupted,
    was written by an unknown format version, names a class or function that cannot
    be imported, or disagrees with `like`. The message names the field and the
    reason; the underlying exception, if any, is chained as `__cause__`.

    It subclasses `ValueError`, since in every case a value handed to zodmem (the
    transform, the file's contents or `like`) is unacceptable, so code that already
    catches `ValueError` around loading keeps working. `load` never returns a
    partly built transform: it either returns the whole stack or raises.

    !!! example

        ```python
        import os
        import tempfile

        import jax.numpy as jnp
        import zodmem as zm

        path = os.path.join(tempfile.mkdtemp(), "hessian.eqx")
        try:  # a lambda has no import path to be loaded back from
            zm.save(path, zm.BatchedHessian(lambda w: jnp.sum(w**3)))
        except zm.SerialisationError as error:
            print(error)
        ```
    """
