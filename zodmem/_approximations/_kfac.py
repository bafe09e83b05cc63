"""Kronecker-factored curvature of any Equinox model: `KFAC` and `EKFAC`.

The layers are found in the traced program (`_kfac_trace`): for a layer with inputs
`a` (a row per example, and per position where the weight is shared) and gradients `g`
of the loss with respect to its outputs, its block of the Gauss-Newton matrix is
approximated by `B ⊗ A` with

    A = sum(a a^T) / R,    B = sum(g g^T),

`R` the number of rows, in the weight's layout `(out, in)` (a bias a last column of
the weight, its input a one); a weight used several times (tied, or in a `lax.scan`)
has the rows of every use, or with `kfac_approx="reduce"` per example the inputs'
mean and the gradients' sum over them (Eschenhagen et al., 2023). The gradients are
those of the columns of a square root of the loss's Hessian (`fisher="type-2"`), of the
loss at targets drawn from the model (`"mc"`) or at the true targets (`"empirical"`).
These are curvlinops' factors
(`KFACLinearOperator`, `kfac_approx="expand"`, `separate_weight_and_bias=False`).
EKFAC keeps the factors' eigenvectors and replaces the eigenvalues by the second moments
of the per-example gradients in that basis (George et al., 2018).

The data are reduced in microbatches by `zm.Microbatcher`; a loss with `reduction="mean"`
has its gradients' moments averaged over the microbatches, weighted by their sizes, so
that the result is the one of the whole batch at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray, PyTree

from .._checks import (
    Integer,
    Memory,
    NamedInMessages,
    as_index,
    check_choice,
    check_int,
    check_key,
    described,
    typechecked,
)
from .._operators._kronecker import KroneckerFactored
from .._plan._lean import lean_jit
from .._plan._plans import Plan
from .._pytree import Variables, split_variables, variable_structure
from .._traceback import public
from .._transforms._base import AbstractTransform
from .._transforms._losses import AbstractLoss
from .._transforms._microbatch import Microbatcher
from . import _kfac_trace as trace
from ._kfac_blocks import check_others, layer_blocks
from ._kfac_examples import (
    batch_size,
    check_examples,
    check_not_empty,
    example_axes,
    leading_array,
)
from ._kfac_pass import StatisticsPass
from ._kfac_statistics import Settings, Statistics, examples_split, traced, variable_leaves

__all__ = ["EKFAC", "KFAC"]

_FISHERS = ("type-2", "mc", "empirical")
_APPROXIMATIONS = ("expand", "reduce")


class _KroneckerCurvature(AbstractTransform, NamedInMessages):
    """What `KFAC` and `EKFAC` share: their options, checks, plan and call. They are
    transforms like the others: `zm.save`/`zm.load` write and read them, `plan()` says
    how their passes over the data will be cut into microbatches, `progress` draws a bar
    over those microbatches."""

    # The constructor checks its annotations itself (`typechecked`), in its own words
    # where they say more: jaxtyping's check of a dataclass's constructor, which its
    # import hook would add, is left out, as it would check them again, first.
    __no_type_check__: ClassVar[bool] = True

    fn: Callable[..., Any]
    loss: Any
    fisher: str = eqx.field(default="type-2", static=True, kw_only=True)
    mc_samples: int = eqx.field(default=1, static=True, kw_only=True)
    key: Any = eqx.field(default=None, kw_only=True)
    microbatch_size: int | None = eqx.field(default=None, static=True, kw_only=True)
    max_memory: int | str | None = eqx.field(default=None, static=True, kw_only=True)
    progress: bool = eqx.field(default=False, static=True, kw_only=True)
    kfac_approx: str = eqx.field(default="expand", static=True, kw_only=True)

    _corrected: ClassVar[bool]

    @public
    @typechecked
    def __init__(
        self,
        fn: Callable[..., Any],
        loss: AbstractLoss,
        *,
        fisher: Literal["type-2", "mc", "empirical"] = "type-2",
        mc_samples: Integer = 1,
        key: PRNGKeyArray | None = None,
        microbatch_size: Integer | None = None,
        max_memory: Memory = None,
        progress: bool = False,
        kfac_approx: Literal["expand", "reduce"] = "expand",
    ):
        self.fn = fn
        self.loss = loss
        self.fisher = fisher
        # Stored, hashed and saved as Python ints, NumPy ones read with operator.index.
        self.mc_samples = as_index(mc_samples)
        self.key = key
        self.microbatch_size = as_index(microbatch_size)
        self.max_memory = as_index(max_memory)
        self.progress = progress
        self.kfac_approx = kfac_approx

    def __check_init__(self):
        # The checks of values, and of the types whose refusal says more in words than
        # the annotations do.
        owner = self._owner
        if not isinstance(self.loss, AbstractLoss):
            raise TypeError(
                f"{owner}: `loss` must be a zm.losses.AbstractLoss (such as "
                f"zm.losses.SquaredError() or SoftmaxCrossEntropy()), whose Hessian's square "
                f"root and likelihood the factors use; got {described(self.loss)}."
            )
        check_choice(self.fisher, "fisher", _FISHERS, owner=owner)
        check_choice(self.kfac_approx, "kfac_approx", _APPROXIMATIONS, owner=owner)
        check_int(self.mc_samples, "mc_samples", owner=owner, minimum=1)
        if self.fisher != "mc" and self.mc_samples != 1:
            raise ValueError(
                f"{owner}: `mc_samples` counts the targets drawn per example for "
                f"fisher='mc'; with fisher={self.fisher!r} it must be 1, got "
                f"mc_samples={self.mc_samples}."
            )
        if self.fisher == "mc":
            if self.key is None:
                raise ValueError(
                    f"{owner}: fisher='mc' draws targets from the model's likelihood and "
                    "needs a `key`, e.g. key=jax.random.key(0); got key=None."
                )
            check_key(self.key, owner=owner)
        check_int(self.microbatch_size, "microbatch_size", owner=owner, minimum=1, optional=True)
        if self.microbatch_size is not None and self.max_memory is not None:
            raise ValueError(
                f"{owner}: give at most one of `microbatch_size` and `max_memory`, got "
                f"microbatch_size={self.microbatch_size} and max_memory={self.max_memory!r}."
            )
        if self.max_memory is not None:  # refused as zm.Microbatcher refuses it
            try:
                Microbatcher(self.fn, max_memory=self.max_memory)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{owner}: {str(error).split(': ', 1)[-1]}") from None

    @public
    @typechecked
    def __call__(self, x: PyTree, *args: Any, **kwargs: Any) -> KroneckerFactored:
        # One compiled program, compiled lean: the statistics are many small operations.
        # The variables' layout over devices is read here, where their shardings are known.
        structure = variable_structure(x, shardings=True)
        split = examples_split(args)  # the data's layout, read while they are concrete
        return lean_jit(type(self)._factored)(self, x, args, kwargs, structure, split)

    @public
    @typechecked
    def plan(self, x: PyTree, *args: Any, **kwargs: Any) -> Plan:
        """How the pass over the data that gathers the factors will be cut into
        microbatches, and the memory each takes, without running it: the `zm.Plan` of
        `zm.Microbatcher` over the data arguments, planned from `max_memory` (the
        microbatches the call will use) or cut by `microbatch_size`; with neither, one
        block of the whole batch. EKFAC's second pass, over the same data in the
        factors' eigenbases, is planned the same way when it runs.

        !!! example

            ```python
            import jax, jax.numpy as jnp, equinox as eqx
            import zodmem as zm

            model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
            inputs, labels = jnp.ones((64, 4)), jnp.arange(64) % 3
            predict = lambda m, inputs, labels: jax.vmap(m)(inputs)
            kfac = zm.KFAC(predict, zm.losses.SoftmaxCrossEntropy(), microbatch_size=16)
            assert kfac.plan(model, inputs, labels).num_blocks == 4
            ```
        """
        first = self._first_pass(x, args, kwargs, examples_split(args))
        batched = self._batched(first.statistics, first.accumulator, first.keys, args)
        plan = batched.plan(first.leaves, first.keys, *args)
        return dataclasses.replace(plan, owner=self._owner)

    def _first_pass(self, x: Any, args: tuple, kwargs: dict, split: Any) -> _Pass:
        """What the pass that gathers the factors needs: the layers found in the
        traced program, the statistics to reduce over the data (kept split over devices
        as `split` says the data are), and their inputs."""
        owner = self._owner
        check_not_empty(args, owner)
        _, variables = split_variables(x, owner=owner)
        leaves = variable_leaves(x, variables)
        program = traced(self.fn, variables, kwargs)
        jaxpr = jax.make_jaxpr(program)(leaves, args).jaxpr
        found = trace.find_layers(jaxpr, len(leaves))
        check_others(found, variables, owner)
        examples = (None,) * len(found.layers)
        if self._corrected:
            examples = example_axes(program, leaves, args, found, jaxpr, variables, owner)
        reduced = ()
        if self.kfac_approx == "reduce":
            reduced = example_axes(
                program, leaves, args, found, jaxpr, variables, owner, terms=True
            )
        mean = getattr(self.loss, "reduction", "sum") == "mean"
        options = (self.fisher, self.mc_samples, mean, found, examples, self.kfac_approx)
        settings = Settings(*options, reduced, owner=owner)
        keys = None
        if self.fisher == "mc":
            keys = jax.random.split(self.key, batch_size(args, owner))
        statistics = Statistics(self.fn, self.loss, variables, settings, kwargs, split=split)
        each = "mean" if mean else "sum"
        accumulator = {"inputs": "sum", "rows": "sum", "gradients": each, "dense": each}
        return _Pass(variables, found, statistics, accumulator, each, leaves, keys)

    def _factored(
        self, x: Any, args: tuple, kwargs: dict, structure: Any, split: Any
    ) -> KroneckerFactored:
        first = self._first_pass(x, args, kwargs, split)
        sums = self._reduce(first.statistics, first.accumulator, first.leaves, first.keys, args)
        blocks, factors = layer_blocks(first.found, first.variables, sums)
        operator = KroneckerFactored(
            blocks,
            [a for a, _ in factors],
            [b for _, b in factors],
            shapes=first.variables.shapes,
            dtype=first.variables.dtype,
            structure=structure,
        )
        if not self._corrected or not first.found.layers:
            return operator
        return self._correct(operator, first.statistics, first.each, first.leaves, first.keys, args)

    def _correct(self, operator, statistics, each, leaves, keys, args) -> KroneckerFactored:
        """EKFAC: the per-example gradients' moments in the factors' eigenbases."""
        program = statistics.settings.program
        weights = [program.layers[group[0]].weight for group in program.groups]
        position = {block.leaves[0]: k for k, block in enumerate(operator.blocks)}
        layer_blocks = [position[weight] for weight in weights]
        bases = [(operator.input_bases[k], operator.gradient_bases[k]) for k in layer_blocks]
        statistics = eqx.tree_at(lambda s: s.bases, statistics, bases, is_leaf=lambda v: v is None)
        corrections = self._reduce(statistics, {"eigenvalues": each}, leaves, keys, args)
        eigenvalues = list(operator.eigenvalues)
        for k, values in zip(layer_blocks, corrections["eigenvalues"], strict=True):
            eigenvalues[k] = values
        return operator.with_eigenvalues(eigenvalues)

    def _reduce(self, statistics, accumulator, leaves, keys, args) -> dict:
        """`statistics` over the whole batch, in microbatches where asked."""
        if self.microbatch_size is None and self.max_memory is None:
            return statistics(leaves, keys, *args)
        batched = self._batched(statistics, accumulator, keys, args)
        return batched(leaves, keys, *args)

    def _batched(self, statistics, accumulator, keys, args) -> Microbatcher:
        """`statistics` as a `zm.Microbatcher` over the data arguments: in microbatches
        of `microbatch_size` or planned from `max_memory`; with neither, one microbatch
        of the whole batch (the arguments of another length passed whole, as the call
        passes them)."""
        if self.microbatch_size is None and self.max_memory is None:
            leading = [leading_array(arg) for arg in args]
            lengths = [None if a is None else a.shape[0] for a in leading]
            size = next((n for n in lengths if n is not None), 1)
            data = tuple(2 + i for i, n in enumerate(lengths) if n == size)
            size = max(size, 1)
        elif not args:
            raise ValueError(
                f"{self._owner}: `microbatch_size` and `max_memory` cut the data arguments "
                "(those after `x`) into microbatches, but the call has none."
            )
        else:
            check_examples(args, self._owner)
            size, data = self.microbatch_size, tuple(range(2, 2 + len(args)))
        argnums = data + ((1,) if keys is not None else ())
        return StatisticsPass(
            statistics,
            microbatch_size=size,
            max_memory=self.max_memory,
            argnums=argnums,
            accumulator=accumulator,
            progress=self.progress,
        )


class _Pass(NamedTuple):
    """The first pass over the data, ready to run or to plan."""

    variables: Variables
    found: trace.Program
    statistics: Statistics
    accumulator: dict
    each: str
    leaves: list
    keys: Any


class KFAC(_KroneckerCurvature):
    """Kronecker-factored approximate curvature (KFAC) of any Equinox model: the
    Gauss-Newton (Fisher) matrix of `loss(fn(x, *args), *args)` with respect to the
    inexact leaves of `x`, approximated block by block over the layers found in `fn`'s
    traced program, as a `zm.KroneckerFactored` operator.

    Use it where the exact matrix (`zm.BatchedGGN`) is too large to form or to invert:
    it costs one pass over the data (a forward pass and one backward pass a column of
    the loss's Hessian's square root), holds per layer two factors of the sizes of the
    layer's inputs and outputs, and its damped solves and log-determinant are exact
    for the approximation, for natural-gradient steps and Laplace posteriors.

    **The layers** are found in the program: a weight leaf used as an operand of a
    `dot_general` (`eqx.nn.Linear`, `w @ a` or `a @ w`, PyTorch's layout `a @ w.T`
    through a transpose, attention's projections, under `vmap`, `jit` or `checkpoint`)
    or as the kernel of a `conv_general_dilated` (`eqx.nn.Conv2d`, ungrouped), the
    other operand being the layer's input. A bias leaf added to that output joins the
    layer as a last column of the weight, its input a one. For each layer, with `a`
    its input in rows (one per example and per position where the weight is shared: a
    sequence's tokens, a convolution's patches) and `g` the gradients with respect to
    its output in the same rows,

        A = sum(a a^T) / R,    B = sum(g g^T),    block ≈ B ⊗ A

    in the weight's layout `(out, in)`, `R` the number of rows: curvlinops'
    `KFACLinearOperator` with `kfac_approx="expand"` and
    `separate_weight_and_bias=False`. A layer's block is exact where the gradients
    `g` do not depend on the example: everything after the layer is linear (an affine
    model, or each layer of a network without nonlinearities) and every example's loss
    has the same Hessian, as `zm.losses.SquaredError` has with the same `weights` (or
    `covariance`) for every example: a precision per output, or per-example rows that
    are all equal. Weights that differ between examples break it: the exact block is
    then `sum_n H_n ⊗ a_n a_n^T`, not `(sum_n H_n) ⊗ (sum_n a_n a_n^T) / N`. The blocks
    between layers are left out, so only a model of one layer is exact as a whole.

    A row lookup of a matrix weight (`eqx.nn.Embedding`, `w[tokens]`) is a layer too,
    its input the one-hot rows of the indices (its input factor, diagonal, is held
    dense: `vocabulary²` numbers). So is a table whose rows are added by position to
    an activation (a learned positional embedding, `h + pos.weight[:T]`, all its rows
    or a static slice of them, broadcast over the examples): a lookup of each row's
    position, its rows every example's every position, its gradients those at the sum.

    **A weight used more than once** is one layer when every use is one of these: the
    same layer applied twice, a tied embedding (its lookup `w[tokens]` and its head
    `h @ w.T`), a weight inside `lax.scan` (a constant of the scan, `fori_loop` with
    fixed bounds too: one use a step). Its uses are the positions of the weight-sharing
    setting of Eschenhagen et al. (2023): with `kfac_approx="expand"` every use's every
    row is a row, `A` the mean of `a a^T` over all of them; with `"reduce"`, per example,
    the inputs are averaged and the gradients summed over its positions in every use
    (the steps, the tokens) before the outer products, `A = sum_n ā ā^T / N`,
    `B = sum_n ĝ ĝ^T`. Where the uses lay the weight out exchanged (the lookup reads
    `(V, D)` as `(in, out)`, the head as `(out, in)`), the weight takes the first use's
    layout; the uses laid out so give one Kronecker product, the exchanged ones another
    (their inputs' moment on the output side, their gradients' on the input side), and
    the layer's block is the Kronecker product nearest their sum in the Frobenius norm
    (Van Loan and Pitsianis, 1993), approximate even where each use alone is exact; no
    bias joins such a layer. The uses' blocks between them are summed into one factor pair
    each, so the cross terms between uses are approximated like those between
    positions. A scan is unrolled in the traced statistics pass (its body evaluated once
    a step, to keep each step's inputs and gradients): the compiled program grows with
    the number of steps, and the rows with steps times examples.

    **Every other leaf** (a normalisation's scale, a weight used through another
    operation or as a scan's carry) is a block of its own: its exact Gauss-Newton block `J^T H J`,
    whatever `fisher` says, held dense: where each example's outputs are one loss term,
    `sum g g^T` over the examples' gradients of the leaf from the columns of the loss's
    Hessian's square root (`fn` vmapped over the examples, each data array of their
    length cut: pass a shared one as EKFAC asks, below); else from one product an entry.
    Such a leaf may have at most 4096 entries: a larger one is refused with a
    `ValueError` naming it, as is one whose uses' layouts cannot be made to agree
    (neither the same `(out, in)` nor exchanged). Blocks of different layers are not
    coupled.

    **Arguments:**

    - `fn`: the model, called as `fn(x, *args, **kwargs)`; the examples are along the
      leading axis of the data arguments `args` and of the outputs, and must not
      interact (no batch normalisation). The outputs' last axis holds one loss term's
      entries (the classes, or the features), every other axis indexes the terms, as
      curvlinops takes them: put the features last (`(N, C)`, `(N, T, C)`), and give a
      single example's outputs a leading axis of one. An empty batch (a data argument
      with no examples) is refused with a `ValueError` naming it.
    - `loss`: a `zm.losses.AbstractLoss`, called as `loss(outputs, *args, **kwargs)`.
      A `reduction="mean"` loss averages over the examples (over microbatches too).
    - `fisher`: whose gradients `g` are:
        - `"type-2"` (the default): the columns of a square root of the loss's Hessian
          on each example's outputs (`loss.hessian_sqrt`), back-propagated: the
          expectation of `"mc"`, exactly (each loss term's entries signed per column:
          terms reaching the same rows leave no products between them);
        - `"mc"`: gradients of the loss at `mc_samples` targets drawn per example from
          the model's likelihood (`loss.sample`), averaged; needs `key`;
        - `"empirical"`: gradients of the loss at the true targets.

      With `torch.nn.MSELoss()` written as `SquaredError(weights=2 / C,
      reduction="mean")` (`C` the outputs' last axis), `"type-2"` equals curvlinops'
      and `"mc"` does in expectation, but `"empirical"` is `C` times smaller than
      curvlinops': it multiplies that loss by `√C` before its backward pass, so its
      `B` is `C` times this `B`. Multiply by `C` to compare
      (`F.with_eigenvalues([C * e for e in F.eigenvalues])`), or give
      `SquaredError(weights=2 / sqrt(C), reduction="mean")`, its scaled loss. With
      `reduction="sum"` (`SquaredError(weights=2.0)`) they agree.
    - `mc_samples`: draws per example for `"mc"` (1 otherwise).
    - `key`: a `jax.random` key for `"mc"`. Each microbatch draws from its own key.
    - `microbatch_size`, `max_memory`: to go over the data in microbatches of that
      many examples, or of a size planned to fit the budget (`zm.Microbatcher`'s);
      neither means the whole batch at once. Keyword data arguments are passed whole.
    - `progress`: a progress bar over the microbatches.
    - `kfac_approx`: `"expand"` (the default) or `"reduce"`, for weights shared over
      positions (a sequence's tokens in one product, the uses of a tied or scanned
      weight), as curvlinops' option of that name. `"reduce"` needs each use's rows to
      have an axis of examples, found as EKFAC finds it (below).

    **Returns:**

    Calling `KFAC(fn, loss, ...)(x, *args, **kwargs)` returns a `zm.KroneckerFactored`
    over the flat variables of `x`, raveled as `zm.BatchedGGN` ravels them.

    !!! example

        ```python
        import jax, jax.numpy as jnp, equinox as eqx
        from jax.flatten_util import ravel_pytree
        import zodmem as zm

        model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
        inputs = jax.random.normal(jax.random.key(1), (64, 4))
        labels = jnp.arange(64) % 3
        predict = lambda m, inputs, labels: jax.vmap(m)(inputs)
        loss = zm.losses.SoftmaxCrossEntropy(reduction="mean")
        F = zm.KFAC(predict, loss, microbatch_size=16)(model, inputs, labels)
        grad = eqx.filter_grad(lambda m: loss(predict(m, inputs, labels), labels))(model)
        flat = ravel_pytree(grad)[0]  # in the order of F's vectors
        step = F.solve(flat, damping=1e-3)  # a natural-gradient step
        ```

    !!! warning

        The layers are read from the program at each call; a weight whose use the
        reader does not recognise falls into the dense blocks without a warning. Look
        at `F.blocks`: each names its leaves.
    """

    _corrected: ClassVar[bool] = False


class EKFAC(_KroneckerCurvature):
    """Eigenvalue-corrected KFAC (George et al., 2018): KFAC's eigenvectors with the
    eigenvalues refitted to the data, as a `zm.KroneckerFactored` operator.

    With `Q_B`, `Q_A` the eigenvectors of a layer's factors, its eigenvalue `(i, j)` is
    the second moment of the per-example gradients in that basis,
    `sum_n (Q_B^T G_n Q_A)_ij^2`, `G_n` example `n`'s gradient of the weight (summed
    over its positions where the weight is shared), instead of KFAC's `b_i a_j`. With
    `fisher="type-2"` and each example's outputs one loss term (outputs `(N, C)`), it is
    the diagonal of the exact Gauss-Newton block in the Kronecker eigenbasis, the best
    diagonal there in the Frobenius norm: EKFAC's blocks are then never further from
    the exact blocks than KFAC's. It costs a second pass over the data.

    Where each example's outputs are one loss term (outputs `(N, C)` or `(N,)`), the
    examples' axis in a layer's rows is the one that grows by one when `fn` is traced
    again with one more example: the data arguments whose leading axis has the first
    one's length grown by one. An array of another length (positions `(T, D)` shared
    by every example beside inputs `(N, T, D)`) is passed as it is; a shared array of
    the examples' length must be a keyword argument or closed over in `fn`. Where that
    trace fails, or a layer's rows have no such axis (the examples merged with
    positions by a reshape), the call is refused with a `ValueError` that says which;
    with no data arguments, each layer's rows must be one per example. Where an example
    has several terms (outputs `(N, T, C)`: the square root's columns are shared by
    them), each row counts as an example.
    The dense blocks of leaves in no layer are KFAC's, exact. The arguments and the
    result are `zm.KFAC`'s.

    !!! example

        ```python
        import jax, jax.numpy as jnp, equinox as eqx
        import zodmem as zm

        model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
        inputs = jax.random.normal(jax.random.key(1), (64, 4))
        labels = jnp.arange(64) % 3
        predict = lambda m, inputs, labels: jax.vmap(m)(inputs)
        loss = zm.losses.SoftmaxCrossEntropy()
        exact = zm.BatchedGGN(predict, loss)(model, inputs, labels)
        kfac = zm.KFAC(predict, loss)(model, inputs, labels).as_matrix()
        ekfac = zm.EKFAC(predict, loss)(model, inputs, labels).as_matrix()
        assert jnp.linalg.norm(ekfac - exact) <= jnp.linalg.norm(kfac - exact)
        ```
    """

    _corrected: ClassVar[bool] = True
