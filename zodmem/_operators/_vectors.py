"""Vectors of an operator's input space, laid out like its variables: the one home of the
vector algebra the estimators do (inner products, linear combinations, blocks of vectors,
hashed random vectors).

A vector is a pytree shaped like the operator's `in_structure()` (for a zodmem operator,
the variables of `x`), each leaf with the shape of its variable and, where the variables
are sharded over devices, with its variable's sharding; a block of `k` vectors has leaves
`(k, *leaf.shape)`, sharded as the leaf on the trailing axes and not over the block axis.
Inner products reduce over the shards (XLA adds the all-reduce); nothing is concatenated
across leaves. A model on one device may be seen through one flat leaf of `n` entries
instead (`VectorSpace.flat`), the estimators' vectors of old.

Random vectors are integer hashes of (global flat index, stream, seed): entry `i` of
random vector `s` is the same whatever the layout, the leaves or the block sizes.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax import lax

from .._checks import described
from .._pytree import split_leaves
from .._sharding import is_explicit, leaf_sharding, pinned
from ._base import AbstractOperator

__all__ = [
    "GOLDEN",
    "VectorSpace",
    "check_symmetric",
    "flat_indices",
    "flat_space",
    "hashed_words",
    "key_seed",
    "leaf_sharding",
    "mix_words",
    "square_input",
    "vector_space",
    "words",
]

# The golden ratio's fraction of 2**32: consecutive multiples of it are spread evenly.
GOLDEN = np.uint32(0x9E3779B9)


def mix_words(x: jax.Array) -> jax.Array:
    """A bijection of 32-bit words in which every output bit depends on every input bit
    (an xorshift-multiply finaliser), in `lax`'s operations: tracing it under `vmap` or
    in a long program costs little."""
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 0x2C1B3C6D)):
        x = lax.mul(
            lax.bitwise_xor(x, lax.shift_right_logical(x, np.uint32(shift))), np.uint32(factor)
        )
    return lax.bitwise_xor(x, lax.shift_right_logical(x, np.uint32(16)))


def words(value: Any) -> jax.Array:
    return lax.convert_element_type(jnp.asarray(value), jnp.uint32)


def key_seed(key: jax.Array) -> jax.Array:
    """One 32-bit word that depends on every word of `key` (a typed `jax.random.key` or
    a raw `PRNGKey`)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    flat = words(jnp.ravel(key))
    seed = jnp.asarray(np.uint32(0x165667B1))
    for k in range(flat.shape[0]):
        seed = mix_words(lax.bitwise_xor(seed, flat[k]))
    return seed


def flat_indices(shape: tuple, offset: int) -> jax.Array:
    """The global flat index of each entry of a leaf of `shape` whose first entry is
    entry `offset` of the flat vector, as 32-bit words, elementwise: each device makes
    only its own shard's (a `(n,)` leaf at 0 is `lax.iota`)."""
    if len(shape) <= 1:
        return lax.add(lax.iota(jnp.uint32, math.prod(shape)).reshape(shape), np.uint32(offset))
    index = jnp.asarray(np.uint32(offset))
    stride = 1
    for axis in reversed(range(len(shape))):
        position = lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = lax.add(index, lax.mul(position, np.uint32(stride)))
        stride *= shape[axis]
    return index


def hashed_words(shape: tuple, offset: int, stream: Any, seed: Any) -> jax.Array:
    """Pseudo-random 32-bit words for a leaf of `shape` at `offset` of the flat vector,
    an integer hash of (global index, stream, seed)."""
    x = lax.mul(flat_indices(shape, offset), GOLDEN)
    x = lax.add(x, lax.mul(words(stream), np.uint32(0x85EBCA6B)))
    x = lax.add(x, lax.add(lax.mul(words(seed), np.uint32(0xC2B2AE35)), np.uint32(0x27D4EB2F)))
    return mix_words(x)


