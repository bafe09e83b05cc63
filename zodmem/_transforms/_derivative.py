"""`AbstractDerivative`, the base of `BatchedJacobian`, `BatchedHessian` and `BatchedGGN`.

A derivative differentiates `fn` with respect to the variables of its first argument, in
blocks of products planned from `nbatches`, `batch_size` or `max_memory`. It fills one
hook, `_prepare(x, args, kwargs, split)`, which turns the arguments of a call into a
`Prepared`: the variables raveled, `fn` as a checked function of their leaves, the shapes
of its outputs, how `aux` is put back, and the mode of the products. The base holds the
rest: the configuration and its checks, the work a call cuts into blocks, how a plan
fixes the block size, the result's partition specs, the checks of variables and outputs,
and the products of `fn` (`product_function`, `split_aux`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._checks import (
    check_block_options,
    check_bool,
    check_callable,
    check_choice,
    int_option,
    memory_option,
)
from .._engine._block_plans import plan_blocks
from .._engine._sharding import Kept, Split, check_sharding
from .._operators._block_diagonal import BlockDiagonal
from .._operators._options import OperatorSource, TransformOptions
from .._plan._memory import check_memory
from .._plan._plans import Work
from .._pytree import Variables, called_as, ravel_leaves, split_variables, variable_structure
from .._traceback import public
from ._base import AbstractBlocked
from ._leaf_blocks import leaf_blocks

__all__ = ["AbstractDerivative", "Prepared", "product_function", "split_aux"]


class Prepared(NamedTuple):
    """A call of a derivative made ready for its blocks, by `AbstractDerivative._prepare`.

    - `flat`: the variables, raveled into one vector of `n` in their common dtype.
    - `variables`: how they were raveled, and how to cut a flat vector back into leaves.
    - `fn`: `fn` as a function of the variables' leaves, its outputs arrays (with
      `has_aux`, `(outputs, aux)` with only the arrays of `aux`), checkpointed where the
      transform says so.
    - `outputs`: the shapes and dtypes of `fn`'s outputs, without `aux`, checked.
    - `restore_aux`: puts `aux` back together (`None` without `has_aux`).
    - `mode`: `"fwd"` or `"rev"`, the mode of the products.
    """

    flat: jax.Array
    variables: Variables
    fn: Callable[[list], Any]
    outputs: Any
    restore_aux: Callable[[Any], Any] | None
    mode: str

    @property
    def n(self) -> int:
        """The number of variables."""
        return self.variables.size

    @property
    def m(self) -> int:
        """The number of output elements."""
        return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(self.outputs))

    @property
    def leaves(self) -> list[jax.Array]:
        """The variables' leaves, each in its own dtype."""
        return self.variables.leaves_of(self.flat)

    def of_flat(self, flat: jax.Array) -> Any:
        """`fn` at the variables read from a flat vector."""
        return self.fn(self.variables.leaves_of(flat))

    def raveled(self, pieces: list[Any]) -> jax.Array:
        """One piece per variable leaf (a vector in the variables' space), as one flat
        vector in the dtype of `flat`."""
        return ravel_leaves(pieces, self.flat.dtype)

    def result(self, value: Any, aux: Any) -> Any:
        """What the call returns: `value`, or `(value, aux)` put back with `has_aux`."""
        return value if self.restore_aux is None else (value, self.restore_aux(aux))


