"""The algebra of `zm.LowRankDiagonal` leaf by leaf, for a model whose variables are
sharded over devices: `U` a pytree of leaves `(r, *leaf.shape)`, each sharded as its
variable on the trailing axes, and `d` and every vector in the variables' structure and
layout. Nothing is gathered: the `(r, r)` Gram matrix of the whitened columns
`W = D^{-1/2} U diag(s)^{1/2}` (an all-reduce of the shards' products) stands for the
flat form's thin SVD, as `Q diag(f(t)) Q^T = W V diag(f(t) / t) V^T W^T` with
`W^T W = V diag(t) V^T`, and each `f(t) / t` the forms need is finite at `t = 0`:

- solve: `f(t) / t = 1 / (1 + t)` (Woodbury: `(I + W W^T)^{-1} = I - W (I + W^T W)^{-1} W^T`);
- logdet: `sum(log1p(t))`;
- sample: `f(t) / t = 1 / (g (1 + g))`, `g = sqrt(1 + t)`.

The flat form's pieces that both share live here too: the check of `d + damping > 0`, the
reading of arrays, the damped form's tuple.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import described
from .._pytree import is_traced
from ._arguments import check_dtype, check_entries
from ._vectors import VectorSpace, leaf_sharding

__all__ = [
    "Damped",
    "VectorSpace",
    "Whitened",
    "as_array",
    "is_leafwise",
    "leaves_space",
    "read",
    "structure",
]


class Damped(NamedTuple):
    """`A + damping I = R (I + Q diag(t) Q^T) R` with `R = diag(root)` and `Q`'s columns
    orthonormal."""

    root: jax.Array  # sqrt(d + damping), (n,)
    basis: jax.Array  # Q, (n, m)
    spectrum: jax.Array  # t, (m,)


def as_array(value: Any) -> Any:
    """`value` as a JAX array (NumPy arrays and nested lists welcome); anything else as it
    is, for the checks to refuse by name."""
    if isinstance(value, (jax.Array, np.ndarray, list, tuple)):
        try:
            return jnp.asarray(value)
        except (TypeError, ValueError):
            return value
    return value


def is_leafwise(d: Any) -> bool:
    """Whether `d` (and so `U`) is held leaf by leaf: a pytree but not one array, or
    an array split over several devices."""
    if not isinstance(d, jax.Array):  # anything but a pytree of arrays: for the words
        parts = jax.tree_util.tree_leaves(d)
        return bool(parts) and all(isinstance(x, jax.Array) for x in parts)
    sharding = leaf_sharding(d)
    return sharding is not None and any(axis is not None for axis in sharding.spec)


def leaves_space(d: Any) -> VectorSpace:
    """The space of vectors laid out like `d` (its leaves' shapes, dtypes, shardings)."""
    leaves, treedef = jax.tree_util.tree_flatten(d)
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    dtypes = tuple(leaf.dtype for leaf in leaves)
    shardings = tuple(leaf_sharding(leaf) for leaf in leaves)
    size = sum(math.prod(shape) for shape in shapes)
    dtype = jnp.result_type(*leaves) if leaves else jnp.dtype(jnp.float32)
    return VectorSpace(size, dtype, shapes, dtypes, shardings, treedef)


def read_either(operator: Any, vector: Any, name: str, owner: str, *, columns: bool) -> Any:
    """`vector` for a `LowRankDiagonal` `operator`, checked: an array (as annotated) of
    shape `(n,)` and of the operator's dtype (or `(n, k)` where `columns`); held leaf by
    leaf, a vector like the variables."""
    if operator.leafwise:
        return read(operator._space, vector, name, owner)
    n, dtype = operator.d.shape[0], operator.d.dtype
    shapes = f"({n},) or ({n}, k)" if columns else f"({n},)"
    ndims = (1, 2) if columns else (1,)
    if jnp.ndim(vector) not in ndims or jnp.shape(vector)[0] != n:
        raise ValueError(
            f"{owner}: `{name}` must be an array of shape {shapes} (flat vectors: see "
            f"`in_structure()`), got shape {jnp.shape(vector)}."
        )
    check_dtype(vector, name, dtype, owner=owner)
    return jnp.asarray(vector)


def read(space: VectorSpace, vector: Any, name: str, owner: str) -> Any:
    """`vector` checked: in the variables' structure, each leaf of its variable's shape
    and of the space's dtype; laid out like the variables."""
    try:
        parts = space.leaves(vector)
    except (TypeError, ValueError):
        parts = None
    shapes = [jnp.shape(x) for x in parts] if parts is not None else None
    if shapes != list(space.shapes) or not all(isinstance(x, jax.Array) for x in parts):
        raise ValueError(
            f"{owner}: `{name}` must be a vector in the variables' structure, arrays of "
            f"shapes {list(space.shapes)} (see `in_structure()`), got {described(vector)}."
        )
    for x in parts:
        check_dtype(x, name, space.dtype, owner=owner)
    return space.constrain(vector)


def gathered(space: VectorSpace, vector: Any) -> jax.Array:
    """A vector (or block) as one flat array, replicated on every device: for `as_matrix`."""
    flat = space.to_flat(vector)
    return jax.sharding.reshard(flat, jax.sharding.PartitionSpec()) if space.explicit else flat


def structure(d: Any) -> Any:
    """The operator's `in_structure()`: `d`'s shapes, dtypes and shardings."""

    def struct(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf_sharding(leaf))

    return jax.tree.map(struct, d)


def _weigh(s: jax.Array, block: jax.Array) -> jax.Array:
    """`block` (leading axis `r`) times `s` along its leading axis."""
    return block * s.reshape((-1,) + (1,) * (block.ndim - 1))


@eqx.filter_jit
def mv(space: VectorSpace, U: Any, s: jax.Array, d: Any, vector: Any) -> Any:
    coefficients = s * space.block_dot(U, vector)
    product = space.map(lambda a, b: a * b, d, vector)
    return space.constrain(space.map(jnp.add, space.combine(U, coefficients), product))


@eqx.filter_jit
def diagonal(space: VectorSpace, U: Any, s: jax.Array, d: Any) -> Any:
    return space.constrain(space.map(lambda u, e: e + jnp.tensordot(s, u * u, axes=(0, 0)), U, d))


class Whitened(eqx.Module):
    """`A + damping I = R (I + W W^T) R`, `R = diag(root)`, with `W^T W = V diag(t) V^T`."""

    root: Any  # sqrt(d + damping), like d
    columns: Any  # W, like U
    rotation: jax.Array  # V, (r, r)
    spectrum: jax.Array  # t, (r,)


@eqx.filter_jit
def whitened(space: VectorSpace, U: Any, s: jax.Array, d: Any) -> Whitened:
    root = space.map(jnp.sqrt, d)  # d + damping, checked by the caller
    columns = space.map(lambda u, q: _weigh(jnp.sqrt(s), u) / q, U, root)
    columns = space.constrain(columns, block=True)
    spectrum, rotation = jnp.linalg.eigh(space.block_gram(columns, columns))
    # A Gram matrix's eigenvalues are >= 0; rounding may leave them a little below.
    return Whitened(root, columns, rotation, jnp.maximum(spectrum, 0))


def _middle(w: Whitened, weights: jax.Array) -> jax.Array:
    """`V diag(weights) V^T`, `(r, r)`."""
    return (w.rotation * weights) @ w.rotation.T


@eqx.filter_jit
def solve(space: VectorSpace, w: Whitened, b: Any) -> Any:
    whitened_b = space.map(jnp.divide, b, w.root)
    inner = _middle(w, 1 / (1 + w.spectrum)) @ space.block_dot(w.columns, whitened_b)
    inside = space.combine(w.columns, inner)
    return space.constrain(space.map(lambda c, q, r: (c - q) / r, whitened_b, inside, w.root))


@eqx.filter_jit
def logdet(space: VectorSpace, w: Whitened) -> jax.Array:
    logs = sum(jnp.sum(jnp.log(r)) for r in space.leaves(w.root))
    return 2 * logs + jnp.sum(jnp.log1p(w.spectrum))


@eqx.filter_jit
def marginal_variances(space: VectorSpace, w: Whitened) -> Any:
    middle = _middle(w, 1 / (1 + w.spectrum))

    def entries(column, root):
        inside = jnp.sum(column * jnp.tensordot(middle, column, axes=(1, 0)), axis=0)
        # Clipped: rounding can take 1 - w_i^T M w_i a little below 0.
        return jnp.maximum(1 - inside, 0) / (root * root)

    return space.constrain(space.map(entries, w.columns, w.root))


@eqx.filter_jit
def sample(space: VectorSpace, w: Whitened, key: jax.Array, shape: tuple) -> Any:
    """Draws `L z`, `z` standard normal leaf by leaf (leaf `i` from `fold_in(key, i)`),
    each draw laid out like the variables behind a leading batch `shape`."""
    grown = jnp.sqrt(1 + w.spectrum)
    middle = _middle(w, 1 / (grown * (1 + grown)))
    lead = len(shape)

    def pinned(x, sharding):
        if sharding is None:
            return x
        spec = tuple(sharding.spec) + (None,) * (x.ndim - lead - len(sharding.spec))
        spec = jax.sharding.PartitionSpec(*((None,) * lead), *spec)
        if jax.sharding.AxisType.Explicit in getattr(sharding.mesh, "axis_types", ()):
            return jax.sharding.reshard(x, spec)
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(sharding.mesh, spec))

    normals = space.tree(
        pinned(jax.random.normal(jax.random.fold_in(key, i), (*shape, *leaf_shape), dtype), sh)
        for i, (leaf_shape, dtype, sh) in enumerate(
            zip(space.shapes, space.dtypes, space.shardings, strict=True)
        )
    )

    def inner_products(z, column):
        axes = tuple(range(1, column.ndim))
        contracted = tuple(a + lead - 1 for a in axes)
        return jnp.tensordot(z, column, axes=(contracted, axes), out_sharding=space._reduced)

    # (*shape, r): each draw's products with W's columns, then through the middle.
    inner = sum(
        inner_products(z, c)
        for z, c in zip(space.leaves(normals), space.leaves(w.columns), strict=True)
    )
    inner = inner @ middle

    def draws(z, column, root, sharding):
        pulled = jnp.tensordot(inner, column, axes=(lead, 0))
        return pinned((z - pulled) / root, sharding)

    return space.tree(
        map(
            draws,
            space.leaves(normals),
            space.leaves(w.columns),
            space.leaves(w.root),
            space.shardings,
        )
    )


