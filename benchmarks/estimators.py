"""Curvature estimators: top eigenvalues, Hutchinson's trace and the exact diagonal.

zodmem's estimators (`zm.eigsh`, `zm.trace`, `zm.diagonal`) on the reference problem
(`problems.reference()`: an `eqx.nn.MLP(32, 1, 96, 2)` with a mean-squared loss over 256
points: n = 12,577 float32, a dense Hessian of 633 MB), against matfree, curvlinops
and the dense Hessian. Every zodmem case takes its products from
`op = zm.BatchedHessian(loss, max_memory=...).operator(model, xs, ys)`, with
`--operator-memory` (default "100MB") as the budget, `--trace-memory` (default "150MB")
for the traces; the targets of a tenth of the dense Hessian (63 MB) are held on the peak
measured above the floor, not on the budget. Each case runs in its own process (see
`report.py`):

- `floor`, `torch-floor`: the imports, model and data; the same with torch imported,
  its model built and curvlinops' operators made.
- The top 5 eigenvalues of the Hessian to a relative tolerance of 1e-6:

  * `zodmem-eigsh`: `zm.eigsh(op, 5, tol=1e-6)` (Lanczos with full
    reorthogonalisation, stopping once the 5 Ritz pairs have converged);
  * `matfree-lanczos`: matfree's Lanczos tridiagonalisation,
    `matfree.decomp.tridiag_sym(80, reortho="full")`, over the product
    `v -> jax.jvp(jax.grad(f), (p,), (v,))[1]` on the raveled parameters `p`, then the
    5 largest eigenvalues of the `(80, 80)` tridiagonal matrix, all under one
    `jax.jit` (a fixed number of products, whatever the accuracy they reach; `verify`
    reports the residuals they leave);
  * `curvlinops-eigsh`: `scipy.sparse.linalg.eigsh(H, k=5, which="LA", tol=1e-6)` with
    `H` curvlinops' `HessianLinearOperator(...).to_scipy()`, its own SciPy
    `LinearOperator` (ARPACK in float64 over float32 products in torch);
  * `dense-eigh`, with `--dense` only: the dense Hessian of `zodmem-hessian-dense`, then
    `jnp.linalg.eigvalsh`. It takes minutes and GBs (`results/estimators_dense.json`),
    which the full run cannot afford; without `--dense` it is left out.

- Hutchinson's trace from 100 Rademacher probes:

  * `zodmem-trace-hutchinson`:
    `zm.trace(op, method="hutchinson", num_probes=100, key=jax.random.key(0))`;
  * `matfree-trace-vmap`: matfree's Monte Carlo estimator,
    `matfree.stochtrace.estimator_monte_carlo_mean_and_sem(monte_carlo_trace(),
    sampler_signs(p, num=100))`, which vmaps the integrand over all 100 probes at once;
  * `matfree-trace-map`: the way matfree's documentation gives to save memory: the same
    estimator with one probe per key, `jax.lax.map` over 100 keys, the mean (and its
    standard error) of the 100 estimates;
  * `curvlinops-trace`: `curvlinops.hutchinson_trace(H, num_matvecs=100)` on curvlinops'
    Hessian operator;
  * `zodmem-trace-hutch++`: `zm.trace(op, method="hutch++", num_probes=100, ...)`, for
    information: as many products, a third of them sketching the top of the spectrum.

- The exact diagonal:

  * `zodmem-diagonal-exact`: `zm.diagonal(op)`, `n` products in blocks planned from the
    operator's budget (`verify` records the plan);
  * `zodmem-hessian-dense`: `zm.BatchedHessian(loss, max_memory="1GB")(model, xs, ys)`,
    then `jnp.diag`, the route through the dense matrix;
  * curvlinops 3.0.1 has no exact Hessian diagonal (only the estimators
    `hutchinson_diag` and `xdiag`), so it has no case here.

- `verify`: in one process, zodmem's top 5 against matfree's and curvlinops' (largest
  difference relative to the largest eigenvalue), with the products `zm.eigsh` took and
  the residuals it and matfree's 80 steps leave; zodmem's Hutchinson and Hutch++
  traces against the exact trace (in units of their standard errors); the exact
  diagonal against the diagonal of the dense Hessian; with `--dense`, the top 5 against
  the dense matrix's.

Every timed case reports its first call (tracing, compiling and planning included),
the fastest of `--steady-calls` further calls, and its peak resident memory above its
floor (above `torch-floor` for curvlinops). The report holds zodmem to these targets,
each against its anchor in the same run:

- top eigenvalues: peak above the floor at most a tenth of the dense Hessian, and first
  call and steady time at most `matfree-lanczos`'s;
- Hutchinson's trace: time and peak above the floor at most `matfree-trace-map`'s;
- exact diagonal: peak above the floor at most a tenth of the dense Hessian, and time at
  most 1.2 times `zodmem-hessian-dense`'s;

and gives every other case's figures as ratios to zodmem's of the same task.

    python benchmarks/estimators.py                  # every case but dense-eigh
    python benchmarks/estimators.py --dense          # with dense-eigh (minutes, GBs)
    python benchmarks/estimators.py --quick          # a small model, to smoke-test
    python benchmarks/estimators.py --cases floor,zodmem-eigsh,matfree-lanczos

matfree, torch and curvlinops-for-pytorch are not dependencies of zodmem; without them
their cases say so and the rest run (see `curvature.py` for installing the torch ones).

Results go to `benchmarks/results/estimators.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

_DENSE_MEMORY = "1GB"
_MB = report.MB


def _problem(args: argparse.Namespace) -> Any:
    """The reference problem, its budgets in its record."""
    import problems

    r = problems.reference(quick=args.quick)
    r.info.update(operator_max_memory=args.operator_memory, trace_max_memory=args.trace_memory)
    return r


def _operator(r: Any, args: argparse.Namespace, max_memory: str | None = None) -> Any:
    """zodmem's Hessian operator at `--operator-memory` (or at `max_memory`)."""
    import zodmem as zm

    budget = args.operator_memory if max_memory is None else max_memory
    return zm.BatchedHessian(r.loss, max_memory=budget).operator(r.model, r.xs, r.ys)


