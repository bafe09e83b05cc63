"""Curvature products on real architectures: zodmem against plain JAX, matfree and curvlinops.

The five problems of `problems.py` (an MLP, a ResNet-style CNN with GroupNorm, a
nanoGPT-style transformer, a GRU through `lax.scan`, a neural ODE through diffrax),
each a loss `loss(model, inputs, targets)` (the mean over the examples) and
`predict(model, inputs)` with a loss of `zm.losses` (`reduction="mean"`) for the
Gauss-Newton matrix. Every case runs in its own process (see `report.py`), is called
once (its first call: tracing, compiling and planning included) and then
`--steady-calls` more times (steady: the fastest of them; one more time only where the
first call took over `--long-call` seconds, 60), and reports its peak resident memory
above its model's floor. For each model:

- `floor`: the imports, the model, its data and the `--vectors` vectors `V` (`(n, 8)`,
  standard normal); nothing computed. `torch-floor`: the same with torch imported,
  the torch model built and its weights copied, and curvlinops' operators made.
- `zm/hessian-mm`: `zm.BatchedHessian(loss, max_memory=B).operator(model, inputs,
  targets).mm(V)`, `B` = `--max-memory` ("2GB", "16GB" at the `--full` sizes); the
  operator is made inside the first call.
- `zm/hessian-mv`: one product of that operator, `op.mv(V[:, 0])`.
- `zm/ggn-mm`: `zm.BatchedGGN(outputs, loss_object, max_memory=B).operator(...).mm(V)`.
- `zm/eigsh`: `zm.eigsh(op, 5, max_steps=S, tol=1e-9, return_info=True)` on the
  Hessian operator: `S` Lanczos steps (`--lanczos-steps`), since float32 residuals
  never reach that `tol`; the same number of products as `matfree/eigsh`.
- `zm/trace`: `zm.trace(op, method="hutchinson", num_probes=P, key=jax.random.key(0))`,
  `P` probes (`--probes`; 100, fewer for the models where 100 take minutes).
- `zm/diagonal`: `zm.diagonal(op)`, the exact diagonal (`n` products), and
  `zm/dense-hessian`: `zm.BatchedHessian(loss, max_memory=B)(model, inputs, targets)`,
  the `(n, n)` Hessian: for the MLP only, where they take seconds.
- `jax/hessian-mm`: `jax.jit(jax.vmap(lambda v: jax.jvp(jax.grad(f), (p,), (v,))[1],
  1, 1))` with `f` the loss of the raveled parameters `p`; the parameters and the data
  are arguments of the compiled function (not constants folded into it), as they are of
  zodmem's operators. `jax/hessian-mv`: one such product. `jax/ggn-mm`: the vmapped
  `J^T H J v`: `jax.jvp` of the predictions, the loss's Hessian on the outputs by
  `jax.jvp(jax.grad(...))`, then the `jax.vjp` of the predictions (linearised once).
- `matfree/eigsh`: matfree's Lanczos, `decomp.tridiag_sym(S, reortho="full")` over the
  plain JAX product, then the 5 largest eigenvalues of the tridiagonal matrix, under
  one `jax.jit`. `matfree/trace`: matfree's `stochtrace.estimator_monte_carlo` with
  `monte_carlo_trace()` and one `sampler_signs` probe per key, `jax.lax.map` over `P`
  keys (the lower-memory form matfree's documentation gives): the mean and its
  standard error.
- `curvlinops/hessian-mm` and `curvlinops/ggn-mm`: curvlinops-for-pytorch's
  `HessianLinearOperator` and `GGNLinearOperator` on the same network in torch (the
  Equinox weights copied parameter by parameter, CPU, float32, the same data,
  `MSELoss()` or `CrossEntropyLoss()`), times the same `V`. After the measurement each
  checks its first column against zodmem's `op.mv(V[:, 0])`. Not for `physics` (an ODE
  solver in torch is another library).

The table of each model gives every case's first call, steady call and peak above its
floor (`torch-floor` for curvlinops), the ratios of its steady time and peak to the
plain JAX anchor of the same work (`jax/...` for products, `matfree/...` for the
estimators, whose products are plain JAX ones), and a check: the products' largest
sampled difference from the anchor's (relative to the largest entry), the top 5
eigenvalues' from matfree's, the trace's estimate and standard error.

    python benchmarks/models.py                         # every model and case, CPU sizes
    python benchmarks/models.py --models mlp,cnn        # some models
    python benchmarks/models.py --models cnn --cases zm/hessian-mm,jax/hessian-mm
    python benchmarks/models.py --quick                 # tiny sizes, to smoke-test
    python benchmarks/models.py --gpu                   # headline cases, --full sizes
    python benchmarks/models.py --gpu --quick           # the same at tiny sizes (a dry run)

`--cases` takes case names (each for every selected model) or `model:case`; the floors
of the selected models are always run. `--full` gives the larger sizes (for a GPU);
`--gpu` runs, at those sizes, only the headline cases (the Hessian and GGN blocks,
eigsh and the trace against their JAX and matfree anchors), records the device's peak
(`memory_stats()["peak_bytes_in_use"]`) beside the resident one, and writes
`models_gpu.json`. Results go to `benchmarks/results/models.json` (`models_quick.json`
with `--quick`).

matfree, diffrax, torch and curvlinops-for-pytorch are not dependencies of zodmem:
`pip install -e ".[bench]"` installs them (torch's CPU wheel: `--index-url
https://download.pytorch.org/whl/cpu`).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

_MB = report.MB
_NAME = "models"
MODELS = ("mlp", "cnn", "gpt", "rnn", "physics")
_K = 5  # eigenvalues wanted
_EIGSH_TOL = 1e-9  # below float32's reach: zm.eigsh takes all its max_steps, as matfree does

# The cases of a model, in the order they run and are shown.
CASE_NAMES = (
    "floor",
    "torch-floor",
    "zm/hessian-mm",
    "jax/hessian-mm",
    "curvlinops/hessian-mm",
    "zm/hessian-mv",
    "jax/hessian-mv",
    "zm/ggn-mm",
    "jax/ggn-mm",
    "curvlinops/ggn-mm",
    "zm/eigsh",
    "matfree/eigsh",
    "zm/trace",
    "matfree/trace",
    "zm/diagonal",
    "zm/dense-hessian",
    "zm/kfac-build",
    "curvlinops/kfac-build",
    "zm/kfac-mv",
    "curvlinops/kfac-mv",
    "zm/kfac-solve",
    "curvlinops/kfac-solve",
    "zm/kfac-logdet",
    "curvlinops/kfac-logdet",
)
# What `--gpu` runs of every model.
HEADLINE = (
    "floor",
    "zm/hessian-mm",
    "jax/hessian-mm",
    "zm/ggn-mm",
    "jax/ggn-mm",
    "zm/eigsh",
    "matfree/eigsh",
    "zm/trace",
    "matfree/trace",
    "zm/kfac-build",
    "zm/kfac-solve",
)
# The plain JAX anchor of the same work, for the ratios.
ANCHOR = {
    "zm/hessian-mm": "jax/hessian-mm",
    "curvlinops/hessian-mm": "jax/hessian-mm",
    "zm/hessian-mv": "jax/hessian-mv",
    "zm/ggn-mm": "jax/ggn-mm",
    "curvlinops/ggn-mm": "jax/ggn-mm",
    "zm/eigsh": "matfree/eigsh",
    "zm/trace": "matfree/trace",
}
# KFAC's anchor is curvlinops' KFAC of the same network (there is no plain JAX one).
KFAC_CASES = ("kfac-build", "kfac-mv", "kfac-solve", "kfac-logdet")
ANCHOR.update({f"zm/{case}": f"curvlinops/{case}" for case in KFAC_CASES})
_DAMPING = 1e-3
# Models without curvlinops' KFAC, and why.
_NO_CURVLINOPS_KFAC = {
    "rnn": "the GRU cell's weights are in no Linear or Conv2d module",
    "physics": "no torch version",
}
# Where the exact diagonal and the dense Hessian take seconds, not hours.
_DENSE_MODELS = ("mlp",)
# Those with a torch version in problems.py (an ODE solver in torch is another library);
# written here so that the parent process, which only starts the cases, imports no JAX.
_TORCH_MODELS = ("mlp", "cnn", "gpt", "rnn")
_PROBES = 100
_LANCZOS_STEPS = {"quick": 12, "cpu": 40, "full": 80}
# Fewer probes at the CPU size where plain JAX products in a loop take over a second each
# (the CNN's), so that matfree's trace takes under about 2 minutes a call.
_CPU_PROBES = {"cnn": 32}


def cases_of(model: str) -> tuple[str, ...]:
    """The cases that `model` has."""

    def has(case: str) -> bool:
        if case.startswith("curvlinops/kfac"):
            return model in _TORCH_MODELS and model not in _NO_CURVLINOPS_KFAC
        if case == "torch-floor" or case.startswith("curvlinops/"):
            return model in _TORCH_MODELS
        if case in ("zm/diagonal", "zm/dense-hessian"):
            return model in _DENSE_MODELS
        return True

    return tuple(case for case in CASE_NAMES if has(case))


def _size(args: argparse.Namespace) -> str:
    if args.quick:
        return "quick"
    return "full" if args.full or args.gpu else "cpu"


def _budget(args: argparse.Namespace) -> str:
    if args.max_memory is not None:
        return args.max_memory
    return "16GB" if _size(args) == "full" else "2GB"


def _probes(model: str, args: argparse.Namespace) -> int:
    if args.probes is not None:
        return args.probes
    return _CPU_PROBES.get(model, _PROBES) if _size(args) == "cpu" else _PROBES


def _steps(args: argparse.Namespace) -> int:
    if args.lanczos_steps is not None:
        return args.lanczos_steps
    return _LANCZOS_STEPS[_size(args)]


# -- the problem in each process -----------------------------------------------------------


def _setup(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The problem, its raveled parameters, the vectors and what to record of them."""
    import jax
    import problems

    import zodmem as zm

    # zodmem imports its public names when first used: import them all here, outside
    # the timed calls, as the anchors' imports are (`import zodmem` is timed apart).
    for name in zm.__all__:
        getattr(zm, name)
    p = problems.make(model, _size(args))
    flat, of_flat = p.flat()
    vectors = jax.random.normal(jax.random.key(1), (flat.size, args.vectors), flat.dtype)
    jax.block_until_ready(vectors)
    info = {
        **p.info,
        "vectors": args.vectors,
        "max_memory": _budget(args),
        "probes": _probes(model, args),
        "lanczos_steps": _steps(args),
        "device": str(jax.devices()[0]),
    }
    return {"problem": p, "flat": flat, "of_flat": of_flat, "vectors": vectors, "info": info}