def check_leaves(U: Any, s: jax.Array, d: Any, owner: str) -> None:
    """`U` and `d` held leaf by leaf: one structure, `U`'s leaves `(r, *leaf.shape)`,
    one floating dtype with `s`, `d`'s entries finite and `>= 0`."""
    d_leaves, treedef = jax.tree_util.tree_flatten(d)
    try:
        U_leaves = treedef.flatten_up_to(U)
    except (TypeError, ValueError):
        raise ValueError(
            f"{owner}: `U` held leaf by leaf must have `d`'s structure (the variables'), one "
            f"leaf (r, *variable.shape) per leaf of `d`; got U={described(U)}."
        ) from None
    if s.ndim != 1:
        raise ValueError(f"{owner}: `s` must have shape (r,), got shape {s.shape}.")
    check_entries(s, "s", "the low-rank part's eigenvalues", owner=owner)
    r = s.shape[0]
    for path, (u, e) in zip(
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(d)[0]],
        zip(U_leaves, d_leaves, strict=True),
        strict=True,
    ):
        for name, value in (("U", u), ("d", e)):
            if not isinstance(value, jax.Array) or not jnp.issubdtype(value.dtype, jnp.floating):
                raise TypeError(
                    f"{owner}: `{name}{path}` must be a real floating array, got "
                    f"{described(value)}."
                )
            if value.dtype != s.dtype:
                raise TypeError(
                    f"{owner}: `{name}{path}` has dtype {value.dtype}, but `s` has {s.dtype}; "
                    f"give all three in one dtype."
                )
        if u.shape != (r, *e.shape):
            raise ValueError(
                f"{owner}: `U{path}` must have shape (r, *d{path}.shape) = "
                f"{(r, *e.shape)} for `s` of shape {s.shape}, got shape {u.shape}."
            )
        check_entries(e, f"d{path}", "the diagonal part", owner=owner)


