"""`zm.influence` against Kronfluence (PyTorch) with EK-FAC, on the same MLP, weights and
data: the scores, their agreement, time and peak memory.

Both score `num_queries` query examples against `num_train` training examples of a
3-class problem (three Gaussian blobs in 2-D) through an MLP of two hidden layers, and
every training example against itself. Kronfluence's EK-FAC averages its factors and
eigenvalue corrections over the `N` training examples, zodmem's of a loss with
`reduction="sum"` sums them, so the conventions are aligned as

    Kronfluence(damping_factor = λ)  ==  N * zm.influence(EKFAC(...), damping = N λ)

with the empirical Fisher (true labels) on both sides (`use_empirical_fisher=True`,
`fisher="empirical"`), which leaves nothing random. Each case runs in a fresh process
and reports the time of each phase (the factors, the pairwise scores, the
self-influences; a first call, zodmem's compiling included, and a second) and the
process's peak resident memory beside that of a process with the same imports and data
that computes nothing.

    pip install kronfluence
    python benchmarks/influence_kronfluence.py                     # float64 and float32
    python benchmarks/influence_kronfluence.py --train 8192 --width 128 --dtypes float32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import report

CLASSES = 3


def problem(args: argparse.Namespace) -> dict[str, Any]:
    """The data and the weights, from NumPy's generator alone: the same in every process."""
    rng = np.random.default_rng(0)
    total = args.train + args.queries
    centres = 3.0 * np.array([[1.0, 0.0], [-0.5, 0.87], [-0.5, -0.87]])
    labels = np.arange(total) % CLASSES
    inputs = centres[labels] + rng.normal(size=(total, 2))
    sizes = [2, args.width, args.width, CLASSES]
    layers = [
        (rng.normal(size=(out, inp)) / np.sqrt(inp), 0.1 * rng.normal(size=out))
        for inp, out in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    n = sum(w.size + b.size for w, b in layers)
    return {"inputs": inputs, "labels": labels, "layers": layers, "n": n}


def _timed(call: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def zodmem_case(args: argparse.Namespace, data: dict[str, Any], floor: bool) -> dict[str, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", args.dtype == "float64")
    import zodmem as zm

    dtype = jnp.dtype(args.dtype)
    model = eqx.nn.MLP(
        2, CLASSES, args.width, 2, activation=jnp.tanh, key=jax.random.key(0), dtype=dtype
    )
    for k, (w, b) in enumerate(data["layers"]):
        model = eqx.tree_at(
            lambda m, k=k: (m.layers[k].weight, m.layers[k].bias),
            model,
            (jnp.asarray(w, dtype), jnp.asarray(b, dtype)),
        )
    inputs = jnp.asarray(data["inputs"], dtype)
    labels = jnp.asarray(data["labels"])
    N = args.train
    train, query = (inputs[:N], labels[:N]), (inputs[N:], labels[N:])
    if floor:
        return {}

    def example_loss(model, x, label):
        return -jax.nn.log_softmax(model(x))[label]

    def logits(model, inputs, labels):
        return jax.vmap(model)(inputs)

    options = dict(damping=N * args.damping, chunk_size=args.block)
    times: dict[str, list[float]] = {"factors": [], "pairwise": [], "self": []}
    for _ in range(2):
        # A transform of its own each time: the second call compiles nothing new.
        ekfac = zm.EKFAC(logits, zm.losses.SoftmaxCrossEntropy(), fisher="empirical")
        F, t = _timed(lambda ekfac=ekfac: jax.block_until_ready(ekfac(model, *train)))
        times["factors"].append(t)
        scores, t = _timed(
            lambda F=F: jax.block_until_ready(
                zm.influence(example_loss, F, model, query=query, train=train, **options)
            )
        )
        times["pairwise"].append(t)
        own, t = _timed(
            lambda F=F: jax.block_until_ready(
                zm.influence(example_loss, F, model, train=train, self_influence=True, **options)
            )
        )
        times["self"].append(t)
    # Kronfluence's convention: its curvature is the mean over the training set, N times
    # smaller than that of the summed loss.
    return {"times": times, "scores": N * np.asarray(scores), "self": N * np.asarray(own)}


def kronfluence_case(args: argparse.Namespace, data: dict[str, Any], floor: bool) -> dict[str, Any]:
    import logging

    import torch
    import torch.nn.functional as functional
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    logging.disable(logging.WARNING)
    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, args.width),
        torch.nn.Tanh(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.Tanh(),
        torch.nn.Linear(args.width, CLASSES),
    )
    with torch.no_grad():
        for layer, (w, b) in zip([net[0], net[2], net[4]], data["layers"], strict=True):
            layer.weight.copy_(torch.as_tensor(w, dtype=dtype))
            layer.bias.copy_(torch.as_tensor(b, dtype=dtype))
    inputs = torch.as_tensor(data["inputs"], dtype=dtype)
    labels = torch.as_tensor(data["labels"])
    N = args.train
    train = torch.utils.data.TensorDataset(inputs[:N], labels[:N])
    query = torch.utils.data.TensorDataset(inputs[N:], labels[N:])

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            x, y = batch
            return functional.cross_entropy(model(x), y, reduction="sum")

        def compute_measurement(self, batch, model):
            x, y = batch
            return functional.cross_entropy(model(x), y, reduction="sum")

    task = Classification()
    net = prepare_model(net, task)
    if floor:
        return {}
    output = tempfile.mkdtemp(prefix="kronfluence-")
    analyzer = Analyzer("benchmark", net, task, cpu=True, disable_tqdm=True, output_dir=output)
    precise = {}
    if args.dtype == "float64":
        precise = dict(
            activation_covariance_dtype=dtype,
            gradient_covariance_dtype=dtype,
            per_sample_gradient_dtype=dtype,
            lambda_dtype=dtype,
        )
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True, **precise)
    score_dtypes = {}
    if args.dtype == "float64":
        score_dtypes = dict(per_sample_gradient_dtype=dtype, precondition_dtype=dtype)
    score_args = ScoreArguments(damping_factor=args.damping, score_dtype=dtype, **score_dtypes)
    times: dict[str, list[float]] = {"factors": [], "pairwise": [], "self": []}
    block = dict(overwrite_output_dir=True)
    for _ in range(2):
        _, t = _timed(
            lambda: analyzer.fit_all_factors(
                "ekfac", train, per_device_batch_size=args.block, factor_args=factor_args, **block
            )
        )
        times["factors"].append(t)
        _, t = _timed(
            lambda: analyzer.compute_pairwise_scores(
                "pairwise",
                "ekfac",
                query,
                train,
                per_device_query_batch_size=args.queries,
                per_device_train_batch_size=args.block,
                score_args=score_args,
                **block,
            )
        )
        times["pairwise"].append(t)
        _, t = _timed(
            lambda: analyzer.compute_self_scores(
                "self",
                "ekfac",
                train,
                per_device_train_batch_size=args.block,
                score_args=score_args,
                **block,
            )
        )
        times["self"].append(t)
    scores = analyzer.load_pairwise_scores("pairwise")["all_modules"].numpy()
    own = analyzer.load_self_scores("self")["all_modules"].numpy()
    return {"times": times, "scores": scores, "self": own}


CASES = {"zodmem": zodmem_case, "kronfluence": kronfluence_case}


def child(args: argparse.Namespace) -> None:
    data = problem(args)
    result = CASES[args.child](args, data, args.floor)
    out: dict[str, Any] = {"peak_rss_bytes": report.peak_rss_bytes(), "n": data["n"]}
    if not args.floor:
        out["times"] = result["times"]
        for name in ("scores", "self"):
            path = Path(args.out) / f"{args.child}_{args.dtype}_{name}.npy"
            np.save(path, result[name])
            out[name] = str(path)
    print(json.dumps(out))


def _run(args: argparse.Namespace, library: str, dtype: str, floor: bool, out: str) -> dict:
    command = [sys.executable, __file__, "--child", library, "--dtype", dtype, "--out", out]
    command += ["--train", str(args.train), "--queries", str(args.queries)]
    command += ["--width", str(args.width), "--block", str(args.block)]
    command += ["--damping", repr(args.damping)] + (["--floor"] if floor else [])
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode:
        return {"failed": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _agreement(ours: np.ndarray, theirs: np.ndarray) -> dict[str, float]:
    from scipy.stats import spearmanr

    ours, theirs = np.ravel(ours).astype(np.float64), np.ravel(theirs).astype(np.float64)
    return {
        "spearman": float(spearmanr(ours, theirs).statistic),
        "max_relative_difference": float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=2048, help="training examples")
    parser.add_argument("--queries", type=int, default=64, help="query examples")
    parser.add_argument("--width", type=int, default=64, help="hidden units per layer")
    parser.add_argument("--block", type=int, default=256, help="training examples a batch")
    parser.add_argument("--damping", type=float, default=1e-3, help="Kronfluence's damping")
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--dtype", default="float64", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    start = report.source_info()
    results = []
    with tempfile.TemporaryDirectory() as out:
        for dtype in args.dtypes.split(","):
            runs = {}
            for library in CASES:
                run = _run(args, library, dtype, False, out)
                run["floor"] = _run(args, library, dtype, True, out).get("peak_rss_bytes")
                runs[library] = run
            ours, theirs = runs["zodmem"], runs["kronfluence"]
            if "failed" not in ours and "failed" not in theirs:
                for name in ("scores", "self"):
                    agreement = _agreement(np.load(ours[name]), np.load(theirs[name]))
                    ours[f"{name}_agreement"] = agreement
            for library, run in runs.items():
                run.pop("scores", None), run.pop("self", None)
                results.append({"library": library, "dtype": dtype, **run})
    text = _table(results, args)
    print(text)
    if not args.no_save:
        payload = {
            "command": " ".join(sys.argv),
            "options": vars(args),
            "machine": {
                **report.machine_info(),
                **report.package_versions("kronfluence", "torch"),
            },
            "source": {"start": start, "end": report.source_info()},
            "results": results,
            "report": text,
        }
        report.write_results("influence_kronfluence", payload)


def _table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = []
    for result in results:
        label = [result["dtype"], result["library"]]
        if "failed" in result:
            rows.append(label + ["failed: " + " ".join(result["failed"])] + [""] * 8)
            continue
        times = result["times"]
        agreement = [
            report.number(result[f"{name}_agreement"][key], form)
            if f"{name}_agreement" in result
            else "(reference)"
            for name in ("scores", "self")
            for key, form in (("spearman", ".6f"), ("max_relative_difference", ".1e"))
        ]
        rows.append(
            label
            + [
                f"{times['factors'][0]:.2f} / {times['factors'][1]:.2f}",
                f"{times['pairwise'][0]:.2f} / {times['pairwise'][1]:.2f}",
                f"{times['self'][0]:.2f} / {times['self'][1]:.2f}",
                report.megabytes(result["peak_rss_bytes"]),
                report.megabytes(result["peak_rss_bytes"] - (result["floor"] or 0)),
            ]
            + agreement
        )
    headers = [
        "dtype",
        "library",
        "EK-FAC factors (s), first / second",
        f"pairwise {args.queries} x {args.train} (s)",
        f"self-influence x {args.train} (s)",
        "peak RSS (MB)",
        "above floor (MB)",
        "pairwise: Spearman",
        "pairwise: max rel. diff.",
        "self: Spearman",
        "self: max rel. diff.",
    ]
    n = next((r["n"] for r in results if "n" in r), None)
    caption = (
        f"MLP 2-{args.width}-{args.width}-3 (n = {n:,}), {args.train} training and "
        f"{args.queries} query examples, EK-FAC with the empirical Fisher, Kronfluence's "
        f"damping {args.damping:g} (zodmem's {args.train * args.damping:g}); agreement of "
        f"zodmem's scores with Kronfluence's.\n\n"
    )
    return caption + report.markdown_table(headers, rows)


if __name__ == "__main__":
    main()
