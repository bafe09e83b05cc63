"""Curvature products and the dense GGN: zodmem against JAX and curvlinops.

The reference problem of `hessian_memory.py`: an `eqx.nn.MLP(32, 1, 96, 2)` with a
mean-squared loss over 256 points (n = 12,577, float32, CPU). Each case runs in its
own process (see `_harness.py`):

- `floor`: the imports, model, data and the 64 vectors; nothing computed.
- `zodmem-hvp-block`: 64 Hessian-vector products,
  `zm.BatchedHessian(loss, max_memory=...).operator(model, xs, ys).mm(V)`, `V` of
  shape `(n, 64)` (standard normal, fixed key).
- `zodmem-ggn-block`: 64 GGN-vector products,
  `zm.BatchedGGN(predict, zm.losses.SquaredError(weights=2 / N), max_memory=...)`
  `.operator(model, xs, ys).mm(V)`, `predict` the MLP's predictions:
  `SquaredError` is half the weighted squared error, so weights `2 / N` make it the
  reference mean-squared loss.
- `jax-hvp-vmap`: the JAX anchor for the Hessian products,
  `jax.vmap(lambda v: jax.jvp(jax.grad(f), (p,), (v,))[1], in_axes=1, out_axes=1)(V)`
  on the raveled parameters `p`, under `jax.jit` with `p` and the data as arguments
  (as zodmem's operators take them, and as any user whose weights change calls it).
- `jax-ggn-vmap`: the JAX anchor for the GGN products: `J^T (2 / N) J v` by
  `jax.jvp` and `jax.vjp` of the raveled predictions, vmapped over the columns, the
  same way.
- `jax-hvp-vmap-const` and `jax-ggn-vmap-const`: the same two programs closed over
  `p` and the data instead, so that XLA folds the forward pass into the program as a
  constant when it compiles it: for reference, not targets, since such a program
  holds for one set of weights only.
- `zodmem-ggn-dense` and `zodmem-hessian-dense`: the dense `(n, n)` GGN and Hessian,
  `zm.BatchedGGN(...)` and `zm.BatchedHessian(...)` with `max_memory="1GB"`.
- `jax-ggn-jacobian`: the dense GGN the way its shape allows here, for scale: the
  `(N, n)` Jacobian of the predictions by `jax.jacrev` (N = 256 outputs, far fewer than
  n), then `(2 / N) J^T J`, under `jax.jit`.
- `torch-floor`, `curvlinops-hessian` and `curvlinops-ggn`: the same MLP (the
  Equinox weights copied into a `torch.nn.Sequential` of `Linear` and `ReLU`,
  `eqx.nn.MLP`'s default activation; its final activation is the identity), the same
  data and `torch.nn.MSELoss()`: `HessianLinearOperator(...) @ V` and
  `GGNLinearOperator(...) @ V` of curvlinops-for-pytorch on the CPU, for the same 64
  vectors. Their peak is taken above `torch-floor` (the same process with torch
  imported and the model built).
- `verify`: every block of products once in one process, compared on the whole
  `(n, 64)` arrays: zodmem's against the JAX anchors, curvlinops' against zodmem's, and
  the dense GGN times `V` against the GGN block (largest difference relative to the
  largest |entry| of the reference, recorded in its `info`).

Every timed case reports its first call (tracing, compiling and any planning
included), the fastest of `--steady-calls` further calls, that time per vector, and
its peak resident memory above the floor.

    python benchmarks/curvature.py                  # every case, about 3 minutes on 2 cores
    python benchmarks/curvature.py --quick          # a small model, to smoke-test
    python benchmarks/curvature.py --cases floor,zodmem-hvp-block,jax-hvp-vmap

The torch cases need torch and curvlinops-for-pytorch, which zodmem does not depend
on; without them those cases say so and the JAX cases still run:

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    pip install --no-deps curvlinops-for-pytorch einops einconv linear_operator

Results go to `benchmarks/results/curvature.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
import hessian_memory  # noqa: E402

_MB = 1e6
_DENSE_MEMORY = "1GB"
_DENSE_MEMORY_BYTES = 1e9


def _problem(args: argparse.Namespace) -> dict[str, Any]:
    """The reference problem, its predictions, the GGN's loss and the vectors."""
    import jax
    import jax.numpy as jnp

    import zodmem as zm

    p = hessian_memory._problem(args)
    points = p["xs"].shape[0]

    def predict(model, xs, ys):
        return jax.vmap(model)(xs)[:, 0]

    # Half the weighted squared error with weights 2 / N is mean((prediction - y)**2).
    ggn_loss = zm.losses.SquaredError(weights=jnp.asarray(2.0 / points, p["flat"].dtype))
    vectors = jax.random.normal(
        jax.random.key(1), (p["flat"].size, args.vectors), dtype=p["flat"].dtype
    )
    jax.block_until_ready(vectors)
    info = {
        **p["info"],
        "vectors": args.vectors,
        "operator_max_memory": args.operator_memory,
        "dense_max_memory": _DENSE_MEMORY,
    }
    return {**p, "predict": predict, "ggn_loss": ggn_loss, "vectors": vectors, "info": info}


