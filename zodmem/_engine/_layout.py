"""Convolutions written in the layout a CPU runs fast, for the bodies of the block loops.

XLA's CPU backend runs a convolution fast in one layout: batch, spatial dimensions,
features (`NHWC`), with the kernel as spatial dimensions, input and output features
(`HWIO`). Outside a loop its layout pass turns every convolution into that form; inside
the body of a `while` loop it cannot, since the body's parameters keep the layout of
the loop's state, and a convolution in any other form (Equinox's and PyTorch's `NCHW`,
and the transposed convolutions that derivatives of any convolution make) runs through
a slower general emitter. `canonical_body(body)` gives
the body with each such convolution written in the fast form between two transposes,
which XLA then folds into the operands' layouts.

The body is traced once to a jaxpr; where it holds no convolution in another form, the
jaxpr is evaluated as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

from .._jaxpr import bind, evaluate

__all__ = ["LOOPS", "canonical_body", "canonical_spec", "holds", "holds_convolution", "jaxpr_holds"]

_CONV = lax.conv_general_dilated_p
# The primitives of a loop (`lax.scan`, `lax.while_loop`; `fori_loop` makes either).
LOOPS = (lax.while_p, lax.scan_p)


def canonical_spec(spatial: int) -> lax.ConvDimensionNumbers:
    """The dimension numbers of the fast form with `spatial` spatial dimensions:
    input `(batch, *spatial, feature)`, kernel `(*spatial, in, out)`, output as the
    input."""
    last = spatial + 1
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, last, *range(1, last)),
        rhs_spec=(last, spatial, *range(spatial)),
        out_spec=(0, last, *range(1, last)),
    )


def _is_canonical(numbers: lax.ConvDimensionNumbers) -> bool:
    return tuple(map(tuple, numbers)) == tuple(map(tuple, canonical_spec(len(numbers[0]) - 2)))


def _canonical_conv(lhs: Any, rhs: Any, *, dimension_numbers: Any, **params: Any) -> Any:
    """The convolution `dimension_numbers` describes, made in the fast form: the
    operands transposed into it, and the result transposed back."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    lhs = jnp.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    rhs = jnp.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    spec = canonical_spec(len(lhs_spec) - 2)
    out = _CONV.bind(lhs, rhs, dimension_numbers=spec, **params)
    made = (out_spec[0], *out_spec[2:], out_spec[1])  # the output's dimensions, in order
    return jnp.transpose(out, tuple(int(i) for i in np.argsort(made)))


def _needs_rewrite(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr`, or a program nested in it, holds a convolution in another form."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is _CONV and not _is_canonical(eqn.params["dimension_numbers"]):
            return True
        if any(_needs_rewrite(sub) for sub in _nested(eqn.params)):
            return True
    return False


def holds_convolution(fn: Callable[..., Any], *args: Any) -> bool:
    """Whether the program of `fn(*args)` (its array outputs), or one nested in it, holds
    a convolution (`holds`)."""
    return holds(fn, *args, primitives=(_CONV,))


def holds(fn: Callable[..., Any], *args: Any, primitives: tuple[Any, ...]) -> bool:
    """Whether the program of `fn(*args)` (its array outputs), or one nested in it, holds
    any of `primitives`. `args` may be tracers; a `jit` of `fn` already traced at these
    shapes is not traced again."""

    def arrays(*args: Any) -> Any:
        return [leaf for leaf in jax.tree_util.tree_leaves(fn(*args)) if eqx.is_array(leaf)]

    return _holds(jax.make_jaxpr(arrays)(*args).jaxpr, primitives)


def jaxpr_holds(jaxpr: Jaxpr, primitives: tuple[Any, ...]) -> bool:
    """Whether `jaxpr`, or a program nested in it, holds any of `primitives`."""
    return _holds(jaxpr, primitives)


def _holds(jaxpr: Jaxpr, primitives: tuple[Any, ...]) -> bool:
    return any(
        (eqn.primitive in primitives and not _runs_once(eqn))
        or any(_holds(sub, primitives) for sub in _nested(eqn.params))
        for eqn in jaxpr.eqns
    )


def _runs_once(eqn: Any) -> bool:
    """Whether `eqn` is a `scan` of one step or none (the loop over the blocks of work
    done in one block): no loop, whatever its body holds."""
    return eqn.primitive is lax.scan_p and eqn.params["length"] <= 1


def _nested(params: dict[str, Any]) -> list[Jaxpr]:
    """The programs nested in an equation's parameters (a `jit`, a loop's body, the
    branches of a `cond`, a `custom_jvp`'s primal)."""
    found = []
    for value in params.values():
        values = value if isinstance(value, tuple) else (value,)
        for item in values:
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                found.append(item)
    return found


def _rewritten_closed(closed: ClosedJaxpr) -> ClosedJaxpr:
    if not _needs_rewrite(closed.jaxpr):
        return closed
    shapes = [
        jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
        for aval in closed.in_avals
    ]
    return jax.make_jaxpr(lambda *args: _evaluate(closed.jaxpr, closed.consts, args))(*shapes)


def _rewritten_param(value: Any) -> Any:
    """A parameter of an equation with its nested programs rewritten (an open program
    that would gain constants stays as it is)."""
    if isinstance(value, ClosedJaxpr):
        return _rewritten_closed(value)
    if isinstance(value, Jaxpr):
        if value.constvars or not _needs_rewrite(value):
            return value
        closed = _rewritten_closed(ClosedJaxpr(value, ()))
        return value if closed.consts else closed.jaxpr
    if isinstance(value, tuple) and value and all(isinstance(v, ClosedJaxpr) for v in value):
        return tuple(_rewritten_closed(v) for v in value)
    return value


def _evaluate(jaxpr: Jaxpr, consts: Any, args: Any) -> list[Any]:
    """`jaxpr` evaluated on `args`, with every convolution in the fast form."""

    def rule(eqn: Any, values: list, path: tuple) -> list | None:
        if eqn.primitive is _CONV and not _is_canonical(eqn.params["dimension_numbers"]):
            return [_canonical_conv(*values, **eqn.params)]
        params = {name: _rewritten_param(value) for name, value in eqn.params.items()}
        return bind(eqn, values, params)

    return evaluate(jaxpr, consts, args, rule)


def canonical_body(body: Callable[..., Any]) -> Callable[..., Any]:
    """`body`, a loop's body, with its convolutions in the form a CPU runs fast inside a
    loop; `body` as it is on other platforms, where the convolution libraries choose
    their own layouts."""
    if jax.default_backend() != "cpu":
        return body

    def rewritten(*args: Any) -> Any:
        flat, tree = jax.tree_util.tree_flatten(args)

        def flat_body(*flat: Any) -> Any:
            return body(*jax.tree_util.tree_unflatten(tree, flat))

        closed, shapes = jax.make_jaxpr(flat_body, return_shape=True)(*flat)
        if _needs_rewrite(closed.jaxpr):
            outs = _evaluate(closed.jaxpr, closed.consts, flat)
        else:
            outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)

    return rewritten