def _device_peak() -> int | None:
    """The accelerator's peak bytes in use, where the backend counts them (not a CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def _case(
    s: dict[str, Any],
    compute: Callable[[], Any] | None,
    tool: str,
    args: argparse.Namespace,
    note: Callable[[Any], dict[str, Any]] | None = None,
    after: Callable[[], dict[str, Any]] | None = None,
) -> report.Case:
    """A harness case whose `info` also gets `note(result)` after each call and
    `after()`'s figures (and the device's peak) once the calls are timed.

    A first call longer than `--long-call` seconds is followed by one further call
    instead of `--steady-calls`: the harness reads `Case.repeats` once the first call is
    done."""
    import jax

    info = {**s["info"], "tool": tool}
    if compute is None:
        info["device_peak_bytes"] = _device_peak()
        return report.Case(None, info)
    inner, calls = compute, []

    def timed():
        start = time.perf_counter()
        result = jax.block_until_ready(inner())
        calls.append(time.perf_counter() - start)
        if len(calls) == 1 and calls[0] > args.long_call:
            case.repeats = min(case.repeats, 1)
        if note is not None:
            info.update(note(result))
        return result

    def finish():
        info["device_peak_bytes"] = _device_peak()
        info["steady_calls"] = len(calls) - 1
        if after is not None:
            info.update(after())

    case = report.Case(timed, info, args.steady_calls, finish)
    return case


def _once(make: Callable[[], Any], use: Callable[[Any], Any]) -> Callable[[], Any]:
    """`use(made)`, `made = make()` on the first call only: the first call pays for
    making the operator, as the JAX anchors' first call pays for tracing."""
    made: list[Any] = []

    def compute():
        if not made:
            made.append(make())
        return use(made[0])

    return compute


