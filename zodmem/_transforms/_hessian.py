"""`BatchedHessian`: the Hessian of a scalar function of any pytree, computed in blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from beartype import beartype
from jax.sharding import PartitionSpec
from jaxtyping import Array, Inexact, PyTree, jaxtyped

from .._curvature._operator import BlockedOperator, make_operator
from .._engine._blocks import OutputSink, map_blocks, plan_blocks
from .._engine._layout import holds
from .._engine._progress import label
from .._engine._sharding import Share, Split, share_of
from .._plan._budget import Work
from .._plan._transform import AbstractDerivative, product_function, split_aux
from .._pytree import Variables, basis_block, called_as, flat_function, split_variables
from .._traceback import public
from ._leafwise import by_leaf

__all__ = ["BatchedHessian"]


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
    - `max_memory`: instead of `nbatches` or `batch_size`, a budget for the call's
      memory: an int (bytes), a string with a unit (`"750MB"`, `"1.5GB"`,
      `"512MiB"`) or `"auto"` (the free memory of the device, less a margin). The
      block size (and the strategy) is planned before anything runs, as the largest
      whose compiled call fits; `plan()` shows the plan, and a budget that cannot hold
      one product per block raises `zm.MemoryBudgetError`. At most one of `nbatches`,
      `batch_size` and `max_memory`.
    - `strategy`: `"linearize"` keeps one linearisation of `fn` for every block (its
      residuals grow with the depth of `fn`); `"recompute"` evaluates `fn` again inside
      each block, keeping nothing between blocks, at the cost of one more forward pass
      per block; `"auto"` (the default) linearises, and with `max_memory` recomputes
      when the residuals leave no room for a block.
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
    - `checkpoint`: wrap `fn` in `jax.checkpoint`, so that it is recomputed rather
      than its intermediates stored.
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
    @public
    def __call__(
        self, x: PyTree, *args: Any, **kwargs: Any
    ) -> Inexact[Array, "n n"] | tuple[Inexact[Array, "n n"], Any]:
        return self._call((x, *args), kwargs)

    def compute_share(
        self, sink: OutputSink | None, share: Any, split: Any, x: Any, *args: Any, **kwargs: Any
    ) -> Any:
        return _hessian_share(self, x, args, kwargs, sink, share, split)

    @public
    def operator(self, x: PyTree, *args: Any, **kwargs: Any) -> BlockedOperator:
        """The Hessian at `(x, *args, **kwargs)` as a `lineax` linear operator, never
        formed: each product with a vector is one Hessian-vector product.

        Use it where the Hessian is only multiplied by vectors (a Newton-CG step, a
        Krylov solve, an eigenvalue estimate), so that nothing `(n, n)` is ever held.

        - `op.mv(v)`: one Hessian-vector product (forward-over-reverse). `v` is a flat
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
        return make_operator(
            self, _hessian_products, x, args, kwargs, square=True, tags=lx.symmetric_tag
        )

    def result_specs(self, spec: PartitionSpec) -> Any:
        if len(spec) > 2:
            raise ValueError(
                f"BatchedHessian: `sharding` has the spec {spec}, for {len(spec)} axes, but "
                "the Hessian has 2: split its rows, PartitionSpec('d', None), or its "
                "columns, PartitionSpec(None, 'd')."
            )
        return super().result_specs(spec)

    def work(self, x: Any, *args: Any, **kwargs: Any) -> Work:
        n = eqx.filter_eval_shape(lambda x: split_variables(x, owner="BatchedHessian")[0], x)
        total = n.shape[0]
        plan = plan_blocks(total, nbatches=self.nbatches, batch_size=self.batch_size)
        return Work(total, "variables", "Hessian", plan.block_size).per_device(self._split)


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
    flat, variables = split_variables(x, owner="BatchedHessian")
    transform._check_variables(variables)
    fn_of_flat = flat_function(transform.fn, variables, args, kwargs, traced_once=transform.jit)
    _check_scalar(transform, transform._output_shapes(fn_of_flat, flat, "value"))
    recompute = transform.strategy == "recompute"
    mode = _mode_of(transform.mode, variables, fn_of_flat, flat)
    if mode == "rev" and variables.real_and_alike:
        # Reverse over reverse, per leaf: a product is the gradient's VJP with the
        # vector's pieces, gathered by one concatenation (no pieces padded to `n` and
        # added, as differentiating through the raveling would make them).
        gradient, _ = _leaf_gradient(transform, variables, args, kwargs)
        _, vjp, _ = product_function(
            (lambda leaves: gradient(leaves)[0]) if transform.has_aux else gradient,
            variables.leaves_of(flat),
            reverse=True,
            has_aux=False,
            recompute=recompute,
        )

        def hvp(vector):
            pieces = vjp(variables.leaves_of(vector))
            return jnp.concatenate([jnp.ravel(piece).astype(flat.dtype) for piece in pieces])

        return flat, variables, hvp

    def value(z):
        return fn_of_flat(z)[0] if transform.has_aux else fn_of_flat(z)

    if transform.checkpoint:
        value = jax.checkpoint(value)
    gradient = jax.grad(value, holomorphic=transform.holomorphic)
    _, hvp, _ = product_function(gradient, flat, reverse=False, has_aux=False, recompute=recompute)
    return flat, variables, hvp


# What makes reverse-over-reverse products slow: a convolution (its products are
# convolutions of the transposed convolutions its gradient makes) and a loop (a `scan`,
# an ODE solver's `while`: its gradient is a loop over saved or recomputed steps, whose
# transpose is another).
_FORWARD_OVER_REVERSE = (jax.lax.conv_general_dilated_p, jax.lax.while_p, jax.lax.scan_p)


