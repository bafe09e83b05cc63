"""`AbstractOperator`: the one base of zodmem's operators, and `VariableLayout`, how their
vectors are read as flat arrays or in the variables' structure.

Every operator zodmem returns (a transform's `BlockedOperator`, `BlockDiagonal`,
`LowRankDiagonal`, `KroneckerFactored`) is a `lineax` operator that declares, beside
lineax's `mv`, `as_matrix`, `transpose` and structures:

- `mm(matrix)`: the products with a block of vectors;
- `diagonal()`, `solve(b, damping=)`, `logdet(damping=)`, `eigh()`: what it can do
  exactly, each in the way its structure allows (by blocks, by factors, by the low-rank
  identity, or from the dense matrix of a transform's products);
- `variable_shardings()`: how each leaf of its input vectors is laid out over devices.

The estimators (`zm.eigsh`, `zm.trace`, `zm.logdet`, ...) are functions of this interface.
"""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, Inexact, PyTree, Shaped

from .._checks import NamedInMessages, RealScalar, described, typechecked
from .._pytree import ravel_leaves, split_leaves
from .._sharding import leaf_sharding, pinned
from .._traceback import public

__all__ = ["AbstractOperator", "Vector", "VariableLayout", "check_leaves", "variables_of"]

# A vector over the variables: flat `(n,)`, or a pytree shaped like them.
Vector = Shaped[Array | np.ndarray, " n"] | PyTree[Shaped[Array, "..."]]


