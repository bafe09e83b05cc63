"""Split a pytree into its differentiable variables and everything else.

The variables of a pytree are its inexact-array leaves (floating or complex
arrays), taken in `jax.tree_util` leaf order. Every other leaf -- functions,
Python and integer-array scalars, bools, strings, activation callables held by an
Equinox model -- is held fixed and put back unchanged when a flat vector is
turned back into a pytree. The flat Jacobians and Hessians that zodmem returns are
turned back into pytrees here too (`jacobian_to_pytree`, `hessian_to_pytree`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, PyTree

from ._eager import one_program
from ._sharding import leaf_sharding, whole

__all__ = [
    "Variables",
    "split_variables",
    "flat_function",
    "basis_block",
    "hessian_to_pytree",
    "jacobian_to_pytree",
    "is_traced",
    "ravel_leaves",
    "split_leaves",
    "variable_structure",
]


def ravel_leaves(leaves: Any, dtype: Any, *, batch: int = 0) -> jax.Array:
    """The arrays `leaves` raveled and joined in order into one vector of `dtype` (empty
    where there are none): the flat form of a vector over variables. With `batch`, each
    leaf's first `batch` axes are kept and the rest raveled and joined along the next."""
    leaves = list(leaves)
    if not leaves:
        return jnp.zeros((0,), dtype)
    return _joined([whole(leaf) for leaf in leaves], jnp.dtype(dtype), batch)


@one_program(static=("dtype", "batch"))
def _joined(leaves: Any, dtype: Any, batch: int) -> Any:
    pieces = [jnp.reshape(leaf, jnp.shape(leaf)[:batch] + (-1,)) for leaf in leaves]
    return jnp.concatenate([piece.astype(dtype) for piece in pieces], axis=batch)


def split_leaves(flat: jax.Array, shapes: Any, dtypes: Any = None) -> list[jax.Array]:
    """The inverse of `ravel_leaves`: `flat`'s last axis cut into pieces of these `shapes`
    (its leading axes kept), each cast to its dtype in `dtypes` where given."""
    shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
    dtypes = None if dtypes is None else tuple(jnp.dtype(dtype) for dtype in dtypes)
    return _cut(flat, shapes, dtypes)


@one_program(static=("shapes", "dtypes"))
def _cut(flat: Any, shapes: Any, dtypes: Any) -> Any:
    pieces, start, batch = [], 0, flat.shape[:-1]
    for index, shape in enumerate(shapes):
        size = math.prod(shape)
        piece = jax.lax.slice_in_dim(flat, start, start + size, axis=flat.ndim - 1)
        piece = piece.reshape(batch + tuple(shape))
        pieces.append(piece if dtypes is None else piece.astype(dtypes[index]))
        start += size
    return pieces


def variable_structure(tree: Any, *, shardings: bool = False) -> Any:
    """`tree` with each variable (inexact-array leaf) as a `jax.ShapeDtypeStruct` and
    `None` at every other leaf: the structure of vectors over its variables (with
    `shardings`, each carrying its variable's sharding over several devices)."""

    def shape_of(leaf: Any) -> Any:
        if not eqx.is_inexact_array(leaf):
            return None
        sharding = leaf_sharding(leaf) if shardings else None
        return jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map(shape_of, tree)


