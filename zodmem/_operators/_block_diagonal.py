"""Block-diagonal operators: the exact curvature of each leaf (or group of variables) on
its own, the cross-terms between them dropped.

`BatchedHessian(fn, blocks="leaf")` and `BatchedGGN(fn, loss, blocks="leaf")` return one
dense block per variable leaf, and their `.operator(...)` this operator over them. Every
operation is one per block, so its cost is that of the largest block, not of `n x n`:
products, damped solves and log-determinants by each block's eigendecomposition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, Inexact, PyTree, Shaped

from .._checks import Number, RealScalar, check_bool, typechecked
from .._eager import one_program
from .._pytree import is_traced
from .._traceback import public
from ._arguments import check_real
from ._base import AbstractOperator, VariableLayout
from ._tags import register_symmetric

__all__ = ["BlockDiagonal"]


class BlockDiagonal(AbstractOperator):
    """The symmetric operator `diag(B_1, ..., B_k)` of square blocks along the diagonal,
    a `lineax` operator over flat vectors of `n = sum(n_i)` entries.

    `zm.BatchedHessian(fn, blocks="leaf").operator(x, ...)` (and `zm.BatchedGGN`'s) give
    one with a block per variable leaf of `x`, in leaf order: the block-diagonal
    approximation of the curvature, the exact curvature of each leaf with the others
    held fixed. It can be built from any symmetric blocks too.

    **Arguments:**

    - `blocks`: the square symmetric blocks, `(n_i, n_i)` arrays of one real floating
      dtype.
    - `positive_semidefinite`: whether every block is known to be positive
      semi-definite (`zm.BatchedGGN`'s are; `zm.BatchedHessian`'s are not assumed to
      be). Then the operator is tagged so for `lineax`, and each block's eigenvalues
      below zero are taken as zeros, as rounding leaves those of its null space.

    - `structure`: the variables the blocks are of, one leaf per block (a pytree of
      arrays or `jax.ShapeDtypeStruct`s, `blocks="leaf"` gives `x`'s): `mv` and `solve`
      then take and return vectors shaped like it too, leaf by leaf. `None`: a tuple of
      flat pieces, one per block.

    It is tagged symmetric for `lineax`. Besides `mv` and `as_matrix`:

    - `solve(b, damping=0.0)`: `(A + damping I)^{-1} b`, block by block;
    - `logdet(damping=0.0)`: `log det(A + damping I)`, `nan` where the determinant is
      negative (an indefinite Hessian);
    - `eigh()`: each block's eigenvalues and eigenvectors.

    Each block's eigenvalues are known to within rounding of its largest, `n_i * eps *
    max|lambda|` (`eps` the dtype's, as `numpy.linalg.matrix_rank` counts), so those
    within that of zero are taken as exactly zero: a singular block is seen as
    singular. `solve` and `logdet` refuse a singular `A + damping I`, every eigenvalue
    plus `damping` nonzero (`> 0` where the blocks are positive semi-definite, as
    `zm.KroneckerFactored` asks): a `ValueError` at once, or under `jax.jit` an error
    when the call runs. `damping` is a finite real number, `0.0` by default.

    !!! example

        ```python
        import jax.numpy as jnp
        import numpy as np
        import zodmem as zm

        def loss(params):
            return jnp.sum(params["w"] ** 4) + jnp.sum(params["b"] ** 2) * jnp.sum(params["w"])

        params = {"b": jnp.array([1.0, 2.0]), "w": jnp.array([0.5, 1.0, 1.5])}
        A = zm.BatchedHessian(loss, blocks="leaf").operator(params)
        H = zm.BatchedHessian(loss)(params)  # b's block, then w's
        np.testing.assert_allclose(A.as_matrix()[:2, :2], H[:2, :2])
        np.testing.assert_allclose(A.as_matrix()[:2, 2:], 0.0)
        v = jnp.arange(5.0)
        u = A.solve(v, damping=1.0)  # (A + I) u = v
        np.testing.assert_allclose(A.mv(u) + u, v, rtol=1e-5, atol=1e-5)
        ```
    """

    # The constructor checks its annotations itself (`typechecked`), in its own words
    # where they say more: jaxtyping's check of a dataclass's constructor, which its
    # import hook would add, is left out, as it would check them again, first.
    __no_type_check__: ClassVar[bool] = True

    solves_exactly: ClassVar[bool] = True
    blocks: tuple[jax.Array, ...]
    sizes: tuple[int, ...] = eqx.field(static=True)
    positive_semidefinite: bool = eqx.field(static=True)
    layout: VariableLayout = eqx.field(static=True)

    @public
    @typechecked
    def __init__(
        self,
        blocks: Sequence[Float[Array | np.ndarray, "_ _"] | Sequence[Sequence[Number]]],
        *,
        positive_semidefinite: bool = False,
        structure: PyTree[jax.ShapeDtypeStruct | Array] | None = None,
    ):
        check_bool(positive_semidefinite, "positive_semidefinite", owner=self._owner)
        blocks = tuple(jnp.asarray(block) for block in blocks)
        if not blocks:
            raise ValueError(f"{self._owner}: `blocks` is empty; give at least one square block.")
        for index, block in enumerate(blocks):
            if block.ndim != 2 or block.shape[0] != block.shape[1]:
                raise ValueError(
                    f"{self._owner}: every block must be a square matrix, but blocks[{index}] has "
                    f"shape {block.shape}."
                )
            if not jnp.issubdtype(block.dtype, jnp.floating):
                raise TypeError(
                    f"{self._owner}: the blocks must be real floating-point matrices, but "
                    f"`blocks[{index}]` has dtype {block.dtype}."
                )
        dtypes = {block.dtype for block in blocks}
        if len(dtypes) > 1:
            raise TypeError(
                f"{self._owner}: the blocks must share one dtype, got {sorted(map(str, dtypes))}; "
                "cast them to one."
            )
        self.blocks = blocks
        self.sizes = tuple(block.shape[0] for block in blocks)
        self.positive_semidefinite = positive_semidefinite
        if structure is None:
            self.layout = VariableLayout.of_shapes([(n,) for n in self.sizes], blocks[0].dtype)
        else:
            self.layout = VariableLayout.of(structure)
            sizes = tuple(math.prod(shape) for shape in self.layout.shapes)
            if sizes != self.sizes:
                raise ValueError(
                    f"{self._owner}: `structure` must have one leaf per block, of the block's "
                    f"size: the blocks have sizes {list(self.sizes)}, the leaves of "
                    f"`structure` {list(sizes)}."
                )

    @property
    def _dtype(self) -> Any:
        return self.blocks[0].dtype

    def _pieces(self, vector: Any, name: str, owner: str) -> tuple[list[jax.Array], bool, Any]:
        """`(pieces, is_tree, dtype)`: `vector`, flat or shaped like `structure`, as one
        piece per block (raveled by the products) in the dtype of the result."""
        leaves = jax.tree_util.tree_leaves(vector)
        if not eqx.is_array(vector) and leaves and all(isinstance(v, Number) for v in leaves):
            vector = jnp.asarray(vector)  # a list of numbers, a flat vector
        dtype = jnp.result_type(*jax.tree_util.tree_leaves(vector), self._dtype)
        pieces, is_tree = self.layout.read(vector, name=name, owner=owner, dtype=dtype)
        return pieces, is_tree, dtype

    def _written(self, pieces: list[jax.Array], is_tree: bool, dtype: Any) -> Any:
        shaped = [p.reshape(shape) for p, shape in zip(pieces, self.layout.shapes, strict=True)]
        return self.layout.write(shaped, is_tree, dtype)

    @public
    @typechecked
    def mv(
        self,
        vector: Shaped[Array | np.ndarray, " n"] | Sequence[Number] | PyTree[Shaped[Array, "..."]],
    ) -> Inexact[Array, " n"] | PyTree[Inexact[Array, "..."]]:
        """The product `A v` with a flat vector `v`, or one shaped like `structure`
        (returned so).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert jnp.allclose(A.mv(jnp.ones(3)), jnp.array([3.0, 3.0, 4.0]))
            ```
        """
        pieces, is_tree, dtype = self._pieces(vector, "vector", f"{self._owner}.mv")
        return self._written(_products(self.blocks, pieces), is_tree, dtype)

    def as_matrix(self) -> jax.Array:
        """The dense `(n, n)` matrix, zeros off the blocks.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert A.as_matrix()[0, 2] == 0.0 and A.as_matrix()[2, 2] == 4.0
            ```
        """
        return jax.scipy.linalg.block_diag(*self.blocks)

    def transpose(self) -> BlockDiagonal:
        """The operator itself: its blocks are symmetric.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert A.transpose() is A
            ```
        """
        return self

    def in_structure(self) -> jax.ShapeDtypeStruct:
        """A flat vector of `n` entries in the blocks' dtype.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert A.in_structure().shape == (3,)
            ```
        """
        return jax.ShapeDtypeStruct((sum(self.sizes),), self._dtype)

    def out_structure(self) -> jax.ShapeDtypeStruct:
        """As `in_structure`.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert A.out_structure() == A.in_structure()
            ```
        """
        return self.in_structure()

    def diagonal(self) -> jax.Array:
        """The diagonal of every block, end to end.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert jnp.allclose(A.diagonal(), jnp.array([2.0, 2.0, 4.0]))
            ```
        """
        return jnp.concatenate([jnp.diagonal(block) for block in self.blocks])

    def eigh(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """`(eigenvalues, eigenvectors)`: per block, its eigenvalues in ascending order
        and the `(n_i, n_i)` matrix of its eigenvectors (as `jnp.linalg.eigh`), the
        eigenvalues those that `solve` and `logdet` use: those within rounding of zero
        taken as zeros (and, where the blocks are positive semi-definite, those below).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            values, vectors = A.eigh()
            assert jnp.allclose(values[0], jnp.array([1.0, 3.0])) and values[1] == 4.0
            ```
        """
        pairs = self._spectra()
        return tuple(values for values, _ in pairs), tuple(vectors for _, vectors in pairs)

    def _spectra(self) -> list[tuple[jax.Array, jax.Array]]:
        """Each block's eigenvalues, those within rounding of zero set to zero (and, where
        the blocks are positive semi-definite, those below), and its eigenvectors."""
        return _spectra(self.blocks, self.positive_semidefinite)

    def _damped(self, damping: Any, owner: str) -> tuple[list[jax.Array], list[jax.Array], Any]:
        """Per block, its eigenvalues plus `damping` and its eigenvectors, with a function
        that refuses a singular damped operator: at once where the values are concrete,
        or, traced, as the program runs, by the result it is given."""
        damping = check_real(damping, "damping", owner=owner, minimum=None)
        shifted, bases, bad, least = _damped_spectra(
            self.blocks, jnp.asarray(damping, self._dtype), self.positive_semidefinite
        )
        if self.positive_semidefinite:
            allowed, advice = "> 0 (the damped operator is then positive definite)", "damping > 0"
            fault = "not positive definite"
        else:
            allowed, advice = "nonzero (the damped operator is then invertible)", "another damping"
            fault = "singular"
        message = f"{owner}: every eigenvalue plus `damping` must be {allowed}"
        rounding = "eigenvalues within rounding of zero count as zeros"

        def refuse_singular(result: Any) -> Any:
            if is_traced(bad):
                return eqx.error_if(result, bad, f"{message} ({rounding}).")
            return result

        if not is_traced(bad) and bool(bad):
            what = "least" if self.positive_semidefinite else "least in magnitude"
            raise ValueError(
                f"{message}, but the {what} is {float(least)!r} with damping={damping!r} "
                f"({rounding}): the damped operator is {fault}. Give {advice}."
            )
        return shifted, bases, refuse_singular

    @public
    @typechecked
    def solve(
        self,
        b: Shaped[Array | np.ndarray, " n"] | Sequence[Number] | PyTree[Shaped[Array, "..."]],
        *,
        damping: RealScalar = 0.0,
    ) -> Inexact[Array, " n"] | PyTree[Inexact[Array, "..."]]:
        """`(A + damping I)^{-1} b` for a flat vector `b` (or one shaped like
        `structure`, the solution returned so), one block at a time (each by its
        eigendecomposition, so a singular block with a positive damping solves). A
        singular `A + damping I` is refused (see the class).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            x = A.solve(jnp.ones(3), damping=1.0)
            assert jnp.allclose(A.mv(x) + x, jnp.ones(3), atol=1e-6)
            ```
        """
        pieces, is_tree, dtype = self._pieces(b, "b", f"{self._owner}.solve")
        shifted, bases, refuse_singular = self._damped(damping, f"{self._owner}.solve")
        return refuse_singular(self._written(_solved(shifted, bases, pieces), is_tree, dtype))

    @public
    @typechecked
    def logdet(self, *, damping: RealScalar = 0.0) -> Float[Array, ""]:
        """`log det(A + damping I)`, from every block's eigenvalues plus `damping`: the sum
        of the logarithms of their magnitudes where the determinant is positive (an even
        count of them negative: `jnp.linalg.slogdet`'s log-determinant, its sign `+1`),
        and `nan` where it is negative. A singular `A + damping I` is refused (see the
        class).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.BlockDiagonal([jnp.array([[2.0, 1.0], [1.0, 2.0]]), jnp.array([[4.0]])])
            assert jnp.allclose(A.logdet(), jnp.log(3.0 * 4.0))
            ```
        """
        shifted, _, refuse_singular = self._damped(damping, f"{self._owner}.logdet")
        return refuse_singular(_logdet(shifted))


# Each of these runs as one compiled program where it is called eagerly (a block's
# eigendecomposition and what is read from it are otherwise a dozen programs of their own).


@one_program(static=("positive_semidefinite",))
def _spectra(blocks: Any, positive_semidefinite: bool) -> list[tuple[Any, Any]]:
    pairs = []
    for block in blocks:
        # Rounding leaves a computed Hessian block a little off symmetric; eigh reads one
        # triangle, so the two are averaged first.
        values, vectors = jnp.linalg.eigh((block + block.T) / 2)
        rounding = block.shape[0] * jnp.finfo(block.dtype).eps * jnp.max(jnp.abs(values))
        zero = values <= rounding if positive_semidefinite else jnp.abs(values) <= rounding
        pairs.append((jnp.where(zero, 0, values), vectors))
    return pairs


@one_program(static=("positive_semidefinite",))
def _damped_spectra(blocks: Any, damping: Any, positive_semidefinite: bool) -> tuple:
    """Each block's eigenvalues plus `damping`, its eigenvectors, whether the damped
    operator is singular (not positive definite, where the blocks are semi-definite),
    and its least eigenvalue (in magnitude, where they are not)."""
    pairs = _spectra(blocks, positive_semidefinite)
    shifted = [values + damping for values, _ in pairs]
    every = jnp.concatenate(shifted)
    if positive_semidefinite:
        bad, least = jnp.any(every <= 0), jnp.min(every)
    else:
        bad, least = jnp.any(every == 0), jnp.min(jnp.abs(every))
    return shifted, [vectors for _, vectors in pairs], bad, least


@one_program()
def _products(blocks: Any, pieces: Any) -> list[Any]:
    return [
        (block @ jnp.ravel(piece)).reshape(piece.shape)
        for block, piece in zip(blocks, pieces, strict=True)
    ]


@one_program()
def _solved(shifted: Any, bases: Any, pieces: Any) -> list[Any]:
    return [
        (vectors @ ((vectors.T @ jnp.ravel(piece)) / values)).reshape(piece.shape)
        for values, vectors, piece in zip(shifted, bases, pieces, strict=True)
    ]


@one_program()
def _logdet(shifted: Any) -> Any:
    every = jnp.concatenate(shifted)
    negative = jnp.count_nonzero(every < 0) % 2 == 1
    return jnp.where(negative, jnp.nan, jnp.sum(jnp.log(jnp.abs(every)))).astype(every.dtype)


register_symmetric(
    BlockDiagonal,
    positive_semidefinite=False,
    diagonal=lambda operator: max(operator.sizes) == 1,
    tridiagonal=lambda operator: max(operator.sizes) <= 2,
)
# Positive semi-definite as each operator is declared, not for the whole type.
lx.is_positive_semidefinite.register(BlockDiagonal)(lambda operator: operator.positive_semidefinite)