def _hvp(r: Any) -> Any:
    """One Hessian-vector product on the raveled parameters, the plain JAX way."""
    import jax

    def f(flat):
        return r.loss_of_flat(flat, r.xs, r.ys)

    return lambda v: jax.jvp(jax.grad(f), (r.flat,), (v,))[1]


def _info(r: Any, tool: str, **more: Any) -> dict[str, Any]:
    return {**r.info, "tool": tool, **more}


def _curvlinops(r: Any) -> tuple[Any, dict[str, Any]]:
    """curvlinops' operators on the same MLP, data and loss in PyTorch, and what to
    record of them; or None and the reason there are none."""
    import problems

    try:
        c = problems.curvlinops_operators(r.problem)
    except ImportError as error:
        missing = f"torch or curvlinops-for-pytorch not installed ({error})"
        return None, _info(r, "curvlinops", missing=missing)
    return c, _info(r, "curvlinops", **c.info)


def floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, _info(_problem(args), "floor"))


def torch_floor(args: argparse.Namespace) -> report.Case:
    _, info = _curvlinops(_problem(args))
    return report.Case(None, {**info, "tool": "floor"})


def _noted(compute: Any, info: dict[str, Any], note: Any) -> Any:
    """`compute`, writing `note(result)`'s figures into `info` after each call (the
    harness stores `info` once the calls are done)."""

    def run():
        result = compute()
        info.update(note(result))
        return result

    return run


def _values(values: Any) -> dict[str, Any]:
    import numpy as np

    return {"values": [float(v) for v in np.sort(np.asarray(values, np.float64))]}


