"""`KroneckerFactored`: a block-diagonal operator whose blocks are Kronecker products,
the result of `zm.KFAC` and `zm.EKFAC`.

Each block acts on a layer's parameters laid out as a matrix `V` of shape `(out, in)`
(a weight transposed to `(out axes..., in axes...)` and reshaped, a joined bias its last
column); a leaf in no layer is a block of its own, `V` its raveled entries as one column.
With the factors' eigendecompositions `A = Q_A diag(a) Q_A^T`, `B = Q_B diag(b) Q_B^T`,

    (B ⊗ A) vec(V) = vec(B V A),
    (B ⊗ A + damping I)^{-1} vec(V) = vec(Q_B [(Q_B^T V Q_A) / (b a^T + damping)] Q_A^T),

and EKFAC replaces the eigenvalues `b a^T` by its own matrix `E` of the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PyTree, Real, Shaped

from .._checks import Integer, RealScalar, typechecked
from .._sharding import whole
from .._traceback import public
from . import _kronecker_products as compiled
from ._arguments import check_real
from ._base import AbstractOperator, VariableLayout
from ._tags import register_symmetric

__all__ = ["KroneckerBlock", "KroneckerEigen", "KroneckerFactored"]


# A factor, a basis or a block's eigenvalues: a matrix, cast to the operator's dtype.
Factor = Real[Array | np.ndarray, "_ _"]


class KroneckerBlock(NamedTuple):
    """Where a block's parameters are: its leaves (a weight and a joined bias, or one
    leaf in no layer), their paths in `x`, and the weight's layout as a matrix."""

    names: tuple[str, ...]
    leaves: tuple[int, ...]
    weight_axes: tuple[int, ...]  # the weight leaf's axes in the order (out..., in...)
    out_size: int
    in_size: int  # the weight's columns; a joined bias adds one more


class KroneckerEigen(NamedTuple):
    """One block's eigendecomposition: eigenvector `(i, j)` is the matrix
    `outer(gradient_basis[:, i], input_basis[:, j])` in the block's layout, with
    eigenvalue `eigenvalues[i, j]`."""

    names: tuple[str, ...]
    eigenvalues: jax.Array
    gradient_basis: jax.Array
    input_basis: jax.Array