def _hessian_operator(s: dict[str, Any], args: argparse.Namespace) -> Any:
    import zodmem as zm

    p = s["problem"]
    transform = zm.BatchedHessian(p.loss, max_memory=_budget(args))
    return transform.operator(p.model, p.inputs, p.targets)


def _ggn_operator(s: dict[str, Any], args: argparse.Namespace) -> Any:
    import zodmem as zm

    p = s["problem"]
    transform = zm.BatchedGGN(p.outputs, p.loss_object, max_memory=_budget(args))
    return transform.operator(p.model, p.inputs, p.targets)


# -- zodmem ------------------------------------------------------------------------------


def floor(model: str, args: argparse.Namespace) -> report.Case:
    s = _setup(model, args)
    return _case(s, None, "floor", args)


def zm_hessian_mm(model: str, args: argparse.Namespace) -> report.Case:
    s = _setup(model, args)
    compute = _once(lambda: _hessian_operator(s, args), lambda op: op.mm(s["vectors"]))
    return _case(s, compute, "zodmem", args)


def zm_hessian_mv(model: str, args: argparse.Namespace) -> report.Case:
    s = _setup(model, args)
    vector = s["vectors"][:, 0]
    compute = _once(lambda: _hessian_operator(s, args), lambda op: op.mv(vector))
    return _case(s, compute, "zodmem", args)


def zm_ggn_mm(model: str, args: argparse.Namespace) -> report.Case:
    s = _setup(model, args)
    compute = _once(lambda: _ggn_operator(s, args), lambda op: op.mm(s["vectors"]))
    return _case(s, compute, "zodmem", args)


def _eigenvalues(result: Any) -> dict[str, Any]:
    import numpy as np

    return {"eigenvalues": [float(v) for v in np.sort(np.asarray(result[0], np.float64))]}