def _mode_of(mode: str, variables: Variables, fn_of_flat: Any, flat: Any) -> str:
    """`mode`, with `"auto"` resolved: reverse over reverse for variables of one real
    dtype where `fn`'s program holds no convolution and no loop, forward over reverse
    otherwise."""
    if mode != "auto":
        return mode
    if not variables.real_and_alike:
        return "fwd"
    slow = holds(fn_of_flat, flat, primitives=_FORWARD_OVER_REVERSE)
    return "fwd" if slow else "rev"


def _leaf_gradient(
    transform: BatchedHessian, variables: Variables, args: tuple, kwargs: dict
) -> tuple[Callable[[list], Any], Any]:
    """`(gradient, restore_aux)`: the gradient of `fn` with respect to the variables'
    leaves (with `has_aux`, `(gradient, aux)`, and how `aux` is put back together), with
    the transform's checkpoint."""
    fn = called_as(transform.fn, traced_once=transform.jit)

    def fn_of_leaves(leaves):
        return fn(variables.fill(leaves), *args, **kwargs)

    restore_aux = None
    if transform.has_aux:
        fn_of_leaves, restore_aux = split_aux(fn_of_leaves)
    if transform.checkpoint:
        fn_of_leaves = jax.checkpoint(fn_of_leaves)
    gradient = jax.grad(fn_of_leaves, has_aux=transform.has_aux, holomorphic=transform.holomorphic)
    return gradient, restore_aux


def _part(gradient: Any, i: int, has_aux: bool) -> Any:
    """Leaf `i` of the gradient (of `(gradient, aux)` with `has_aux`)."""
    return (gradient[0] if has_aux else gradient)[i]


def _sharded_mode(transform: BatchedHessian, split: Split) -> str | None:
    """The mode that makes the split axis's items: rows by VJPs, columns by JVPs."""
    if split.dim is None:
        return None
    return transform._split_mode("rev" if split.dim == 0 else "fwd", "Hessian")


def _hessian_share(
    transform: BatchedHessian,
    x: Any,
    args: tuple,
    kwargs: dict,
    sink: OutputSink | None = None,
    share: Share | None = None,
    split: Split | None = None,
) -> Any:
    """The Hessian, or with `share` the rows (or columns) of one device's share of it."""
    flat, variables = split_variables(x, owner="BatchedHessian")
    transform._check_variables(variables)
    # Traced for its shapes only: a checkpoint here would refuse leaves of aux that are not arrays.
    fn_of_flat = flat_function(transform.fn, variables, args, kwargs, traced_once=transform.jit)
    _check_scalar(transform, transform._output_shapes(fn_of_flat, flat, "value"))
    n = variables.size
    plan = plan_blocks(
        n,
        nbatches=transform.nbatches,
        batch_size=transform.batch_size,
        what="variables",
        owner="BatchedHessian",
    )
    what = "rows" if split is not None and split.dim == 0 else "columns"
    plan, offset = share_of(n, plan, share, split, owner="BatchedHessian", what=what)

    # Differentiated per leaf, not as `fn_of_flat`: a block's products are then gathered
    # by one concatenation instead of padding every leaf's piece to n columns and adding.
    gradient, restore_aux = _leaf_gradient(transform, variables, args, kwargs)
    leaves_of = variables.leaves_of

    def gather(products):
        pieces = [
            piece.reshape(plan.block_size, size).astype(flat.dtype)
            for piece, size in zip(products, variables.sizes, strict=True)
        ]
        return jnp.concatenate(pieces, axis=1)

    def basis(start):
        return basis_block(start + offset, plan.block_size, n, flat.dtype)

    mode = None if split is None else _sharded_mode(transform, split)
    fn_of_flat = flat_function(transform.fn, variables, args, kwargs, traced_once=transform.jit)
    mode = _mode_of(mode or transform.mode, variables, fn_of_flat, flat)
    if mode == "rev":
        # H is symmetric, so row i is the VJP of the gradient with e_i (for a
        # holomorphic function too: H is then complex symmetric, and JAX's VJPs
        # transpose without conjugating).
        _, vjp, aux = transform._products(gradient, leaves_of(flat), reverse=True)

        def every_leaf(start):
            return gather(jax.vmap(lambda v: vjp(leaves_of(v)))(basis(start)))

        def in_leaf(i):
            # The VJP of leaf i's part of the gradient alone: a block of rows within that
            # leaf, where the other leaves' zero pieces are symbolic and cost nothing.
            _, vjp_of_leaf, _ = product_function(
                lambda leaves: _part(gradient(leaves), i, transform.has_aux),
                leaves_of(flat),
                reverse=True,
                has_aux=False,
                recompute=transform.strategy == "recompute",
            )
            return lambda units: gather(jax.vmap(vjp_of_leaf)(units))

        block = by_leaf(variables, plan, offset, every_leaf, in_leaf)
        axis = 0
    else:
        _, hvp, aux = transform._products(lambda z: gradient(leaves_of(z)), flat, reverse=False)

        def block(start):
            # Column j is the JVP with e_j, as in `jax.hessian`; written as columns, the
            # result matches it exactly even where rounding makes it not quite symmetric
            # (float32 leaves among float64 ones).
            return gather(jax.vmap(hvp)(basis(start))).T

        axis = 1

    if n == 0:  # only empty variables: nothing to run, the Hessian is empty
        hessian = jnp.zeros((0, 0), flat.dtype)
    else:
        hessian = map_blocks(
            block,
            plan,
            axis=axis,
            sink=None if sink is None else sink.part([0], plan),
            progress=label(transform),
        )
    if restore_aux is None:
        return hessian
    return hessian, restore_aux(aux)
