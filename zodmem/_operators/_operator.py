"""A transform's matrix at a point as a `lineax` linear operator: products with vectors,
one at a time (`mv`) or a block of vectors at a time, planned like the transform's own
blocks (`mm`).

A transform that offers an operator supplies one function, its *products*:
`products(transform, x, args, kwargs) -> (flat, variables, mv)`, with `flat` the raveled
variables of `x`, `variables` the `Variables` that ravel and unravel them, and `mv(v)`
one product with a flat vector `v` (a flat vector of the variables' space for a
curvature, the output pytree of `fn` for a Jacobian). `BlockedOperator` does the rest:
the shapes vectors may take, the checks, blocks of products (`mm`), their plan from a
budget, their spread over devices, the dense matrix, the transpose and the tags lineax
reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Inexact, Shaped

from .._checks import RealScalar, described, typechecked
from .._memo import memo_of, signature_of
from .._pytree import ravel_leaves, split_leaves, variable_structure
from .._sharding import is_explicit
from .._traceback import public
from ._arguments import check_dtype
from ._base import AbstractOperator, Vector, check_leaves, variables_of
from ._dense import dense_diagonal, dense_eigh, dense_logdet, dense_solve
from ._options import TransformOptions, options_of, unblocked, with_strategy
from ._vector_blocks import ProductBlocks
from ._vectors import VectorSpace, leaf_sharding

__all__ = [
    "BlockedOperator",
    "check_leaves",
    "flat_product",
    "make_operator",
    "variables_of",
]


Products = Callable[[Any, Any, tuple, dict], tuple]


def _ravel_outputs(tree: Any) -> jax.Array:
    """The leaves of an output pytree, raveled and concatenated in their common dtype."""
    leaves = jax.tree_util.tree_leaves(tree)
    return ravel_leaves(leaves, jnp.result_type(*leaves))


def _forward(transform: Any, products: Products, x: Any, args: tuple, kwargs: dict) -> Callable:
    """The product with a flat vector, as a function from flat vectors to flat vectors."""
    _, _, mv = products(transform, x, args, kwargs)
    return lambda v: _ravel_outputs(mv(v))


def _shapes(transform: Any, products: Products, x: Any, args: tuple, kwargs: dict) -> Any:
    """`(flat, out)`: the shapes of the raveled variables and of one product's outputs.
    Tracing the product here refuses bad input (a Hessian's non-scalar `fn`) at once."""

    def probe(transform, x, args, kwargs):
        flat, _, mv = products(transform, x, args, kwargs)
        return flat, mv(jnp.zeros_like(flat))

    return eqx.filter_eval_shape(probe, transform, x, args, kwargs)


class BlockedOperator(AbstractOperator):
    """A transform's matrix at a point `(x, *args, **kwargs)`, as a lineax operator.

    Made by `transform.operator(x, *args, **kwargs)`; not built directly.
    """

    transform: Any
    x: Any
    args: tuple
    kwargs: dict
    products: Products = eqx.field(static=True)
    square: bool = eqx.field(static=True)
    output: Any = eqx.field(static=True)  # (leaves, treedef) of one product's outputs
    tags: frozenset = eqx.field(static=True)
    transposed: bool = eqx.field(static=True, default=False)
    recompute: bool = eqx.field(static=True, default=True)
    linear: Any = None  # the product kept by `lx.linearise` (its residuals are leaves)

    # -- shapes ------------------------------------------------------------------------

    @property
    def _owner(self) -> str:
        # The user called the transform's `operator`, not this class.
        return f"{self.transform._owner}.operator"

    @property
    def _options(self) -> TransformOptions:
        """The options of the transform that made the operator, that its products follow."""
        return options_of(self.transform)

    def _variable_structure(self) -> Any:
        """`x` with its variables as `jax.ShapeDtypeStruct`s and `None` elsewhere."""
        return variable_structure(self.x)

    def _output_structure(self) -> Any:
        if self.square:
            return self._variable_structure()
        leaves, treedef = self.output
        return jax.tree_util.tree_unflatten(treedef, list(leaves))

    def in_structure(self) -> Any:
        return self._output_structure() if self.transposed else self._variable_structure()

    def out_structure(self) -> Any:
        return self._variable_structure() if self.transposed else self._output_structure()

    # -- vectors in their two forms ------------------------------------------------------

    def _read(self, vector: Any, name: str) -> tuple[Any, bool]:
        """`(vector, is_flat)`: `vector`, checked, as a flat array of the input space or a
        pytree shaped like `in_structure()` (from the whole of `x`, its variables)."""
        structure = self.in_structure()
        leaves, treedef = jax.tree_util.tree_flatten(structure)
        size = sum(math.prod(leaf.shape) for leaf in leaves)
        dtype = jnp.result_type(*leaves)
        if eqx.is_array(vector) and jnp.shape(vector) == (size,):
            input_is = dict(expected="the operator's input is", given="is a flat vector of dtype")
            check_dtype(vector, name, dtype, owner=self._owner, **input_is)
            return vector, True
        if not self.transposed:
            vector = variables_of(vector, self.x, treedef)
        given = jax.tree_util.tree_structure(vector)
        if given != treedef:
            shape = jnp.shape(vector) if eqx.is_array(vector) else None
            got = f"an array of shape {shape}" if shape is not None else f"structure {given}"
            raise ValueError(
                f"{self._owner}: `{name}` must be a flat vector of shape ({size},) or a pytree "
                f"shaped like {structure}, but got {got}."
            )
        check_leaves(vector, leaves, name, owner=self._owner)
        return vector, False

    def _ravel(self, vector: Any) -> jax.Array:
        """A pytree shaped like `in_structure()` as a flat vector."""
        dtype = _flat_structure(self.in_structure()).dtype
        return ravel_leaves(jax.tree_util.tree_leaves(vector), dtype)

    def _write(self, flat: jax.Array) -> Any:
        """A flat vector of the output space as a pytree shaped like `out_structure()`."""
        leaves, treedef = jax.tree_util.tree_flatten(self.out_structure())
        shapes, dtypes = [leaf.shape for leaf in leaves], [leaf.dtype for leaf in leaves]
        return jax.tree_util.tree_unflatten(treedef, split_leaves(flat, shapes, dtypes))

    # -- products ----------------------------------------------------------------------

    def _map(self) -> Callable[[jax.Array], jax.Array]:
        """The product as a function of flat vectors, in this operator's direction."""
        forward = self.linear
        if forward is None:
            forward = _forward(self.transform, self.products, self.x, self.args, self.kwargs)
        if not self.transposed:
            return forward
        transposed = jax.linear_transpose(forward, _flat_vector_type(self))
        return lambda v: transposed(v)[0]

    def with_strategy(self, strategy: Any) -> BlockedOperator:
        """This operator with its products computed by `strategy` (`"linearize"` or
        `"recompute"`, for a transform that has a strategy; `None`: as it is)."""
        transform = with_strategy(self.transform, strategy)
        return (
            self if transform is self.transform else dataclasses.replace(self, transform=transform)
        )

    def mv(self, vector: Any) -> Any:
        """One product with `vector`: flat, or a pytree shaped like `in_structure()`
        (for a curvature, like `x`'s variables); returned in the same form."""
        vector, is_flat = self._read(vector, "vector")
        # One product is the same whatever the blocks: one compiled product serves them all.
        single = dataclasses.replace(self, transform=unblocked(self.transform))
        layout = None if is_flat else self._output_layout()
        return (_product_jit if self._options.jit else _product)(single, vector, is_flat, layout)

    def variable_shardings(self) -> tuple[jax.sharding.Sharding | None, ...]:
        """Each input leaf's sharding over several devices: the variables' of `x`."""
        if self.transposed:
            return super().variable_shardings()
        return self._shardings_of_variables()

    def _shardings_of_variables(self) -> tuple[jax.sharding.Sharding | None, ...]:
        """Each variable's sharding over several devices (`None` where it has none),
        whichever way the operator is turned."""
        leaves = [leaf for leaf in jax.tree_util.tree_leaves(self.x) if eqx.is_inexact_array(leaf)]
        return tuple(leaf_sharding(leaf) for leaf in leaves)

    def _output_layout(self) -> VectorSpace | None:
        """The output space with the variables' shardings, where the products lie in the
        variables' space and some variable is sharded over several devices; else `None`."""
        if not (self.square or self.transposed):
            return None
        leaves, treedef = jax.tree_util.tree_flatten(self._variable_structure())
        shardings = self._shardings_of_variables()
        if len(shardings) != len(leaves) or all(s is None for s in shardings):
            return None
        shapes = tuple(tuple(leaf.shape) for leaf in leaves)
        dtypes = tuple(leaf.dtype for leaf in leaves)
        size = sum(math.prod(shape) for shape in shapes)
        dtype = jnp.result_type(*leaves)
        return VectorSpace(size, dtype, shapes, dtypes, shardings, treedef)

    def mm(self, matrix: Any) -> Any:
        """The products with the `k` columns of `matrix`, an `(n, k)` array (`n` the
        input size), as an `(m, k)` array, in blocks of columns planned from the
        transform's options; or with a block of `k` vectors as a pytree shaped like
        `in_structure()`, leaves `(k, *leaf.shape)`, returned as such, each leaf laid out
        like its variable where the variables are sharded over devices."""
        # Worked out on the first call and kept for the operator's life: the input's
        # shape, and per matrix shape and placement, the planned program.
        if not eqx.is_array(matrix) and jax.tree_util.tree_leaves(matrix):
            return self._tree_mm(matrix)
        memo = memo_of(self)
        if "in" not in memo:
            memo["in"] = _flat_structure(self.in_structure())
        (size,), dtype = memo["in"].shape, memo["in"].dtype
        if not eqx.is_array(matrix) or jnp.ndim(matrix) != 2 or jnp.shape(matrix)[0] != size:
            shown = f"shape {jnp.shape(matrix)}" if eqx.is_array(matrix) else described(matrix)
            raise ValueError(
                f"{self._owner}: `matrix` must be an ({size}, k) array, one vector per "
                f"column, got {shown}."
            )
        check_dtype(matrix, "matrix", dtype, owner=self._owner, expected="the operator takes")
        signature = signature_of(matrix)
        if signature is not None and signature in memo:
            return memo[signature]((matrix,), {})
        blocks = ProductBlocks.of(self)
        if signature is not None:
            bound = blocks.planned((matrix,), {}).bound
            if bound is not None:
                memo[signature] = bound
                return bound((matrix,), {})
        return blocks(matrix)

    def _tree_mm(self, matrix: Any) -> Any:
        """`mm` of a block of `k` vectors as a pytree shaped like `in_structure()` with
        leaves `(k, *leaf.shape)`, returned so, each leaf pinned to its variable's layout."""
        leaves, treedef = jax.tree_util.tree_flatten(self.in_structure())
        if not self.transposed:
            matrix = variables_of(matrix, self.x, treedef)
        given = jax.tree_util.tree_leaves(matrix)
        if jax.tree_util.tree_structure(matrix) != treedef or any(
            not eqx.is_array(g) or jnp.shape(g)[1:] != w.shape
            for g, w in zip(given, leaves, strict=True)
        ):
            raise ValueError(
                f"{self._owner}: `matrix` must be an (n, k) array or a pytree shaped like "
                f"{self.in_structure()} with a leading block axis on every leaf."
            )
        dtype = _flat_structure(self.in_structure()).dtype
        products = self.mm(ravel_leaves(given, dtype, batch=1).T).T
        out, out_def = jax.tree_util.tree_flatten(self.out_structure())
        pieces = split_leaves(products, [o.shape for o in out], [o.dtype for o in out])
        block = jax.tree_util.tree_unflatten(out_def, pieces)
        layout = self._output_layout()
        return block if layout is None else layout.constrain(block, block=True)

    def as_matrix(self) -> jax.Array:
        """The dense matrix, made by the transform's own blocked call."""
        result = self.transform(self.x, *self.args, **self.kwargs)
        if self._options.has_aux:
            result = result[0]
        if not self.square:
            n = _flat_structure(self._variable_structure()).shape[0]
            pieces = jax.tree_util.tree_leaves(result)
            dtype = jnp.result_type(*pieces)
            result = jnp.concatenate([p.reshape(-1, n).astype(dtype) for p in pieces], axis=0)
        return result.T if self.transposed else result

    # -- exact, from the dense matrix (see `_dense`; the estimators use products) -----

    def diagonal(self) -> jax.Array:
        """The diagonal, flat `(n,)`, from the dense matrix (`zm.diagonal`: products)."""
        return dense_diagonal(self, f"{self._owner}.diagonal")

    @public
    @typechecked
    def solve(
        self, b: Vector | Shaped[Array | np.ndarray, "n k"], *, damping: RealScalar = 0.0
    ) -> Vector | Inexact[Array, "n k"]:
        """`(A + damping I)^{-1} b`, `b` flat `(n,)`, `(n, k)` or like the variables
        (returned so), from the dense matrix (`zm.solve`: CG or GMRES from products)."""
        owner = f"{self._owner}.solve"
        if eqx.is_array(b) and jnp.ndim(b) == 2:
            return dense_solve(self, b, damping, owner)
        vector, is_flat = self._read(b, "b")
        solution = dense_solve(self, vector if is_flat else self._ravel(vector), damping, owner)
        return solution if is_flat else self._write(solution)

    @public
    @typechecked
    def logdet(self, *, damping: RealScalar = 0.0) -> jax.Array:
        """`log det(A + damping I)`, dense (`nan` where it is negative; `zm.logdet`)."""
        return dense_logdet(self, damping, f"{self._owner}.logdet")

    def eigh(self) -> tuple[jax.Array, jax.Array]:
        """`jnp.linalg.eigh` of the dense symmetric matrix (`zm.eigsh`: a few, products)."""
        return dense_eigh(self, f"{self._owner}.eigh")

    def transpose(self) -> BlockedOperator:
        if lx.is_symmetric(self):
            return self
        return dataclasses.replace(
            self, transposed=not self.transposed, tags=lx.transpose_tags(self.tags)
        )


def _flat_structure(structure: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of the vector that raveling a pytree of this structure makes."""
    leaves = jax.tree_util.tree_leaves(structure)
    size = sum(math.prod(leaf.shape) for leaf in leaves)
    return jax.ShapeDtypeStruct((size,), jnp.result_type(*leaves))


def _product(
    operator: BlockedOperator, vector: Any, is_flat: bool, layout: VectorSpace | None = None
) -> Any:
    """One product with `vector`, in the form it was given (`is_flat` or a pytree), each
    leaf pinned to its variable's sharding where `layout` gives them."""
    if is_flat:
        return operator._map()(vector)
    product = operator._write(operator._map()(operator._ravel(vector)))
    return product if layout is None else layout.constrain(product)


_product_jit = eqx.filter_jit(_product)


def make_operator(
    transform: Any,
    products: Products,
    x: Any,
    args: tuple,
    kwargs: dict,
    *,
    square: bool,
    tags: Any = (),
) -> BlockedOperator:
    """The operator of `transform` at `(x, *args, **kwargs)`, whose one product with a
    flat vector `products` gives. `square`: the products lie in the variables' space
    (a curvature; its `tags` hold for it with real variables), else in the outputs'."""
    flat, out = _shapes(transform, products, x, args, kwargs)
    if square and jnp.issubdtype(flat.dtype, jnp.complexfloating):
        tags = ()  # a holomorphic curvature is complex symmetric, not Hermitian
    leaves, treedef = jax.tree_util.tree_flatten(out)
    return BlockedOperator(
        transform,
        x,
        tuple(args),
        dict(kwargs),
        products,
        square,
        (tuple(leaves), treedef),
        frozenset(tags if isinstance(tags, (tuple, list, set, frozenset)) else (tags,)),
        recompute=options_of(transform).strategy in (None, "recompute"),
    )


def flat_product(operator: BlockedOperator, vector: jax.Array) -> jax.Array:
    """One product of `operator` with a flat vector, as a flat vector (unchecked)."""
    return operator._map()(vector)


# -- what lineax asks of an operator, by type ----------------------------------------------


@lx.linearise.register(BlockedOperator)
def _(operator):
    if operator.recompute or operator.linear is not None:
        return operator
    linear = (_linearised_jit if operator._options.jit else _linearised)(operator)
    return dataclasses.replace(operator, linear=linear)


def _linearised(operator: BlockedOperator) -> Any:
    """The forward product, `fn` linearised: a module whose leaves are its residuals."""
    forward = _forward(
        operator.transform, operator.products, operator.x, operator.args, operator.kwargs
    )
    return eqx.filter_closure_convert(forward, _flat_vector_type(operator))


def _flat_vector_type(operator: BlockedOperator) -> jax.ShapeDtypeStruct:
    """The type of the flat vectors the forward product takes: where the variables lie
    over Explicit mesh axes, whole on every device of their mesh (as raveling makes
    them), so that a function traced for it runs on them."""
    flat = _flat_structure(operator._variable_structure())
    for sharding in operator._shardings_of_variables():
        if sharding is not None and is_explicit(sharding):
            whole = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            return jax.ShapeDtypeStruct(flat.shape, flat.dtype, sharding=whole)
    return flat


_linearised_jit = eqx.filter_jit(_linearised)


@lx.materialise.register(BlockedOperator)
def _(operator):
    blocks = (_blocks_jit if operator._options.jit else _blocks_of)(operator)
    return lx.PyTreeLinearOperator(blocks, operator.out_structure(), operator.tags)


def _blocks_of(operator: BlockedOperator) -> Any:
    """The dense matrix as lineax's pytree of blocks: the output structure, each leaf
    the input structure with blocks of shape `out_leaf.shape + in_leaf.shape`."""
    dense = operator.as_matrix()
    out_leaves, out_def = jax.tree_util.tree_flatten(operator.out_structure())
    in_leaves, in_def = jax.tree_util.tree_flatten(operator.in_structure())
    rows, row = [], 0
    for out_leaf in out_leaves:
        height = math.prod(out_leaf.shape)
        pieces, column = [], 0
        for in_leaf in in_leaves:
            width = math.prod(in_leaf.shape)
            piece = dense[row : row + height, column : column + width]
            pieces.append(piece.reshape(out_leaf.shape + in_leaf.shape).astype(out_leaf.dtype))
            column += width
        rows.append(jax.tree_util.tree_unflatten(in_def, pieces))
        row += height
    return jax.tree_util.tree_unflatten(out_def, rows)


_blocks_jit = eqx.filter_jit(_blocks_of)


@lx.tridiagonal.register(BlockedOperator)
def _(operator):
    dense = operator.as_matrix()
    return jnp.diagonal(dense), jnp.diagonal(dense, -1), jnp.diagonal(dense, 1)


def _real(operator: BlockedOperator) -> bool:
    leaves = jax.tree_util.tree_leaves((operator.in_structure(), operator.out_structure()))
    return not jnp.issubdtype(jnp.result_type(*leaves), jnp.complexfloating)


@lx.is_symmetric.register(BlockedOperator)
def _(operator):
    if lx.symmetric_tag in operator.tags:
        return True
    definite = {lx.positive_semidefinite_tag, lx.negative_semidefinite_tag}
    return bool(definite & operator.tags) and _real(operator)


@lx.is_positive_semidefinite.register(BlockedOperator)
def _(operator):
    return lx.positive_semidefinite_tag in operator.tags


@lx.is_negative_semidefinite.register(BlockedOperator)
def _(operator):
    return lx.negative_semidefinite_tag in operator.tags


for _check in (
    lx.is_diagonal,
    lx.is_tridiagonal,
    lx.has_unit_diagonal,
    lx.is_lower_triangular,
    lx.is_upper_triangular,
):
    _check.register(BlockedOperator)(lambda operator: False)


@lx.conj.register(BlockedOperator)
def _(operator):
    if _real(operator):
        return operator

    def conjugated(vector):
        conjugate = functools.partial(jax.tree_util.tree_map, jnp.conj)
        return conjugate(operator.mv(conjugate(vector)))

    return lx.FunctionLinearOperator(conjugated, operator.in_structure(), operator.tags)