class AbstractDerivative(AbstractBlocked, OperatorSource):
    """The configuration, the checks and the planned work that `BatchedJacobian`,
    `BatchedHessian` and `BatchedGGN` share.

    Each differentiates `fn` with respect to its first argument, in blocks of products
    planned from `nbatches`, `batch_size` or `max_memory`, in forward or reverse mode. A
    derivative fills `_prepare` and `compute_share` (which calls it), names its result
    (`_result`, and `_square` for an `(n, n)` one) and gives `__call__` its annotations.
    """

    fn: Callable[..., Any]
    nbatches: int | None = eqx.field(default=None, static=True, kw_only=True, converter=int_option)
    batch_size: int | None = eqx.field(
        default=None, static=True, kw_only=True, converter=int_option
    )
    max_memory: int | str | None = eqx.field(
        default=None, static=True, kw_only=True, converter=memory_option
    )
    strategy: Literal["auto", "linearize", "recompute"] = eqx.field(
        default="auto", static=True, kw_only=True
    )
    mode: Literal["auto", "fwd", "rev"] = eqx.field(default="auto", static=True, kw_only=True)
    holomorphic: bool = eqx.field(default=False, static=True, kw_only=True)
    has_aux: bool = eqx.field(default=False, static=True, kw_only=True)
    jit: bool = eqx.field(default=True, static=True, kw_only=True)
    checkpoint: bool = eqx.field(default=False, static=True, kw_only=True)
    sharding: NamedSharding | None = eqx.field(default=None, static=True, kw_only=True)
    progress: bool = eqx.field(default=False, static=True, kw_only=True)
    blocks: Literal["full", "leaf"] = eqx.field(default="full", static=True, kw_only=True)

    # The result's name in plans and messages ("Jacobian").
    _result: ClassVar[str]
    # For an (n, n) result over the variables, its name in messages about its axes; `None`
    # for a result shaped by the outputs.
    _square: ClassVar[str | None]

    @public
    def __check_init__(self):
        owner = self._owner
        check_sharding(self.sharding, owner=owner)
        check_callable(self.fn, "fn", owner=owner)
        check_block_options(self.nbatches, self.batch_size, owner=owner)
        check_memory(self.max_memory, owner=owner)
        if self.max_memory is not None and (self.nbatches, self.batch_size) != (None, None):
            given = "nbatches" if self.nbatches is not None else "batch_size"
            raise ValueError(
                f"{owner}: give at most one of `nbatches`, `batch_size` and `max_memory`, "
                f"got {given}={getattr(self, given)} and max_memory={self.max_memory!r}."
            )
        if self.max_memory is not None and not self.jit:
            raise ValueError(
                f"{owner}: max_memory={self.max_memory!r} plans the blocks of the compiled "
                "call, but with jit=False the call runs op by op, whose memory no plan "
                "describes. Leave jit=True with a budget, or give nbatches or batch_size."
            )
        check_choice(self.strategy, "strategy", ("auto", "linearize", "recompute"), owner=owner)
        check_choice(self.mode, "mode", ("auto", "fwd", "rev"), owner=owner)
        for name in ("holomorphic", "has_aux", "jit", "checkpoint", "progress"):
            check_bool(getattr(self, name), name, owner=owner)
        check_choice(self.blocks, "blocks", ("full", "leaf"), owner=owner)
        if self.blocks == "leaf":
            self._check_leaf_blocks(owner)

    def _check_leaf_blocks(self, owner: str) -> None:
        """Refuse `blocks="leaf"` where it has no meaning or no implementation."""
        if self._square is None:
            raise ValueError(
                f"{owner}: blocks='leaf' takes the diagonal blocks of a square matrix over "
                "the variables (zm.BatchedHessian, zm.BatchedGGN); a Jacobian has none. "
                "Leave blocks='full'."
            )
        for name in ("sharding", "holomorphic"):
            if getattr(self, name):
                raise ValueError(
                    f"{owner}: blocks='leaf' makes one small block per leaf, each held whole "
                    f"on one device and real, so it does not take {name}="
                    f"{getattr(self, name)!r}. Use blocks='full' with {name}."
                )

    def _operator_options(self) -> TransformOptions:
        return TransformOptions(
            has_aux=self.has_aux,
            jit=self.jit,
            strategy=self.strategy,
            nbatches=self.nbatches,
            batch_size=self.batch_size,
            max_memory=self.max_memory,
            sharding=self.sharding,
            progress=self.progress,
        )

    def _unblocked(self) -> AbstractDerivative:
        # With strategy="auto" one product evaluates `fn` in place: a linearisation kept
        # pays only where blocks share it, and JAX's partial evaluation of a loop in `fn`
        # (a scan, an ODE solver's while) keeps the whole loop on the linear side, which
        # then costs more than the product evaluated afresh.
        strategy = "recompute" if self.strategy == "auto" else self.strategy
        one_block = self.with_block_size(None, strategy)
        return dataclasses.replace(one_block, progress=False, sharding=None)

    def _with_strategy(self, strategy: Any) -> AbstractDerivative:
        return dataclasses.replace(self, strategy=strategy)

    def _refuse_leaf_blocks(self) -> None:
        """Refuse to plan or stream one call where `blocks="leaf"` makes one per leaf."""
        if self.blocks == "leaf":
            raise ValueError(
                f"{self._owner}: with blocks='leaf' every leaf's block is planned "
                "and made by a call of its own, so there is no one call to plan or to "
                "stream: call the transform (or its .operator) for the blocks, or use "
                "blocks='full' with plan(), zm.to_host and zm.to_file."
            )

    def split(self, *args: Any, **kwargs: Any) -> Split | None:
        # Read first by every run of one call: none with blocks per leaf, whose call
        # makes one per leaf.
        self._refuse_leaf_blocks()
        return super().split(*args, **kwargs)

    def _leaf_operator(
        self, args: tuple, kwargs: dict, *, positive_semidefinite: bool = False
    ) -> BlockDiagonal:
        """The operator of the blocks per leaf (`blocks="leaf"`), declared positive
        semi-definite where the transform's matrix is."""
        blocks = leaf_blocks(self, args, kwargs)
        blocks = blocks[0] if self.has_aux else blocks
        structure = variable_structure(args[0])
        return BlockDiagonal(
            blocks, positive_semidefinite=positive_semidefinite, structure=structure
        )

    @abc.abstractmethod
    def _prepare(self, x: Any, args: tuple, kwargs: dict, split: Split | None) -> Prepared:
        """The call `fn(x, *args, **kwargs)` made ready for its blocks, its inputs and
        outputs checked, with the mode of its products: the one that makes the axis
        `split` spreads over devices, where it spreads one (`None`: not spread)."""

    @property
    def strategies(self) -> tuple[str, ...]:
        # Keeping one linearisation is faster; recomputing is the way out when its
        # residuals leave no room for a block.
        if self.strategy != "auto":
            return (self.strategy,)
        return ("linearize", "recompute") if self.max_memory is not None else ("linearize",)

    def with_block_size(self, size: int | None, strategy: str | None) -> AbstractDerivative:
        return dataclasses.replace(
            self, nbatches=None, batch_size=size, max_memory=None, strategy=strategy
        )

    def work(self, x: PyTree, *args: Any, **kwargs: Any) -> Work:
        split = self.split(x, *args, **kwargs)

        def count(x, args, kwargs):
            prepared = self._prepare(x, args, kwargs, split)
            return prepared.n, prepared.m, prepared.mode  # not arrays: returned as they are

        n, m, mode = eqx.filter_eval_shape(count, x, args, kwargs)
        # One product per variable, but for a Jacobian's rows: one per output element.
        if self._square is None and mode == "rev":
            total, what = m, "output elements"
        else:
            total, what = n, "variables"
        plan = plan_blocks(total, nbatches=self.nbatches, batch_size=self.batch_size)
        return Work(total, what, self._result, plan.block_size).per_device(split)

    def result_specs(self, spec: PartitionSpec) -> Any:
        if self._square is not None and len(spec) > 2:
            raise ValueError(
                f"{self._owner}: `sharding` has the spec {spec}, for {len(spec)} axes, "
                f"but the {self._square} has 2: split its rows, PartitionSpec('d', None), or "
                "its columns, PartitionSpec(None, 'd')."
            )
        return (spec, PartitionSpec()) if self.has_aux else spec

    def _split_mode(self, mode: str) -> str:
        """`mode`, the one that makes the axis `sharding` splits (rows by VJPs: `"rev"`,
        columns by JVPs: `"fwd"`), unless the transform was given the other."""
        if self.mode not in ("auto", mode):
            made = "rows" if self.mode == "rev" else "columns"
            split = "rows" if mode == "rev" else "columns"
            raise ValueError(
                f"{self._owner}: mode={self.mode!r} makes the {self._result} in "
                f"blocks of {made}, but `sharding` ({self.sharding.spec}) splits its {split} "
                f"over the devices, and each device makes whole {split} of its share. Use "
                f"mode={mode!r} or 'auto' with this sharding."
            )
        return mode

    def _products(self, fn: Callable[[Any], Any], primal: Any, *, reverse: bool) -> tuple:
        """`(out, product, aux)` of `product_function` with this transform's `has_aux`
        and strategy (`"auto"` keeps one linearisation)."""
        return product_function(
            fn,
            primal,
            reverse=reverse,
            has_aux=self.has_aux,
            recompute=self.strategy == "recompute",
        )

    def _variables(self, x: Any) -> tuple[jax.Array, Variables]:
        """`(flat, variables)`: the variables of `x` raveled, and how; refused where their
        dtypes do not go with `holomorphic`, as `jax.jacfwd`/`jax.jacrev`/`jax.hessian`
        refuse them."""
        owner = self._owner
        flat, variables = split_variables(x, owner=owner)
        for name, dtype in zip(variables.names, variables.dtypes, strict=True):
            is_complex = jnp.issubdtype(dtype, jnp.complexfloating)
            if self.holomorphic and not is_complex:
                raise TypeError(
                    f"{owner}: with holomorphic=True every variable must be complex, as in "
                    f"jax.jacfwd(holomorphic=True), but x{name} has dtype {dtype}. Cast it "
                    "to a complex dtype, or leave holomorphic=False."
                )
            if not self.holomorphic and is_complex:
                raise TypeError(
                    f"{owner}: x{name} has the complex dtype {dtype}. As in jax.jacfwd and "
                    "jax.jacrev, complex variables are differentiated only with "
                    "holomorphic=True (for holomorphic functions); for a function that is "
                    "not holomorphic, split the variables into real and imaginary parts."
                )
        return flat, variables

    def _function(
        self, flat: jax.Array, variables: Variables, args: tuple, kwargs: dict, what: str
    ) -> tuple[Callable[[list], Any], Any, Callable[[Any], Any] | None]:
        """`(fn_of_leaves, outputs, restore_aux)`: `fn` as a function of the variables'
        leaves (as `Prepared.fn`), the shapes of its outputs, and how `aux` is put back.

        An output that is a constant Python number becomes a scalar array, as `jax.jacfwd`
        takes it; other leaves that are not arrays are left for the checks to refuse.
        With `has_aux`, `fn` must return a pair `(what, aux)`."""
        call = called_as(self.fn, traced_once=self.jit)

        def arrays(outputs):
            return jax.tree_util.tree_map(
                lambda leaf: jnp.asarray(leaf) if eqx.is_array_like(leaf) else leaf, outputs
            )

        def fn_of_leaves(leaves):
            result = call(variables.fill(leaves), *args, **kwargs)
            if not self.has_aux:
                return arrays(result)
            if isinstance(result, tuple) and len(result) == 2:
                return arrays(result[0]), result[1]
            return result  # not a pair: refused below, with what it returned

        restore_aux = None
        if self.has_aux:
            fn_of_leaves, restore_aux = split_aux(fn_of_leaves)
        outputs = eqx.filter_eval_shape(fn_of_leaves, variables.leaves_of(flat))
        if self.has_aux:
            if not (isinstance(outputs, tuple) and len(outputs) == 2):
                raise TypeError(
                    f"{self._owner}: with has_aux=True, `fn` must return a pair "
                    f"({what}, aux), but it returned {outputs}."
                )
            outputs = outputs[0]
        if self.checkpoint:
            fn_of_leaves = jax.checkpoint(fn_of_leaves)
        return fn_of_leaves, outputs, restore_aux

    def _output_leaves(self, outputs: Any) -> list[tuple[str, jax.ShapeDtypeStruct]]:
        """`(where, leaf)` for each leaf of the outputs' shapes, `where` naming it (as
        `output['a']`); a leaf that is not an array is refused."""
        leaves = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
            where = f"output{jax.tree_util.keystr(path)}"
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                raise TypeError(
                    f"{self._owner}: `fn` must return arrays, but its {where} is "
                    f"{leaf!r}. Return it in `aux` (has_aux=True) or close over it."
                )
            leaves.append((where, leaf))
        return leaves