class Variables(eqx.Module):
    """The inexact leaves of a pytree, described well enough to ravel and unravel them.

    - `shapes`, `dtypes`: shape and dtype of each variable leaf, in leaf order.
    - `dtype`: the common dtype of the flat vector (`jnp.result_type` of the leaves).
    - `names`: where each variable leaf sits in the pytree, as `jax.tree_util.keystr`
      writes it (`"['w']"`, `".layers[0].weight"`), for messages.
    - `treedef`, `is_variable`: the structure of the whole pytree and which of its
      leaves are variables.
    - `fixed`: the leaves that are not variables (`None` in the place of each variable).
    """

    shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    dtypes: tuple[Any, ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    names: tuple[str, ...] = eqx.field(static=True)
    treedef: Any = eqx.field(static=True)
    is_variable: tuple[bool, ...] = eqx.field(static=True)
    fixed: list[Any]
    # Each leaf's number of entries, and where it starts in the flat vector: read by every
    # cut of a flat vector into leaves, so computed once.
    sizes: tuple[int, ...] = eqx.field(static=True, init=False)
    offsets: tuple[int, ...] = eqx.field(static=True, init=False)

    def __post_init__(self):
        self.sizes = tuple(math.prod(shape) for shape in self.shapes)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.sizes[:-1]))

    @property
    def size(self) -> int:
        """`n`: the number of scalar variables."""
        return sum(self.sizes)

    @property
    def real_and_alike(self) -> bool:
        """Whether every variable has one real floating dtype: there, `mode="auto"`
        takes a curvature's products in reverse mode (with mixed dtypes, forward mode
        matches JAX's rounding; complex variables keep it too)."""
        return len(set(self.dtypes)) == 1 and bool(jnp.issubdtype(self.dtype, jnp.floating))

    def ravel(self, tree: Any) -> jax.Array:
        """Concatenate the variable leaves of `tree` into one vector of dtype `self.dtype`."""
        leaves = [
            leaf
            for leaf, is_var in zip(jax.tree_util.tree_leaves(tree), self.is_variable, strict=True)
            if is_var
        ]
        return ravel_leaves(leaves, self.dtype)

    def unravel(self, flat: jax.Array) -> Any:
        """The pytree with its variables read from `flat` and every other leaf restored."""
        return self.fill(self.leaves_of(flat))

    def fill(self, leaves: list[Any], *, keep_fixed: bool = True) -> Any:
        """Put `leaves` (one per variable, in leaf order) back into the pytree's structure.

        The other leaves are restored (`keep_fixed=True`) or set to `None`.
        """
        it = iter(leaves)
        out = [
            next(it) if is_var else (leaf if keep_fixed else None)
            for is_var, leaf in zip(self.is_variable, self.fixed, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def leaves_of(self, flat: jax.Array) -> list[jax.Array]:
        """The flat vector `flat` cut into the variables' leaves, each in its own dtype
        (the variables of `unravel`, not yet put back into the pytree)."""
        return split_leaves(flat, self.shapes, self.dtypes)

    def split_per_leaf(self, flat_axis_array: jax.Array, axis: int = -1) -> list[jax.Array]:
        """Cut `flat_axis_array` along its `axis` of size `n` into one piece per variable
        leaf, that axis reshaped to the leaf's shape."""
        return _cut_along(flat_axis_array, self.shapes, axis % flat_axis_array.ndim)


@one_program(static=("shapes", "axis"))
def _cut_along(array: Any, shapes: Any, axis: int) -> Any:
    """`array`'s `axis` cut into one piece per shape in `shapes`, reshaped to it."""
    pieces, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        piece = jax.lax.slice_in_dim(array, start, start + size, axis=axis)
        pieces.append(piece.reshape(piece.shape[:axis] + shape + piece.shape[axis + 1 :]))
        start += size
    return pieces


def _describe(leaf: Any) -> str:
    """`int32[3]` for an array (traced or not), the type's name for anything else."""
    if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
        return f"{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}"
    if isinstance(leaf, (bool, int, str)):
        return f"{leaf!r} ({type(leaf).__name__})"
    return type(leaf).__name__


def split_variables(
    tree: Any, *, argname: str = "x", owner: str = ""
) -> tuple[jax.Array, Variables]:
    """Return `(flat, variables)` for `tree`: its inexact leaves raveled, and how to undo it.

    Raises `ValueError` when `tree` has no inexact-array leaf, since there is then
    nothing to differentiate.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    all_leaves = [leaf for _, leaf in paths_leaves]
    is_variable = tuple(bool(eqx.is_inexact_array(leaf)) for leaf in all_leaves)
    leaves = [leaf for leaf, is_var in zip(all_leaves, is_variable, strict=True) if is_var]
    if not leaves:
        described = ", ".join(
            f"{argname}{jax.tree_util.keystr(path)}: {_describe(leaf)}"
            for path, leaf in paths_leaves[:8]
        ) + (f", ... ({len(paths_leaves) - 8} more)" if len(paths_leaves) > 8 else "")
        prefix = f"{owner}: " if owner else ""
        raise ValueError(
            f"{prefix}`{argname}` has no inexact-array leaves, so there is nothing to "
            f"differentiate: its leaves are {described or '(none)'}. The variables of "
            f"`{argname}` are its floating-point or complex JAX/NumPy arrays; pass them as "
            "arrays, e.g. `jnp.asarray(value, dtype=float)`."
        )
    names = tuple(
        jax.tree_util.keystr(path)
        for (path, _), is_var in zip(paths_leaves, is_variable, strict=True)
        if is_var
    )
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    dtypes = tuple(jnp.dtype(leaf.dtype) for leaf in leaves)
    dtype = jnp.result_type(*dtypes)
    fixed = [None if is_var else leaf for leaf, is_var in zip(all_leaves, is_variable, strict=True)]
    info = Variables(
        shapes=shapes,
        dtypes=dtypes,
        dtype=dtype,
        names=names,
        treedef=treedef,
        is_variable=is_variable,
        fixed=fixed,
    )
    return info.ravel(tree), info


def flat_function(
    fn: Any,
    variables: Variables,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    traced_once: bool = False,
) -> Any:
    """`z -> fn(unravel(z), *args, **kwargs)`: `fn` as a function of the flat variables.

    With `traced_once`, for a caller that compiles its call anyway, `fn` is called
    through `traced_once_call`."""
    call = called_as(fn, traced_once=traced_once)

    def fn_of_flat(flat: jax.Array) -> Any:
        return call(variables.unravel(flat), *args, **kwargs)

    return fn_of_flat


def called_as(fn: Any, *, traced_once: bool) -> Any:
    """`fn`, or with `traced_once` `fn` called through `traced_once_call`."""
    return functools.partial(traced_once_call, fn) if traced_once else fn


def _apply(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


# `fn(*args, **kwargs)` as a compiled call of its own: JAX keeps the program traced from
# `fn` per argument shapes (and `fn`'s own arrays, for a module), and its derivatives'
# per program. Each program that differentiates `fn` again at the same shapes (a plan's
# candidate block sizes, a loop's shape probe) transforms the program kept instead of
# tracing `fn` anew, at a fraction of the cost; inside a compiled call it is inlined.
traced_once_call = eqx.filter_jit(_apply)


def basis_block(start: jax.Array, block_size: int, n: int, dtype: Any) -> jax.Array:
    """Rows `start, ..., start + block_size - 1` of the `n x n` identity: `(block_size, n)`."""
    return jax.nn.one_hot(start + jnp.arange(block_size), n, dtype=dtype)


def hessian_to_pytree(H: ArrayLike, x: PyTree) -> PyTree:
    """Cut a flat `(n, n)` Hessian into blocks, one per pair of variable leaves of `x`.

    The layout is zodiax's: the result has `x`'s structure twice, and block
    `[i][j]` has shape `leaf_i.shape + leaf_j.shape` and, as in `jax.hessian` of a
    pytree, the dtype of `leaf_i` (the derivative of the gradient's leaf `i`), which
    matters when the leaves mix precisions. Leaves of `x` that are not variables (not
    inexact arrays) get `None`.

    **Arguments:**

    - `H`: a Hessian from `BatchedHessian` (or `jax.hessian` of the raveled function).
    - `x`: the pytree it was taken at (or any pytree of the same structure and shapes).

    **Returns:**

    The nested pytree of blocks.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def loss(params, data):
            return jnp.sum((params["w"] * data + params["b"]) ** 2)

        params = {"b": jnp.zeros(()), "w": jnp.ones(4)}
        H = zm.BatchedHessian(loss)(params, jnp.arange(4.0))
        blocks = zm.hessian_to_pytree(H, params)
        blocks["w"]["b"].shape   # (4,)
        ```
    """
    H = jnp.asarray(H)
    variables = split_variables(x, owner="hessian_to_pytree")[1]
    n = variables.size
    if jnp.ndim(H) != 2 or jnp.shape(H) != (n, n):
        raise ValueError(
            f"H has shape {jnp.shape(H)}, but x flattens to {n} elements, so H should have "
            f"shape ({n}, {n}). Did you pass the same x used to compute H?"
        )
    blocks = _hessian_blocks(H, variables.shapes, variables.dtypes)
    return variables.fill(
        [variables.fill(row, keep_fixed=False) for row in blocks], keep_fixed=False
    )


@functools.partial(jax.jit, static_argnums=(1, 2))
def _hessian_blocks(H: jax.Array, shapes: tuple, dtypes: tuple) -> list[list[jax.Array]]:
    """The blocks of `H` per pair of leaves of these shapes, in one compiled program (cut
    eagerly, every block's slice and reshape would be a program of its own)."""
    offsets = np.cumsum([0, *(math.prod(shape) for shape in shapes)])
    return [
        [
            H[offsets[i] : offsets[i + 1], offsets[j] : offsets[j + 1]]
            .reshape(shapes[i] + shapes[j])
            .astype(dtypes[i])
            for j in range(len(shapes))
        ]
        for i in range(len(shapes))
    ]


def jacobian_to_pytree(J: PyTree, x: PyTree) -> PyTree:
    """Reshape a flat Jacobian `(*out_shape, n)` to the structure of `x`.

    Each variable leaf of `x` gets the Jacobian block of shape
    `(*out_shape, *leaf.shape)`; leaves that are not variables get `None`. When `J`
    is a pytree (one Jacobian per output leaf of `fn`), the result has the output's
    structure on the outside and `x`'s on the inside, as `jax.jacrev` returns.

    **Arguments:**

    - `J`: a Jacobian from `BatchedJacobian`.
    - `x`: the pytree it was taken at.

    **Returns:**

    The Jacobian as a pytree.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def f(params, t):
            return params["a"] * jnp.sin(params["w"] * t)

        params = {"a": jnp.ones(3), "w": jnp.arange(3.0)}
        J = zm.BatchedJacobian(f)(params, 0.5)          # (3, 6)
        zm.jacobian_to_pytree(J, params)["w"].shape     # (3, 3)
        ```
    """
    variables = split_variables(x, owner="jacobian_to_pytree")[1]
    n = variables.size

    def one_output(leaf: ArrayLike) -> Any:
        leaf = jnp.asarray(leaf)
        if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[-1] != n:
            raise ValueError(
                f"J has a leaf of shape {jnp.shape(leaf)}, but x flattens to {n} elements, so "
                f"its last axis should have size {n}. Did you pass the same x used to compute J?"
            )
        return variables.fill(variables.split_per_leaf(leaf, axis=-1), keep_fixed=False)

    return jax.tree_util.tree_map(one_output, J)


def is_traced(tree: Any) -> bool:
    """Whether any leaf of `tree` is traced (a value inside an outer transform's program)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))