class VariableLayout(NamedTuple):
    """The variables' structure, as an operator's vectors may take it: the pytree's
    structure and each leaf's shape and dtype, in leaf order. A flat vector holds the
    leaves raveled and concatenated in that order."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    shardings: tuple[Any, ...]  # per leaf, where it is split over devices (or None)

    @classmethod
    def of(cls, structure: Any) -> VariableLayout:
        """The layout of `structure`, a pytree of arrays or `jax.ShapeDtypeStruct`s (its
        `None`s are empty subtrees, as `eqx.filter` leaves them), with the shardings over
        several devices that its leaves carry."""
        leaves, treedef = jax.tree_util.tree_flatten(structure)
        shapes = tuple(tuple(int(d) for d in jnp.shape(leaf)) for leaf in leaves)
        dtypes = tuple(jnp.dtype(leaf.dtype) for leaf in leaves)
        return cls(treedef, shapes, dtypes, tuple(leaf_sharding(leaf) for leaf in leaves))

    @classmethod
    def of_shapes(cls, shapes: Any, dtype: Any) -> VariableLayout:
        """A tuple of leaves of these shapes, all of `dtype`."""
        structs = tuple(jax.ShapeDtypeStruct(tuple(shape), dtype) for shape in shapes)
        return cls.of(structs)

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def structure(self) -> Any:
        """The variables as `jax.ShapeDtypeStruct`s in their pytree, with their shardings."""
        structs = [
            jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for shape, dtype, sharding in zip(self.shapes, self.dtypes, self.shardings, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, structs)

    def split(self, flat: jax.Array) -> list[jax.Array]:
        """A flat `(n,)` vector cut into the leaves, each reshaped (in `flat`'s dtype)."""
        return split_leaves(flat, self.shapes)

    def join(self, pieces: list[jax.Array], dtype: Any) -> jax.Array:
        """The leaves raveled and concatenated, in `dtype`."""
        return ravel_leaves(pieces, dtype)

    def read(
        self, vector: Any, *, name: str, owner: str, dtype: Any, columns: bool = False
    ) -> tuple[list, bool]:
        """`(pieces, is_tree)`: `vector`, a flat `(n,)` array or a pytree of this
        structure, as its leaves in `dtype`; refused in words naming `name` and the
        caller `owner` otherwise (`columns`: where `(n, k)` arrays are taken too, which
        the caller reads itself)."""
        n = self.size
        if eqx.is_array(vector) and jnp.shape(vector) == (n,):
            return self.split(jnp.asarray(vector, dtype)), False
        leaves, given = jax.tree_util.tree_flatten(vector)
        shapes = tuple(tuple(jnp.shape(leaf)) for leaf in leaves)
        if given != self.treedef or shapes != self.shapes:
            got = f"an array of shape {jnp.shape(vector)}" if eqx.is_array(vector) else None
            got = got or f"{described(vector)} with leaves of shapes {list(shapes)}"
            raise ValueError(
                f"{owner}: `{name}` must be an array of shape ({n},)"
                f"{f' or ({n}, k)' if columns else ''} or a pytree shaped like the "
                f"variables, {self.structure()}, but got {got}."
            )
        return [jnp.asarray(leaf, dtype) for leaf in leaves], True

    def write(self, pieces: list[jax.Array], is_tree: bool, dtype: Any) -> Any:
        """The leaves as they were read: a flat vector, or the variables' pytree, each
        leaf laid out like its variable."""
        if not is_tree:
            return self.join(pieces, dtype)
        leaves = [
            pinned(piece.reshape(shape).astype(dtype), sharding)
            for piece, shape, sharding in zip(pieces, self.shapes, self.shardings, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def variables_of(vector: Any, x: Any, treedef: Any) -> Any:
    """`vector` given as the whole of `x` (its leaves that are not variables ignored), as a
    pytree of `treedef`, the variables' structure; any other `vector` as it is."""
    given = jax.tree_util.tree_structure(vector)
    if given == treedef or given != jax.tree_util.tree_structure(x):
        return vector
    leaves = jax.tree_util.tree_leaves(vector)
    of_x = jax.tree_util.tree_leaves(x)
    picked = [leaf for leaf, o in zip(leaves, of_x, strict=True) if eqx.is_inexact_array(o)]
    return jax.tree_util.tree_unflatten(treedef, picked)


def check_leaves(vector: Any, expected: list, name: str, *, owner: str) -> None:
    """Refuse a leaf of the pytree `vector` that is not an array of the shape and dtype of
    its `expected` `jax.ShapeDtypeStruct`, naming it by its path in `name`."""
    for (path, leaf), wanted in zip(
        jax.tree_util.tree_flatten_with_path(vector)[0], expected, strict=True
    ):
        if not eqx.is_array(leaf) or jnp.shape(leaf) != wanted.shape:
            shown = f"shape {jnp.shape(leaf)}" if eqx.is_array(leaf) else described(leaf)
            raise ValueError(
                f"{owner}: `{name}`{jax.tree_util.keystr(path)} must be an array of shape "
                f"{wanted.shape}, got {shown}."
            )
        if jnp.dtype(leaf.dtype) != wanted.dtype:
            raise TypeError(
                f"{owner}: `{name}`{jax.tree_util.keystr(path)} has dtype {leaf.dtype}, but "
                f"the operator takes {wanted.dtype} there; cast it."
            )


class AbstractOperator(lx.AbstractLinearOperator, NamedInMessages):
    """The base of zodmem's operators: a `lineax` linear operator over the variables of a
    model that declares what it can do exactly.

    Its vectors are flat `(n,)` arrays (the variables raveled in `jax.tree_util` leaf
    order) or pytrees shaped like the variables, and each method returns a vector in the
    form it was given. A concrete operator fills lineax's methods and:

    - `diagonal()`: the diagonal;
    - `solve(b, *, damping=0.0)`: `(A + damping I)^{-1} b`;
    - `logdet(*, damping=0.0)`: `log det(A + damping I)`;
    - `eigh()`: its eigendecomposition, in the form its structure gives (per block for a
      block-diagonal or Kronecker-factored operator, whole for a dense one).

    `solves_exactly` says whether its `solve` is exact at a cost far below the dense
    matrix's (a structured operator's), so that `zm.solve` takes it rather than iterating.

    It inherits `mm(matrix)`, the products with the `k` columns of an `(n, k)` array (or
    a block of `k` vectors as a pytree with a leading axis of `k` on every leaf), and
    `variable_shardings()`; either may be restated where the structure does better.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
        assert isinstance(A, zm.AbstractOperator)
        assert A.mm(jnp.eye(3)).shape == (3, 3)
        ```
    """

    solves_exactly: ClassVar[bool] = False

    @abc.abstractmethod
    def diagonal(self) -> Inexact[Array, " n"] | PyTree[Inexact[Array, "..."]]:
        """The diagonal, a flat `(n,)` array.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert jnp.allclose(A.diagonal(), jnp.array([2.0, 2.0, 4.0]))
            ```
        """

    @abc.abstractmethod
    def solve(
        self, b: Vector | Shaped[Array | np.ndarray, "n k"], *, damping: RealScalar = 0.0
    ) -> Vector | Inexact[Array, "n k"]:
        """`(A + damping I)^{-1} b`, shaped like `b` (flat, or like the variables).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            # A rank-one term over a diagonal, solved without its dense matrix.
            u = jnp.array([[0.6], [0.8], [0.0]])
            A = zm.LowRankDiagonal(u, jnp.array([2.0]), jnp.array([1.0, 1.0, 3.0]))
            dense = A.as_matrix() + 0.5 * jnp.eye(3)
            y = A.solve(jnp.ones(3), damping=0.5)
            assert jnp.allclose(y, jnp.linalg.solve(dense, jnp.ones(3)), atol=1e-6)
            ```
        """

    @abc.abstractmethod
    def logdet(self, *, damping: RealScalar = 0.0) -> Float[Array, ""]:
        """`log det(A + damping I)`.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert jnp.allclose(A.logdet(damping=1.0), jnp.log(4.0 * 2.0 * 5.0))
            ```
        """

    @abc.abstractmethod
    def eigh(self) -> tuple[Any, ...]:
        """The eigendecomposition, in the form of the operator's structure (for a
        block-diagonal operator, each block's eigenvalues and eigenvectors).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            values, vectors = A.eigh()
            assert jnp.allclose(values[0], jnp.array([1.0, 3.0]))
            ```
        """

    @public
    @typechecked
    def mm(
        self, matrix: Shaped[Array | np.ndarray, "n k"] | PyTree[Shaped[Array, "k ..."]]
    ) -> Shaped[Array, "m k"] | PyTree[Shaped[Array, "k ..."]]:
        """The products with the `k` columns of `matrix`, an `(n, k)` array, as an
        `(m, k)` array; or with a block of `k` vectors given as a pytree like the
        variables whose leaves have a leading axis of `k`, returned so.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert jnp.allclose(A.mm(jnp.eye(3)), A.as_matrix())
            ```
        """
        if eqx.is_array(matrix) and jnp.ndim(matrix) == 2:
            return jax.vmap(self.mv, in_axes=1, out_axes=1)(matrix)
        return jax.vmap(self.mv)(matrix)

    def variable_shardings(self) -> tuple[jax.sharding.Sharding | None, ...]:
        """Each input leaf's sharding where it is spread over several devices, `None`
        where it is whole on one device (or not an array with a sharding).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert A.variable_shardings() == (None,)
            ```
        """

        def over_devices(leaf: Any) -> Any:
            sharding = getattr(leaf, "sharding", None)
            if sharding is None or len(sharding.device_set) < 2:
                return None
            return sharding

        return tuple(over_devices(leaf) for leaf in jax.tree_util.tree_leaves(self.in_structure()))