class VectorSpace(eqx.Module):
    """The input space of a square operator, whose vectors are pytrees shaped like its
    `in_structure()` (one leaf per variable), or, with `flat()`, one `(n,)` leaf.

    - `size`, `dtype`: the number of entries and the common dtype of its vectors (the
      estimators' arithmetic is in `dtype`, each leaf cast to its own for products).
    - `shapes`, `dtypes`, `shardings`: per leaf, the shape, the dtype and the
      `NamedSharding` over several devices (`None`: on one device, or not known).
    - `sharded`: whether any leaf is sharded over several devices.
    """

    size: int = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    shapes: tuple = eqx.field(static=True)
    dtypes: tuple = eqx.field(static=True)
    shardings: tuple = eqx.field(static=True)
    treedef: Any = eqx.field(static=True)

    @property
    def sharded(self) -> bool:
        return any(s is not None for s in self.shardings)

    @property
    def offsets(self) -> tuple:
        starts = np.cumsum([0] + [math.prod(shape) for shape in self.shapes])
        return tuple(int(s) for s in starts[:-1])

    def flat(self) -> VectorSpace:
        """The same space seen through one `(n,)` leaf (for a model on one device)."""
        treedef = jax.tree_util.tree_structure(0)
        size = (self.size,)
        return VectorSpace(self.size, self.dtype, (size,), (self.dtype,), (None,), treedef)

    # -- vectors and their layout -----------------------------------------------------

    def leaves(self, vector: Any) -> list:
        return self.treedef.flatten_up_to(vector)

    def tree(self, leaves: Any) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, list(leaves))

    def map(self, fn: Any, *vectors: Any) -> Any:
        """`fn` leaf by leaf over vectors (or blocks) of the space."""
        return self.tree(map(fn, *(self.leaves(v) for v in vectors)))

    def constrain(self, vector: Any, *, block: bool = False) -> Any:
        """`vector` (a block of vectors with `block`) pinned to the space's layout: at a
        few chosen points (a product's result, a fresh vector), never per operation."""
        if not self.sharded:
            return vector
        leaves = self.leaves(vector)
        return self.tree(pinned(x, s, block) for x, s in zip(leaves, self.shardings, strict=True))

    def zeros(self, steps: int | None = None) -> Any:
        """The zero vector, or with `steps` a block of that many zero vectors."""
        lead = () if steps is None else (steps,)
        vector = self.tree(jnp.zeros(lead + shape, self.dtype) for shape in self.shapes)
        return self.constrain(vector, block=steps is not None)

    def to_flat(self, vector: Any) -> jax.Array:
        """A vector as one flat `(n,)` array (a gather: for a model on one device), or a
        block as `(k, n)`."""
        leaves = self.leaves(vector)
        lead = leaves[0].shape[: leaves[0].ndim - len(self.shapes[0])]
        flat = [jnp.reshape(x, lead + (-1,)).astype(self.dtype) for x in leaves]
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=-1)

    def from_flat(self, flat: jax.Array) -> Any:
        """A flat `(..., n)` array as a vector (a block) of the space, leaves in `dtype`."""
        return self.tree(split_leaves(flat, self.shapes))

    def as_input(self, vector: Any) -> Any:
        """A vector with each leaf in its own dtype, as the operator takes it."""
        return self.tree(x.astype(d) for x, d in zip(self.leaves(vector), self.dtypes, strict=True))

    def as_vector(self, vector: Any) -> Any:
        """An operator's output (each leaf in its dtype) in the space's `dtype`, pinned."""
        return self.constrain(self.map(lambda x: x.astype(self.dtype), vector))

    # -- algebra ------------------------------------------------------------------------

    @property
    def explicit(self) -> bool:
        """Whether a leaf is sharded over Explicit mesh axes (its layout in its type)."""
        return any(s is not None and is_explicit(s) for s in self.shardings)

    @property
    def _reduced(self) -> Any:
        """The layout of a reduction over sharded leaves: on Explicit axes, replicated
        (the type must say it), else whatever XLA gives it."""
        return jax.sharding.PartitionSpec() if self.explicit else None

    def dot(self, u: Any, v: Any) -> jax.Array:
        if not self.sharded:
            return sum(jnp.vdot(a, b) for a, b in zip(self.leaves(u), self.leaves(v), strict=True))

        def leaf_dot(a, b):
            axes = tuple(range(a.ndim))
            return jnp.tensordot(a, b, axes=(axes, axes), out_sharding=self._reduced)

        return sum(leaf_dot(a, b) for a, b in zip(self.leaves(u), self.leaves(v), strict=True))

    def norm(self, v: Any) -> jax.Array:
        if len(self.shapes) == 1:
            return jnp.linalg.norm(self.leaves(v)[0])
        return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in self.leaves(v)))

    def block_dot(self, basis: Any, v: Any) -> jax.Array:
        """`(k,)`: the inner products of the `k` vectors of `basis` with `v`."""

        def leaf_dot(b, x):
            axes = tuple(range(x.ndim))
            leading = tuple(a + 1 for a in axes)
            return jnp.tensordot(b, x, axes=(leading, axes), out_sharding=self._reduced)

        return sum(leaf_dot(b, x) for b, x in zip(self.leaves(basis), self.leaves(v), strict=True))

    def block_gram(self, basis: Any, others: Any) -> jax.Array:
        """`(k, l)`: the inner products of the vectors of two blocks."""

        def leaf_gram(b, c):
            axes = tuple(range(1, b.ndim))
            return jnp.tensordot(b, c, axes=(axes, axes), out_sharding=self._reduced)

        return sum(
            leaf_gram(b, c) for b, c in zip(self.leaves(basis), self.leaves(others), strict=True)
        )

    def combine(self, basis: Any, c: jax.Array) -> Any:
        """`sum_i c[i] basis[i]`: a vector, or a block of them for `c` of shape `(k, l)`
        (then its leaves have a leading axis of `l`)."""

        def leaf_combine(b):
            return jnp.tensordot(c.astype(b.dtype), b, axes=(0, 0))

        return self.map(leaf_combine, basis)

    def axpy(self, a: Any, x: Any, y: Any) -> Any:
        """`a * x + y`."""
        return self.map(lambda x, y: a * x + y, x, y)

    def scale(self, a: Any, x: Any) -> Any:
        return self.map(lambda x: a * x, x)

    def normalised(self, v: Any) -> Any:
        norm = self.norm(v)
        return self.scale(1 / jnp.where(norm > 0, norm, 1), v)

    def row(self, basis: Any, j: Any) -> Any:
        """Vector `j` of a block."""
        return self.map(lambda b: lax.dynamic_index_in_dim(b, j, axis=0, keepdims=False), basis)

    def set_row(self, basis: Any, j: Any, v: Any) -> Any:
        """A block with vector `j` replaced by `v`."""
        return self.map(lambda b, x: lax.dynamic_update_index_in_dim(b, x, j, axis=0), basis, v)

    def unit(self, index: Any) -> Any:
        """The unit vector `e_index` (a global flat index, traced too), each device
        making only its own shard of each leaf."""
        index = lax.convert_element_type(index, jnp.uint32)
        vector = self.tree(
            lax.convert_element_type(flat_indices(shape, offset) == index, self.dtype)
            for shape, offset in zip(self.shapes, self.offsets, strict=True)
        )
        return self.constrain(vector)

    # -- hashed random vectors -----------------------------------------------------------

    def hashed(self, stream: Any, seed: Any = 0) -> Any:
        """32-bit words, entry `i` an integer hash of (global index `i`, stream, seed)."""
        drawn = self.tree(
            hashed_words(shape, offset, stream, seed)
            for shape, offset in zip(self.shapes, self.offsets, strict=True)
        )
        return self.constrain(drawn)

    def uniform(self, stream: Any, seed: Any = 0) -> Any:
        """Entries in [-1, 1) (`hashed(...) * 2**-31 - 1`)."""
        return self.map(lambda w: w.astype(self.dtype) * 2.0**-31 - 1, self.hashed(stream, seed))

    def normal(self, seed: Any, draw: Any) -> Any:
        """Unit vector number `draw` of standard normal entries (Box-Muller over hashed
        words) for the 32-bit `seed`: uniform on the sphere."""

        def box_muller(w1, w2):
            u1 = (w1.astype(self.dtype) + 1) * 2.0**-32  # in (0, 1]: a finite logarithm
            u2 = w2.astype(self.dtype) * 2.0**-32
            return jnp.sqrt(-2 * jnp.log(u1)) * jnp.cos(2 * math.pi * u2)

        drawn = self.map(box_muller, self.hashed(2 * draw, seed), self.hashed(2 * draw + 1, seed))
        return self.normalised(drawn)

    def signs(self, seeds: jax.Array) -> Any:
        """A block of random sign vectors (+1 or -1 in `dtype`), one per 32-bit word of
        `seeds`: entry `i` the top bit of a hash of global index `i` and its seed."""

        def leaf_signs(shape, offset, sharding):
            full = (seeds.shape[0], *shape)
            positions = lax.broadcast_in_dim(
                lax.mul(flat_indices(shape, offset), GOLDEN), full, tuple(range(1, len(full)))
            )
            block = lax.broadcast_in_dim(seeds, full, (0,))
            bits = mix_words(lax.add(mix_words(lax.bitwise_xor(positions, block)), block))
            top = lax.shift_right_logical(bits, np.uint32(31))
            signs = 1 - 2 * lax.convert_element_type(top, jnp.int32)
            return pinned(lax.convert_element_type(signs, self.dtype), sharding, True)

        return self.tree(map(leaf_signs, self.shapes, self.offsets, self.shardings))

    # -- budgets ------------------------------------------------------------------------

    def bytes_per_device(self, steps: int = 1) -> int:
        """The bytes one device holds of a block of `steps` vectors (each leaf divided
        as it is sharded)."""
        itemsize = jnp.dtype(self.dtype).itemsize
        total = 0
        for shape, sharding in zip(self.shapes, self.shardings, strict=True):
            share = math.prod(shape)
            if sharding is not None:
                local = sharding.shard_shape(shape)
                share = math.prod(local)
            total += share
        return steps * total * itemsize


