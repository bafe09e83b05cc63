"""The public `save` and `load`."""

from __future__ import annotations

import os

import equinox as eqx

from .._checks import typechecked
from .._transforms._base import AbstractTransform
from ._error import SerialisationError
from ._file import corrupt, read_file, write_file
from ._stack import build, describe, leaf_table, read_arrays, skeleton_of, write_arrays

__all__ = ["load", "save"]


def save(path: str | os.PathLike, transform: AbstractTransform) -> None:
    """Save a transform stack, and the arrays of every model inside it, to one file.

    Each transform's class and static configuration are written as a JSON header, and
    every array in the stack (the parameters of a model passed as `fn`, at any depth
    of nesting) after it with `eqx.tree_serialise_leaves`. Checksums of both guard
    against truncation and corruption. The file is replaced atomically: it is written
    beside `path` under a temporary name, flushed to disk and renamed, so a crash
    while saving leaves any previous file at `path` as it was.

    What `fn` may be:

    - a function defined with `def` at the top level of a module, or any other object
      found again by import, such as `jnp.sin`: its import path `module:qualname` is
      written;
    - a wrapper such as `jax.jit(f)` or `jax.grad(f)` assigned to a name at the top
      level of a module, whichever module defines `f`: the path of that name is
      written (`losses:grad_loss` for `grad_loss = jax.grad(loss)` in `losses.py`);
    - another zodmem transform: it is described in turn;
    - any other Equinox module, e.g. a model such as `eqx.nn.MLP`: its arrays are
      written, and its skeleton comes from `like` at [`zodmem.load`][]. Its class need
      not be importable: one defined inside a function or in a script is named by its
      `module:qualname`, and `like` must then hold an instance of a class so named.
    - an Equinox module without arrays whose class can be imported and whose fields can
      be written (such as a loss of `zm.losses`): it is written as its class and fields,
      and needs no `like`.

    Static configuration may hold `None`, `bool`, `int`, `float`, `complex`, `str`,
    tuples, lists, dicts and named tuples of these, enum members, dtypes, importable
    functions and classes, `functools.partial` of these, and dataclass instances
    rebuilt from their fields (such as `eqx.if_array(0)`). Each value is read back
    while saving, and only values that come back equal are accepted.

    **Arguments:**

    - `path`: the file to write. No suffix is added.
    - `transform`: a zodmem transform (which may wrap other transforms and models).

    **Returns:**

    Nothing.

    **Raises:**

    `zodmem.SerialisationError` if anything in the stack cannot be written faithfully
    (a lambda or locally defined function, an array in static configuration, an object
    with no import path); the message names the field and the value, and no file is
    touched. `OSError`, naming `path`, if the file cannot be written; any previous file
    is kept.

    !!! example

        ```python
        import pathlib
        import tempfile

        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import zodmem as zm

        path = pathlib.Path(tempfile.mkdtemp()) / "jacobian.zm"
        model = eqx.nn.MLP(2, 3, 8, 2, key=jax.random.key(0))
        jacobian = zm.BatchedJacobian(model, nbatches=2)
        zm.save(path, jacobian)

        # Shapes and dtypes only: the weights come from the file.
        skeleton = eqx.filter_eval_shape(eqx.nn.MLP, 2, 3, 8, 2, key=jax.random.key(1))
        loaded = zm.load(path, like=skeleton)
        loaded(jnp.ones(2)).shape  # (3, 2), equal to jacobian(jnp.ones(2))
        ```

    !!! warning

        Functions are saved by name, not by code: loading imports them again, so a
        function defined in a script or notebook (module `__main__`) can be loaded
        only where the main module defines it too. Put functions you want to load
        elsewhere in an importable module. A module passed as `fn` is saved by its
        arrays instead, so its class may live anywhere: `like` rebuilds it.
    """
    if not isinstance(transform, AbstractTransform):
        raise SerialisationError(
            "zodmem.save saves zodmem transforms, got "
            f"{type(transform).__module__}.{type(transform).__qualname__}. To save a bare "
            "Equinox model use eqx.tree_serialise_leaves."
        )
    stack = describe(transform, "transform")
    contents = {"stack": stack, "leaves": leaf_table(transform)}
    write_file(os.fspath(path), contents, write_arrays(transform))


@typechecked
def load(path: str | os.PathLike, like: eqx.Module | None = None) -> AbstractTransform:
    """Load a transform stack written by [`zodmem.save`][].

    The stack is rebuilt through each transform's constructor, called once with the
    file's configuration and arrays, so it is validated exactly as when it was first
    built. Functions and classes are imported by the paths the file names.

    **Arguments:**

    - `path`: the file to read.
    - `like`: the skeletons of the Equinox modules held in the stack (models passed as
      `fn`), which the file cannot rebuild alone. Their arrays are replaced by the
      file's; only their structure, shapes and dtypes matter, so a skeleton from
      `eqx.filter_eval_shape` costs no memory. Three forms:

        - `None` (the default): the stack holds no such module.
        - A single Equinox module (not a transform), when the stack holds exactly
          one: e.g. the skeleton `eqx.nn.MLP` of `zm.BatchedJacobian(model)`.
        - A transform stack of the same shape as the saved one: the same transform
          classes at every level, with skeletons wherever the saved stack holds a
          module. Its configuration and functions are ignored; the file's are used.

      A skeleton's class is the one the file names; when that class cannot be
      imported (it was defined inside a function, or in a script), a class of the
      same `module:qualname` is accepted.

    **Returns:**

    The transform, equal to the one saved.

    **Raises:**

    `zodmem.SerialisationError`, with the reason, if the file is truncated or corrupted
    (a checksum covers the header and another the arrays, so a flipped byte anywhere is
    found), was written by an unknown format version, names a class or function that
    cannot be imported, or holds configuration its class rejects, or if `like` is
    missing or disagrees with the file (other classes, shapes or dtypes). Nothing is
    returned in these cases, never a partly built transform. `OSError` if the file
    cannot be read.

    !!! example

        ```python
        import pathlib
        import tempfile

        import jax
        import jax.numpy as jnp
        import zodmem as zm

        # An importable function is saved by its import path, so no `like` is needed.
        path = pathlib.Path(tempfile.mkdtemp()) / "hessian.zm"
        zm.save(path, zm.BatchedHessian(jax.nn.logsumexp, nbatches=4))
        hessian = zm.load(path)
        hessian.nbatches  # 4
        hessian(jnp.arange(8.0)).shape  # (8, 8)
        ```

    !!! warning

        Like `pickle`, loading imports the modules a file names and calls the
        constructors of the classes it names. Load only files you trust.
    """
    header, payload = read_file(os.fspath(path))
    stack, table = header.get("stack"), header.get("leaves")
    if not isinstance(stack, dict) or not isinstance(table, list):
        raise corrupt("the header has no description of the stack")
    skeleton = skeleton_of(stack, like)
    return build(read_arrays(skeleton, payload, table))