class KroneckerFactored(AbstractOperator):
    """A Kronecker-factored curvature: block-diagonal over the layers, each block
    `B ⊗ A` (KFAC) or `Q_B diag(E) Q_B^T ⊗ Q_A (...) Q_A^T` with corrected eigenvalues
    (EKFAC), as `zm.KFAC` and `zm.EKFAC` return it.

    It is a `lineax` operator over the flat variables of `x` (raveled as
    `zm.BatchedGGN`'s: the inexact leaves of `x` in `jax.tree_util` order, each in C
    order), tagged symmetric and positive semi-definite. `mv` and `solve` take the
    variables' pytree too (as `eqx.filter(grads, eqx.is_inexact_array)` gives it,
    `None` where `x` has no variable) and return one, leaf by leaf, never raveled.
    Its products, damped solves and log-determinant are exact for the approximation,
    from the factors' eigendecompositions, at the cost of products with the factors
    only.

    **Arguments** (as `zm.KFAC` fills them):

    - `blocks`: per block, where its parameters are (`F.blocks[i].names` are the paths
      of its leaves in `x`: a weight and its joined bias, or one leaf in no layer).
    - `input_factors`, `gradient_factors`: per block `A`, `(in, in)` (with a bias's
      row and column last), and `B`, `(out, out)`.
    - `shapes`: the shapes of the leaves, in leaf order; `dtype`: the operator's.
    - `eigenvalues`: EKFAC's corrected eigenvalues, per block an `(out, in)` array in
      the factors' eigenbasis, or `None` for KFAC's, the products of the factors'.
    - `structure`: the variables, a pytree of arrays or `jax.ShapeDtypeStruct`s whose
      leaves have the `shapes` (`zm.KFAC` gives `x`'s, `None` where a leaf of `x` is no
      variable): the pytree vectors `mv` and `solve` take. `None`: a tuple of the leaves.

    !!! example

        ```python
        import jax, jax.numpy as jnp, equinox as eqx
        import zodmem as zm

        model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
        inputs, targets = jnp.ones((16, 3)), jnp.zeros((16, 2))
        predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
        F = zm.KFAC(predict, zm.losses.SquaredError())(model, inputs, targets)
        v = jnp.ones(F.in_structure().shape)
        assert jnp.allclose(F.solve(F.mv(v) + 0.1 * v, damping=0.1), v, rtol=1e-3)
        ```
    """

    # The constructor checks its annotations itself (`typechecked`), in its own words
    # where they say more: jaxtyping's check of a dataclass's constructor, which its
    # import hook would add, is left out, as it would check them again, first.
    __no_type_check__: ClassVar[bool] = True

    solves_exactly: ClassVar[bool] = True
    blocks: tuple[KroneckerBlock, ...] = eqx.field(static=True)
    input_factors: tuple[jax.Array, ...]
    gradient_factors: tuple[jax.Array, ...]
    # The bases and eigenvalues, `None` for KFAC's own: the factors' eigendecompositions,
    # taken on first use (`compiled.decomposition`), as a product with the factors needs none.
    eigen: tuple | None
    corrected: bool = eqx.field(static=True)
    shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    layout: VariableLayout = eqx.field(static=True)

    @public
    @typechecked
    def __init__(
        self,
        blocks: Sequence[KroneckerBlock],
        input_factors: Sequence[Factor],
        gradient_factors: Sequence[Factor],
        *,
        shapes: Sequence[Sequence[Integer]],
        dtype: DTypeLike,
        eigenvalues: Sequence[Factor] | None = None,
        bases: tuple[Sequence[Factor], Sequence[Factor]] | None = None,
        structure: PyTree[jax.ShapeDtypeStruct | Array] | None = None,
    ):
        self.blocks = tuple(blocks)
        self.shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        self.dtype = jnp.dtype(dtype)
        if structure is None:
            self.layout = VariableLayout.of_shapes(self.shapes, self.dtype)
        else:
            self.layout = VariableLayout.of(structure)
            if self.layout.shapes != self.shapes:
                raise ValueError(
                    f"{self._owner}: the leaves of `structure` must have the `shapes` "
                    f"{list(self.shapes)}, got {list(self.layout.shapes)}."
                )

        # Every array in the operator's dtype, so that its products are too (data of
        # another dtype than the model's gives factors of the data's).
        def own(arrays: Any) -> tuple:
            # Whole on every device: a factor is small, and held by each device.
            return tuple(whole(jnp.asarray(array, self.dtype)) for array in arrays)

        self.input_factors = own(input_factors)
        self.gradient_factors = own(gradient_factors)
        self.corrected = eigenvalues is not None
        self.eigen = None
        if eigenvalues is not None:
            if bases is None:
                bases = compiled.decompose(self.input_factors, self.gradient_factors)[:2]
            values = tuple(jnp.maximum(values, 0) for values in own(eigenvalues))
            self.eigen = (*(own(q) for q in bases), values)

    @property
    def input_bases(self) -> tuple[jax.Array, ...]:
        """Per block, the eigenvectors of `A` (or EKFAC's basis), as columns."""
        return compiled.decomposition(self)[0]

    @property
    def gradient_bases(self) -> tuple[jax.Array, ...]:
        """Per block, the eigenvectors of `B` (or EKFAC's basis), as columns."""
        return compiled.decomposition(self)[1]

    @property
    def eigenvalues(self) -> tuple[jax.Array, ...]:
        """Per block, its `(out, in)` eigenvalues: `outer(b, a)` (KFAC) or EKFAC's."""
        return compiled.decomposition(self)[2]

    # -- layout ---------------------------------------------------------------------------

    @property
    def _size(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def _matrices(self, vector: jax.Array) -> list[jax.Array]:
        """The flat `vector` as one `(out, in)` matrix per block."""
        return self._leaf_matrices(self.layout.split(vector))

    def _vector(self, matrices: list[jax.Array]) -> jax.Array:
        """The inverse of `_matrices`."""
        return self.layout.join(self._leaf_pieces(matrices), self.dtype)

    def _leaf_matrices(self, pieces: list[jax.Array]) -> list[jax.Array]:
        """A vector given as the variables' leaves as one `(out, in)` matrix per block."""
        matrices = []
        for block in self.blocks:
            weight = jnp.transpose(pieces[block.leaves[0]], block.weight_axes)
            columns = [weight.reshape(block.out_size, block.in_size)]
            columns += [pieces[leaf].reshape(block.out_size, 1) for leaf in block.leaves[1:]]
            matrices.append(jnp.concatenate(columns, axis=1) if len(columns) > 1 else columns[0])
        return matrices

    def _leaf_pieces(self, matrices: list[jax.Array]) -> list[jax.Array]:
        """The inverse of `_leaf_matrices`."""
        pieces = [None] * len(self.shapes)
        for block, matrix in zip(self.blocks, matrices, strict=True):
            shape = self.shapes[block.leaves[0]]
            moved = tuple(shape[d] for d in block.weight_axes)
            weight = matrix[:, : block.in_size].reshape(moved)
            pieces[block.leaves[0]] = jnp.transpose(weight, np.argsort(block.weight_axes))
            for leaf in block.leaves[1:]:
                pieces[leaf] = matrix[:, block.in_size]
        return pieces

    # -- the operator ---------------------------------------------------------------------

    def in_structure(self) -> jax.ShapeDtypeStruct:
        """The flat vectors the operator takes, `(n,)` of its dtype.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            assert F.in_structure() == jax.ShapeDtypeStruct((8,), jnp.float32)
            ```
        """
        return jax.ShapeDtypeStruct((self._size,), self.dtype)

    def out_structure(self) -> jax.ShapeDtypeStruct:
        """Those it returns: the same.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            assert F.out_structure() == F.in_structure()
            ```
        """
        return self.in_structure()

    @public
    @typechecked
    def mv(
        self, vector: Shaped[Array | np.ndarray, " n"] | PyTree[Shaped[Array, "..."]]
    ) -> Float[Array, " n"] | PyTree[Float[Array, "..."]]:
        """The product with a flat `(n,)` vector or one shaped like the variables (see
        `structure`), returned in the same form: `B V A` for each block (KFAC), or in
        the eigenbasis with the corrected eigenvalues (EKFAC).

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            # A linear layer with a squared error: KFAC is its Gauss-Newton matrix.
            G = zm.BatchedGGN(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            assert jnp.allclose(F.mv(jnp.ones(8)), G @ jnp.ones(8), rtol=1e-4, atol=1e-4)
            ```
        """
        pieces, is_tree = self.layout.read(
            vector, name="vector", owner=f"{self._owner}.mv", dtype=self.dtype
        )
        return self.layout.write(compiled.products(self, pieces), is_tree, self.dtype)

    @public
    def as_matrix(self) -> jax.Array:
        """The dense `(n, n)` matrix, from `n` products: for small `n` and tests.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            assert F.as_matrix().shape == (8, 8)
            ```
        """
        return compiled.dense(self)

    def transpose(self) -> KroneckerFactored:
        """The operator itself: it is symmetric.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            assert F.transpose() is F
            ```
        """
        return self

    @public
    def diagonal(self) -> jax.Array:
        """The diagonal, `(n,)`: `(Q_B^2) E (Q_A^2)^T` per block, `E` its eigenvalues.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            assert jnp.allclose(F.diagonal(), jnp.diag(F.as_matrix()), atol=1e-5)
            ```
        """
        return compiled.diagonal(compiled.decomposed(self))

    def _damping(self, damping: Any, owner: str) -> jax.Array:
        """`damping` checked: a finite real scalar with every eigenvalue plus it `> 0`
        (where it is concrete; traced, the same check fails the compiled call when it
        runs)."""
        damping = check_real(damping, "damping", owner=owner, minimum=None)
        value = jnp.asarray(damping, self.dtype)
        least = compiled.least(compiled.decomposed(self)) + value
        message = (
            f"{owner}: every eigenvalue plus `damping` must be > 0 (the damped operator is "
            "then positive definite); give damping > 0"
        )
        if isinstance(least, jax.core.Tracer):
            # Written so that a NaN, which compares false, fails too.
            return eqx.error_if(value, jnp.logical_not(least > 0), message + ".")
        if float(least) <= 0:
            raise ValueError(f"{message}: the least is {float(least)!r} with damping={damping!r}.")
        return value

    @public
    @typechecked
    def solve(
        self,
        b: Shaped[Array | np.ndarray, " n"]
        | Shaped[Array | np.ndarray, "n k"]
        | PyTree[Shaped[Array, "..."]],
        *,
        damping: RealScalar = 0.0,
    ) -> Float[Array, " n"] | Float[Array, "n k"] | PyTree[Float[Array, "..."]]:
        """The solution `y` of `(F + damping I) y = b`, exactly for this `F`, in its
        eigenbasis: `damping` is added to every eigenvalue, not to the factors (as the
        factored damping `(B + sqrt(damping) I) ⊗ (A + sqrt(damping) I)` would).

        **Arguments:**

        - `b`: an `(n,)` array, `(n, k)` for `k` right-hand sides, or a vector shaped
          like the variables (see `structure`).
        - `damping`: a finite real scalar (a Python or NumPy number, or a 0-d real
          array; anything else is a `TypeError`, NaN or infinity a `ValueError`); every
          eigenvalue plus it must be `> 0` (a `ValueError`; under `jax.jit`, where NaN
          fails too, an error when the call runs).

        **Returns:**

        `y`, shaped like `b`.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            b = jnp.arange(8.0)
            y = F.solve(b, damping=0.1)
            assert jnp.allclose(F.mv(y) + 0.1 * y, b, rtol=1e-3, atol=1e-3)
            ```
        """
        owner = f"{self._owner}.solve"
        n = self._size
        if eqx.is_array(b) and jnp.ndim(b) == 2 and jnp.shape(b)[0] == n:
            columns = jnp.asarray(b, self.dtype)
            return compiled.solve(compiled.decomposed(self), columns, self._damping(damping, owner))
        read = dict(name="b", owner=owner, dtype=self.dtype, columns=True)
        pieces, is_tree = self.layout.read(b, **read)
        out = compiled.solve(compiled.decomposed(self), pieces, self._damping(damping, owner))
        return self.layout.write(out, is_tree, self.dtype)

    @public
    @typechecked
    def logdet(self, *, damping: RealScalar = 0.0) -> Float[Array, ""]:
        """`log det(F + damping I)`, exactly: the sum of the logarithms of the eigenvalues
        plus `damping`, which must all be `> 0`.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            dense = F.as_matrix() + 0.1 * jnp.eye(8)
            assert jnp.allclose(F.logdet(damping=0.1), jnp.linalg.slogdet(dense)[1], rtol=1e-4)
            ```
        """
        damping = self._damping(damping, f"{self._owner}.logdet")
        return compiled.logdet(compiled.decomposed(self), damping)

    def eigh(self) -> tuple[KroneckerEigen, ...]:
        """Each block's eigenvalues and eigenvectors, as a `KroneckerEigen`: the
        eigenvectors are the Kronecker products of the factors' eigenvectors.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            (block,) = F.eigh()  # one layer: its weight and bias
            assert block.names == (".weight", ".bias") and block.eigenvalues.shape == (2, 4)
            ```
        """
        return tuple(
            KroneckerEigen(block.names, values, q_b, q_a)
            for block, values, q_b, q_a in zip(
                self.blocks, self.eigenvalues, self.gradient_bases, self.input_bases, strict=True
            )
        )

    @public
    @typechecked
    def with_eigenvalues(self, eigenvalues: Sequence[Factor]) -> KroneckerFactored:
        """The same factors and eigenvectors with other eigenvalues, one `(out, in)`
        array per block: EKFAC's correction.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            layer = eqx.nn.Linear(3, 2, key=jax.random.key(0))
            inputs = jax.random.normal(jax.random.key(1), (10, 3))
            predict = lambda m, inputs, targets: jax.vmap(m)(inputs)
            F = zm.KFAC(predict, zm.losses.SquaredError())(layer, inputs, jnp.zeros((10, 2)))
            doubled = F.with_eigenvalues([2 * values for values in F.eigenvalues])
            assert jnp.allclose(doubled.as_matrix(), 2 * F.as_matrix(), rtol=1e-4, atol=1e-5)
            ```
        """
        bases = (self.input_bases, self.gradient_bases)
        return KroneckerFactored(
            self.blocks,
            self.input_factors,
            self.gradient_factors,
            shapes=self.shapes,
            dtype=self.dtype,
            eigenvalues=eigenvalues,
            bases=bases,
            structure=self.layout.structure(),
        )


# -- what lineax asks of an operator, by type ------------------------------------------------


register_symmetric(KroneckerFactored, positive_semidefinite=True)
