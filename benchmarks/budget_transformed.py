"""What a blocked call takes when it is differentiated or mapped: the budget bounds the
call as it is planned, and `jax.grad` and `jax.vmap` of it run another program.

For each transform, XLA's own peak (`memory_analysis()`: output and temporaries) of the
call compiled as it is, of `jax.grad` of a scalar of it, and of `jax.vmap` of it over a
few inputs, beside the same for the plain JAX transform. Compiled only: nothing runs, so
each figure is what XLA plans, the same in any process.

    python benchmarks/budget_transformed.py

Results go to `benchmarks/results/budget_transformed.json`.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import zodmem as zm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

MAPPED = 4  # inputs mapped at once by jax.vmap


def peak(fn, *args):
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def heavy(x):
    """36 MB of temporaries per element at 3,000: a map that needs its chunks."""
    return jnp.sum(jnp.tanh(jnp.outer(x, x)) @ x)


def loss(w, data):
    return jnp.sum(jnp.tanh(data @ w) ** 2) + jnp.sum(w**4)


def cases():
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(32, 1000)), jnp.float32)
    w = jnp.linspace(-1, 1, 1000, dtype=jnp.float32)
    data = jnp.asarray(np.random.default_rng(1).normal(size=(64, 1000)), jnp.float32)
    chunked = zm.ChunkedVmap(heavy, chunk_size=2)
    blocked = zm.BatchedHessian(loss, nbatches=50)
    plain_hessian = jax.hessian(loss)
    return {
        "ChunkedVmap(chunk_size=2) of a 4 MB-per-element map over 32": dict(
            call=lambda s: chunked(xs * s),
            plain=lambda s: jax.vmap(heavy)(xs * s),
            scalar=lambda out: jnp.sum(out),
        ),
        "BatchedHessian(nbatches=50) of 1,000 variables": dict(
            call=lambda s: blocked(w * s, data),
            plain=lambda s: plain_hessian(w * s, data),
            scalar=lambda out: jnp.trace(out),
        ),
    }


def measure():
    rows, results = [], []
    one, many = jnp.float32(1.0), jnp.linspace(0.5, 1.5, MAPPED, dtype=jnp.float32)
    for name, case in cases().items():
        figures = {}
        for which in ("call", "plain"):
            fn, scalar = case[which], case["scalar"]
            figures[which] = {
                "alone": peak(fn, one),
                "grad": peak(jax.grad(lambda s, fn=fn, scalar=scalar: scalar(fn(s))), one),
                "vmap": peak(jax.vmap(fn), many),
            }
        c, p = figures["call"], figures["plain"]
        results.append({"case": name, "mapped": MAPPED, **figures})
        rows.append(
            [
                name,
                f"{c['alone'] / 1e6:.1f}",
                f"{c['grad'] / 1e6:.1f} ({c['grad'] / c['alone']:.1f}x)",
                f"{c['vmap'] / 1e6:.1f} ({c['vmap'] / c['alone']:.1f}x)",
                f"{p['alone'] / 1e6:.1f}",
                f"{p['grad'] / 1e6:.1f}",
            ]
        )
    headers = [
        "case",
        "call (MB)",
        "under grad (MB)",
        f"under vmap of {MAPPED} (MB)",
        "plain JAX (MB)",
        "plain JAX under grad (MB)",
    ]
    return rows, headers, results


if __name__ == "__main__":
    rows, headers, results = measure()
    print(_harness.markdown_table(headers, rows))
    _harness.RESULTS_DIR.mkdir(exist_ok=True)
    out = _harness.RESULTS_DIR / "budget_transformed.json"
    out.write_text(json.dumps({"machine": _harness.machine_info(), "results": results}, indent=2))
