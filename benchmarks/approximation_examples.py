"""How far each structured approximation is from the exact Gauss-Newton matrix on two
small classifiers: the table of "Choosing an approximation" in docs/curvature.md.

A 4-class MLP (`eqx.nn.MLP(8, 4, 32, 2)`, tanh, 1,476 parameters) and a small CNN
(`Conv2d(1, 4, 3)`, ReLU, `Linear(144, 4)`: 620 parameters), each on 256 random
examples with `SoftmaxCrossEntropy(reduction="mean")`, float32. For KFAC, EKFAC, the top
20 eigenpairs (alone and with the diagonal of the rest) and the diagonal alone:
`zm.approximation_error` against the exact operator, the mean relative error of 8
products with random vectors and the largest error of the top 5 eigenvalues (relative
to the largest of them). Each model runs in a process of its own.

    python benchmarks/approximation_examples.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import report

MODELS = ("mlp", "cnn")
RANK = 20
TOP = 5


def _model(name: str) -> tuple[Any, Any, Any]:
    """`(model, fn, inputs)` of classifier `name`."""
    import equinox as eqx
    import jax

    key, data_key = jax.random.split(jax.random.key(0))
    if name == "mlp":
        model = eqx.nn.MLP(8, 4, 32, 2, activation=jax.numpy.tanh, key=key)
        inputs = jax.random.normal(data_key, (256, 8))
    else:
        conv_key, dense_key = jax.random.split(key)
        model = eqx.nn.Sequential(
            [
                eqx.nn.Conv2d(1, 4, 3, key=conv_key),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Lambda(lambda h: h.reshape(-1)),
                eqx.nn.Linear(144, 4, key=dense_key),
            ]
        )
        inputs = jax.random.normal(data_key, (256, 1, 8, 8))

    def logits(model, inputs, labels):
        return jax.vmap(model)(inputs)

    return model, logits, inputs


def child(name: str) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import zodmem as zm

    model, logits, inputs = _model(name)
    labels = jnp.arange(inputs.shape[0]) % 4
    loss = zm.losses.SoftmaxCrossEntropy(reduction="mean")
    data = (model, inputs, labels)
    exact = zm.BatchedGGN(logits, loss).operator(*data)
    approximations = {
        "KFAC": zm.KFAC(logits, loss)(*data),
        "EKFAC": zm.EKFAC(logits, loss)(*data),
        f"low rank, `r = {RANK}`": zm.low_rank(exact, RANK),
        f"low rank, `r = {RANK}`, and the diagonal": zm.low_rank(exact, RANK, diagonal="exact"),
        "the diagonal alone": zm.low_rank(exact, 0, diagonal="exact"),
    }
    rows = {}
    for label, approx in approximations.items():
        error = zm.approximation_error(approx, exact, key=jax.random.key(1), k=TOP)
        rows[label] = {
            "products": float(error.products.mean()),
            "eigenvalues": float(error.eigenvalues.max()),
        }
    n = sum(leaf.size for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    return {"model": name, "n": n, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    results = []
    for name in MODELS:
        done = subprocess.run(
            [sys.executable, __file__, "--child", name], capture_output=True, text=True, check=True
        )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    headers = ["approximation"] + [
        f"{result['model'].upper()}: products / top {TOP}" for result in results
    ]
    rows = [
        [label]
        + [
            f"{result['rows'][label]['products']:.3f} / {result['rows'][label]['eigenvalues']:.3f}"
            for result in results
        ]
        for label in results[0]["rows"]
    ]
    text = report.markdown_table(headers, rows)
    print(text)
    if not args.no_save:
        payload = {
            "command": " ".join(sys.argv),
            "machine": report.machine_info(),
            "source": report.source_info(),
            "results": results,
            "report": text,
        }
        report.write_results("approximation_examples", payload)


if __name__ == "__main__":
    main()
