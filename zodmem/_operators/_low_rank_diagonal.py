"""Low-rank plus diagonal operators, `A = U diag(s) U^T + diag(d)` (`zm.low_rank`'s, a
Laplace posterior's precision), with exact damped inverses, log-determinants, marginal
variances and Gaussian samples in `O(n r^2)` from one thin SVD.

With `D = d + damping > 0` and the thin SVD `D^{-1/2} U diag(s)^{1/2} = Q diag(sigma) V^T`,

    A + damping I = D^{1/2} (I + Q diag(t) Q^T) D^{1/2},    t = sigma^2,

and the middle factor is the identity but on the span of `Q`'s orthonormal columns, so

- `(A + damping I)^{-1} = D^{-1/2} (I - Q diag(t / (1 + t)) Q^T) D^{-1/2}` (Woodbury),
- `log det(A + damping I) = sum(log D) + sum(log1p(t))` (the determinant lemma),
- `L = D^{-1/2} (I - Q diag(1 - (1 + t)^{-1/2}) Q^T)` has `L L^T = (A + damping I)^{-1}`,
  so `L z`, `z ~ N(0, I)`, is a draw from `N(0, (A + damping I)^{-1})`.

None of these needs `U`'s columns orthonormal, or `s > 0`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._checks import Integer, Number, RealScalar, check_key, described, typechecked
from .._traceback import public
from . import _low_rank_leaves as leaves, _woodbury as woodbury
from ._arguments import check_entries, check_real, check_shape
from ._base import AbstractOperator
from ._dense import dense_eigh
from ._tags import register_symmetric

__all__ = ["LowRankDiagonal"]

# A vector of an operator held leaf by leaf: in the variables' structure.
Vector = PyTree[Float[Array, "..."]]


class LowRankDiagonal(AbstractOperator):
    """The symmetric positive semi-definite operator `A = U diag(s) U^T + diag(d)`: a
    low-rank part and a diagonal one, with exact inverses, log-determinants and samples
    of `A + damping I`.

    Use it as a Laplace posterior's precision: `zm.low_rank(G, r)` takes a curvature
    `G`'s top `r` eigenpairs, and where asked the diagonal of what they leave out, and
    `damping` is a Gaussian prior's precision. Every operation costs `O(n r^2)` at most
    and holds `O(n r)` numbers: the `n x n` matrix is never formed, but by `as_matrix`.
    It is a `lineax` linear operator tagged symmetric and positive semi-definite, so
    lineax's solvers and zodmem's estimators (`zm.solve`, `zm.eigsh`, ...) take it too.

    Its vectors are flat, `(n,)` arrays of its dtype: built from a curvature of a model's
    pytree of parameters, `A` is in the raveled order of the variables (as `zm.eigsh`'s
    vectors are), and `jax.flatten_util.ravel_pytree` of the variables gives the way back.
    Where the variables are sharded over devices, it is held leaf by leaf instead
    (`leafwise`): `d` and its vectors in the variables' structure, each leaf laid out like
    its variable, and `U` a leaf `(r, *variable.shape)` per variable, sharded as it is;
    nothing is gathered onto one device but `(r, r)` matrices.

    **Arguments:**

    - `U`: an `(n, r)` array, the low-rank part's directions; orthonormal columns as
      `zm.eigsh` gives them, though nothing here needs them so. `r = 0` is allowed.
      Leaf by leaf: a pytree of `d`'s structure, leaves `(r, *leaf.shape)` (the
      eigenvectors `zm.eigsh` returns for sharded variables).
    - `s`: an `(r,)` array `>= 0`, the low-rank part's eigenvalues (for orthonormal `U`).
    - `d`: an `(n,)` array `>= 0`, the diagonal part; or a pytree of arrays `>= 0` (the
      variables'), or an array sharded over devices: then `A` is held leaf by leaf.

    All three real, of one floating dtype. Values are checked where they are concrete
    (not inside `jax.jit`): `s` and `d` must be finite and `>= 0`.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import zodmem as zm

        U = jnp.linalg.qr(jax.random.normal(jax.random.key(0), (6, 2)))[0]
        A = zm.LowRankDiagonal(U, jnp.array([3.0, 1.0]), jnp.full(6, 0.1))
        dense = U @ jnp.diag(jnp.array([3.0, 1.0])) @ U.T + 0.1 * jnp.eye(6)
        assert jnp.allclose(A.as_matrix(), dense, atol=1e-6)
        ```
    """

    # The constructor checks its annotations itself (`typechecked`), in its own words
    # where they say more: jaxtyping's check of a dataclass's constructor, which its
    # import hook would add, is left out, as it would check them again, first.
    __no_type_check__: ClassVar[bool] = True

    solves_exactly: ClassVar[bool] = True
    U: PyTree[jax.Array]
    s: jax.Array
    d: PyTree[jax.Array]
    leafwise: bool = eqx.field(static=True)

    @public
    @typechecked
    def __init__(
        self,
        U: Float[Array | np.ndarray, "n r"]
        | Sequence[Sequence[Number]]
        | PyTree[Float[Array, "..."]],
        s: Float[Array | np.ndarray, " r"] | Sequence[Number],
        d: Float[Array | np.ndarray, " n"] | Sequence[Number] | PyTree[Float[Array, "..."]],
    ):
        self.U = leaves.as_array(U)
        self.s = leaves.as_array(s)
        self.d = leaves.as_array(d)
        self.leafwise = leaves.is_leafwise(self.d)

    def __check_init__(self):
        for name in ("s",) if self.leafwise else ("U", "s", "d"):
            value = getattr(self, name)
            if not isinstance(value, jax.Array):
                raise TypeError(
                    f"{self._owner}: `{name}` must be an array, got {described(value)}."
                )
            if not jnp.issubdtype(value.dtype, jnp.floating):
                raise TypeError(
                    f"{self._owner}: `{name}` must be a real floating array (float32 or float64), "
                    f"got dtype {value.dtype}."
                )
        if self.leafwise:
            return leaves.check_leaves(self.U, self.s, self.d, self._owner)
        if self.U.ndim != 2:
            raise ValueError(
                f"{self._owner}: `U` must be a 2-d array of shape (n, r), one direction a column, "
                f"got shape {self.U.shape}."
            )
        n, r = self.U.shape
        for name, shape in (("s", (r,)), ("d", (n,))):
            value = getattr(self, name)
            if value.shape != shape:
                raise ValueError(
                    f"{self._owner}: `{name}` must have shape {shape} for `U` of shape {(n, r)}, "
                    f"got shape {value.shape}."
                )
            if value.dtype != self.U.dtype:
                raise TypeError(
                    f"{self._owner}: `{name}` has dtype {value.dtype}, but `U` has {self.U.dtype}; "
                    f"give all three in one dtype."
                )
        check_entries(self.s, "s", "the low-rank part's eigenvalues", owner=self._owner)
        check_entries(self.d, "d", "the diagonal part", owner=self._owner)

    # -- the operator --------------------------------------------------------------------

    @property
    def _space(self) -> leaves.VectorSpace:
        return leaves.leaves_space(self.d)

    def in_structure(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The shape and dtype of the vectors `A` takes: flat, `(n,)` (held leaf by leaf,
        `d`'s structure, shapes and shardings).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.ones((4, 1)) / 2, jnp.ones(1), jnp.ones(4))
            assert A.in_structure().shape == (4,)
            ```
        """
        if self.leafwise:
            return leaves.structure(self.d)
        return jax.ShapeDtypeStruct(self.d.shape, self.d.dtype)

    def out_structure(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The shape and dtype of the vectors `A` returns: those it takes.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.ones((4, 1)) / 2, jnp.ones(1), jnp.ones(4))
            assert A.out_structure() == A.in_structure()
            ```
        """
        return self.in_structure()

    def _read(self, vector: Any, name: str, owner: str, *, columns: bool) -> Any:
        """`vector` checked (see `_low_rank_leaves.read_either`)."""
        return leaves.read_either(self, vector, name, owner, columns=columns)

    @public
    @typechecked
    def mv(self, vector: Float[Array | np.ndarray, " n"] | Vector) -> Float[Array, " n"] | Vector:
        """The product `A v = U (s * (U^T v)) + d * v`, in `O(n r)`.

        **Arguments:**

        - `vector`: a flat `(n,)` array of the operator's dtype.

        **Returns:**

        The product, an `(n,)` array.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.ones(3))
            assert jnp.allclose(A.mv(jnp.ones(3)), jnp.array([3.0, 1.0, 1.0]))
            ```
        """
        vector = self._read(vector, "vector", f"{self._owner}.mv", columns=False)
        if self.leafwise:
            return leaves.mv(self._space, self.U, self.s, self.d, vector)
        return woodbury.product(self.U, self.s, self.d, vector)

    @public
    def as_matrix(self) -> jax.Array:
        """The dense `(n, n)` matrix `U diag(s) U^T + diag(d)`: for small `n` and tests.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.ones(3))
            assert jnp.allclose(A.as_matrix(), jnp.diag(jnp.array([3.0, 1.0, 1.0])))
            ```
        """
        if self.leafwise:  # gathered: for small models and tests
            U, d = leaves.gathered(self._space, self.U).T, leaves.gathered(self._space, self.d)
            return (U * self.s) @ U.T + jnp.diag(d)
        return woodbury.dense(self.U, self.s, self.d)

    def transpose(self) -> LowRankDiagonal:
        """`A` itself: it is symmetric.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.ones(3))
            assert A.transpose() is A and A.T is A
            ```
        """
        return self

    def diagonal(self) -> PyTree[jax.Array]:
        """The diagonal of `A`, `d + sum(U**2 * s, axis=1)`, in `O(n r)`.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.ones(3))
            assert jnp.allclose(A.diagonal(), jnp.array([3.0, 1.0, 1.0]))
            ```
        """
        if self.leafwise:
            return leaves.diagonal(self._space, self.U, self.s, self.d)
        return woodbury.diagonal(self.U, self.s, self.d)

    # -- the damped operator: inverse, determinant, samples --------------------------------

    def _damped(self, damping: Any, owner: str) -> leaves.Damped | leaves.Whitened:
        """`A + damping I` as `R (I + Q diag(t) Q^T) R`; `d + damping > 0` checked (when
        traced, as the compiled call runs)."""
        damping = check_real(damping, "damping", owner=owner, minimum=None)
        shifted = leaves.check_shift(self.d, damping, owner)
        if self.leafwise:
            return leaves.whitened(self._space, self.U, self.s, shifted)
        return woodbury.damped(self.U, self.s, shifted)

    @public
    @typechecked
    def solve(
        self,
        b: Float[Array | np.ndarray, " n"] | Float[Array | np.ndarray, "n k"] | Vector,
        *,
        damping: RealScalar = 0.0,
    ) -> Float[Array, " n"] | Float[Array, "n k"] | Vector:
        """The solution `y` of `(A + damping I) y = b`, exactly, by Woodbury's identity.

        With `D = d + damping` it is `D^{-1/2} (c - Q diag(t / (1 + t)) Q^T c)`,
        `c = D^{-1/2} b`, from the thin SVD `D^{-1/2} U diag(s)^{1/2} = Q diag(t)^{1/2} V^T`:
        `O(n r^2)` for the SVD, `O(n r k)` for `k` right-hand sides. For a Laplace
        posterior, `damping` is the prior's precision and `y` a posterior covariance
        times `b`.

        **Arguments:**

        - `b`: an `(n,)` array, or an `(n, k)` array of `k` right-hand sides, one a
          column, in the operator's dtype.
        - `damping`: `lambda`, a real number (a 0-d array, traced too). Every entry of
          `d + damping` must be `> 0` (then `A + damping I` is positive definite): a
          `ValueError` otherwise (under `jax.jit`, an error when the call runs).

        **Returns:**

        `y`, shaped like `b`.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.zeros(3))
            y = A.solve(jnp.ones(3), damping=1.0)  # (A + I)^-1 1
            assert jnp.allclose(y, jnp.array([1 / 3, 1.0, 1.0]))
            ```
        """
        owner = f"{self._owner}.solve"
        b = self._read(b, "b", owner, columns=True)
        if self.leafwise:
            return leaves.solve(self._space, self._damped(damping, owner), b)
        return woodbury.solve(self._damped(damping, owner), b)

    @public
    @typechecked
    def logdet(self, *, damping: RealScalar = 0.0) -> Float[Array, ""]:
        """`log det(A + damping I)`, exactly, by the matrix determinant lemma:
        `sum(log(d + damping)) + sum(log1p(t))` with `t` the squared singular values of
        `(d + damping)^{-1/2} U diag(s)^{1/2}`. `O(n r^2)`.

        Unlike `zm.logdet`, an estimate from products, this is the exact value for this
        operator, and so returns no standard error.

        **Arguments:**

        - `damping`: as for `solve`; `d + damping` must be `> 0`.

        **Returns:**

        A scalar in the operator's dtype.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.zeros(3))
            assert jnp.allclose(A.logdet(damping=1.0), jnp.log(3.0))
            ```
        """
        if self.leafwise:
            return leaves.logdet(self._space, self._damped(damping, f"{self._owner}.logdet"))
        return woodbury.logdet(self._damped(damping, f"{self._owner}.logdet"))

    def eigh(self) -> tuple[jax.Array, jax.Array]:
        """`jnp.linalg.eigh` of the dense `A`, `O(n^3)` (`s`, `U`: the low rank's alone).

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.ones(3))
            assert jnp.allclose(A.eigh()[0], jnp.array([1.0, 1.0, 3.0]))
            ```
        """
        return dense_eigh(self, f"{self._owner}.eigh")

    @public
    @typechecked
    def marginal_variances(self, *, damping: RealScalar = 0.0) -> Float[Array, " n"] | Vector:
        """The diagonal of `(A + damping I)^{-1}`, exactly, all `n` entries in `O(n r^2)`:
        for a Laplace posterior, the variances of the parameters (their standard
        deviations are the square roots).

        From the Woodbury form, entry `i` is `(1 - |q_i|^2 + sum_j q_ij^2 / (1 + t_j)) / D_i`
        with `q_i` row `i` of `Q`: the part of the unit vector `e_i` outside the low-rank
        span keeps the diagonal's variance `1 / D_i`, and the part inside it is shrunk.

        **Arguments:**

        - `damping`: as for `solve`; `d + damping` must be `> 0`.

        **Returns:**

        An `(n,)` array.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([2.0]), jnp.zeros(3))
            variances = A.marginal_variances(damping=1.0)
            assert jnp.allclose(variances, jnp.array([1 / 3, 1.0, 1.0]))
            ```
        """
        damped = self._damped(damping, f"{self._owner}.marginal_variances")
        if self.leafwise:
            return leaves.marginal_variances(self._space, damped)
        return woodbury.marginal_variances(damped)

    @public
    @typechecked
    def sample(
        self,
        key: PRNGKeyArray,
        shape: Sequence[Integer] | Integer = (),
        *,
        damping: RealScalar = 0.0,
    ) -> Float[Array, "*shape n"] | Vector:
        """Draws from the Gaussian `N(0, (A + damping I)^{-1})`, exactly: for a Laplace
        posterior, parameters' deviations from the mode (add the mode yourself).

        Each draw is `L z` with `z = jax.random.normal(key, (*shape, n))` and
        `L = D^{-1/2} (I - Q diag(1 - (1 + t)^{-1/2}) Q^T)`, `D = d + damping`, whose
        `L L^T` is `(A + damping I)^{-1}` (see `solve` for `Q` and `t`): `O(n r)` a
        draw beside the SVD. `L` is a square root of the inverse for any `d`, not only
        a constant one.

        **Arguments:**

        - `key`: a `jax.random` key.
        - `shape`: the batch shape of the draws, a tuple of ints or an int (default
          `()`, one draw).
        - `damping`: as for `solve`; `d + damping` must be `> 0`.

        **Returns:**

        An array of shape `(*shape, n)` in the operator's dtype.

        !!! example

            ```python
            import jax, jax.numpy as jnp
            import zodmem as zm

            A = zm.LowRankDiagonal(jnp.eye(3, 1), jnp.array([8.0]), jnp.zeros(3))
            draws = A.sample(jax.random.key(0), (20_000,), damping=1.0)
            assert draws.shape == (20_000, 3)
            assert jnp.allclose(jnp.var(draws, axis=0), jnp.array([1 / 9, 1, 1]), rtol=0.05)
            ```
        """
        owner = f"{self._owner}.sample"
        key = check_key(key, owner=owner)
        shape = check_shape(shape, owner)
        if self.leafwise:
            return leaves.sample(self._space, self._damped(damping, owner), key, shape)
        return woodbury.sample(self._damped(damping, owner), key, shape)


# With no low-rank part, the operator is its diagonal.
register_symmetric(
    LowRankDiagonal, positive_semidefinite=True, diagonal=lambda operator: operator.s.shape[0] == 0
)


@lx.tridiagonal.register(LowRankDiagonal)
def _(operator):
    U, s = operator.U, operator.s
    if operator.leafwise:
        raise ValueError(
            f"{operator._owner}: a tridiagonal part of an operator held leaf by leaf has no "
            "order of its entries across the variables; use it on one device."
        )
    beside = jnp.sum(U[:-1] * U[1:] * s, axis=1)  # entries (i, i + 1), in O(n r)
    return operator.diagonal(), beside, beside