def zm_eigsh(model: str, args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    s = _setup(model, args)
    steps = _steps(args)

    def top(op):
        values, vectors, report = zm.eigsh(
            op, _K, max_steps=steps, tol=_EIGSH_TOL, return_info=True
        )
        return values, vectors, report.num_products

    def note(result):
        return {**_eigenvalues(result), "num_products": int(result[2])}

    compute = _once(lambda: _hessian_operator(s, args), top)
    return _case(s, compute, "zodmem", args, note)


def _estimate(result: Any) -> dict[str, Any]:
    import numpy as np

    estimate, error = np.asarray(result, np.float64)
    return {"estimate": float(estimate), "standard_error": float(error)}


def zm_trace(model: str, args: argparse.Namespace) -> report.Case:
    import jax
    import jax.numpy as jnp

    import zodmem as zm

    s = _setup(model, args)
    probes = _probes(model, args)

    def trace(op):
        estimate = zm.trace(op, method="hutchinson", num_probes=probes, key=jax.random.key(0))
        return jnp.stack(estimate)

    compute = _once(lambda: _hessian_operator(s, args), trace)
    return _case(s, compute, "zodmem", args, _estimate)


def zm_diagonal(model: str, args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    s = _setup(model, args)
    compute = _once(lambda: _hessian_operator(s, args), zm.diagonal)
    return _case(s, compute, "zodmem", args)


def zm_dense_hessian(model: str, args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    s = _setup(model, args)
    p = s["problem"]
    transform = zm.BatchedHessian(p.loss, max_memory=_budget(args))
    return _case(s, lambda: transform(p.model, p.inputs, p.targets), "zodmem", args)


# -- plain JAX -----------------------------------------------------------------------------


def _loss_of_flat(s: dict[str, Any]) -> Callable[[Any, Any, Any], Any]:
    p, of_flat = s["problem"], s["of_flat"]
    return lambda flat, inputs, targets: p.loss(of_flat(flat), inputs, targets)


def _hvp(s: dict[str, Any]) -> Callable[..., Any]:
    """`(flat, inputs, targets, v) -> H v`, forward over reverse on the raveled parameters."""
    import jax

    loss = _loss_of_flat(s)

    def product(flat, inputs, targets, vector):
        gradient = jax.grad(lambda w: loss(w, inputs, targets))
        return jax.jvp(gradient, (flat,), (vector,))[1]

    return product


def _ggn_block(s: dict[str, Any]) -> Callable[..., Any]:
    """`(flat, inputs, targets, V) -> G V`, `G = J^T H J`: the predictions linearised
    once, each column pushed forward, through the loss's Hessian and pulled back."""
    import jax

    p, of_flat = s["problem"], s["of_flat"]

    def block(flat, inputs, targets, vectors):
        def predictions(w):
            return p.predict(of_flat(w), inputs)

        outputs, pullback = jax.vjp(predictions, flat)
        loss_gradient = jax.grad(lambda o: p.loss_object(o, targets))

        def product(vector):
            jv = jax.jvp(predictions, (flat,), (vector,))[1]
            hjv = jax.jvp(loss_gradient, (outputs,), (jv,))[1]
            return pullback(hjv)[0]

        return jax.vmap(product, in_axes=1, out_axes=1)(vectors)

    return block


def _compiled(s: dict[str, Any], fn: Callable[..., Any], *rest: Any) -> Callable[[], Any]:
    """`fn(flat, inputs, targets, *rest)` under `jax.jit`, all of them its arguments."""
    import jax

    p, flat = s["problem"], s["flat"]
    compiled = jax.jit(fn)
    return lambda: compiled(flat, p.inputs, p.targets, *rest)


def jax_hessian_mm(model: str, args: argparse.Namespace) -> report.Case:
    import jax

    s = _setup(model, args)
    block = jax.vmap(_hvp(s), in_axes=(None, None, None, 1), out_axes=1)
    return _case(s, _compiled(s, block, s["vectors"]), "jax", args)


def jax_hessian_mv(model: str, args: argparse.Namespace) -> report.Case:
    s = _setup(model, args)
    return _case(s, _compiled(s, _hvp(s), s["vectors"][:, 0]), "jax", args)


def jax_ggn_mm(model: str, args: argparse.Namespace) -> report.Case:
    s = _setup(model, args)
    return _case(s, _compiled(s, _ggn_block(s), s["vectors"]), "jax", args)


# -- matfree ------------------------------------------------------------------------------


def matfree_eigsh(model: str, args: argparse.Namespace) -> report.Case:
    import jax
    import jax.numpy as jnp
    from matfree import decomp

    s = _setup(model, args)
    hvp, steps = _hvp(s), _steps(args)
    tridiagonalise = decomp.tridiag_sym(steps, reortho="full")

    def top(flat, inputs, targets, start):
        def matvec(vector, flat, inputs, targets):
            return hvp(flat, inputs, targets, vector)

        result = tridiagonalise(matvec, start, flat, inputs, targets)
        return (jnp.linalg.eigvalsh(result.J_small)[-_K:],)

    start = jax.random.normal(jax.random.key(0), s["flat"].shape, s["flat"].dtype)
    info_steps = {"num_products": steps}
    return _case(
        s, _compiled(s, top, start), "matfree", args, lambda r: {**_eigenvalues(r), **info_steps}
    )


def matfree_trace(model: str, args: argparse.Namespace) -> report.Case:
    import jax
    import jax.numpy as jnp
    from matfree import stochtrace

    s = _setup(model, args)
    hvp, probes = _hvp(s), _probes(model, args)
    one_probe = stochtrace.estimator_monte_carlo(
        stochtrace.monte_carlo_trace(), stochtrace.sampler_signs(s["flat"], num=1)
    )

    def estimate(flat, inputs, targets, key):
        def matvec(vector, flat, inputs, targets):
            return hvp(flat, inputs, targets, vector)

        def sample(k):
            return one_probe(matvec, k, flat, inputs, targets)

        samples = jax.lax.map(sample, jax.random.split(key, probes))
        error = jnp.std(samples, ddof=1) / jnp.sqrt(probes)
        return jnp.stack([jnp.mean(samples), error])

    compute = _compiled(s, estimate, jax.random.key(0))
    return _case(s, compute, "matfree", args, _estimate)


# -- curvlinops ----------------------------------------------------------------------------


def _torch_setup(s: dict[str, Any]) -> Any:
    """curvlinops' two operators on the torch problem, their record in `s["info"]`."""
    import problems

    c = problems.curvlinops_operators(s["problem"])
    s["info"].update(c.info)
    return c


def torch_floor(model: str, args: argparse.Namespace) -> report.Case:
    s = _setup(model, args)
    _torch_setup(s)
    return _case(s, None, "floor", args)


def _curvlinops(model: str, args: argparse.Namespace, which: str) -> report.Case:
    import numpy as np
    import torch

    s = _setup(model, args)
    operator = _torch_setup(s).operators[which]
    vectors = torch.from_numpy(np.array(s["vectors"]))
    products: list[Any] = []

    def compute():
        with torch.no_grad():
            result = (operator @ vectors).numpy()
        products[:] = [result]
        return result

    def agreement():
        # zodmem's product with the first vector, against curvlinops' first column.
        make = _hessian_operator if which == "hessian" else _ggn_operator
        ours = np.asarray(make(s, args).mv(s["vectors"][:, 0]), np.float64)
        theirs = products[0][:, 0].astype(np.float64)
        scale = max(float(np.max(np.abs(ours))), 1e-30)
        return {"agreement_vs_zodmem": float(np.max(np.abs(theirs - ours)) / scale)}

    return _case(s, compute, "curvlinops", args, after=agreement)


# -- KFAC ----------------------------------------------------------------------------------


def _reset_peak() -> bool:
    """Start the process's peak resident memory afresh from what it holds now (Linux's
    `clear_refs`), so that a call's peak leaves out the building before it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _kfac_transform(args: argparse.Namespace) -> Callable[[Any], Any]:
    """`problem -> zm.KFAC(...)(model, inputs, targets)`, at the operators' budget where
    the data can be cut into microbatches: not the GPT's, whose targets are flat (one a
    token) while its inputs are sequences."""
    import zodmem as zm

    def build(p):
        aligned = p.inputs.shape[0] == p.targets.shape[0]
        budget = _budget(args) if aligned else None
        transform = zm.KFAC(p.outputs, p.loss_object, max_memory=budget)
        return transform(p.model, p.inputs, p.targets)

    return build


def _kfac_record(operator: Any) -> dict[str, Any]:
    """What KFAC made of the model: its layers, and the leaves it holds as exact dense
    blocks (those in no layer it reads)."""
    dense = [b for b in operator.blocks if len(b.leaves) == 1 and b.in_size == 1]
    return {
        "kfac_blocks": len(operator.blocks),
        "kfac_layers": len(operator.blocks) - len(dense),
        "kfac_dense_blocks": len(dense),
        "kfac_dense_largest": max((b.out_size for b in dense), default=0),
    }


def _refused(s: dict[str, Any], tool: str, args: argparse.Namespace, error: Exception):
    """The case of a model that zm.KFAC refuses: a row that says so, not a crash."""
    import jax.numpy as jnp

    s["info"]["refused"] = f"{type(error).__name__}: {error}"
    return _case(s, lambda: jnp.zeros((1,)), tool, args)


def zm_kfac_build(model: str, args: argparse.Namespace) -> report.Case:
    import jax.numpy as jnp

    s = _setup(model, args)
    build, refusal = _kfac_transform(args), {}

    def compute():
        try:
            return build(s["problem"])
        except ValueError as error:  # a leaf KFAC cannot hold, refused by name
            refusal["refused"] = f"{type(error).__name__}: {error}"
            return jnp.zeros((1,))  # the harness fingerprints an array of one axis at least

    def note(result):
        return refusal or _kfac_record(result)

    return _case(s, compute, "zodmem", args, note)


def _zm_kfac(model: str, args: argparse.Namespace, use: Callable[..., Any]) -> report.Case:
    """A case of the built operator: `use(F, v)`, `v` the first of the vectors; the
    building is not timed, and the peak starts afresh after it."""
    import jax

    s = _setup(model, args)
    try:
        operator = jax.block_until_ready(_kfac_transform(args)(s["problem"]))
    except ValueError as error:
        return _refused(s, "zodmem", args, error)
    s["info"].update(_kfac_record(operator), peak_reset=_reset_peak())
    vector = s["vectors"][:, 0]
    return _case(s, lambda: use(operator, vector), "zodmem", args)


def _damped_logdets(ours: Any, theirs: Any, names: list[str]) -> tuple[float, float]:
    """`log det(F + damping I)` over the blocks curvlinops has, from zodmem's
    eigenvalues and from curvlinops' factors (its own `logdet` has no damping)."""
    import numpy as np
    import torch

    def logdet(values):
        return float(np.sum(np.log(np.maximum(values, 0) + _DAMPING)))

    mine = sum(
        logdet(np.asarray(eigen.eigenvalues, np.float64))
        for eigen in ours.eigh()
        if all(name in names for name in eigen.names)
    )
    other = 0.0
    for layer, factor in theirs._gradient_covariances.items():
        inputs = theirs._input_covariances.get(layer, torch.ones(1, 1))
        b, a = (torch.linalg.eigvalsh(m.double()).numpy() for m in (factor, inputs))
        other += logdet(np.outer(b, a))
    return mine, other


def _curvlinops_kfac(model: str, args: argparse.Namespace, which: str) -> report.Case:
    """curvlinops' KFAC on the parameters it takes: its factors (`kfac-build`, each
    call a new operator), or with them computed before the timed calls (and the peak
    started afresh), its product, its exactly damped inverse's product (the factors'
    eigendecompositions in the first call, cached for the others) or its `logdet`
    (undamped: curvlinops offers no damped one), each checked against zodmem's KFAC
    on the same entries."""
    import numpy as np
    import problems
    import torch
    from curvlinops import KFACInverseLinearOperator

    s = _setup(model, args)
    c = problems.curvlinops_kfac(s["problem"])
    s["info"].update(c.info)
    vector = torch.from_numpy(np.array(s["vectors"][:, 0])[c.indices])
    results: list[Any] = []

    if which == "build":

        def compute():
            operator = c.make()
            operator.compute_kronecker_factors()
            return np.asarray([float(f.trace()) for f in operator._input_covariances.values()])

    else:
        operator = c.make()
        operator.compute_kronecker_factors()
        s["info"]["peak_reset"] = _reset_peak()
        inverse: list[Any] = []

        def compute():
            with torch.no_grad():
                if which == "mv":
                    result = (operator @ vector).numpy()
                elif which == "solve":
                    if not inverse:
                        inverse.append(
                            KFACInverseLinearOperator(
                                operator, damping=_DAMPING, use_exact_damping=True
                            )
                        )
                    result = (inverse[0] @ vector).numpy()
                else:
                    operator._reset_matrix_properties()  # the property caches its value
                    result = np.asarray([float(operator.logdet)])
            results[:] = [result]
            return result

    def agreement():
        # zodmem's KFAC of the whole model, on the entries curvlinops has.
        if which == "build":
            return {"kfac_leaves_curvlinops": len(c.names)}
        try:
            ours = _kfac_transform(args)(s["problem"])
        except ValueError:
            return {"agreement_vs_zodmem": None, "zodmem_refused": True}
        if which == "logdet":
            mine, other = _damped_logdets(ours, operator, c.names)
            return {
                "logdet_curvlinops_undamped": float(results[0][0]),
                "logdet_damped_zodmem": mine,
                "logdet_damped_curvlinops_factors": other,
            }
        flat = s["vectors"][:, 0]
        mine = ours.mv(flat) if which == "mv" else ours.solve(flat, damping=_DAMPING)
        difference = report.relative_difference(results[0], np.asarray(mine)[c.indices])
        return {"agreement_vs_zodmem": difference}

    return _case(s, compute, "curvlinops", args, after=agreement)


# -- the cases, the report and the command line ---------------------------------------------

_BUILDERS: dict[str, Callable[[str, argparse.Namespace], report.Case]] = {
    "floor": floor,
    "torch-floor": torch_floor,
    "zm/hessian-mm": zm_hessian_mm,
    "jax/hessian-mm": jax_hessian_mm,
    "curvlinops/hessian-mm": functools.partial(_curvlinops, which="hessian"),
    "zm/hessian-mv": zm_hessian_mv,
    "jax/hessian-mv": jax_hessian_mv,
    "zm/ggn-mm": zm_ggn_mm,
    "jax/ggn-mm": jax_ggn_mm,
    "curvlinops/ggn-mm": functools.partial(_curvlinops, which="ggn"),
    "zm/eigsh": zm_eigsh,
    "matfree/eigsh": matfree_eigsh,
    "zm/trace": zm_trace,
    "matfree/trace": matfree_trace,
    "zm/diagonal": zm_diagonal,
    "zm/dense-hessian": zm_dense_hessian,
    "zm/kfac-build": zm_kfac_build,
    "zm/kfac-mv": functools.partial(_zm_kfac, use=lambda operator, vector: operator.mv(vector)),
    "zm/kfac-solve": functools.partial(
        _zm_kfac, use=lambda operator, vector: operator.solve(vector, damping=_DAMPING)
    ),
    "zm/kfac-logdet": functools.partial(
        _zm_kfac, use=lambda operator, vector: operator.logdet(damping=_DAMPING)[None]
    ),
    **{
        f"curvlinops/kfac-{which}": functools.partial(_curvlinops_kfac, which=which)
        for which in ("build", "mv", "solve", "logdet")
    },
}

CASES: dict[str, Callable[[argparse.Namespace], report.Case]] = {
    f"{model}:{case}": functools.partial(_BUILDERS[case], model)
    for model in MODELS
    for case in cases_of(model)
}


def _floor_of(case: str) -> str:
    return "torch-floor" if case.startswith("curvlinops/") else "floor"


def _check(case: str, r: dict[str, Any], anchor: dict[str, Any] | None) -> str:
    info = r["info"]
    if "agreement_vs_zodmem" in info:
        return f"{info['agreement_vs_zodmem']:.1e} vs zm"
    if "estimate" in info:
        return f"{info['estimate']:.4g} ± {info['standard_error']:.2g}"
    if "eigenvalues" in info:
        top = f"top {info['eigenvalues'][-1]:.5g}, {info['num_products']} products"
        other = anchor["info"].get("eigenvalues") if anchor is not None else None
        if not other or other is info["eigenvalues"]:
            return top
        scale = max(abs(v) for v in other)
        worst = max(abs(a - b) for a, b in zip(info["eigenvalues"], other, strict=True))
        return f"{top}, {worst / scale:.1e} vs anchor"
    if anchor is not None and anchor is not r and "check" in r and "check" in anchor:
        return f"{report.compare_fingerprints(r['check'], anchor['check']):.1e}"
    return ""


def _is_kfac(case: str) -> bool:
    return case.split("/", 1)[-1] in KFAC_CASES


def _kfac_check(which: str, ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    """What KFAC made of the model (`build`), or how curvlinops' result compares with
    zodmem's on the same entries."""
    info = ours.get("info", {}) if ours is not None else {}
    if "refused" in info:
        leaf = re.search(r"the leaf (\S+) of shape (\(.*?\))", info["refused"])
        return f"zm refused: {leaf.group(1)} {leaf.group(2)} in no layer" if leaf else "zm refused"
    other = theirs["info"] if theirs is not None and "error" not in theirs else {}
    if which == "kfac-build":
        cells = []
        if "kfac_layers" in info:
            dense = info["kfac_dense_blocks"]
            largest = f" (≤ {info['kfac_dense_largest']} entries)" if dense else ""
            cells.append(f"zm: {info['kfac_layers']} layers, {dense} dense blocks{largest}")
        if "kfac_leaves_curvlinops" in other:
            left = other.get("curvlinops_kfac_left_out", 0)
            cells.append(f"curvlinops: {other['kfac_leaves_curvlinops']} leaves, {left} left out")
        return "; ".join(cells)
    if which == "kfac-logdet" and "logdet_damped_zodmem" in other:
        mine, theirs = other["logdet_damped_zodmem"], other["logdet_damped_curvlinops_factors"]
        return f"{abs(theirs - mine) / abs(mine):.1e} vs zm (damped, from its factors)"
    if other.get("agreement_vs_zodmem") is not None:
        return f"{other['agreement_vs_zodmem']:.1e} vs zm"
    return ""


def _kfac_table(results: list[dict[str, Any]]) -> str:
    """One row a model and KFAC case: zodmem's figures, curvlinops', their ratios."""
    by_case = {r["case"]: r for r in results}
    headers = [
        "model",
        "case",
        "zm first (s)",
        "zm steady (s)",
        "zm peak - floor (MB)",
        "curvlinops first (s)",
        "curvlinops steady (s)",
        "curvlinops peak - floor (MB)",
        "steady zm / curvlinops",
        "peak zm / curvlinops",
        "check",
    ]
    rows = []
    for model in MODELS:
        for which in KFAC_CASES:
            ours = by_case.get(f"{model}:zm/{which}")
            theirs = by_case.get(f"{model}:curvlinops/{which}")
            if ours is None and theirs is None:
                continue
            figures = []
            for r, floor_case in ((ours, "floor"), (theirs, "torch-floor")):
                floor = by_case.get(f"{model}:{floor_case}")
                floor = floor if floor is not None and "error" not in floor else None
                if r is None:
                    missing = "n/a" if model in _NO_CURVLINOPS_KFAC else ""
                    figures.append(((missing, "", ""), None, None))
                elif "error" in r:
                    figures.append(((report.failed_row(r, 2)[1][:60], "", ""), None, None))
                elif "refused" in r["info"]:
                    figures.append((("refused", "", ""), None, None))
                else:
                    above = report.above(r, floor)
                    steady = r.get("steady_min_s")
                    cells = (
                        report.number(r["time_s"], ".3g"),
                        report.number(steady, ".3g"),
                        report.megabytes(above),
                    )
                    figures.append((cells, steady, above))
            (zm_cells, zm_steady, zm_above), (cl_cells, cl_steady, cl_above) = figures
            no_anchor = model in _NO_CURVLINOPS_KFAC
            rows.append(
                [
                    model,
                    which,
                    *zm_cells,
                    *cl_cells,
                    "n/a" if no_anchor else report.ratio(zm_steady, cl_steady, ".3g"),
                    "n/a" if no_anchor else report.ratio(zm_above, cl_above, ".3g"),
                    _kfac_check(which, ours, theirs),
                ]
            )
    return report.markdown_table(headers, rows)


def _table(model: str, results: list[dict[str, Any]]) -> str:
    by_case = {r["case"].split(":", 1)[1]: r for r in results}
    device = any(r.get("info", {}).get("device_peak_bytes") for r in results)
    headers = [
        "case",
        "first call (s)",
        "steady (s)",
        "peak - floor (MB)",
        "steady / anchor",
        "peak / anchor",
        "check",
    ]
    if device:
        headers.insert(4, "device peak - floor (MB)")
    rows = []
    for case, r in by_case.items():
        if case in ("floor", "torch-floor") or _is_kfac(case):
            continue
        if "error" in r:
            rows.append(report.failed_row(r, len(headers), shown=case))
            continue
        floor = by_case.get(_floor_of(case))
        floor = floor if floor is not None and "error" not in floor else None
        above = report.above(r, floor)
        anchor = by_case.get(ANCHOR.get(case, ""))
        anchor = anchor if anchor is not None and "error" not in anchor else None
        anchor_above = None
        if anchor is not None:
            anchor_above = report.above(
                anchor, by_case.get(_floor_of(anchor["case"].split(":")[1]))
            )
        row = [
            case,
            report.number(r["time_s"], ".3g"),
            report.number(r.get("steady_min_s"), ".3g"),
            report.megabytes(above),
            report.ratio(r.get("steady_min_s"), anchor.get("steady_min_s") if anchor else None),
            report.ratio(above, anchor_above),
            _check(case, r, anchor),
        ]
        if device:
            device_above = report.above(
                r["info"], floor["info"] if floor else None, "device_peak_bytes"
            )
            row.insert(4, report.megabytes(device_above))
        rows.append(row)
    return report.markdown_table(headers, rows)


def _describe(info: dict[str, Any]) -> str:
    shapes = {
        "mlp": "eqx.nn.MLP(32, 1, {width}, {depth}), mean squared error over {points} points",
        "cnn": "ResNet-style CNN with GroupNorm, {channels}-{channels2} channels, {blocks} "
        "block(s) per stage, {images} images 3x{side}x{side}, 10 classes, cross-entropy",
        "gpt": "nanoGPT-style transformer, {depth} blocks, width {width}, {heads} heads, "
        "{sequences} x {length} tokens, vocabulary {vocabulary}, tied head, cross-entropy",
        "rnn": "GRU (lax.scan) over {steps} steps, {features} features, hidden {hidden}, "
        "{sequences} sequences, mean squared error",
        "physics": "neural ODE (MLP field, width {width}, depth {depth}), diffrax Tsit5, "
        "{steps} fixed steps, {trajectories} trajectories x {observations} observations, "
        "mean squared error",
    }[info["model"]]
    text = shapes.format(**info, channels2=2 * info.get("channels", 0))
    return (
        f"**{info['model']}** ({info['size']} size): {text}; n = {info['n']:,} parameters in "
        f"{info['leaves']} leaves; max_memory={info['max_memory']}, {info['vectors']} vectors, "
        f"{info['lanczos_steps']} Lanczos steps, {info['probes']} probes."
    )


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for model in MODELS:
        mine = [r for r in results if r["case"].startswith(model + ":")]
        if not mine:
            continue
        infos = [r["info"] for r in mine if "info" in r]
        lines += [_describe(infos[0]) if infos else f"**{model}**", ""]
        if any(not _is_kfac(r["case"].split(":")[1]) for r in mine if "floor" not in r["case"]):
            lines += [_table(model, mine), ""]
        torch_info = next((r["info"] for r in mine if r["case"].endswith(":torch-floor")), None)
        if torch_info and "curvlinops" in torch_info:
            remark = f"; copied weights equal to {torch_info['copied_weights_max_error']:.1e}"
            lines += [report.curvlinops_line(torch_info, remark), ""]
    if any(_is_kfac(r["case"].split(":")[1]) for r in results):
        lines += [
            f"**KFAC** (type-2, damping {_DAMPING:g}), zodmem against curvlinops' "
            "KFACLinearOperator on the parameters of its Linear and Conv2d modules:",
            "",
            _kfac_table(results),
            "",
            "kfac-build: the factors over the data (zm: `zm.KFAC(...)(model, inputs, "
            "targets)`; curvlinops: a new operator and `compute_kronecker_factors()`; "
            "neither eigendecomposes them); kfac-mv, kfac-solve, kfac-logdet: `F.mv(v)`, "
            "`F.solve(v, damping)`, `F.logdet(damping)` (zm: the factors' "
            "eigendecompositions in the first solve or logdet, kept for the others; "
            "curvlinops: `@ v`, "
            "`KFACInverseLinearOperator(F, damping, use_exact_damping=True) @ v` with the "
            "eigendecompositions in its first call, and its undamped `logdet`) on the built "
            "operator, the peak started afresh after building (held factors included); "
            "check: curvlinops' result against zodmem's on the same entries.",
            "",
        ]
    lines.append(
        "first call: wall time with tracing, compiling and planning; steady: the fastest of "
        "the further calls; peak - floor: peak resident memory above the model's floor "
        "(above torch-floor for curvlinops); anchor: plain JAX for the products, matfree "
        "(over plain JAX products) for eigsh and the trace; check: the products' largest "
        "sampled difference from the anchor's, relative to the largest entry (vs zm: "
        "curvlinops' first column against zodmem's op.mv, whole vector), the top 5 "
        "eigenvalues' largest difference from matfree's, or the trace's estimate ± its "
        "standard error."
    )
    return "\n".join(lines)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}"
    )
    parser.add_argument("--full", action="store_true", help="the larger sizes, for a GPU")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="the headline cases at the --full sizes; results in models_gpu.json",
    )
    parser.add_argument(
        "--max-memory",
        default=None,
        help='max_memory of zodmem\'s operators (default "2GB", "16GB" at the --full sizes)',
    )
    parser.add_argument("--vectors", type=int, default=8, help="columns of V in the blocks")
    parser.add_argument("--probes", type=int, default=None, help="Hutchinson probes (all models)")
    parser.add_argument("--lanczos-steps", type=int, default=None, help="products of eigsh")
    parser.add_argument(
        "--long-call",
        type=float,
        default=60.0,
        help="seconds: a first call longer than this is followed by one further call",
    )


