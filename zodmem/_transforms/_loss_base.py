"""The base of the losses whose Hessian on the outputs `zm.BatchedGGN` applies
(`AbstractLoss`), and what the built-in losses share: their reductions, the square root
of a diagonal Hessian, and the checks of their outputs and targets."""

from __future__ import annotations

import abc
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray, PyTree

from .._checks import NamedInMessages, check_choice, described
from .._operators._arguments import is_traced

__all__ = ["AbstractLoss"]


class AbstractLoss(NamedInMessages):
    """A loss of a model's outputs with the product of its Hessian (or Fisher
    information) on the outputs in closed form.

    `zm.BatchedGGN` calls `loss(outputs, *args, **kwargs)` for the value and, when the
    loss is an `AbstractLoss`, `loss.hessian_product(outputs, tangents, *args,
    **kwargs)` instead of differentiating the loss twice. Subclass it for a loss of your
    own whose curvature has a cheap closed form.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        class Quartic(zm.losses.AbstractLoss):
            def __call__(self, outputs, *args, **kwargs):
                return jnp.sum(outputs**4) / 12

            def hessian_product(self, outputs, tangents, *args, **kwargs):
                return outputs**2 * tangents

        ggn = zm.BatchedGGN(lambda w: 2 * w, Quartic())
        G = ggn(jnp.arange(3.0))  # 4 * diag(4 w**2)
        ```
    """

    @abc.abstractmethod
    def __call__(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        """The loss, a real scalar, of `outputs` and the call's data arguments."""

    @abc.abstractmethod
    def hessian_product(self, outputs: PyTree, tangents: PyTree, *args: Any, **kwargs: Any) -> Any:
        """The Hessian (or Fisher information) of the loss on the outputs, at `outputs`,
        applied to `tangents` (shaped like `outputs`); returned shaped and typed like
        `tangents`."""

    def hessian_sqrt(self, outputs: PyTree, *args: Any, **kwargs: Any) -> Any:
        """Columns `s_1, ..., s_K` of a square root of the loss's Hessian on the outputs,
        for each loss term at once: a pytree like `outputs` whose leaves have a leading
        axis of `K`, with `sum_k s_k s_k^T` the Hessian on each term's outputs.
        `zm.KFAC(..., fisher="type-2")` back-propagates them.

        The terms are the indices of every axis of the outputs but the last, and the
        Hessian is taken to couple no two of them. This default (for one output array)
        takes each term's block from `K` products `hessian_product` with one-hot tangents
        along the last axis, and its symmetric square root; the built-in losses have
        closed forms (for `SquaredError`, `GaussianNLL` and `PoissonNLL`, whose Hessians
        are diagonal, outputs of one axis are that many terms of one entry).

        !!! example

            ```python
            import jax, jax.numpy as jnp
            import zodmem as zm

            loss = zm.losses.SoftmaxCrossEntropy()
            logits, labels = jnp.array([[1.0, 0.0, -1.0]]), jnp.array([0])
            S = loss.hessian_sqrt(logits, labels)  # (3, 1, 3): 3 columns
            H = jax.vmap(lambda u: loss.hessian_product(logits, u, labels))(jnp.eye(3)[:, None])
            assert jnp.allclose(jnp.einsum("kni,knj->ij", S, S), H[:, 0], atol=1e-6)
            ```
        """
        outputs = one_array(outputs, self._owner, "for the default `hessian_sqrt`")
        if outputs.ndim == 0:
            value = self.hessian_product(outputs, jnp.ones_like(outputs), *args, **kwargs)
            return jnp.sqrt(jnp.maximum(value, 0))[None]

        def column(unit: Any) -> Any:
            tangents = jnp.broadcast_to(unit, outputs.shape)
            return self.hessian_product(outputs, tangents, *args, **kwargs)

        # One product gives a column of every term's block, the terms being uncoupled.
        units = jnp.eye(outputs.shape[-1], dtype=outputs.dtype)
        blocks = jnp.moveaxis(jax.vmap(column)(units), 0, -1)
        values, vectors = jnp.linalg.eigh((blocks + jnp.swapaxes(blocks, -1, -2)) / 2)
        root = vectors * jnp.sqrt(jnp.maximum(values, 0))[..., None, :]
        return jnp.moveaxis(root, -1, 0)

    def sample(self, outputs: PyTree, key: PRNGKeyArray) -> Any:
        """Targets drawn from the likelihood whose negative logarithm the loss is, at
        `outputs`, shaped as the loss takes its targets: for `zm.KFAC(...,
        fisher="mc")`. The built-in losses define one; this default refuses.
        """
        raise TypeError(
            f"{self._owner} defines no distribution to draw targets from: give it "
            "a `sample(outputs, key)` method, or use fisher='type-2' or 'empirical'."
        )


REDUCTIONS = ("sum", "mean")


def reduced(value: Any, outputs: Any, reduction: str, owner: str, *, classes: bool = False) -> Any:
    """`value` (the loss, or a product with its Hessian) as `reduction` says: as it is for
    `"sum"`; for `"mean"`, divided by the number of examples, the length of the outputs'
    leading axis (which, with `classes`, must come before the classes' axis)."""
    if reduction == "sum":
        return value
    shape = jnp.shape(outputs)
    if len(shape) < (2 if classes else 1):
        held = f"of shape {shape}, one example's classes" if classes else "a scalar"
        raise TypeError(
            f"{owner}: reduction='mean' divides by the number of examples, the length of "
            f"the outputs' leading axis, but the outputs are {held}, with no examples "
            "axis. Give them one, or use reduction='sum'."
        )
    if shape[0] == 0:
        raise TypeError(
            f"{owner}: reduction='mean' divides by the number of examples, but the outputs, "
            f"of shape {shape}, have none: the mean over no examples is undefined."
        )
    return jax.tree_util.tree_map(lambda leaf: leaf / shape[0], value)


def diagonal_sqrt(diagonal: Any) -> Any:
    """`hessian_sqrt`'s columns for a diagonal Hessian, `diagonal` a pytree like the
    outputs: one column per entry of each leaf's last axis (a leaf of one axis holds that
    many terms of one entry: one column), zero on the other leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(diagonal)
    parts = []
    for leaf in leaves:
        root = jnp.sqrt(jnp.maximum(leaf, 0))
        if root.ndim <= 1:
            parts.append(root[None])
        else:
            size = root.shape[-1]
            units = jnp.eye(size, dtype=root.dtype).reshape(
                (size,) + (1,) * (root.ndim - 1) + (size,)
            )
            parts.append(units * root)
    total, columns, start = sum(len(part) for part in parts), [], 0
    for part in parts:
        # Padded, not concatenated with fresh zeros: the part keeps its layout (a batch
        # sharded over Explicit axes), which zeros of their own would not share.
        widths = [(start, total - start - len(part))] + [(0, 0)] * (part.ndim - 1)
        columns.append(jnp.pad(part, widths))
        start += len(part)
    return jax.tree_util.tree_unflatten(treedef, columns)


def check_loss_options(loss: AbstractLoss, *, optional_targets: bool = False) -> None:
    """Refuse a built-in loss's `targets` (`None` only where `optional_targets`) and
    `reduction` that it cannot read, in words that name the loss."""
    owner, targets = loss._owner, loss.targets
    if targets is None and not optional_targets:
        raise TypeError(f"{owner}: `targets` must be an int or a str, got None.")
    if not (targets is None or isinstance(targets, str)) and (
        isinstance(targets, bool) or not isinstance(targets, int)
    ):
        raise TypeError(
            f"{owner}: `targets` must be an int (the position of the targets among the "
            "call's data arguments, -1 for the last), a str (the name of a keyword "
            f"argument) or None, got {described(targets)}."
        )
    check_choice(loss.reduction, "reduction", REDUCTIONS, owner=owner)


def targets_of(targets: Any, args: tuple, kwargs: dict, owner: str) -> Any:
    """The data argument that `targets` names (`None`: none)."""
    if targets is None:
        return None
    if isinstance(targets, str):
        if targets not in kwargs:
            raise TypeError(
                f"{owner}: targets={targets!r} names a keyword argument, but the call has "
                f"the keyword arguments {sorted(kwargs)}."
            )
        return kwargs[targets]
    if not -len(args) <= targets < len(args):
        raise TypeError(
            f"{owner}: targets={targets} is the position of the targets among the call's "
            f"data arguments (those after `x`), but the call has {len(args)} of them. Pass "
            "the targets, or say where they are with `targets=`."
        )
    return args[targets]


def one_array(outputs: Any, owner: str, what: str) -> jax.Array:
    if not (eqx.is_array(outputs) or isinstance(outputs, jax.ShapeDtypeStruct)):
        raise TypeError(
            f"{owner}: the outputs of `fn` must be one array ({what}), but they are "
            f"{output_shapes(outputs)}."
        )
    return outputs


def check_shapes(outputs: Any, targets: Any, owner: str, what: str) -> None:
    if jnp.shape(targets) != jnp.shape(outputs):
        raise TypeError(
            f"{owner}: the targets have shape {jnp.shape(targets)} and the {what} (the "
            f"outputs of `fn`) shape {jnp.shape(outputs)}; they must be the same."
        )


def output_shapes(tree: Any) -> Any:
    """`tree` with its arrays as shapes and dtypes, for messages."""
    return jax.tree_util.tree_map(
        lambda leaf: (
            jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))
            if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
            else leaf
        ),
        tree,
    )


def checked_labels(labels: Any, logits: Any, targets: Any, product: Any) -> Any:
    """`product`, refused where class indices as labels fall outside `[0, C)` (the loss
    would be NaN, and an empirical Fisher would count the example as a zero gradient)
    or where probabilities as labels do not sum to one per example (the Hessian of the
    loss is `diag(p) - p p^T` times each example's sum of labels, and the closed form
    takes that sum to be one). Eagerly a ValueError; traced, the same through
    `eqx.error_if` when the compiled call runs."""
    if jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        return _in_range(labels, logits, targets, product)
    check_shapes(logits, labels, "SoftmaxCrossEntropy", "logits")
    dtype = jnp.result_type(labels)
    eps = float(jnp.finfo(dtype).eps)
    classes = jnp.shape(labels)[-1]
    # Rounding each label, and the sum itself, may move a sum by about classes * eps.
    tolerance = max(math.sqrt(eps), 2 * classes * eps)
    head = (
        f"SoftmaxCrossEntropy: the labels (targets={targets!r} among the call's data "
        "arguments) are probabilities, so each example's must sum to 1 over the classes "
        f"(the last axis), within {tolerance:.1e} in {jnp.dtype(dtype).name}"
    )
    tail = (
        ". The closed-form Fisher information assumes it: normalise them "
        "(labels / labels.sum(-1, keepdims=True)), or pass the loss as a plain function "
        "to have its Hessian taken as it is."
    )
    if is_traced(labels):
        wide = jnp.promote_types(dtype, jnp.float32)
        off = jnp.abs(jnp.sum(labels, axis=-1, dtype=wide) - 1)
        wrong = jnp.max(off, initial=0) > tolerance
        return eqx.error_if(product, wrong, f"{head}, but one does not{tail}")
    sums = np.sum(np.asarray(labels, dtype=np.float64), axis=-1).ravel()
    if sums.size:
        worst = sums[np.argmax(np.abs(sums - 1))]
        if abs(worst - 1) > tolerance:
            raise ValueError(f"{head}, but one sums to {worst:.7g}{tail}")
    return product


def _in_range(labels: Any, logits: Any, targets: Any, product: Any) -> Any:
    """`product`, refused where class indices fall outside `[0, C)`."""
    classes = logits.shape[-1]
    head = (
        f"SoftmaxCrossEntropy: the labels (targets={targets!r} among the call's data "
        f"arguments) are class indices, so each must lie in [0, {classes}) for logits of "
        f"{classes} classes (the last axis)"
    )
    tail = ". Give each example's class as an index from 0 to the number of classes less 1."
    if is_traced(labels):
        wrong = jnp.any((labels < 0) | (labels >= classes))
        return eqx.error_if(product, wrong, f"{head}, but one is not{tail}")
    labels = np.asarray(labels)
    outside = labels[(labels < 0) | (labels >= classes)]
    if outside.size:
        raise ValueError(f"{head}, but one is {int(outside[0])}{tail}")
    return product
