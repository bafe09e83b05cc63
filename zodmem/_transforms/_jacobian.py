"""`BatchedJacobian`: a Jacobian of a function of any pytree, computed in blocks."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Inexact, PyTree

from .._checks import checked_annotations, taking_jvps_of_fn, typechecked_constructor
from .._engine._block_plans import OutputSink, plan_blocks
from .._engine._blocks import map_blocks
from .._engine._progress import label
from .._engine._sharding import Split, check_divides, share_of
from .._operators._operator import BlockedOperator, make_operator
from .._pytree import basis_block
from .._traceback import public
from ._derivative import AbstractDerivative, Prepared, product_function

__all__ = ["BatchedJacobian"]


@typechecked_constructor
class BatchedJacobian(AbstractDerivative):
    """The Jacobian of `fn` with respect to its first argument, computed in blocks.

    Use it where `jax.jacfwd` / `jax.jacrev` of a function of many variables runs
    out of memory: the Jacobian is built a block of Jacobian-vector products
    (`mode="fwd"`, a block of columns) or vector-Jacobian products (`mode="rev"`, a
    block of rows) at a time, each block written straight into the preallocated
    result. Peak memory is the Jacobian plus one block's working set.

    The variables are the inexact-array leaves of `x`, raveled in leaf order; every
    other leaf (functions, ints, bools, static fields of an Equinox model) is held
    fixed. `n` is their total size.

    **Arguments:**

    - `fn`: the function, called as `fn(x, *args, **kwargs)`. It returns an array
      or a pytree of arrays (and an auxiliary value when `has_aux=True`). It may be
      an Equinox module.
    - `nbatches`: cut the products into this many blocks. At most one of `nbatches`
      and `batch_size` may be given; with neither, all products form one block.
    - `batch_size`: the number of products per block.
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
    - `mode`: `"fwd"` builds columns from JVPs of one `jax.linearize`, as
      `jax.jacfwd` does; `"rev"` builds rows from VJPs of one `jax.vjp`, as
      `jax.jacrev` does; `"auto"` picks the mode with fewer products (`"fwd"` when
      `n` is at most the output size, as for `jax.jacfwd` on tall Jacobians), and
      `"fwd"` whenever an output is complex and `holomorphic=False`.
    - `holomorphic`: the variables are complex and `fn` is holomorphic in them, as
      `jax.jacfwd(holomorphic=True)`. Without it, complex variables are refused.
    - `has_aux`: `fn` returns `(output, aux)`; `aux` is returned unchanged (its
      leaves need not be arrays).
    - `jit`: compile the whole computation with `eqx.filter_jit`. A budget
      (`max_memory`) plans the compiled call, so it needs `jit=True`.
    - `checkpoint`: wrap `fn` in `jax.checkpoint`, so that it is recomputed rather
      than its intermediates stored.
    - `sharding`: a `jax.sharding.NamedSharding` for the result (applied to every
      output leaf's Jacobian). Each device computes only the blocks of its own share, in
      blocks of the size the options give (a budget is then per device), and holds only
      that share; the result is a global `jax.Array` with this sharding, across
      processes too under `jax.distributed`. One axis may be split: the first (rows,
      output elements: reverse mode, e.g. `PartitionSpec("d")`) or the last (columns,
      variables: forward mode, e.g. `PartitionSpec(None, "d")` for a vector output);
      `mode="auto"` takes the mode that makes the split axis. The devices along it must
      divide its size. See the "Scaling out" page.
    - `progress`: show a progress bar on stderr (blocks done of the total, rate, time
      left), updated from inside the compiled loop after each block. With mode `"rev"`
      and several output leaves, each leaf's rows are one loop, with a bar of their
      own. Off by default, and then nothing is added to the compiled program.

    **Returns:**

    Calling `BatchedJacobian(fn)(x, *args, **kwargs)` returns the Jacobian, shape
    `(*out_shape, n)` (a pytree of these, one per output leaf, when `fn` returns a
    pytree), or `(jacobian, aux)` with `has_aux=True`. `zm.jacobian_to_pytree(J, x)`
    reshapes it to the structure of `x`.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        def f(params, t):
            return params["a"] * jnp.sin(params["w"] * t)

        params = {"a": jnp.ones(3), "w": jnp.arange(3.0)}
        J = zm.BatchedJacobian(f, nbatches=2)(params, 0.5)   # shape (3, 6)
        ```

    !!! tip

        `nbatches` and `batch_size` count products: columns with `mode="fwd"`, rows
        (output elements) with `mode="rev"`.

    !!! note

        Values and dtypes are those of `jax.jacfwd` (`mode="fwd"`: the output's dtype)
        or `jax.jacrev` (`mode="rev"`: the variables' dtype) of `fn` as a function of
        the raveled variables. A real `x` with complex outputs gets `jax.jacfwd`'s
        complex Jacobian; `mode="rev"` refuses it, as `jax.jacrev` refuses complex
        outputs.
    """

    _result: ClassVar[str] = "Jacobian"
    _square: ClassVar[str | None] = None

    @public
    @checked_annotations
    def __call__(
        self, x: PyTree, *args: Any, **kwargs: Any
    ) -> PyTree[Inexact[Array, "... n"]] | tuple[PyTree[Inexact[Array, "... n"]], Any]:
        return super().__call__(x, *args, **kwargs)

    def compute_share(
        self, sink: OutputSink | None, share: Any, split: Any, x: Any, *args: Any, **kwargs: Any
    ) -> Any:
        prepared = self._prepare(x, args, kwargs, split)
        if prepared.mode == "rev":
            return prepared.result(*_reverse(self, prepared, sink, share, split))
        named = "mode='fwd'"
        if self.mode == "auto":
            named = (
                f"mode='auto' (which chose forward mode for {prepared.n} variables and "
                f"{prepared.m} output elements)"
            )
        with taking_jvps_of_fn("BatchedJacobian", named):
            return prepared.result(*_forward(self, prepared, sink, share, split))

    def _prepare(self, x: Any, args: tuple, kwargs: dict, split: Split | None) -> Prepared:
        flat, variables = self._variables(x)
        fn, outputs, restore_aux = self._function(flat, variables, args, kwargs, "output")
        out_leaves = _checked_outputs(self, outputs)
        complex_outputs = any(jnp.issubdtype(o.dtype, jnp.complexfloating) for o in out_leaves)
        mode = None if split is None else _split_mode(self, split, out_leaves)
        if mode == "rev" and complex_outputs and not self.holomorphic:
            raise TypeError(
                f"BatchedJacobian: `sharding` ({self.sharding.spec}) splits the rows of "
                "the Jacobian, which reverse mode makes, but `fn` returns complex outputs and "
                "reverse mode requires real-valued ones, as jax.jacrev does. Split the columns "
                "instead, e.g. PartitionSpec(..., 'd') on the last axis."
            )
        mode = mode or _choose_mode(self, variables.size, out_leaves, complex_outputs)
        return Prepared(flat, variables, fn, outputs, restore_aux, mode)

    @public
    def operator(self, x: PyTree, *args: Any, **kwargs: Any) -> BlockedOperator:
        """The Jacobian at `(x, *args, **kwargs)` as a `lineax` linear operator, from the
        variables to the outputs, never formed: each product is one JVP.

        Use it where the Jacobian is only applied to vectors (a Gauss-Newton step, a
        least-squares solve, a sensitivity), or its transpose (VJPs).

        - `op.mv(v)`: one Jacobian-vector product. `v` is a flat vector of the `n`
          variables or a pytree shaped like `x`'s variables; the product is the outputs
          of `fn` raveled and concatenated (for a flat `v`) or shaped like them.
        - `op.mm(V)`: the products with the `k` columns of an `(n, k)` array, `(m, k)`
          for `m` output elements, in blocks of columns as this transform's options say
          (`nbatches`, `batch_size`: columns per block; `max_memory`: planned as the
          call is; `sharding`: columns spread over its devices).
        - `op.as_matrix()`: the dense `(m, n)` Jacobian, by this transform's own call.
        - `op.T`: the transposed operator, whose products are VJPs.

        **Arguments:** as for the call: `x`, the point (its inexact-array leaves are the
        variables), and the other arguments of `fn`.

        **Returns:**

        A `lineax.AbstractLinearOperator` from the variables to the outputs.

        !!! example

            ```python
            import jax.numpy as jnp
            import zodmem as zm

            def f(params, t):
                return params["a"] * jnp.sin(params["w"] * t)

            params = {"a": jnp.ones(3), "w": jnp.arange(3.0)}
            op = zm.BatchedJacobian(f, batch_size=2).operator(params, 0.5)
            op.mv(jnp.ones(6))             # J @ 1, shape (3,)
            op.T.mv(jnp.ones(3))           # J.T @ 1, shape (6,)
            op.mm(jnp.eye(6))              # J, in blocks of 2 columns
            ```
        """
        return make_operator(self, _jacobian_products, x, args, kwargs, square=False)


def _checked_outputs(transform: BatchedJacobian, outputs: Any) -> list[jax.ShapeDtypeStruct]:
    """The output leaves, refused where they cannot be differentiated: integer ones, and
    real ones with `holomorphic=True` (as `jax.jacfwd(holomorphic=True)` does)."""
    leaves = transform._output_leaves(outputs)
    for where, leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                "BatchedJacobian: `fn` must return floating-point (or complex) arrays to be "
                f"differentiated, but one output leaf has dtype {leaf.dtype} and shape "
                f"{leaf.shape} ({where})."
            )
        if transform.holomorphic and not jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            raise TypeError(
                "BatchedJacobian: with holomorphic=True `fn` must return complex arrays, as in "
                f"jax.jacfwd(holomorphic=True), but {where} has dtype {leaf.dtype}."
            )
    return [leaf for _, leaf in leaves]


def _choose_mode(
    transform: BatchedJacobian, n: int, out_leaves: list, complex_outputs: bool
) -> str:
    if transform.mode == "auto":
        if complex_outputs and not transform.holomorphic:
            return "fwd"  # the only mode that keeps the imaginary part, as jax.jacfwd
        return "fwd" if n <= sum(math.prod(o.shape) for o in out_leaves) else "rev"
    if transform.mode == "rev" and complex_outputs and not transform.holomorphic:
        raise TypeError(
            "BatchedJacobian: mode='rev' requires real-valued outputs, as jax.jacrev does "
            '("jacrev requires real-valued outputs"), but `fn` returns complex ones. Use '
            "mode='fwd' or 'auto' for the complex Jacobian of a real `x` (jax.jacfwd's), or "
            "holomorphic=True with complex variables."
        )
    return transform.mode


def _jacobian_products(transform: BatchedJacobian, x: Any, args: tuple, kwargs: dict) -> tuple:
    """`(flat, variables, jvp)`: the variables, raveled, and one Jacobian-vector product
    with a flat vector (the outputs of `fn` as it returns them, without `aux`)."""
    prepared = transform._prepare(x, args, kwargs, None)
    of_flat = prepared.of_flat
    value = of_flat if prepared.restore_aux is None else (lambda z: of_flat(z)[0])
    recompute = transform.strategy == "recompute"
    flat = prepared.flat
    _, jvp, _ = product_function(value, flat, reverse=False, has_aux=False, recompute=recompute)
    return flat, prepared.variables, jvp


def _split_mode(transform: BatchedJacobian, split: Split, out_leaves: list) -> str | None:
    """The mode that makes the split axis of every output leaf's Jacobian: its first axis
    (rows: output elements, by VJPs) or its last (columns: variables, by JVPs)."""
    if split.dim is None:
        return None
    modes = set()
    for k, leaf in enumerate(out_leaves):
        ndim = len(leaf.shape) + 1
        if split.dim == ndim - 1:
            modes.add("fwd")
        elif split.dim == 0:
            modes.add("rev")
        else:
            raise ValueError(
                f"BatchedJacobian: `sharding` ({transform.sharding.spec}) splits axis "
                f"{split.dim} of the Jacobian of output leaf {k}, shape "
                f"{(*leaf.shape, 'n')}; each device makes whole rows (the first axis, output "
                "elements) or whole columns (the last axis, variables), so split one of those."
            )
    if len(modes) > 1:
        raise ValueError(
            f"BatchedJacobian: `sharding` ({transform.sharding.spec}) splits the columns of "
            "some output leaves' Jacobians (scalar outputs, whose Jacobian has one axis) and "
            "the rows of others; one sharding must split the same kind of axis of each."
        )
    (mode,) = modes
    return transform._split_mode(mode)


def _forward(transform: BatchedJacobian, prepared: Prepared, sink, share, split) -> tuple:
    """`(jacobian, aux)`: columns from JVPs of one linearisation, in the outputs' dtypes
    (as jax.jacfwd); with `share` (of `split`), the columns of one device's share."""
    flat, n = prepared.flat, prepared.n
    plan = plan_blocks(
        n,
        nbatches=transform.nbatches,
        batch_size=transform.batch_size,
        what="variables",
        owner=transform._owner,
        context=" (mode 'fwd' makes one column per variable)",
    )
    plan, offset = share_of(
        n, plan, share, split, owner=transform._owner, what="columns (variables)"
    )
    out, jvp, aux = transform._products(prepared.of_flat, flat, reverse=False)
    if n == 0:  # only empty variables: nothing to run, the Jacobian is empty
        return jax.tree_util.tree_map(lambda o: jnp.zeros((*o.shape, 0), o.dtype), out), aux

    def columns(start):
        tangents = basis_block(start + offset, plan.block_size, n, flat.dtype)
        cols = jax.vmap(jvp)(tangents)
        return jax.tree_util.tree_map(lambda c: jnp.moveaxis(c, 0, -1), cols)

    if sink is not None:
        every_leaf = range(len(jax.tree_util.tree_leaves(out)))
        return map_blocks(columns, plan, axis=-1, sink=sink.part(every_leaf, plan)), aux
    return map_blocks(columns, plan, axis=-1, progress=label(transform)), aux


def _reverse(transform: BatchedJacobian, prepared: Prepared, sink, share, split) -> tuple:
    """`(jacobian, aux)`: rows from VJPs of one forward pass, output leaf by output leaf,
    in the variables' dtype (as jax.jacrev); with `share`, the rows of one device's share
    of each leaf (its first axis split, so a contiguous run of the leaf's rows in C order)."""
    flat, n, m = prepared.flat, prepared.n, prepared.m
    sharded = share is not None and split.dim is not None
    if transform.mode == "auto":
        why = (
            f" (mode 'auto' chose reverse mode, which makes one row per output element, "
            f"since the {m} output elements are fewer than the {n} variables; so `nbatches` "
            "counts output elements)"
        )
    else:
        why = " (mode 'rev' makes one row per output element)"
    plan = plan_blocks(
        m,
        nbatches=transform.nbatches,
        batch_size=transform.batch_size,
        what="output elements",
        owner=transform._owner,
        context=why,
    )
    out, vjp, aux = transform._products(prepared.of_flat, flat, reverse=True)
    out_leaves, out_def = jax.tree_util.tree_flatten(out)

    jacobians = []
    for k, leaf in enumerate(out_leaves):
        size = math.prod(leaf.shape)
        rows_shape, offset = leaf.shape, 0
        if sharded:
            check_divides(
                leaf.shape[0], split, owner=transform._owner, what=f"rows of output leaf {k}"
            )
            size //= split.count
            rows_shape = (leaf.shape[0] // split.count, *leaf.shape[1:])
            offset = share.offset(math.prod(leaf.shape))
        if size == 0:
            jacobians.append(jnp.zeros((*rows_shape, n), flat.dtype))
            continue
        leaf_plan = plan_blocks(size, batch_size=plan.block_size)

        def rows(start, k=k, block=leaf_plan.block_size, offset=offset):
            cotangents = [
                basis_block(start + offset, block, o.size, o.dtype).reshape(block, *o.shape)
                if j == k
                else jnp.zeros((block, *o.shape), o.dtype)
                for j, o in enumerate(out_leaves)
            ]
            return jax.vmap(vjp)(jax.tree_util.tree_unflatten(out_def, cotangents))

        if sink is not None:
            # Rows of the (size, n) block are rows of the (*leaf.shape, n) leaf, in C order.
            map_blocks(rows, leaf_plan, axis=0, sink=sink.part([k], leaf_plan))
            jacobians.append(None)
            continue
        rows_of_leaf = map_blocks(rows, leaf_plan, axis=0, progress=label(transform))
        jacobians.append(rows_of_leaf.reshape(*rows_shape, n))
    return jax.tree_util.tree_unflatten(out_def, jacobians), aux