def _estimate(result: Any) -> dict[str, Any]:
    import numpy as np

    estimate, error = np.asarray(result, np.float64).ravel()[:2]
    return {"estimate": float(estimate), "standard_error": float(error)}


# -- top eigenvalues -------------------------------------------------------------------


def zodmem_eigsh(args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    p = _problem(args)
    op = _operator(p, args)
    info = _info(p, "zodmem", k=args.k, tol=args.tol)

    def compute():
        values, _, found = zm.eigsh(op, args.k, tol=args.tol, return_info=True)
        return values, found

    def note(result):
        values, found = result
        return {
            **_values(values),
            "num_products": int(found.num_products),
            "converged": bool(found.converged),
        }

    return report.Case(_noted(compute, info, note), info, args.steady_calls)


def _matfree_top(p: Any, args: argparse.Namespace) -> Any:
    """The `k` largest Ritz values of matfree's Lanczos tridiagonalisation, compiled,
    with the tridiagonal matrix and its last residual (for `verify`)."""
    import jax
    import jax.numpy as jnp
    from matfree import decomp

    hvp = _hvp(p)
    tridiagonalise = decomp.tridiag_sym(args.matfree_steps, reortho="full")

    @jax.jit
    def top(start):
        result = tridiagonalise(hvp, start)
        return jnp.linalg.eigvalsh(result.J_small)[-args.k :], result

    start = jax.random.normal(jax.random.key(0), p.flat.shape, p.flat.dtype)
    return top, start


def matfree_lanczos(args: argparse.Namespace) -> report.Case:
    p = _problem(args)
    try:
        top, start = _matfree_top(p, args)
    except ImportError as error:
        raise SystemExit(f"matfree not installed ({error})") from None
    info = _info(
        p,
        "matfree",
        k=args.k,
        num_products=args.matfree_steps,
        **report.package_versions("matfree"),
    )
    compute = _noted(lambda: top(start)[0], info, _values)
    return report.Case(compute, info, args.steady_calls)


def curvlinops_eigsh(args: argparse.Namespace) -> report.Case:
    import numpy as np
    import scipy
    from scipy.sparse.linalg import eigsh

    c, info = _curvlinops(_problem(args))
    if c is None:
        raise SystemExit(info["missing"])
    # curvlinops' own SciPy view of its operator: products in torch, ARPACK in float64.
    hessian = c.operators["hessian"].to_scipy()

    def compute():
        return np.sort(eigsh(hessian, k=args.k, which="LA", tol=args.tol)[0])

    info.update(k=args.k, tol=args.tol, scipy=scipy.__version__)
    info["arpack_dtype"] = str(hessian.dtype)
    return report.Case(_noted(compute, info, _values), info, args.steady_calls)


def _dense_hessian(r: Any) -> Any:
    import zodmem as zm

    transform = zm.BatchedHessian(r.loss, max_memory=_DENSE_MEMORY)
    return lambda: transform(r.model, r.xs, r.ys)


def dense_eigh(args: argparse.Namespace) -> report.Case:
    import jax
    import jax.numpy as jnp

    p = _problem(args)
    dense = _dense_hessian(p)
    top = jax.jit(lambda matrix: jnp.linalg.eigvalsh(matrix)[-args.k :])
    info = _info(p, "zodmem", k=args.k, max_memory=_DENSE_MEMORY)
    compute = _noted(lambda: top(dense()), info, _values)
    return report.Case(compute, info, args.dense_steady_calls)


# -- Hutchinson's trace ------------------------------------------------------------------


def _zodmem_trace(args: argparse.Namespace, method: str) -> report.Case:
    import jax
    import jax.numpy as jnp

    import zodmem as zm

    p = _problem(args)
    op = _operator(p, args, args.trace_memory)

    def compute():
        estimate, error = zm.trace(op, method=method, num_probes=args.probes, key=jax.random.key(0))
        return jnp.stack([estimate, error])

    info = _info(p, "zodmem", probes=args.probes, method=method, max_memory=args.trace_memory)
    return report.Case(_noted(compute, info, _estimate), info, args.steady_calls)


def zodmem_trace_hutchinson(args: argparse.Namespace) -> report.Case:
    return _zodmem_trace(args, "hutchinson")


def zodmem_trace_hutchpp(args: argparse.Namespace) -> report.Case:
    return _zodmem_trace(args, "hutch++")


def _matfree_trace(p: Any, probes: int, mapped: bool) -> Any:
    """matfree's Hutchinson estimate and its standard error, compiled: the probes
    vmapped all at once, or one probe per key under `jax.lax.map`."""
    import jax
    import jax.numpy as jnp
    from matfree import stochtrace

    hvp, flat = _hvp(p), p.flat
    integrand = stochtrace.monte_carlo_trace()
    if not mapped:
        sampler = stochtrace.sampler_signs(flat, num=probes)
        estimate = stochtrace.estimator_monte_carlo_mean_and_sem(integrand, sampler)
        return jax.jit(lambda key: jnp.stack(estimate(hvp, key)))
    one = stochtrace.estimator_monte_carlo(integrand, stochtrace.sampler_signs(flat, num=1))

    def estimate_mapped(key):
        samples = jax.lax.map(lambda k: one(hvp, k), jax.random.split(key, probes))
        error = jnp.std(samples, ddof=1) / jnp.sqrt(probes)
        return jnp.stack([jnp.mean(samples), error])

    return jax.jit(estimate_mapped)


def _matfree_trace_case(args: argparse.Namespace, mapped: bool) -> report.Case:
    import jax

    p = _problem(args)
    try:
        estimate = _matfree_trace(p, args.probes, mapped)
    except ImportError as error:
        raise SystemExit(f"matfree not installed ({error})") from None
    key = jax.random.key(0)
    info = _info(p, "matfree", probes=args.probes, **report.package_versions("matfree"))
    return report.Case(_noted(lambda: estimate(key), info, _estimate), info, args.steady_calls)


def matfree_trace_vmap(args: argparse.Namespace) -> report.Case:
    return _matfree_trace_case(args, mapped=False)


def matfree_trace_map(args: argparse.Namespace) -> report.Case:
    return _matfree_trace_case(args, mapped=True)


def curvlinops_trace(args: argparse.Namespace) -> report.Case:
    import numpy as np

    c, info = _curvlinops(_problem(args))
    if c is None:
        raise SystemExit(info["missing"])
    import curvlinops
    import torch

    hessian = c.operators["hessian"]
    torch.manual_seed(0)

    def compute():
        with torch.no_grad():
            return np.atleast_1d(curvlinops.hutchinson_trace(hessian, args.probes).numpy())

    def note(result):
        return {"estimate": float(result[0])}

    info["probes"] = args.probes
    return report.Case(_noted(compute, info, note), info, args.steady_calls)


# -- the exact diagonal ----------------------------------------------------------------


def _diagonal_plan(op: Any) -> dict[str, Any]:
    """The blocks `zm.diagonal(op)` is planned into, read from zodmem's probe engine (a
    private interface: should it have moved, the record says why there is no plan)."""
    try:
        from zodmem._estimators._diagonal import UnitDiagonal
        from zodmem._estimators._probes import Probes
        from zodmem._operators._flat import flat_view

        engine = Probes(
            flat_view(op, "zm.diagonal"),
            job=UnitDiagonal(),
            owner="zm.diagonal",
            max_memory=op.transform.max_memory,
            strategy=getattr(op.transform, "strategy", None),
        )
        plan = engine.plan()
    except Exception as error:  # noqa: BLE001  (the figure is for information only)
        return {"plan_error": f"{type(error).__name__}: {error}"}
    return {
        "plan_block_size": int(plan.block_size),
        "plan_num_blocks": int(plan.num_blocks),
        "plan_peak_bytes": int(plan.peak_bytes),
    }


def zodmem_diagonal_exact(args: argparse.Namespace) -> report.Case:
    import zodmem as zm

    p = _problem(args)
    op = _operator(p, args)
    return report.Case(lambda: zm.diagonal(op), _info(p, "zodmem"), args.steady_calls)


def zodmem_hessian_dense(args: argparse.Namespace) -> report.Case:
    import jax.numpy as jnp

    p = _problem(args)
    dense = _dense_hessian(p)
    return report.Case(
        lambda: jnp.diag(dense()),
        _info(p, "zodmem", max_memory=_DENSE_MEMORY),
        args.dense_steady_calls,
    )


# -- correctness -----------------------------------------------------------------------


def verify(args: argparse.Namespace) -> report.Case:
    """The estimates of every tool once, in one process, against each other and the
    exact figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zodmem as zm

    p = _problem(args)
    op = _operator(p, args)
    relative = report.relative_difference
    checks: dict[str, Any] = {}
    values, _, found = zm.eigsh(op, args.k, tol=args.tol, return_info=True)
    values = np.asarray(values, np.float64)
    bound = args.tol * np.abs(values)
    checks["zodmem-eigsh top values"] = [float(v) for v in values]
    checks["zodmem-eigsh products"] = int(found.num_products)
    checks["zodmem-eigsh converged"] = bool(found.converged)
    checks["zodmem-eigsh largest residual / (tol |value|)"] = float(
        np.max(np.asarray(found.residual_norms) / bound)
    )
    try:
        top, start = _matfree_top(p, args)
    except ImportError as error:
        checks["matfree"] = f"not installed ({error})"
    else:
        matfree_values, result = top(start)
        matfree_values = np.asarray(matfree_values, np.float64)
        # Residual norms of the Ritz pairs: |last residual| x |last entry of the eigenvector|.
        ritz, vectors = np.linalg.eigh(np.asarray(result.J_small, np.float64))
        beta = float(jnp.linalg.norm(result.residual))
        residuals = np.abs(beta * vectors[-1, -args.k :])
        checks["matfree-lanczos largest residual / (tol |value|)"] = float(
            np.max(residuals / (args.tol * np.abs(ritz[-args.k :])))
        )
        checks["zodmem-eigsh vs matfree-lanczos"] = relative(values, matfree_values)
    c, info = _curvlinops(p)
    if c is None:
        checks["curvlinops"] = info["missing"]
    else:
        from scipy.sparse.linalg import LinearOperator, eigsh as scipy_eigsh

        hessian = c.operators["hessian"].to_scipy()
        count = [0]

        def counted(v):
            count[0] += 1
            return hessian @ v

        counting = LinearOperator(hessian.shape, matvec=counted, dtype=hessian.dtype)
        scipy_values = scipy_eigsh(counting, k=args.k, which="LA", tol=args.tol)[0]
        checks["curvlinops-eigsh products"] = count[0]
        checks["zodmem-eigsh vs curvlinops-eigsh"] = relative(values, np.sort(scipy_values))

    exact_diagonal = np.asarray(zm.diagonal(op), np.float64)
    exact_trace = float(np.sum(exact_diagonal))
    checks["exact trace"] = exact_trace
    trace_op = _operator(p, args, args.trace_memory)
    for method in ("hutchinson", "hutch++"):
        estimate, error = zm.trace(
            trace_op, method=method, num_probes=args.probes, key=jax.random.key(0)
        )
        checks[f"zodmem-trace-{method}: (estimate - exact) / standard error"] = float(
            (float(estimate) - exact_trace) / float(error)
        )
        checks[f"zodmem-trace-{method}: relative standard error"] = float(error) / abs(exact_trace)
    checks["zodmem-diagonal-exact plan"] = _diagonal_plan(op)
    dense = _dense_hessian(p)()
    dense_diagonal = np.asarray(jnp.diag(dense), np.float64)
    checks["zodmem-diagonal-exact vs diag(zodmem-hessian-dense)"] = relative(
        exact_diagonal, dense_diagonal
    )
    if args.dense:
        exact_values = np.asarray(jnp.linalg.eigvalsh(dense)[-args.k :], np.float64)
        checks["zodmem-eigsh vs dense-eigh"] = relative(values, exact_values)
    del dense
    return report.Case(lambda: jnp.asarray(exact_diagonal), _info(p, "check", checks=checks))


CASES = {
    "floor": floor,
    "torch-floor": torch_floor,
    "zodmem-eigsh": zodmem_eigsh,
    "matfree-lanczos": matfree_lanczos,
    "curvlinops-eigsh": curvlinops_eigsh,
    "dense-eigh": dense_eigh,
    "zodmem-trace-hutchinson": zodmem_trace_hutchinson,
    "matfree-trace-vmap": matfree_trace_vmap,
    "matfree-trace-map": matfree_trace_map,
    "curvlinops-trace": curvlinops_trace,
    "zodmem-trace-hutch++": zodmem_trace_hutchpp,
    "zodmem-diagonal-exact": zodmem_diagonal_exact,
    "zodmem-hessian-dense": zodmem_hessian_dense,
    "verify": verify,
}

# What each estimate is measured against: zodmem's case of a task and the others'.
_TASKS = {
    "top eigenvalues": ("zodmem-eigsh", ("matfree-lanczos", "curvlinops-eigsh", "dense-eigh")),
    "Hutchinson trace": (
        "zodmem-trace-hutchinson",
        ("matfree-trace-map", "matfree-trace-vmap", "curvlinops-trace", "zodmem-trace-hutch++"),
    ),
    "exact diagonal": ("zodmem-diagonal-exact", ("zodmem-hessian-dense",)),
}
# The exact diagonal may take this much longer than the route through the dense Hessian.
_DIAGONAL_TIME_VS_DENSE = 1.2
# The peak above the floor that the zodmem cases are held to, as a share of the Hessian.
_PEAK_SHARE_OF_HESSIAN = 0.1


# -- the report ------------------------------------------------------------------------


def _result(r: dict[str, Any], exact_trace: float | None) -> str:
    """What the case found, in a few characters."""
    info = r["info"]
    if "values" in info:
        shown = f"top {info['values'][-1]:.6g}"
        products = info.get("num_products")
        return shown + (f", {products} products" if products is not None else "")
    if "estimate" in info:
        shown = f"{info['estimate']:.5g}"
        if "standard_error" in info:
            shown += f" +- {info['standard_error']:.2g}"
        if exact_trace is not None:
            shown += f" ({info['estimate'] / exact_trace - 1:+.1%})"
        return shown
    if "check" in r and r["case"] != "floor":
        return f"sum {r['check']['sum']:.6g}"
    return ""


def _check(name: str, r: dict[str, Any], by_case: dict[str, Any]) -> str:
    """Agreement with zodmem's case of the same task (the dense route for the diagonal)."""
    for task, (zodmem_case, others) in _TASKS.items():
        reference = by_case.get("zodmem-hessian-dense" if task == "exact diagonal" else zodmem_case)
        if name not in (zodmem_case, *others) or reference is None or reference is r:
            continue
        if "values" in r["info"] and "values" in reference["info"]:
            difference = report.relative_difference(
                r["info"]["values"], reference["info"]["values"]
            )
            return f"{difference:.1e}"
        if task == "exact diagonal" and "check" in r and "check" in reference:
            return f"{report.compare_fingerprints(r['check'], reference['check']):.1e}"
    return ""


def _seconds(value: float | None) -> str:
    return report.number(value, ".3f" if value is not None and value < 10 else ".1f")


def _above(name: str, by_case: dict[str, Any]) -> float | None:
    """The case's peak above `floor` (above `torch-floor` for curvlinops)."""
    floor_case = by_case.get("torch-floor" if name.startswith("curvlinops") else "floor")
    return report.above(by_case.get(name), floor_case)


def _verdict(what: str, value: float, limit: float, unit: str) -> str:
    return report.verdict(what, value, limit, unit, form=".3g")


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = report.succeeded(results)
    info = next((r["info"] for r in by_case.values()), {})
    checks = by_case.get("verify", {}).get("info", {}).get("checks", {})
    exact_trace = checks.get("exact trace")
    headers = [
        "case",
        "first call (s)",
        "compile (s)",
        "steady (s)",
        "peak (MB)",
        "peak - floor (MB)",
        "result",
        "check",
    ]

    def row(r: dict[str, Any]) -> list[Any] | None:
        name = r["case"]
        if name == "verify":
            return None
        return [
            name,
            _seconds(r.get("time_s")),
            "" if name.startswith("curvlinops") else _seconds(r.get("compile_s")),
            _seconds(r.get("steady_min_s")),
            report.megabytes(r["peak_rss_bytes"]),
            "" if "floor" in name else report.megabytes(_above(name, by_case)),
            _result(r, exact_trace),
            _check(name, r, by_case),
        ]

    lines = [
        report.describe_mlp(info, "Estimators on the Hessian") + f"; zodmem's operator "
        f"at max_memory={args.operator_memory} (traces: {args.trace_memory}); top {args.k} "
        f"eigenvalues to tol={args.tol}, "
        f"traces from {args.probes} probes, matfree's Lanczos with "
        f"{args.matfree_steps} products.",
        "",
        report.case_table(results, headers, row),
        "",
        "first call: wall time, tracing, compiling and planning included (compile: the "
        "part JAX spent tracing and compiling); steady: the fastest of the further calls; "
        "peak - floor: peak resident memory above `floor` (above `torch-floor` for "
        "curvlinops); result: the largest eigenvalue (and the products taken), the trace "
        "estimate +- its standard error (and its error against the exact trace), or the sum "
        "of the diagonal; check: largest difference from zodmem's figures of the same task "
        "(from the dense Hessian's diagonal for the diagonals), relative to the largest.",
    ]
    if "dense-eigh" not in {r["case"] for r in results}:
        lines += [
            "",
            "dense-eigh not run: it needs --dense, and takes minutes and GBs.",
        ]
    if "torch-floor" in by_case:
        torch_info = by_case["torch-floor"]["info"]
        remark = (
            f"; curvlinops {torch_info.get('curvlinops')} has no exact Hessian diagonal (only "
            "the estimators hutchinson_diag and xdiag), so no curvlinops-diagonal case"
        )
        lines += ["", report.curvlinops_line(torch_info, remark)]
    if checks:
        lines += ["", "Correctness (verify, one process):"]
        for what, value in checks.items():
            if isinstance(value, float):
                value = f"{value:.3g}"
            elif isinstance(value, list):
                value = ", ".join(f"{v:.7g}" for v in value)
            elif isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items())
            lines.append(f"- {what}: {value}")
    lines += _targets(by_case)
    return "\n".join(lines)