def check_shift(d: Any, damping: Any, owner: str) -> Any:
    """`d + damping` (leaf by leaf), refused where an entry is not `> 0` (when traced,
    as the compiled call runs)."""
    shifted = jax.tree.map(lambda e: e + jnp.asarray(damping, e.dtype), d)
    message = (
        f"{owner}: d + damping must be > 0 in every entry for the Woodbury form "
        f"(A + damping I is then positive definite)"
    )
    advice = "give damping > 0, such as a prior's precision, or a positive `d`."
    if any(is_traced(e) for e in jax.tree.leaves(shifted)):
        bad = sum(jnp.any(e <= 0) for e in jax.tree.leaves(shifted)) > 0
        return eqx.error_if(shifted, bad, f"{message}; {advice}")
    paths = jax.tree_util.tree_flatten_with_path(shifted)[0]
    for (path, entries), e in zip(paths, jax.tree.leaves(d), strict=True):
        entries = np.asarray(entries)
        if np.any(entries <= 0):
            index = int(np.flatnonzero(entries.ravel() <= 0)[0])
            name = f"d{jax.tree_util.keystr(path)}" if paths[0][0] else "d"
            raise ValueError(
                f"{message}, but {name}[{index}] + damping = {entries.ravel()[index].item()!r} "
                f"({name}[{index}] = {np.asarray(e).ravel()[index].item()!r}, "
                f"damping={damping!r}); {advice}"
            )
    return shifted
