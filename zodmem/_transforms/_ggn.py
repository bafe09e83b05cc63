"""`BatchedGGN`: the generalised Gauss-Newton matrix `J^T H J` of a loss of a model's
outputs, in blocks of products, with the Jacobian `J` never held."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._checks import (
    check_callable,
    refuses_forward_mode,
    taking_jvps_of_fn,
    typechecked_constructor,
)
from .._engine._block_plans import OutputSink
from .._engine._sharding import Split
from .._operators._block_diagonal import BlockDiagonal
from .._operators._operator import BlockedOperator
from .._pytree import Variables, split_variables
from .._traceback import public
from ._derivative import Prepared
from ._leafwise import curvature_matrix
from ._losses import AbstractLoss
from ._square import AbstractSquare

__all__ = ["BatchedGGN", "ggn_products"]


@typechecked_constructor
class BatchedGGN(AbstractSquare):
    """The generalised Gauss-Newton matrix `G = J^T H J` of a loss of a model's outputs,
    with respect to the model's first argument, in blocks.

    `J` is the Jacobian of the outputs `fn(x, *args, **kwargs)` with respect to the
    variables of `x`, and `H` the Hessian of `loss(outputs, *args, **kwargs)` with respect
    to the outputs. `G` is the part of the Hessian of `loss(fn(x))` that the curvature of
    `fn` leaves out: positive semi-definite wherever the loss is convex in the outputs,
    and, for a negative log-likelihood with one of the losses of `zm.losses`, the Fisher
    information matrix. Use it for Laplace approximations, natural-gradient and
    Gauss-Newton steps, and the covariance of fitted parameters.

    `G` is built as `G V` for blocks of basis vectors `V`: `J V` by forward products, the
    loss's Hessian on the outputs applied, then `J^T` by reverse products. Neither `J`
    nor a Hessian of `loss(fn(x))` is ever formed: peak memory is the `(n, n)` result,
    one linearisation of `fn` and one block's products. Rows are written straight into
    the preallocated result.

    The variables are the inexact-array leaves of `x`, raveled in leaf order, as for
    `zm.BatchedHessian`; every other leaf is held fixed. `n` is their total size.

    **Arguments:**

    - `fn`: the model, called as `fn(x, *args, **kwargs)`; it returns the outputs, an
      array or a pytree of floating-point arrays (or `(outputs, aux)` with
      `has_aux=True`). It may be an Equinox module.
    - `loss`: called as `loss(outputs, *args, **kwargs)` with the same data arguments as
      `fn`; it returns a real scalar. Any callable works: the product of its Hessian on
      the outputs is then taken by forward-over-reverse differentiation. The losses in
      `zm.losses` (`SquaredError`, `GaussianNLL`, `PoissonNLL`, `SoftmaxCrossEntropy`,
      or a subclass of `zm.losses.AbstractLoss`) apply their Fisher information in
      closed form instead. It may be an Equinox module.
    - `nbatches`: compute `G` in this many blocks of rows. At most one of `nbatches`,
      `batch_size` and `max_memory`; with none, one block.
    - `batch_size`: the number of rows per block.
    - `max_memory`: a budget for the call's memory (an int in bytes, a string with a unit
      such as `"750MB"`, or `"auto"`); the block size and strategy are planned as the
      largest whose compiled call fits, as for `zm.BatchedHessian`.
    - `strategy`: `"linearize"` keeps one linearisation of `fn` for every block;
      `"recompute"` linearises `fn` again inside each block, keeping nothing between
      blocks at the cost of one forward pass per block; `"auto"` (the default)
      linearises, and with `max_memory` recomputes when the linearisation leaves no room.
    - `mode`: how the two products with `J` come from one linearisation. `"fwd"`: `J v`
      are JVPs of one `jax.linearize` of `fn`, and `J^T u` the transpose of that linear
      map. `"rev"`: `J^T u` are VJPs of one `jax.vjp` of `fn`, and `J v` the transpose of
      that; it needs only reverse-mode differentiation of `fn`, so it takes functions
      with `jax.custom_vjp` rules, which forward mode refuses. `"auto"` (the default) is
      `"rev"` for variables of one real dtype (a little faster), else `"fwd"`, or
      `"rev"` where forward mode refuses `fn`. Both give the same values.
    - `has_aux`: `fn` returns `(outputs, aux)`; `aux` is returned unchanged beside `G`
      and not passed to `loss`.
    - `jit`: compile the whole computation with `eqx.filter_jit`. A budget needs it.
    - `checkpoint`: wrap `fn` in `jax.checkpoint`.
    - `sharding`: a `jax.sharding.NamedSharding` for the result: its rows
      (`PartitionSpec("d", None)`) or columns (`PartitionSpec(None, "d")`) over a mesh
      axis whose devices divide `n`. Each device computes only its own share, in blocks.
    - `progress`: show a progress bar of the blocks done on stderr.
    - `holomorphic`: taken for the shared configuration of derivatives, and refused:
      complex variables are not supported.
    - `blocks`: `"full"` (the default) for the whole `(n, n)` matrix; `"leaf"` for its
      diagonal blocks alone, as for `zm.BatchedHessian`: one `(n_i, n_i)` block per
      variable leaf of `x`, the Gauss-Newton matrix of `fn` in that leaf alone, each
      planned and made by a call of its own; the call returns them as a tuple in leaf
      order, and `.operator(...)` as a `zm.BlockDiagonal`.

    **Returns:**

    Calling `BatchedGGN(fn, loss)(x, *args, **kwargs)` returns the `(n, n)` matrix, in
    the dtype of the raveled variables (as `zm.BatchedHessian`), or `(G, aux)` with
    `has_aux=True`. `zm.hessian_to_pytree(G, x)` cuts it into blocks per pair of leaves.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import zodmem as zm

        def model(params, inputs, labels):
            return jnp.tanh(inputs @ params["w"]) @ params["v"]   # logits, (8, 3)

        def loss(logits, inputs, labels):
            return -jnp.sum(jax.nn.log_softmax(logits)[jnp.arange(8), labels])

        params = {"v": jnp.ones((4, 3)) / 4, "w": jnp.ones((2, 4)) / 2}
        inputs, labels = jnp.linspace(-1, 1, 16).reshape(8, 2), jnp.arange(8) % 3
        G = zm.BatchedGGN(model, loss, batch_size=5)(params, inputs, labels)  # (20, 20)
        # The same Fisher matrix, with the loss's Hessian in closed form:
        F = zm.BatchedGGN(model, zm.losses.SoftmaxCrossEntropy())(params, inputs, labels)
        assert jnp.allclose(G, F, atol=1e-6)
        ```

    !!! tip

        For a loss summed over a dataset too large for one call, wrap it:
        `zm.Microbatcher(zm.BatchedGGN(fn, loss), microbatch_size=256, argnums=(1, 2))`
        sums the matrices of the microbatches.
    """

    loss: Callable[..., Any]

    _result: ClassVar[str] = "Gauss-Newton matrix"
    _square: ClassVar[str | None] = "matrix"

    @public
    def __check_init__(self):
        check_callable(self.loss, "loss", owner=self._owner)
        if self.holomorphic:
            raise ValueError(
                f"{self._owner}: holomorphic=True is not supported: the Gauss-Newton matrix is "
                "built for real variables and real outputs. Split complex variables into "
                "their real and imaginary parts."
            )

    def compute_share(
        self, sink: OutputSink | None, share: Any, split: Any, x: Any, *args: Any, **kwargs: Any
    ) -> Any:
        prepared = self._prepare(x, args, kwargs, split)
        products, aux = _products(self, prepared, args, kwargs)
        # Row i is (G e_i)^T; G is symmetric, so a block of them is a block of rows, and
        # transposed, a block of columns.
        matrix = curvature_matrix(
            self,
            prepared,
            products,
            lambda i: lambda units: products(units, leaf=i),
            sink,
            share,
            split,
            columns=split is not None and split.dim == 1,
        )
        return prepared.result(matrix, aux)

    def _prepare(self, x: Any, args: tuple, kwargs: dict, split: Split | None) -> Prepared:
        # The mode does not follow `split`: a block of columns is a block of rows transposed.
        flat, variables = split_variables(x, owner=self._owner)
        _check_variables(variables, self._owner)
        fn, outputs, restore_aux = self._function(flat, variables, args, kwargs, "outputs")
        _check_outputs(self, outputs)

        def loss_of(outputs):
            return self.loss(outputs, *args, **kwargs)

        _check_loss(loss_of, outputs, self._owner)
        if isinstance(self.loss, AbstractLoss):
            _check_hessian_product(self.loss, outputs, args, kwargs, self._owner)
        mode = _mode_of(self.mode, variables, fn, variables.leaves_of(flat))
        return Prepared(flat, variables, fn, outputs, restore_aux, mode)

    @public
    def operator(self, x: PyTree, *args: Any, **kwargs: Any) -> BlockedOperator | BlockDiagonal:
        """The Gauss-Newton matrix at `(x, *args, **kwargs)` as a `lineax` linear
        operator, never formed: each product `G v = J^T (H_loss (J v))` is one JVP of
        `fn`, one product with the loss's Hessian and one VJP.

        Use it for Gauss-Newton or natural-gradient steps solved by conjugate gradients,
        and for the Fisher matrix's spectrum, where the `(n, n)` matrix does not fit.
        It carries `lx.symmetric_tag` and `lx.positive_semidefinite_tag` (for a convex
        loss, `G` is positive semi-definite), so `lx.CG` takes it as it is. `op.mv(v)`
        takes a flat vector or a pytree shaped like `x`'s variables and answers in the
        same form; `op.mm(V)` the products with the columns of an `(n, k)` array, in
        blocks as this transform's options (`nbatches`, `batch_size`, `max_memory`,
        `sharding`) say; `op.as_matrix()` is this transform's call.

        **Arguments:** as for the call.

        **Returns:**

        A `lineax.AbstractLinearOperator` from the variables to the variables.

        !!! example

            ```python
            import jax.numpy as jnp
            import lineax as lx
            import zodmem as zm

            def model(w, inputs):
                return jnp.tanh(inputs @ w)

            def loss(outputs, inputs):
                return 0.5 * jnp.sum(outputs**2)

            w, inputs = jnp.full(3, 0.1), jnp.eye(3) + 0.5
            op = zm.BatchedGGN(model, loss, batch_size=2).operator(w, inputs)
            damped = op + 1e-3 * lx.IdentityLinearOperator(op.in_structure())
            damped = lx.TaggedLinearOperator(damped, lx.positive_semidefinite_tag)
            lx.linear_solve(damped, jnp.ones(3), lx.CG(rtol=1e-8, atol=1e-8)).value
            ```
        """
        return self._square_operator(ggn_products, x, args, kwargs, positive_semidefinite=True)


def _check_variables(variables: Variables, owner: str) -> None:
    for name, dtype in zip(variables.names, variables.dtypes, strict=True):
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"{owner}: x{name} has the complex dtype {dtype}; the Gauss-Newton "
                "matrix is built for real variables only (jax.jacrev refuses complex "
                "outputs likewise). Split the variable into its real and imaginary parts."
            )


def _described(shapes: Any) -> str:
    """Shapes and dtypes as `float32[3, 2]`, inside the structure that holds them."""

    def one(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return f"{leaf.dtype}{list(leaf.shape)}"
        return repr(leaf)

    return str(jax.tree_util.tree_map(one, shapes))


def _check_outputs(transform: BatchedGGN, shapes: Any) -> None:
    for where, leaf in transform._output_leaves(shapes):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"{transform._owner}: `fn` must return real floating-point arrays, but its {where} "
                f"has dtype {leaf.dtype} and shape {leaf.shape}. Integer outputs have no "
                "derivative, and complex ones are not supported (split them into real and "
                "imaginary parts)."
            )


def _check_loss(loss_of: Callable[[Any], Any], shapes: Any, owner: str) -> None:
    """Refuse a loss that cannot take the outputs, or does not return a real scalar."""
    try:
        value = eqx.filter_eval_shape(loss_of, shapes)
    except Exception as error:
        raise TypeError(
            f"{owner}: `loss` cannot take the outputs of `fn`, {_described(shapes)}, with "
            f"the call's data arguments: {type(error).__name__}: {error}"
        ) from error
    if eqx.is_array_like(value) and not isinstance(value, jax.ShapeDtypeStruct):
        value = jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value))
    if not isinstance(value, jax.ShapeDtypeStruct) or value.shape != ():
        got = (
            f"an array of shape {value.shape}"
            if isinstance(value, jax.ShapeDtypeStruct)
            else _described(value)
            if jax.tree_util.tree_leaves(value)
            else repr(value)
        )
        raise TypeError(
            f"{owner}: `loss` must return a scalar (shape ()), but it returned {got}. "
            "Reduce it to a scalar, e.g. with jnp.sum."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"{owner}: `loss` must return a real floating-point scalar, but it returned "
            f"dtype {value.dtype}."
        )


def _check_hessian_product(
    loss: AbstractLoss, shapes: Any, args: tuple, kwargs: dict, owner: str
) -> None:
    """Refuse a closed-form product that does not return a tangent of the outputs."""

    def product(outputs):
        return loss.hessian_product(outputs, outputs, *args, **kwargs)

    returned = eqx.filter_eval_shape(product, shapes)
    if jax.tree_util.tree_structure(returned) != jax.tree_util.tree_structure(shapes) or any(
        not isinstance(r, jax.ShapeDtypeStruct) or (r.shape, r.dtype) != (s.shape, s.dtype)
        for r, s in zip(
            jax.tree_util.tree_leaves(returned), jax.tree_util.tree_leaves(shapes), strict=False
        )
    ):
        raise TypeError(
            f"{owner}: `{loss._owner}.hessian_product` must return a tangent "
            f"shaped and typed like the outputs of `fn`, {_described(shapes)}, but it "
            f"returned {_described(returned)}."
        )


def _mode_of(mode: str, variables: Variables, fn: Callable, primal: list) -> str:
    """`mode`, with `"auto"` resolved: `"rev"` for variables of one real dtype, else `"fwd"`,
    or `"rev"` where forward mode refuses `fn` for its `jax.custom_vjp` rules."""
    if mode != "auto":
        return mode
    if variables.real_and_alike:
        # `fn`'s own VJP, and J v as its transpose: no slower than J v by JVP and its
        # transpose on the benchmarks' models (convolutional ones included). Forward
        # mode's J^T u is the transpose of its JVP, which needs what reverse mode needs
        # of `fn`: reverse mode refuses no `fn` that forward mode takes.
        return "rev"

    def batched_jvp(p):  # traced, JAX refuses forward mode once the products are batched
        return jax.vmap(lambda t: jax.jvp(fn, (p,), (t,))[1])([leaf[None] for leaf in p])

    try:
        eqx.filter_eval_shape(batched_jvp, primal)
    except TypeError as error:
        if not refuses_forward_mode(error):
            raise
        return "rev"
    return "fwd"


def _linearised(fn: Callable, primal: list, mode: str, has_aux: bool, owner: str) -> tuple:
    """`(outputs, aux, jvp, vjp)` from one linearisation of `fn` at `primal`, in `mode`
    (`"fwd"` or `"rev"`): `jvp(v)` is `J v` and `vjp(u)` is `J^T u`, one of them the
    transpose of the other."""
    if mode == "fwd":
        with taking_jvps_of_fn(owner):
            if has_aux:
                outputs, jvp, aux = jax.linearize(fn, primal, has_aux=True)
            else:
                (outputs, jvp), aux = jax.linearize(fn, primal), None
            # JAX refuses a `jax.custom_vjp` function in a batched product as it is traced,
            # but in a single one only as it is compiled, past any place to say why.
            batch = [jax.ShapeDtypeStruct((1, *leaf.shape), leaf.dtype) for leaf in primal]
            jax.eval_shape(jax.vmap(jvp), batch)
        transposed = jax.linear_transpose(jvp, primal)
        return outputs, aux, jvp, lambda u: transposed(u)[0]
    if has_aux:
        outputs, vjp_of, aux = jax.vjp(fn, primal, has_aux=True)
    else:
        (outputs, vjp_of), aux = jax.vjp(fn, primal), None

    def vjp(u):
        return vjp_of(u)[0]

    transposed = jax.linear_transpose(vjp, outputs)
    return outputs, aux, lambda v: transposed(v)[0], vjp


def _loss_hessian(transform: BatchedGGN, outputs: Any, args: tuple, kwargs: dict):
    """`u -> H u`, the loss's Hessian on the outputs at `outputs` applied to `u`: in closed
    form for a `zm.losses` loss, else forward-over-reverse of one linearised gradient."""
    if isinstance(transform.loss, AbstractLoss):
        return lambda u: transform.loss.hessian_product(outputs, u, *args, **kwargs)

    def loss_of(outputs):
        return transform.loss(outputs, *args, **kwargs)

    _, hvp = jax.linearize(jax.grad(loss_of), outputs)
    return hvp


def _products(
    transform: BatchedGGN, prepared: Prepared, args: tuple, kwargs: dict, single: bool = False
) -> tuple[Callable[[Any], Any], Any]:
    """`(products, aux)`: `products(V)` is `G v` for each row `v` of the `(k, n)` block `V`,
    as a `(k, n)` block in the variables' dtype (with `single`, `products(v)` is `G v` for
    one flat `v`); `products(V, leaf=i)` takes `V`'s rows as vectors of leaf `i` alone,
    `(k, *leaf_shape)`, the others zero. `aux` is `fn`'s (its arrays only)."""
    variables, primal = prepared.variables, prepared.leaves

    def apply(linearised, vectors, leaf):
        outputs, _, jvp, vjp = linearised
        hessian = _loss_hessian(transform, outputs, args, kwargs)
        if leaf is None:

            def forward(v):
                return jvp(variables.leaves_of(v))
        else:
            # J along one leaf: the transpose of that leaf's part of J^T, in which the
            # other leaves' pieces are symbolic zeros that cost nothing.
            along = jax.linear_transpose(lambda u: vjp(u)[leaf], outputs)

            def forward(v):
                return along(v)[0]

        def one(v):
            return prepared.raveled(vjp(hessian(forward(v))))

        return one(vectors) if single else jax.vmap(one)(vectors)

    def linearised():
        return _linearised(prepared.fn, primal, prepared.mode, transform.has_aux, transform._owner)

    if transform.strategy != "recompute":
        kept = linearised()
        return (lambda vectors, leaf=None: apply(kept, vectors, leaf)), kept[1]
    aux = prepared.fn(primal)[1] if transform.has_aux else None
    return (lambda vectors, leaf=None: apply(linearised(), vectors, leaf)), aux


def ggn_products(
    transform: BatchedGGN, x: Any, args: tuple, kwargs: dict
) -> tuple[jax.Array, Variables, Callable[[jax.Array], jax.Array]]:
    """`(flat, variables, mv)` for `transform` at `x` with the data `args` and `kwargs`:
    the raveled variables of `x`, how they were raveled, and `mv(v)`, the product
    `G v` of the Gauss-Newton matrix with one flat vector `v` of size `n`, in the
    variables' dtype (vmappable).

    The inputs are checked as a call of `transform` checks them. With the transform's
    strategy `"linearize"` (or `"auto"`), `fn` is linearised once, here, and every
    product reuses it; with `"recompute"`, each product linearises it again.
    """
    prepared = transform._prepare(x, args, kwargs, None)
    mv, _ = _products(transform, prepared, args, kwargs, single=True)
    return prepared.flat, prepared.variables, mv
