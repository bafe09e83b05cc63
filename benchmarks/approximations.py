"""How far each structured approximation of the Gauss-Newton matrix is from the exact one,
on the models of the benchmark of real architectures (`problems.py`).

For each model, in a fresh process: the exact operator
`zm.BatchedGGN(outputs, loss).operator(model, inputs, targets)` and, against it with
`zm.approximation_error` (the relative error of products with random vectors, and of
the top eigenvalues), KFAC and EKFAC (type-2 Fisher, and the Monte Carlo Fisher of
8 drawn targets an example), the exact blocks per leaf
(`blocks="leaf"`, where every leaf's block is small enough to hold) and the top
eigenpairs alone (`zm.low_rank(op, r)`). An approximation a model refuses is a row that
says why.

    python benchmarks/approximations.py                  # the quick sizes, every model
    python benchmarks/approximations.py --size cpu --models mlp,cnn
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import report

# The largest leaf whose dense block `blocks="leaf"` is asked to hold here.
LEAF_BLOCK_LIMIT = 4096
# The targets drawn per example for the Monte Carlo Fisher's KFAC and EKFAC.
MC_SAMPLES = 8


def _errors(approx: Any, exact: Any, key: Any, k: int) -> dict[str, Any]:
    import zodmem as zm

    start = time.perf_counter()
    error = zm.approximation_error(approx, exact, key=key, num_vectors=8, k=k)
    return {
        "products": float(error.products.mean()),
        "eigenvalues": float(error.eigenvalues.max()) if k else None,
        "seconds": time.perf_counter() - start,
    }


def child(name: str, size: str, rank: int, k: int) -> dict[str, Any]:
    """Every approximation of model `name` at `size`, against the exact operator."""
    import equinox as eqx
    import jax
    import problems

    import zodmem as zm

    problem = problems.make(name, size)
    data = (problem.model, problem.inputs, problem.targets)
    exact = zm.BatchedGGN(problem.outputs, problem.loss_object).operator(*data)
    key = jax.random.key(0)
    leaves = jax.tree_util.tree_leaves(eqx.filter(problem.model, eqx.is_inexact_array))
    builders = {
        "KFAC": lambda: zm.KFAC(problem.outputs, problem.loss_object)(*data),
        "EKFAC": lambda: zm.EKFAC(problem.outputs, problem.loss_object)(*data),
        f'KFAC, `fisher="mc"` ({MC_SAMPLES} draws)': lambda: zm.KFAC(
            problem.outputs, problem.loss_object, fisher="mc", mc_samples=MC_SAMPLES, key=key
        )(*data),
        f'EKFAC, `fisher="mc"` ({MC_SAMPLES} draws)': lambda: zm.EKFAC(
            problem.outputs, problem.loss_object, fisher="mc", mc_samples=MC_SAMPLES, key=key
        )(*data),
        "blocks per leaf": lambda: _leaf_blocks(problem, data, leaves),
        f"low rank, r = {rank}": lambda: zm.low_rank(exact, rank),
    }
    rows = {}
    for label, build in builders.items():
        try:
            start = time.perf_counter()
            approx = build()
            built = time.perf_counter() - start
            rows[label] = {"build_seconds": built, **_errors(approx, exact, key, k)}
        except (ValueError, TypeError) as error:
            rows[label] = {"refused": str(error).split("\n")[0][:200]}
    return {"model": name, "size": size, **problem.info, "rows": rows}


def _leaf_blocks(problem: Any, data: tuple, leaves: list) -> Any:
    import zodmem as zm

    largest = max(leaf.size for leaf in leaves)
    if largest > LEAF_BLOCK_LIMIT:
        raise ValueError(
            f"a leaf of {largest} entries: its dense block would hold {largest}^2 numbers"
        )
    ggn = zm.BatchedGGN(problem.outputs, problem.loss_object, blocks="leaf")
    return ggn.operator(*data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="quick", choices=("quick", "cpu", "full"))
    parser.add_argument("--models", default="mlp,cnn,gpt,rnn,physics")
    parser.add_argument("--rank", type=int, default=10, help="r of the low-rank rows")
    parser.add_argument("--k", type=int, default=5, help="top eigenvalues compared")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.size, args.rank, args.k)))
        return
    results = []
    for name in args.models.split(","):
        command = [sys.executable, __file__, "--child", name, "--size", args.size]
        command += ["--rank", str(args.rank), "--k", str(args.k)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            results.append({"model": name, "failed": done.stderr.strip().splitlines()[-1:]})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = _table(results, args)
    print(text)
    if not args.no_save:
        payload = {
            "command": " ".join(sys.argv),
            "machine": report.machine_info(),
            "source": report.source_info(),
            "results": results,
            "report": text,
        }
        report.write_results(f"approximations_{args.size}", payload)


def _table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = []
    for result in results:
        if "failed" in result:
            rows.append([result["model"], "(failed)", " ".join(result["failed"]), "", ""])
            continue
        model = f"{result['model']} (n = {result['n']:,})"
        for label, row in result["rows"].items():
            if "refused" in row:
                rows.append([model, label, "refused: " + row["refused"], "", ""])
                continue
            rows.append(
                [
                    model,
                    label,
                    report.number(row["products"], ".3f"),
                    report.number(row["eigenvalues"], ".3f"),
                    report.number(row["build_seconds"], ".1f"),
                ]
            )
    headers = [
        "model",
        "approximation",
        "products: mean relative error",
        f"top {args.k} eigenvalues: largest relative error",
        "build (s)",
    ]
    return report.markdown_table(headers, rows)


if __name__ == "__main__":
    main()
