"""`BatchedHessian`: the Hessian of a scalar function of any pytree, computed in blocks."""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core.primitives import remat_p
from jaxtyping import PyTree

from .._checks import typechecked_constructor
from .._engine._block_plans import OutputSink
from .._engine._layout import holds
from .._engine._sharding import Split
from .._operators._block_diagonal import BlockDiagonal
from .._operators._operator import BlockedOperator
from .._pytree import Variables
from .._traceback import public
from ._derivative import Prepared, product_function
from ._leafwise import curvature_matrix
from ._square import AbstractSquare

__all__ = ["BatchedHessian"]


@typechecked_constructor
class BatchedHessian(AbstractSquare):
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
    - `max_memory`: instead of `nbatches` or `batch_size`, a budget for the call's
      memory, as for `zm.BatchedJacobian`: an int (bytes), a string with a unit
      (`"750MB"`, `"512MiB"`) or `"auto"` (the device's free memory, less a margin). The
      block size and the strategy are planned before anything runs, as the largest whose
      compiled call fits (`plan()` shows them); a budget that cannot hold the Hessian and
      one row or column per block raises `zm.MemoryBudgetError`. At most one of
      `nbatches`, `batch_size` and `max_memory`.
    - `strategy`: `"linearize"` keeps one linearisation of the gradient of `fn` for every
      block (its residuals grow with the depth of `fn`); `"recompute"` evaluates the
      gradient again inside each block, keeping nothing between blocks, at the cost of
      one more forward and backward pass of `fn` per block; `"auto"` (the default)
      linearises, and with `max_memory` recomputes when the residuals leave no room for
      a block. The operator's products in an iteration (`zm.eigsh`, `zm.solve`) are
      formed afresh under `"auto"` where `fn` holds a `jax.checkpoint`, whose forward
      pass a linearisation would run again in every product anyway.
    - `mode`: how the products are formed. `"fwd"` is forward-over-reverse:
      Hessian-vector products, JVPs of one linearisation of the gradient, written
      as blocks of columns exactly as `jax.hessian` (`jacfwd(jacrev(fn))`) forms
      them. `"rev"` is reverse-over-reverse: VJPs of one `jax.vjp` of the gradient,
      written as blocks of rows (H is symmetric); a block whose rows lie in one leaf
      that holds many blocks is the VJP of that leaf's part of the gradient alone, so
      the other leaves' zero pieces cost nothing. `"auto"` (the default) picks
      `"rev"` when all variables share one real dtype and `fn` holds no convolution
      and no loop (`lax.scan`, `lax.while_loop`, as in recurrent models and ODE
      solvers), and `"fwd"` otherwise: reverse-over-reverse products of those are
      transposes of transposed convolutions and loops, which run several times slower
      than forward-over-reverse ones; and where precisions are mixed, rounding makes H
      not exactly symmetric (the benchmarks of real models on the Benchmarks page
      compare the two).
    - `holomorphic`: the variables are complex and `fn` (complex-valued) is
      holomorphic in them, as `jax.hessian(holomorphic=True)`. Without it, complex
      variables are refused.
    - `has_aux`: `fn` returns `(value, aux)`; `aux` is returned unchanged (its
      leaves need not be arrays).
    - `jit`: compile the whole computation with `eqx.filter_jit`. A budget
      (`max_memory`) plans the compiled call, so it needs `jit=True`.
    - `checkpoint`: wrap `fn` in `jax.checkpoint`, so that the gradient recomputes
      `fn`'s intermediates rather than storing them.
    - `sharding`: a `jax.sharding.NamedSharding` for the result, e.g.
      `NamedSharding(mesh, PartitionSpec("d", None))` (rows over the mesh axis `"d"`) or
      `PartitionSpec(None, "d")` (columns). Each device computes only the blocks of its
      own share, in blocks of the size the options give (a budget is then per device),
      and holds only that share and one block, never the whole Hessian; the result is a
      global `jax.Array` with this sharding, across processes too under
      `jax.distributed`. Rows are made by `mode="rev"` and columns by `mode="fwd"`, which
      `"auto"` then takes. The devices along the split axis must divide `n`. See the
      "Scaling out" page.
    - `progress`: show a progress bar on stderr (blocks done of the total, rate, time
      left), updated from inside the compiled loop after each block. Off by default,
      and then nothing is added to the compiled program.
    - `blocks`: `"full"` (the default) for the whole `(n, n)` matrix; `"leaf"` for its
      diagonal blocks alone, one `(n_i, n_i)` block per variable leaf of `x` (the
      cross-terms between leaves dropped): each is the Hessian of `fn` in that leaf
      alone, the others held fixed, computed and planned by a call of its own, so
      the memory is that of the largest block, not of `n x n`. The call then returns
      a tuple of the blocks in leaf order (in the dtype the whole matrix has), and
      `.operator(...)` a `zm.BlockDiagonal` of them, with exact solves and
      log-determinants. `plan()`, `zm.to_host` and `zm.to_file` take the whole matrix
      only.

    **Returns:**

    Calling `BatchedHessian(fn)(x, *args, **kwargs)` returns the `(n, n)` Hessian, or
    `(hessian, aux)` with `has_aux=True`. `zm.hessian_to_pytree(H, x)` gives the
    blocks per pair of leaves.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def loss(params, data):
            return jnp.mean(jnp.tanh(data @ params["w"] + params["b"]) ** 2)

        params = {"b": jnp.zeros(()), "w": jnp.full(4, 0.25)}
        data = jnp.arange(12.0).reshape(3, 4) / 12
        H = zm.BatchedHessian(loss, batch_size=2)(params, data)  # (5, 5): b, then w
        ```

    !!! warning

        `fn` must return a scalar: a `(1,)`-shaped loss is refused with a
        `TypeError` naming its shape. Reduce it with `jnp.sum` or index it first.
    """

    _result: ClassVar[str] = "Hessian"
    _square: ClassVar[str | None] = "Hessian"

    def compute_share(
        self, sink: OutputSink | None, share: Any, split: Any, x: Any, *args: Any, **kwargs: Any
    ) -> Any:
        prepared = self._prepare(x, args, kwargs, split)
        rows = prepared.mode == "rev"
        product, in_leaf, aux = _hessian_product(self, prepared, reverse=rows)
        # Row i is the VJP of the gradient with e_i, H being symmetric (for a holomorphic
        # function too: H is then complex symmetric, and JAX's VJPs transpose without
        # conjugating). Column j is the JVP with e_j, as in `jax.hessian`: written as
        # columns, the result matches it exactly even where rounding makes it not quite
        # symmetric (float32 leaves among float64 ones).
        hessian = curvature_matrix(
            self, prepared, jax.vmap(product), in_leaf, sink, share, split, columns=not rows
        )
        return prepared.result(hessian, aux)

    def _prepare(self, x: Any, args: tuple, kwargs: dict, split: Split | None) -> Prepared:
        flat, variables = self._variables(x)
        fn, value, restore_aux = self._function(flat, variables, args, kwargs, "value")
        _check_scalar(self, value)
        # The mode that makes the axis the devices split: rows by VJPs, columns by JVPs.
        mode = self.mode
        if split is not None and split.dim is not None:
            mode = self._split_mode("rev" if split.dim == 0 else "fwd")
        if mode == "auto":
            mode = _auto_mode(variables, fn, variables.leaves_of(flat))
        return Prepared(flat, variables, fn, value, restore_aux, mode)

    @public
    def operator(self, x: PyTree, *args: Any, **kwargs: Any) -> BlockedOperator | BlockDiagonal:
        """The Hessian at `(x, *args, **kwargs)` as a `lineax` linear operator, never
        formed: each product with a vector is one Hessian-vector product.

        Use it where the Hessian is only multiplied by vectors (a Newton-CG step, a
        Krylov solve, an eigenvalue estimate), so that nothing `(n, n)` is ever held.

        - `op.mv(v)`: one Hessian-vector product, formed as `mode` says (with
          `"auto"`, reverse over reverse for a dense model of one real dtype, forward
          over reverse where `fn` holds a convolution or a loop). `v` is a flat
          vector of the `n` variables, or a pytree shaped like `x`'s variables; the
          product comes back in the same form.
        - `op.mm(V)`: the products with the `k` columns of an `(n, k)` array, in blocks
          of columns as this transform's options say (`nbatches`, `batch_size`: columns
          per block; `max_memory`: planned as the call is; `sharding`: columns spread
          over its devices), with one linearisation of the gradient kept for every block
          unless `strategy="recompute"`.
        - `op.as_matrix()`: the dense Hessian, by this transform's own call.
        - `op.T` is `op`: it carries `lx.symmetric_tag` (for real variables), so lineax's
          solvers for symmetric operators take it; `lx.linearise(op)` keeps one
          linearisation of the gradient for every later product.

        **Arguments:** as for the call: `x`, the point (its inexact-array leaves are the
        variables), and the other arguments of `fn`.

        **Returns:**

        A `lineax.AbstractLinearOperator` from the variables to the variables.

        !!! example

            ```python
            import jax.numpy as jnp
            import lineax as lx
            import zodmem as zm

            def loss(w, data):
                return jnp.sum(jnp.cosh(data @ w))

            w, data = jnp.zeros(3), jnp.eye(3)
            op = zm.BatchedHessian(loss, batch_size=2).operator(w, data)
            op.mv(jnp.ones(3))                  # H @ 1, one Hessian-vector product
            op.mm(jnp.eye(3))                   # H, in blocks of 2 columns
            positive = lx.TaggedLinearOperator(op, lx.positive_semidefinite_tag)
            lx.linear_solve(positive, jnp.ones(3), lx.CG(rtol=1e-6, atol=1e-6)).value
            ```

        !!! tip

            A Hessian is not known to be positive definite, so `lx.CG` needs the tag
            given, as above, where you know it is (a convex loss, a minimum).
        """
        return self._square_operator(_hessian_products, x, args, kwargs)


def _check_scalar(transform: BatchedHessian, shapes: Any) -> None:
    if not isinstance(shapes, jax.ShapeDtypeStruct) and eqx.is_array_like(shapes):
        # A constant Python number, which jax.hessian takes as a scalar array.
        shapes = jax.ShapeDtypeStruct(jnp.shape(shapes), jnp.result_type(shapes))
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
    if transform.holomorphic:
        if not jnp.issubdtype(shapes.dtype, jnp.complexfloating):
            raise TypeError(
                "BatchedHessian: with holomorphic=True `fn` must return a complex scalar, as "
                f"in jax.hessian(holomorphic=True), but it returned dtype {shapes.dtype}."
            )
    elif not jnp.issubdtype(shapes.dtype, jnp.floating):
        raise TypeError(
            "BatchedHessian: `fn` must return a real floating-point scalar, but it returned "
            f"dtype {shapes.dtype}; jax.hessian refuses it too ('jacrev requires real-valued "
            "outputs'). For a holomorphic function of complex variables, pass "
            "holomorphic=True."
        )


def _hessian_products(transform: BatchedHessian, x: Any, args: tuple, kwargs: dict) -> tuple:
    """`(flat, variables, hvp)`: the variables, raveled, and one Hessian-vector product
    with a flat vector: the VJP of the gradient (`H` is symmetric), or with
    `mode="fwd"` or variables of mixed or complex dtypes, the JVP of the gradient."""
    prepared = transform._prepare(x, args, kwargs, None)
    reverse = prepared.mode == "rev" and prepared.variables.real_and_alike
    hvp, _, _ = _hessian_product(transform, prepared, reverse=reverse)
    return prepared.flat, prepared.variables, hvp


# What makes reverse-over-reverse products slow: a convolution (its products are
# convolutions of the transposed convolutions its gradient makes) and a loop (a `scan`,
# an ODE solver's `while`: its gradient is a loop over saved or recomputed steps, whose
# transpose is another).
_FORWARD_OVER_REVERSE = (jax.lax.conv_general_dilated_p, jax.lax.while_p, jax.lax.scan_p)


# A `jax.checkpoint` in `fn`: JAX's linearisation puts its forward pass on the linear
# side, by design, so a product of a kept linearisation runs that pass again anyway, with
# more to carry than a product formed afresh. Where `strategy` is `"auto"` and no plan
# chose it, such products are formed afresh (a neural ODE's solver checkpoints its steps).
_UNKEPT = (remat_p,)


def _auto_mode(variables: Variables, fn_of_leaves: Any, leaves: list) -> str:
    """Reverse over reverse for variables of one real dtype where `fn`'s program holds no
    convolution and no loop, forward over reverse otherwise."""
    if not variables.real_and_alike:
        return "fwd"
    slow = holds(fn_of_leaves, leaves, primitives=_FORWARD_OVER_REVERSE)
    return "fwd" if slow else "rev"


def _hessian_product(transform: BatchedHessian, prepared: Prepared, *, reverse: bool) -> tuple:
    """`(product, in_leaf, aux)`: `product(v)` is `H v` for one flat `v`, as a flat vector
    in the variables' dtype, by reverse over reverse (`reverse`) or forward over reverse.
    In reverse, `in_leaf(i)` gives the products with a block of vectors of leaf `i` alone,
    `(k, *leaf_shape)`, as a `(k, n)` block: the VJPs of that leaf's part of the gradient,
    in which the other leaves' zero pieces are symbolic and cost nothing (`None` forward).
    `aux` is `fn`'s, as the products' linearisation gives it.

    The gradient is taken per leaf, not of `fn` of the flat variables: a product's pieces
    are then gathered by one concatenation instead of padded to `n` and added."""
    gradient = jax.grad(prepared.fn, has_aux=transform.has_aux, holomorphic=transform.holomorphic)
    leaves, leaves_of = prepared.leaves, prepared.variables.leaves_of
    if not reverse:
        linearising = transform
        if transform.strategy == "auto" and holds(prepared.fn, leaves, primitives=_UNKEPT):
            linearising = transform._with_strategy("recompute")
        _, jvp, aux = linearising._products(
            lambda z: gradient(leaves_of(z)), prepared.flat, reverse=False
        )
        return (lambda v: prepared.raveled(jvp(v))), None, aux
    _, vjp, aux = transform._products(gradient, leaves, reverse=True)

    def in_leaf(i):
        _, vjp_of_leaf, _ = product_function(
            lambda point: _part(gradient(point), i, transform.has_aux),
            leaves,
            reverse=True,
            has_aux=False,
            recompute=transform.strategy == "recompute",
        )
        return jax.vmap(lambda unit: prepared.raveled(vjp_of_leaf(unit)))

    return (lambda v: prepared.raveled(vjp(leaves_of(v)))), in_leaf, aux


def _part(gradient: Any, i: int, has_aux: bool) -> Any:
    """Leaf `i` of the gradient (of `(gradient, aux)` with `has_aux`)."""
    return (gradient[0] if has_aux else gradient)[i]
