"""One interpreter of traced programs, for the places that evaluate a jaxpr equation by
equation and change what some equations do: the block loops' bodies with convolutions
rewritten into the layout a CPU runs fast (`_engine/_layout.py`), and KFAC's pass that
keeps each layer's input and perturbs its output (`_approximations/_kfac_trace.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import Literal

__all__ = ["Rule", "bind", "evaluate"]

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