def split_aux(fn: Callable[[Any], tuple[Any, Any]]) -> tuple[Callable, Callable]:
    """`fn` returning `(out, aux)`, as a function whose `aux` holds only arrays (the
    other leaves ride in its structure, as `Kept`), and the function that puts them back.

    JAX's transforms and loops carry arrays only; a string, an int or `None` in `aux`
    is returned unchanged, as `jax.jacrev` does.
    """

    def arrays_only(z):
        result = fn(z)
        if not (isinstance(result, tuple) and len(result) == 2):
            return result  # not a pair: refused by the caller, with what it returned
        out, aux = result
        arrays, others = eqx.partition(aux, eqx.is_array)
        return out, (arrays, Kept(others))

    def restore(aux: Any) -> Any:
        arrays, others = aux
        return eqx.combine(arrays, others.value)

    return arrays_only, restore


def product_function(
    fn: Callable[[Any], Any], primal: Any, *, reverse: bool, has_aux: bool, recompute: bool
) -> tuple[Any, Callable[[Any], Any], Any]:
    """`(out, product, aux)`: `product(v)` is the JVP of `fn` at `primal` with the tangent
    `v` (or, with `reverse`, its VJP with the cotangent `v`).

    By default `fn` is linearised once (`jax.linearize`, `jax.vjp`) and its residuals
    are kept for every product. With `recompute`, each product evaluates `fn` again
    (`jax.jvp`, `jax.vjp` inside the product): nothing of `fn`'s forward pass outlives a
    block, at the cost of one more forward pass per block; `out` is then the outputs'
    shapes (`jax.ShapeDtypeStruct`s).
    """
    if not recompute:
        if reverse:
            if has_aux:
                out, vjp, aux = jax.vjp(fn, primal, has_aux=True)
            else:
                (out, vjp), aux = jax.vjp(fn, primal), None
            return out, lambda cotangent: vjp(cotangent)[0], aux
        if has_aux:
            out, jvp, aux = jax.linearize(fn, primal, has_aux=True)
        else:
            (out, jvp), aux = jax.linearize(fn, primal), None
        return out, jvp, aux

    def value(z):
        return fn(z)[0] if has_aux else fn(z)

    out = jax.eval_shape(value, primal)
    aux = fn(primal)[1] if has_aux else None
    if reverse:
        return out, lambda cotangent: jax.vjp(value, primal)[1](cotangent)[0], aux
    return out, lambda tangent: jax.jvp(value, (primal,), (tangent,))[1], aux