def _selected(argv: list[str]) -> tuple[list[str], argparse.Namespace]:
    """The `model:case` names that `--models`, `--cases` and `--gpu` select (every model's
    floors with them), and those options."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cases", default=None)
    parser.add_argument("--gpu", action="store_true")
    options, _ = parser.parse_known_args(argv)
    models = [m.strip() for m in options.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"models.py: unknown models {unknown}; choose from {list(MODELS)}.")
    wanted = None
    if options.cases is not None:
        wanted = [c.strip() for c in options.cases.split(",") if c.strip()]
        for case in wanted:
            short = case.split(":", 1)[-1]
            if short not in CASE_NAMES:
                raise SystemExit(
                    f"models.py: unknown case {case!r}; choose from {list(CASE_NAMES)}, "
                    "alone or as model:case."
                )
    names = []
    for model in models:
        for case in cases_of(model):
            if options.gpu and case not in HEADLINE:
                continue
            floor = case in ("floor", "torch-floor")
            if wanted is None or floor or case in wanted or f"{model}:{case}" in wanted:
                names.append(f"{model}:{case}")
    # A floor alone is dropped where the model has no other case selected.
    chosen = {n.split(":")[0] for n in names if n.split(":")[1] not in ("floor", "torch-floor")}
    names = [n for n in names if n.split(":")[0] in chosen]
    uses_torch = {n.split(":")[0] for n in names if ":curvlinops/" in n}
    names = [n for n in names if not n.endswith(":torch-floor") or n.split(":")[0] in uses_torch]
    return names, options


def _without(argv: list[str], option: str) -> list[str]:
    """`argv` without `option` and its value (`--x v` or `--x=v`)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == option:
            skip = True
        elif not token.startswith(option + "="):
            out.append(token)
    return out


def _value(argv: list[str], option: str) -> str | None:
    """The value given to `option` in `argv` (`--x v` or `--x=v`), or None."""
    for i, token in enumerate(argv):
        if token == option and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(option + "="):
            return token.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    options = dict(
        name=_NAME,
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report_text,
        add_arguments=_add_arguments,
        steady_calls=3,
    )
    if "--child" in argv:
        report.main(**options, argv=argv)
        return
    names, selected = _selected(argv)
    if not names:
        raise SystemExit("models.py: no case selected.")
    run = _without(argv, "--cases") + ["--cases", ",".join(names)]
    if selected.gpu and _value(argv, "--save-as") is None:
        run += ["--save-as", "models_gpu" + ("_quick" if "--quick" in argv else "")]
    if selected.gpu and _value(argv, "--timeout") is None:
        run += ["--timeout", "150"]  # so that one stuck case cannot spend a GPU's lease
    # The command recorded is the one typed, not its expanded `--cases`.
    report.main(**options, argv=run, command=argv)


if __name__ == "__main__":
    main()