def _bytes(text: str) -> float:
    """Bytes of a budget written as zodmem takes it: a number with an optional unit."""
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = text.strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text.rstrip("B"))


# -- the JAX cases --------------------------------------------------------------------


def floor(args: argparse.Namespace) -> _harness.Case:
    return _harness.Case(None, {**_problem(args)["info"], "tool": "floor"})


def _hvp_operator(p: dict[str, Any], args: argparse.Namespace) -> Any:
    import zodmem as zm

    transform = zm.BatchedHessian(p["loss"], max_memory=args.operator_memory)
    return transform.operator(p["model"], p["xs"], p["ys"])


def _ggn_operator(p: dict[str, Any], max_memory: str) -> Any:
    import zodmem as zm

    transform = zm.BatchedGGN(p["predict"], p["ggn_loss"], max_memory=max_memory)
    return transform.operator(p["model"], p["xs"], p["ys"])


def _jax_hvp(p: dict[str, Any], constants: bool = False) -> Any:
    """The JAX anchor's block of HVPs, `V -> H V`: compiled with the raveled weights and
    the data as its arguments, as a user whose weights change calls it; with
    `constants`, closed over them, so that XLA folds the whole forward pass into the
    program when it compiles it (a program for one set of weights only)."""
    import jax

    loss = _of_flat(p, p["loss"])

    def block(flat, xs, ys, vectors):
        def product(v):
            return jax.jvp(jax.grad(lambda w: loss(w, xs, ys)), (flat,), (v,))[1]

        return jax.vmap(product, in_axes=1, out_axes=1)(vectors)

    return _anchor(block, p, constants)


def _anchor(block: Any, p: dict[str, Any], constants: bool) -> Any:
    """`V -> block(flat, xs, ys, V)` under `jax.jit`, the weights and data its arguments
    or (with `constants`) constants of the program."""
    import jax

    flat, xs, ys = p["flat"], p["xs"], p["ys"]
    if constants:
        return jax.jit(lambda vectors: block(flat, xs, ys, vectors))
    compiled = jax.jit(block)
    return lambda vectors: compiled(flat, xs, ys, vectors)


def _of_flat(p: dict[str, Any], fn: Any) -> Any:
    """`(flat, xs, ys) -> fn(model, xs, ys)`, the model rebuilt from its raveled
    parameters `flat`."""
    import equinox as eqx
    from jax.flatten_util import ravel_pytree

    params, static = eqx.partition(p["model"], eqx.is_inexact_array)
    _, unravel = ravel_pytree(params)

    def of_flat(flat, xs, ys):
        return fn(eqx.combine(unravel(flat), static), xs, ys)

    return of_flat


def _outputs_of_flat(p: dict[str, Any]) -> Any:
    """The predictions as a function of the raveled parameters and the data."""
    return _of_flat(p, p["predict"])


def _jax_ggn(p: dict[str, Any], constants: bool = False) -> Any:
    """The JAX anchor's block of GGN products, `V -> J^T (2 / N) J V`, as `_jax_hvp`."""
    import jax

    outputs, scale = _outputs_of_flat(p), 2.0 / p["xs"].shape[0]

    def block(flat, xs, ys, vectors):
        def predictions(w):
            return outputs(w, xs, ys)

        _, pullback = jax.vjp(predictions, flat)

        def product(v):
            jv = jax.jvp(predictions, (flat,), (v,))[1]
            return pullback(scale * jv)[0]

        return jax.vmap(product, in_axes=1, out_axes=1)(vectors)

    return _anchor(block, p, constants)


