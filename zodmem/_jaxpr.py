"""Traced programs read and run equation by equation: one interpreter, for the places that
evaluate a jaxpr and change what some equations do (the block loops' bodies with
convolutions rewritten into the layout a CPU runs fast, `_engine/_layout.py`; KFAC's pass
that keeps each layer's input and perturbs its output, `_approximations/_kfac_trace.py`),
and the size of the largest value a program makes from some of its inputs (a planner's
reading of one item's temporaries).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend.core import Literal

__all__ = ["Rule", "bind", "evaluate", "largest_made_from"]

# What an interpreter changes: given an equation, the values of its operands and its path
# (the indices of the equations that lead to it, through the calls evaluated equation by
# equation), the list of its results, or `None` to evaluate it as it is.
Rule = Callable[[Any, list, tuple], "list | None"]


def bind(eqn: Any, values: Sequence[Any], params: dict | None = None) -> list:
    """The results of the equation `eqn` on `values` (with other `params`, if given), as
    `jax.core.eval_jaxpr` computes them: always a list."""
    params = eqn.params if params is None else params
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(params))
    return outs if eqn.primitive.multiple_results else [outs]


def evaluate(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rule: Rule, path: tuple = ()
) -> list:
    """`jaxpr` evaluated on `args` (its constants `consts`), each equation by `rule` where
    the rule gives its results, else as it is; `path` is the path of `jaxpr` itself
    where it is a call's program evaluated for a rule."""
    env: dict[Any, Any] = {}

    def read(var: Any) -> Any:
        return var.val if isinstance(var, Literal) else env[var]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for index, eqn in enumerate(jaxpr.eqns):
        values = [read(var) for var in eqn.invars]
        outs = rule(eqn, values, path + (index,))
        if outs is None:
            outs = bind(eqn, values)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(var) for var in jaxpr.outvars]


def largest_made_from(jaxpr: Any, made_from: list[bool]) -> int:
    """The bytes of the largest value that `jaxpr`'s top-level equations make from the
    inputs flagged in `made_from` (its outputs excepted). Values inside nested programs
    (a `jit`, a loop's body) are not looked into, so this errs low."""
    dependent = {var for var, flag in zip(jaxpr.invars, made_from, strict=True) if flag}
    outputs = {id(var) for var in jaxpr.outvars}
    largest = 0
    for eqn in jaxpr.eqns:
        if not any(var in dependent for var in eqn.invars if not isinstance(var, Literal)):
            continue
        for var in eqn.outvars:
            dependent.add(var)
            aval = var.aval
            if id(var) in outputs or not hasattr(aval, "shape"):
                continue
            try:
                size = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
            except TypeError:  # a key or token: no plain item size
                continue
            largest = max(largest, size)
    return largest