def flat_space(size: int, dtype: Any) -> VectorSpace:
    """The space of flat `(size,)` vectors of `dtype` on one device."""
    treedef = jax.tree_util.tree_structure(0)
    return VectorSpace(size, jnp.dtype(dtype), ((size,),), (jnp.dtype(dtype),), (None,), treedef)


def _variable_shardings(operator: Any, count: int, like: Any) -> tuple:
    """Each input leaf's sharding over several devices: as the operator says of its
    variables (a zodmem operator), else as `like` (a vector given) is laid out, else as
    a lineax operator's structure says."""
    if isinstance(operator, AbstractOperator):
        shardings = operator.variable_shardings()
        if len(shardings) == count and any(s is not None for s in shardings):
            return shardings
    if like is not None and len(jax.tree_util.tree_leaves(like)) == count:
        return tuple(leaf_sharding(leaf) for leaf in jax.tree_util.tree_leaves(like))
    return tuple(leaf_sharding(leaf) for leaf in jax.tree_util.tree_leaves(operator.in_structure()))


def vector_space(
    operator: Any, owner: str, *, symmetric: bool = False, like: Any = None
) -> VectorSpace:
    """The input space of `operator`, a square linear operator (refused in words
    naming the caller `owner` otherwise; with `symmetric`, a real symmetric one), with
    its variables' shardings (or those of `like`, a vector laid out like them)."""
    structure, size, dtype = square_input(operator, owner)
    leaves, treedef = jax.tree_util.tree_flatten(structure)
    if symmetric:
        check_symmetric(operator, dtype, owner)
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    dtypes = tuple(leaf.dtype for leaf in leaves)
    shardings = _variable_shardings(operator, len(leaves), like)
    return VectorSpace(size, dtype, shapes, dtypes, shardings, treedef)