def zodmem_hvp_block(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    operator = _hvp_operator(p, args)
    return _harness.Case(
        lambda: operator.mm(p["vectors"]), {**p["info"], "tool": "zodmem"}, args.steady_calls
    )


def zodmem_ggn_block(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    operator = _ggn_operator(p, args.operator_memory)
    return _harness.Case(
        lambda: operator.mm(p["vectors"]), {**p["info"], "tool": "zodmem"}, args.steady_calls
    )


def jax_hvp_vmap(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    anchor = _jax_hvp(p)
    return _harness.Case(
        lambda: anchor(p["vectors"]), {**p["info"], "tool": "jax"}, args.steady_calls
    )


def jax_ggn_vmap(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    anchor = _jax_ggn(p)
    return _harness.Case(
        lambda: anchor(p["vectors"]), {**p["info"], "tool": "jax"}, args.steady_calls
    )


def jax_hvp_vmap_const(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    anchor = _jax_hvp(p, constants=True)
    return _harness.Case(
        lambda: anchor(p["vectors"]), {**p["info"], "tool": "jax"}, args.steady_calls
    )


def jax_ggn_vmap_const(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    anchor = _jax_ggn(p, constants=True)
    return _harness.Case(
        lambda: anchor(p["vectors"]), {**p["info"], "tool": "jax"}, args.steady_calls
    )


def zodmem_ggn_dense(args: argparse.Namespace) -> _harness.Case:
    import zodmem as zm

    p = _problem(args)
    transform = zm.BatchedGGN(p["predict"], p["ggn_loss"], max_memory=_DENSE_MEMORY)
    return _harness.Case(
        lambda: transform(p["model"], p["xs"], p["ys"]),
        {**p["info"], "tool": "zodmem"},
        args.dense_steady_calls,
    )


def _jax_ggn_jacobian(p: dict[str, Any]) -> Any:
    import jax

    outputs, scale = _outputs_of_flat(p), 2.0 / p["xs"].shape[0]

    def dense(flat):
        jacobian = jax.jacrev(outputs)(flat, p["xs"], p["ys"])
        return scale * (jacobian.T @ jacobian)

    return jax.jit(dense)


def jax_ggn_jacobian(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    dense = _jax_ggn_jacobian(p)
    return _harness.Case(
        lambda: dense(p["flat"]), {**p["info"], "tool": "jax"}, args.dense_steady_calls
    )


def zodmem_hessian_dense(args: argparse.Namespace) -> _harness.Case:
    import zodmem as zm

    p = _problem(args)
    transform = zm.BatchedHessian(p["loss"], max_memory=_DENSE_MEMORY)
    return _harness.Case(
        lambda: transform(p["model"], p["xs"], p["ys"]),
        {**p["info"], "tool": "zodmem"},
        args.dense_steady_calls,
    )


# -- curvlinops ----------------------------------------------------------------------


def _torch_problem(p: dict[str, Any]) -> dict[str, Any]:
    """The same MLP, data and loss in PyTorch, or the reason there is none."""
    try:
        import curvlinops
        import torch
    except ImportError as error:
        return {"missing": f"torch or curvlinops-for-pytorch not installed ({error})"}
    import numpy as np

    torch.manual_seed(0)
    layers: list[Any] = []
    mlp = p["model"]
    for i, linear in enumerate(mlp.layers):
        out_size, in_size = linear.weight.shape
        layer = torch.nn.Linear(in_size, out_size, bias=linear.bias is not None)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(np.array(linear.weight)))
            if linear.bias is not None:
                layer.bias.copy_(torch.from_numpy(np.array(linear.bias)))
        layers.append(layer)
        if i < len(mlp.layers) - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    xs = torch.from_numpy(np.array(p["xs"]))
    ys = torch.from_numpy(np.array(p["ys"]))[:, None]
    params = [q for q in model.parameters() if q.requires_grad]
    vectors = torch.from_numpy(np.array(p["vectors"]))
    kwargs = dict(check_deterministic=False, num_data=xs.shape[0])
    loss = torch.nn.MSELoss(reduction="mean")
    operators = {
        "hessian": curvlinops.HessianLinearOperator(model, loss, params, [(xs, ys)], **kwargs),
        "ggn": curvlinops.GGNLinearOperator(model, loss, params, [(xs, ys)], **kwargs),
    }
    return {
        "operators": operators,
        "vectors": vectors,
        "versions": {"torch": torch.__version__, "curvlinops": _version("curvlinops-for-pytorch")},
        "threads": torch.get_num_threads(),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _torch_info(t: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    if "missing" in t:
        return {**p["info"], "tool": "curvlinops", "missing": t["missing"]}
    return {**p["info"], "tool": "curvlinops", **t["versions"], "torch_threads": t["threads"]}


def torch_floor(args: argparse.Namespace) -> _harness.Case:
    p = _problem(args)
    t = _torch_problem(p)
    return _harness.Case(None, {**_torch_info(t, p), "tool": "floor"})


def _curvlinops_case(args: argparse.Namespace, which: str) -> _harness.Case:
    p = _problem(args)
    t = _torch_problem(p)
    if "missing" in t:
        raise SystemExit(t["missing"])
    operator, vectors = t["operators"][which], t["vectors"]

    def compute():
        import torch

        with torch.no_grad():
            return (operator @ vectors).numpy()

    return _harness.Case(compute, _torch_info(t, p), args.steady_calls)


def curvlinops_hessian(args: argparse.Namespace) -> _harness.Case:
    return _curvlinops_case(args, "hessian")


def curvlinops_ggn(args: argparse.Namespace) -> _harness.Case:
    return _curvlinops_case(args, "ggn")


# -- correctness ---------------------------------------------------------------------


def _relative(a: Any, b: Any) -> float:
    """Largest |a - b| over the whole arrays, relative to the largest |b|."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def verify(args: argparse.Namespace) -> _harness.Case:
    """Every block of products in one process, compared on the whole arrays."""
    import jax
    import numpy as np

    p = _problem(args)
    vectors = p["vectors"]
    hvp = np.asarray(_hvp_operator(p, args).mm(vectors))
    ggn = np.asarray(_ggn_operator(p, args.operator_memory).mm(vectors))
    jax_hvp = np.asarray(_jax_hvp(p)(vectors))
    jax_ggn = np.asarray(_jax_ggn(p)(vectors))
    dense = _ggn_operator(p, _DENSE_MEMORY).as_matrix()
    times = jax.jit(lambda g, v: g @ v)
    dense_times = np.asarray(times(dense, vectors))
    del dense
    jacobian_times = np.asarray(times(_jax_ggn_jacobian(p)(p["flat"]), vectors))
    checks = {
        "zodmem-hvp-block vs jax-hvp-vmap": _relative(hvp, jax_hvp),
        "zodmem-ggn-block vs jax-ggn-vmap": _relative(ggn, jax_ggn),
        "zodmem-ggn-dense @ V vs zodmem-ggn-block": _relative(dense_times, ggn),
        "jax-ggn-jacobian @ V vs zodmem-ggn-block": _relative(jacobian_times, ggn),
    }
    t = _torch_problem(p)
    if "missing" in t:
        checks["curvlinops"] = t["missing"]
    else:
        import torch

        with torch.no_grad():
            torch_hvp = (t["operators"]["hessian"] @ t["vectors"]).numpy()
            torch_ggn = (t["operators"]["ggn"] @ t["vectors"]).numpy()
        checks["curvlinops-hessian vs zodmem-hvp-block"] = _relative(torch_hvp, hvp)
        checks["curvlinops-ggn vs zodmem-ggn-block"] = _relative(torch_ggn, ggn)
    return _harness.Case(lambda: hvp, {**p["info"], "tool": "check", "checks": checks})


CASES = {
    "floor": floor,
    "zodmem-hvp-block": zodmem_hvp_block,
    "jax-hvp-vmap": jax_hvp_vmap,
    "zodmem-ggn-block": zodmem_ggn_block,
    "jax-ggn-vmap": jax_ggn_vmap,
    "jax-hvp-vmap-const": jax_hvp_vmap_const,
    "jax-ggn-vmap-const": jax_ggn_vmap_const,
    "zodmem-ggn-dense": zodmem_ggn_dense,
    "zodmem-hessian-dense": zodmem_hessian_dense,
    "jax-ggn-jacobian": jax_ggn_jacobian,
    "torch-floor": torch_floor,
    "curvlinops-hessian": curvlinops_hessian,
    "curvlinops-ggn": curvlinops_ggn,
    "verify": verify,
}

_KIND = {
    "zodmem-hvp-block": "hvp",
    "jax-hvp-vmap": "hvp",
    "curvlinops-hessian": "hvp",
    "zodmem-ggn-block": "ggn",
    "jax-ggn-vmap": "ggn",
    "curvlinops-ggn": "ggn",
}
# The anchors with the weights and data compiled in as constants: for reference, not
# targets (XLA folds the forward pass into such a program, which then holds for one
# set of weights only).
_CONSTANT_ANCHORS = {"jax-hvp-vmap-const": "hvp", "jax-ggn-vmap-const": "ggn"}
_REFERENCE = {
    **{
        name: "jax-hvp-vmap"
        for name, kind in {**_KIND, **_CONSTANT_ANCHORS}.items()
        if kind == "hvp"
    },
    **{
        name: "jax-ggn-vmap"
        for name, kind in {**_KIND, **_CONSTANT_ANCHORS}.items()
        if kind == "ggn"
    },
    "zodmem-ggn-dense": "jax-ggn-jacobian",
    "jax-ggn-jacobian": "jax-ggn-jacobian",
}


# -- the report ----------------------------------------------------------------------


def _floor_of(name: str, by_case: dict[str, Any]) -> int | None:
    floor_case = by_case.get("torch-floor" if name.startswith("curvlinops") else "floor")
    return floor_case.get("peak_rss_bytes") if floor_case else None


def _above(name: str, by_case: dict[str, Any]) -> int | None:
    base = _floor_of(name, by_case)
    r = by_case.get(name)
    return None if base is None or r is None else r["peak_rss_bytes"] - base


def _per_vector(r: dict[str, Any]) -> float | None:
    if "steady_min_s" not in r or (r["case"] not in _KIND and r["case"] not in _CONSTANT_ANCHORS):
        return None
    return r["steady_min_s"] / r["info"]["vectors"]


def _verdict(what: str, value: float, limit: float, unit: str = "") -> str:
    ok = value <= limit
    return f"{what} {value:.3g}{unit} {'<=' if ok else '>'} {limit:.3g}{unit}: " + (
        "met" if ok else "MISSED"
    )


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = {r["case"]: r for r in results if "error" not in r}
    info = next((r["info"] for r in by_case.values()), {})
    headers = [
        "case",
        "first call (s)",
        "steady (s)",
        "per vector (ms)",
        "peak (MB)",
        "peak - floor (MB)",
        "check",
    ]
    rows = []
    for r in results:
        name = r["case"]
        if "error" in r:
            reason = "; ".join(r.get("stderr_tail", [])[-1:]) or r["error"]
            rows.append([name, "failed: " + reason] + [""] * (len(headers) - 2))
            continue
        if name == "verify":
            continue
        above = _above(name, by_case)
        per_vector = _per_vector(r)
        check = ""
        reference = by_case.get(_REFERENCE.get(name, ""))
        if reference is r:
            check = "reference"
        elif reference is not None and "check" in r:
            r["max_rel_diff_vs_reference"] = _harness.compare_fingerprints(
                r["check"], reference["check"]
            )
            check = f"{r['max_rel_diff_vs_reference']:.1e}"
        rows.append(
            [
                name,
                f"{r['time_s']:.2f}" if "time_s" in r else "",
                f"{r['steady_min_s']:.3f}" if "steady_min_s" in r else "",
                f"{per_vector * 1e3:.2f}" if per_vector is not None else "",
                f"{r['peak_rss_bytes'] / _MB:.0f}",
                f"{above / _MB:.0f}" if above is not None and name != "floor" else "",
                check,
            ]
        )
    lines = [
        f"Curvature of an eqx.nn.MLP(32, 1, {info.get('width')}, {info.get('depth')}) "
        f"mean-squared loss over {info.get('points')} points: n = {info.get('n', 0):,}, "
        f"{info.get('vectors')} vectors; operators at max_memory="
        f"{info.get('operator_max_memory')}, dense matrices at max_memory={_DENSE_MEMORY}.",
        "",
        _harness.markdown_table(headers, rows),
        "",
        "first call: wall time, tracing, compiling and planning included; steady: the "
        "fastest of the further calls; per vector: steady / vectors; peak - floor: peak "
        "resident memory above `floor` (above `torch-floor` for curvlinops; torch-floor's "
        "own is what importing torch and building its model adds); check: "
        "largest sampled difference from the JAX anchor of the same products (of the "
        "same matrix for the dense GGN), relative "
        "to the largest sampled |entry|.",
    ]
    lines += torch_lines(by_case)
    checks = by_case.get("verify", {}).get("info", {}).get("checks")
    if checks:
        lines += ["", "Correctness, whole (n, vectors) arrays (max |a - b| / max |b|):"]
        for what, value in checks.items():
            shown = f"{value:.1e}" if isinstance(value, float) else value
            lines.append(f"- {what}: {shown}")
    lines += _targets(by_case, args)
    return "\n".join(lines)


def torch_lines(by_case: dict[str, Any], remark: str = "") -> list[str]:
    """The report's lines on the torch cases: why they did not run, or the versions
    and threads they ran with, then `remark` (formatted with the torch case's info)."""
    torch_floor = by_case.get("torch-floor")
    if torch_floor is None:
        return []
    info = torch_floor["info"]
    if "missing" in info:
        return ["", f"curvlinops cases not run: {info['missing']}."]
    return [
        "",
        f"curvlinops-for-pytorch {info.get('curvlinops')}, torch {info.get('torch')}, "
        f"{info.get('torch_threads')} threads{remark.format(**info)}.",
    ]


def _targets(by_case: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = []
    budget = _bytes(args.operator_memory)
    for kind, name in (("hvp", "zodmem-hvp-block"), ("ggn", "zodmem-ggn-block")):
        r = by_case.get(name)
        if r is None:
            continue
        anchors = {
            a: _per_vector(by_case[a])
            for a, k in _KIND.items()
            if k == kind and not a.startswith("zodmem") and a in by_case
        }
        anchors = {a: v for a, v in anchors.items() if v is not None}
        verdicts = []
        per_vector = _per_vector(r)
        if anchors and per_vector is not None:
            best = min(anchors, key=anchors.__getitem__)
            verdicts.append(
                _verdict(
                    f"per vector vs {best} (best anchor)",
                    per_vector * 1e3,
                    anchors[best] * 1e3,
                    " ms",
                )
            )
        above = _above(name, by_case)
        if above is not None:
            verdicts.append(
                _verdict(
                    f"peak - floor vs max_memory={args.operator_memory}",
                    above / _MB,
                    budget / _MB,
                    " MB",
                )
            )
        for constant, k in _CONSTANT_ANCHORS.items():
            if k == kind and constant in by_case and per_vector is not None:
                folded = _per_vector(by_case[constant])
                if folded is not None:
                    verdicts.append(
                        f"(not a target: {per_vector / folded:.2f} x {constant}, "
                        f"{folded * 1e3:.3g} ms, whose weights are compiled in)"
                    )
        lines.append(f"- {name}: " + "; ".join(verdicts))
    dense, hessian = by_case.get("zodmem-ggn-dense"), by_case.get("zodmem-hessian-dense")
    if dense is not None:
        verdicts = []
        above = _above("zodmem-ggn-dense", by_case)
        if above is not None:
            verdicts.append(
                _verdict(
                    f"peak - floor vs max_memory={_DENSE_MEMORY}",
                    above / _MB,
                    _DENSE_MEMORY_BYTES / _MB,
                    " MB",
                )
            )
        if hessian is not None and "steady_min_s" in dense and "steady_min_s" in hessian:
            verdicts.append(
                _verdict(
                    "steady time vs zodmem-hessian-dense",
                    dense["steady_min_s"],
                    hessian["steady_min_s"],
                    " s",
                )
            )
            verdicts.append(f"(first call {dense['time_s']:.2f} s vs {hessian['time_s']:.2f} s)")
        jacobian = by_case.get("jax-ggn-jacobian")
        if jacobian is not None and "steady_min_s" in dense and "steady_min_s" in jacobian:
            verdicts.append(
                f"(for scale, not a target: {dense['steady_min_s'] / jacobian['steady_min_s']:.1f}"
                " x the steady time of jax-ggn-jacobian)"
            )
        lines.append("- zodmem-ggn-dense: " + "; ".join(verdicts))
    return ["", "Targets:"] + lines if lines else []


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    hessian_memory._add_arguments(parser)
    parser.add_argument("--vectors", type=int, default=64, help="vectors in each block")
    parser.add_argument(
        "--operator-memory", default="200MB", help="max_memory of the two operators"
    )
    parser.add_argument(
        "--steady-calls",
        type=int,
        default=30,
        help="further calls of each block case (a block takes milliseconds: the fastest "
        "of many is steadier than of few)",
    )
    parser.add_argument(
        "--dense-steady-calls", type=int, default=2, help="further calls of each dense case"
    )


if __name__ == "__main__":
    _harness.main(
        name="curvature",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report,
        add_arguments=_add_arguments,
    )