def _targets(by_case: dict[str, Any]) -> list[str]:
    info = next((r["info"] for r in by_case.values()), {})
    share = _PEAK_SHARE_OF_HESSIAN * info.get("hessian_bytes", 0) / _MB
    lines = []

    def peak(name: str) -> list[str]:
        above = _above(name, by_case)
        if above is None:
            return []
        return [_verdict("peak - floor vs 0.1 x H", above / _MB, share, " MB")]

    def times(name: str, anchor: str, factor: float = 1.0) -> list[str]:
        r, a = by_case.get(name), by_case.get(anchor)
        if r is None or a is None:
            return []
        scale = f"{factor:g} x " if factor != 1 else ""
        verdicts = [
            _verdict(f"first call vs {scale}{anchor}", r["time_s"], factor * a["time_s"], " s")
        ]
        if "steady_min_s" in r and "steady_min_s" in a:
            verdicts.append(
                _verdict(
                    f"steady vs {scale}{anchor}",
                    r["steady_min_s"],
                    factor * a["steady_min_s"],
                    " s",
                )
            )
        return verdicts

    if "zodmem-eigsh" in by_case:
        verdicts = peak("zodmem-eigsh") + times("zodmem-eigsh", "matfree-lanczos")
        lines.append("- zodmem-eigsh: " + "; ".join(verdicts))
    name, anchor = "zodmem-trace-hutchinson", "matfree-trace-map"
    if name in by_case:
        verdicts = times(name, anchor)
        above, anchor_above = _above(name, by_case), _above(anchor, by_case)
        if above is not None and anchor_above is not None:
            verdicts.append(
                _verdict(f"peak - floor vs {anchor}", above / _MB, anchor_above / _MB, " MB")
            )
        lines.append(f"- {name}: " + "; ".join(verdicts))
    name = "zodmem-diagonal-exact"
    if name in by_case:
        verdicts = peak(name) + times(name, "zodmem-hessian-dense", _DIAGONAL_TIME_VS_DENSE)
        lines.append(f"- {name}: " + "; ".join(verdicts))
    if not lines:
        return []
    ratios = []
    for zodmem_case, others in _TASKS.values():
        z = by_case.get(zodmem_case)
        for name in (zodmem_case, *others):
            r = by_case.get(name)
            if r is None or z is None:
                continue
            above = _above(name, by_case)
            ratios.append(
                [
                    name,
                    f"{r['time_s'] / z['time_s']:.2f}",
                    f"{r['steady_min_s'] / z['steady_min_s']:.2f}"
                    if "steady_min_s" in r and "steady_min_s" in z
                    else "",
                    f"{above / _MB / share:.2f}" if above is not None and share else "",
                ]
            )
    return [
        "",
        "Targets:",
        *lines,
        "",
        "Each case against zodmem's of the same task (time / zodmem's time) and against the "
        f"budget (peak - floor / 0.1 x H = {share:.1f} MB):",
        "",
        report.markdown_table(
            ["case", "first call / zodmem", "steady / zodmem", "peak - floor / (0.1 x H)"],
            ratios,
        ),
    ]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--operator-memory",
        default="100MB",
        help="max_memory of zodmem's Hessian operator for eigsh and the diagonal",
    )
    parser.add_argument(
        "--trace-memory", default="150MB", help="max_memory of the operator of the traces"
    )
    parser.add_argument("--k", type=int, default=5, help="eigenvalues wanted")
    parser.add_argument("--tol", type=float, default=1e-6, help="eigsh's relative tolerance")
    parser.add_argument(
        "--matfree-steps", type=int, default=80, help="products of matfree's Lanczos"
    )
    parser.add_argument("--probes", type=int, default=100, help="probes of the traces")
    parser.add_argument(
        "--dense-steady-calls", type=int, default=1, help="further calls of the dense cases"
    )
    parser.add_argument(
        "--dense", action="store_true", help="also run dense-eigh (minutes and GBs)"
    )


def _selected_cases(argv: list[str]) -> dict[str, Any]:
    """Every case, with dense-eigh only when `--dense` or `--cases` names it."""
    if "--dense" in argv or any("dense-eigh" in a for a in argv):
        return CASES
    return {name: build for name, build in CASES.items() if name != "dense-eigh"}


if __name__ == "__main__":
    report.main(
        name="estimators",
        description=__doc__.splitlines()[0],
        cases=_selected_cases(sys.argv[1:]),
        report=report_text,
        add_arguments=_add_arguments,
        steady_calls=3,
    )