def square_input(operator: Any, owner: str) -> tuple[Any, int, Any]:
    """`(in_structure, size, dtype)` of `operator`, refused in words naming the caller
    `owner` unless it is a square linear operator."""
    if not isinstance(operator, lx.AbstractLinearOperator):
        raise TypeError(
            f"{owner}: `operator` must be a linear operator, such as "
            f"`zm.BatchedHessian(f).operator(x)` or a `lineax` operator, got "
            f"{described(operator)}."
        )
    structure = operator.in_structure()
    leaves = jax.tree_util.tree_leaves(structure)
    out_leaves = jax.tree_util.tree_leaves(operator.out_structure())
    size = sum(math.prod(leaf.shape) for leaf in leaves)
    out_size = sum(math.prod(leaf.shape) for leaf in out_leaves)
    if size != out_size:
        raise ValueError(
            f"{owner}: `operator` must be square, but it maps vectors of size {size} to "
            f"vectors of size {out_size} (a Jacobian's operator is not square; use a "
            f"Hessian's or a Gauss-Newton matrix's)."
        )
    return structure, size, jnp.result_type(*leaves, *out_leaves)


def check_symmetric(operator: Any, dtype: Any, owner: str) -> None:
    """Refuse, naming the caller `owner`, an operator that is not real and symmetric."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{owner}: `operator` has the complex dtype {dtype}; only real symmetric "
            "operators are supported (float32 or float64)."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{owner}: `operator` has dtype {dtype}; only real floating operators "
            "(float32 or float64) are supported."
        )
    if not lx.is_symmetric(operator):
        raise ValueError(
            f"{owner}: `operator` must be symmetric, but {type(operator).__name__} does not "
            "say it is. If it is, tag it: `lx.TaggedLinearOperator(operator, "
            "lx.symmetric_tag)` (or build it with `lx.symmetric_tag`, as in "
            "`lx.MatrixLinearOperator(A, lx.symmetric_tag)`)."
        )
