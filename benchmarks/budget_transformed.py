"""What a blocked call takes when it is differentiated or mapped: the budget bounds the
call as it is planned, and `jax.grad` and `jax.vmap` of it run another program.

For each transform, XLA's own peak (`memory_analysis()`: output and temporaries) of the
call compiled as it is, of `jax.grad` of a scalar of it, and of `jax.vmap` of it over a
few inputs, beside the same for the plain JAX transform. Compiled only: nothing runs, so
each figure is what XLA plans, the same in any process.

- `chunked-vmap`: `zm.ChunkedVmap(f, chunk_size=2)` of `problems.outer_tanh` over 32
  vectors of 1,000 float32 (4 MB of intermediate per element), against `jax.vmap(f)`;
  the scalar is the sum.
- `batched-hessian`: `zm.BatchedHessian(loss, nbatches=50)` of a 1,000-variable loss,
  against `jax.hessian(loss)`; the scalar is the trace.

    python benchmarks/budget_transformed.py

Results go to `benchmarks/results/budget_transformed.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

MAPPED = 4  # inputs mapped at once by jax.vmap


def _peak(fn: Any, *args: Any) -> int:
    """XLA's count of `fn`'s buffers, compiled: its temporaries and output."""
    import jax

    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def _compiled_case(description: str, call: Any, plain: Any, scalar: Any) -> report.Case:
    """The peaks of `call(s)` and `plain(s)` for a scale `s`: alone, under `jax.grad` of
    `scalar` of them, and under `jax.vmap` over `MAPPED` scales; nothing runs."""
    import jax
    import jax.numpy as jnp

    one, many = jnp.float32(1.0), jnp.linspace(0.5, 1.5, MAPPED, dtype=jnp.float32)
    figures = {}
    for which, fn in (("call", call), ("plain", plain)):
        figures[which] = {
            "alone": _peak(fn, one),
            "grad": _peak(jax.grad(lambda s, fn=fn: scalar(fn(s))), one),
            "vmap": _peak(jax.vmap(fn), many),
        }
    return report.Case(None, {"description": description, "mapped": MAPPED, **figures})


def chunked_vmap(args: argparse.Namespace) -> report.Case:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import problems

    import zodmem as zm

    xs = jnp.asarray(np.random.default_rng(0).normal(size=(32, 1000)), jnp.float32)
    chunked = zm.ChunkedVmap(problems.outer_tanh, chunk_size=2)
    return _compiled_case(
        "ChunkedVmap(chunk_size=2) of a 4 MB-per-element map over 32",
        lambda s: chunked(xs * s),
        lambda s: jax.vmap(problems.outer_tanh)(xs * s),
        jnp.sum,
    )


def batched_hessian(args: argparse.Namespace) -> report.Case:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zodmem as zm

    def loss(w, data):
        return jnp.sum(jnp.tanh(data @ w) ** 2) + jnp.sum(w**4)

    w = jnp.linspace(-1, 1, 1000, dtype=jnp.float32)
    data = jnp.asarray(np.random.default_rng(1).normal(size=(64, 1000)), jnp.float32)
    blocked = zm.BatchedHessian(loss, nbatches=50)
    plain = jax.hessian(loss)
    return _compiled_case(
        "BatchedHessian(nbatches=50) of 1,000 variables",
        lambda s: blocked(w * s, data),
        lambda s: plain(w * s, data),
        jnp.trace,
    )


CASES = {"chunked-vmap": chunked_vmap, "batched-hessian": batched_hessian}


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    headers = [
        "case",
        "call (MB)",
        "under grad (MB)",
        f"under vmap of {MAPPED} (MB)",
        "plain JAX (MB)",
        "plain JAX under grad (MB)",
    ]

    def row(r: dict[str, Any]) -> list[Any] | None:
        c, p = r["info"]["call"], r["info"]["plain"]
        return [
            r["info"]["description"],
            report.megabytes(c["alone"], ".1f"),
            f"{report.megabytes(c['grad'], '.1f')} ({c['grad'] / c['alone']:.1f}x)",
            f"{report.megabytes(c['vmap'], '.1f')} ({c['vmap'] / c['alone']:.1f}x)",
            report.megabytes(p["alone"], ".1f"),
            report.megabytes(p["grad"], ".1f"),
        ]

    return report.case_table(results, headers, row)


if __name__ == "__main__":
    report.main(
        name="budget_transformed",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report_text,
    )
