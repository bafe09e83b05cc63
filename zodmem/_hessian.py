"""`BatchedHessian`, and the conversions of flat derivatives back to pytrees."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, ArrayLike, Inexact, PyTree, jaxtyped

from ._blocks import map_blocks, plan_blocks
from ._pytree import Variables, basis_block, flat_function, split_variables
from ._transform import AbstractDerivative

__all__ = ["BatchedHessian", "hessian_to_pytree", "jacobian_to_pytree"]


class BatchedHessian(AbstractDerivative):
    """The Hessian of a scalar function with respect to its first argument, in blocks.

    Use it where `jax.hessian` runs out of memory: the gradient of `fn` is
    differentiated once (one `jax.linearize` or one `jax.vjp` of it), and its
    products with blocks of basis vectors are computed one block at a time. Each
    block is written straight into the preallocated `(n, n)` result, so peak memory
    is the Hessian, the gradient's residuals and one block, and never a second copy
    of the Hessian.

    The variables are the inexact-array leaves of `x`, raveled in leaf order; every
    other leaf (functions, ints, bools, static fields of an Equinox model) is held
    fixed. `n` is their total size.

    **Arguments:**

    - `fn`: the function, called as `fn(x, *args, **kwargs)`; it must return a
      scalar (or `(scalar, aux)` with `has_aux=True`). It may be an Equinox module.
    - `nbatches`: compute the Hessian in this many blocks (of rows or columns). At
      most one of `nbatches` and `batch_size` may be given; with neither, one block.
    - `batch_size`: the number of rows (or columns) per block.
    - `mode`: how the products are formed. `"fwd"` is forward-over-reverse:
      Hessian-vector products, JVPs of one linearisation of the gradient, written
      as blocks of columns exactly as `jax.hessian` (`jacfwd(jacrev(fn))`) forms
      them. `"rev"` is reverse-over-reverse: VJPs of one `jax.vjp` of the gradient,
      written as blocks of rows (H is symmetric). `"auto"` (the default) picks
      `"rev"` when all variables share one real dtype -- it ran up to 2x faster on
      CPU in `benchmarks/hessian_memory.py`, in no more memory -- and `"fwd"` when
      precisions are mixed, where rounding makes H not exactly symmetric.
    - `has_aux`: `fn` returns `(value, aux)`; `aux` is returned unchanged.
    - `jit`: compile the whole computation with `eqx.filter_jit`.
    - `checkpoint`: wrap `fn` in `jax.checkpoint`, so that it is recomputed rather
      than its intermediates stored.

    **Returns:**

    Calling `BatchedHessian(fn)(x, *args, **kwargs)` returns the `(n, n)` Hessian, or
    `(hessian, aux)` with `has_aux=True`. `zm.hessian_to_pytree(H, x)` gives the
    blocks per pair of leaves.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def loss(params, data):
            return jnp.sum((params["w"] * data + params["b"]) ** 2)

        params = {"b": jnp.zeros(()), "w": jnp.ones(4)}
        H = zm.BatchedHessian(loss, batch_size=2)(params, jnp.arange(4.0))  # (5, 5)
        ```

    !!! warning

        `fn` must return a scalar: a `(1,)`-shaped loss is refused with a
        `TypeError` naming its shape. Reduce it with `jnp.sum` or index it first.
    """

    @jaxtyped(typechecker=beartype)
    def __call__(
        self, x: PyTree, *args: Any, **kwargs: Any
    ) -> Inexact[Array, "n n"] | tuple[Inexact[Array, "n n"], Any]:
        compute = _hessian_jit if self.jit else _hessian
        return compute(self, x, args, kwargs)


def _check_scalar(shapes: Any, has_aux: bool) -> None:
    if has_aux:
        if not (isinstance(shapes, tuple) and len(shapes) == 2):
            raise TypeError(
                "BatchedHessian: with has_aux=True, `fn` must return a pair (value, aux), "
                f"but it returned {shapes}."
            )
        shapes = shapes[0]
    if not isinstance(shapes, jax.ShapeDtypeStruct) or shapes.shape != ():
        described = (
            f"an array of shape {shapes.shape}"
            if isinstance(shapes, jax.ShapeDtypeStruct)
            else f"{shapes}"
        )
        raise TypeError(
            f"BatchedHessian: `fn` must return a scalar (shape ()), but it returned "
            f"{described}. Reduce the output to a scalar, e.g. with jnp.sum or jnp.mean."
        )
    if not jnp.issubdtype(shapes.dtype, jnp.floating):
        raise TypeError(
            "BatchedHessian: `fn` must return a real floating-point scalar, but it returned "
            f"dtype {shapes.dtype}."
        )


def _hessian(t: BatchedHessian, x: Any, args: tuple, kwargs: dict) -> Any:
    flat, variables = split_variables(x)
    fn_of_flat = flat_function(t.fn, variables, args, kwargs)
    if t.checkpoint:
        fn_of_flat = jax.checkpoint(fn_of_flat)
    _check_scalar(jax.eval_shape(fn_of_flat, flat), t.has_aux)
    n = variables.size
    plan = plan_blocks(n, nbatches=t.nbatches, batch_size=t.batch_size, what="variables")

    def fn_of_leaves(leaves):
        return t.fn(variables.fill(leaves), *args, **kwargs)

    if t.checkpoint:
        fn_of_leaves = jax.checkpoint(fn_of_leaves)
    # Differentiated per leaf, not as `fn_of_flat`: a block's products are then gathered
    # by one concatenation instead of padding every leaf's piece to n columns and adding.
    gradient = jax.grad(fn_of_leaves, has_aux=t.has_aux)

    def leaves_of(vector):
        pieces = variables.split_rows(vector)
        return [piece.astype(d) for piece, d in zip(pieces, variables.dtypes, strict=True)]

    def gather(products):
        pieces = [
            piece.reshape(plan.block_size, size).astype(flat.dtype)
            for piece, size in zip(products, variables.sizes, strict=True)
        ]
        return jnp.concatenate(pieces, axis=1)

    def basis(start):
        return basis_block(start, plan.block_size, n, flat.dtype)

    mode = t.mode
    if mode == "auto":
        one_real_dtype = len(set(variables.dtypes)) == 1 and jnp.issubdtype(
            flat.dtype, jnp.floating
        )
        mode = "rev" if one_real_dtype else "fwd"
    if mode == "rev":
        # H is symmetric, so row i is the VJP of the gradient with e_i.
        if t.has_aux:
            _, vjp, aux = jax.vjp(gradient, leaves_of(flat), has_aux=True)
        else:
            (_, vjp), aux = jax.vjp(gradient, leaves_of(flat)), None

        def block(start):
            return gather(jax.vmap(lambda v: vjp(leaves_of(v))[0])(basis(start)))

        axis = 0
    else:
        if t.has_aux:
            _, hvp, aux = jax.linearize(lambda z: gradient(leaves_of(z)), flat, has_aux=True)
        else:
            (_, hvp), aux = jax.linearize(lambda z: gradient(leaves_of(z)), flat), None

        def block(start):
            # Column j is the JVP with e_j, as in `jax.hessian`; written as columns, the
            # result matches it exactly even where rounding makes it not quite symmetric
            # (float32 leaves among float64 ones).
            return gather(jax.vmap(hvp)(basis(start))).T

        axis = 1

    if n == 0:  # only empty variables: nothing to run, the Hessian is empty
        hessian = jnp.zeros((0, 0), flat.dtype)
    else:
        hessian = map_blocks(block, plan, axis=axis)
    return (hessian, aux) if t.has_aux else hessian


_hessian_jit = eqx.filter_jit(_hessian)


def _variables_of(x: Any, argname: str = "x") -> Variables:
    return split_variables(x, argname=argname)[1]


def hessian_to_pytree(H: ArrayLike, x: PyTree) -> PyTree:
    """Cut a flat `(n, n)` Hessian into blocks, one per pair of variable leaves of `x`.

    The layout is zodiax's: the result has `x`'s structure twice, and block
    `[i][j]` has shape `leaf_i.shape + leaf_j.shape`. Leaves of `x` that are not
    variables (not inexact arrays) get `None`.

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
    variables = _variables_of(x)
    n = variables.size
    if jnp.ndim(H) != 2 or jnp.shape(H) != (n, n):
        raise ValueError(
            f"H has shape {jnp.shape(H)}, but x flattens to {n} elements, so H should have "
            f"shape ({n}, {n}). Did you pass the same x used to compute H?"
        )
    rows = variables.split_rows(H, axis=0)
    return variables.fill(
        [variables.fill(variables.split_rows(row, axis=-1), keep_fixed=False) for row in rows],
        keep_fixed=False,
    )


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
    variables = _variables_of(x)
    n = variables.size

    def one_output(leaf: ArrayLike) -> Any:
        leaf = jnp.asarray(leaf)
        if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[-1] != n:
            raise ValueError(
                f"J has a leaf of shape {jnp.shape(leaf)}, but x flattens to {n} elements, so "
                f"its last axis should have size {n}. Did you pass the same x used to compute J?"
            )
        return variables.fill(variables.split_rows(leaf, axis=-1), keep_fixed=False)

    return jax.tree_util.tree_map(one_output, J)
