"""Curvature products and the dense GGN: zodmem against JAX and curvlinops.

The reference problem (`problems.reference()`): an `eqx.nn.MLP(32, 1, 96, 2)` with a
mean-squared loss over 256 points (n = 12,577, float32, CPU). Each case runs in its
own process (see `report.py`):

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
- `torch-floor`, `curvlinops-hessian` and `curvlinops-ggn`: the same MLP in torch
  (`problems.torch_problem`: `Linear` layers with ReLU between them, `eqx.nn.MLP`'s
  default activation, the Equinox weights copied), the same data and
  `torch.nn.MSELoss()`: `HessianLinearOperator(...) @ V` and
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
import dataclasses
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

_DENSE_MEMORY = "1GB"
_DENSE_MEMORY_BYTES = 1e9


@dataclasses.dataclass
class _Setup:
    """The reference problem, the GGN's loss, the vectors and what to record of them."""

    reference: Any
    ggn_loss: Any
    vectors: Any
    info: dict[str, Any]


def _setup(args: argparse.Namespace) -> _Setup:
    import jax
    import jax.numpy as jnp
    import problems

    import zodmem as zm

    r = problems.reference(quick=args.quick)
    # Half the weighted squared error with weights 2 / N is mean((prediction - y)**2).
    ggn_loss = zm.losses.SquaredError(weights=jnp.asarray(2.0 / r.xs.shape[0], r.flat.dtype))
    vectors = jax.random.normal(jax.random.key(1), (r.flat.size, args.vectors), r.flat.dtype)
    jax.block_until_ready(vectors)
    info = {
        **r.info,
        "vectors": args.vectors,
        "operator_max_memory": args.operator_memory,
        "dense_max_memory": _DENSE_MEMORY,
    }
    return _Setup(r, ggn_loss, vectors, info)


def _bytes(text: str) -> float:
    """Bytes of a budget written as zodmem takes it: a number with an optional unit."""
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = text.strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text.rstrip("B"))


# -- the JAX cases --------------------------------------------------------------------


def floor(args: argparse.Namespace) -> report.Case:
    return report.Case(None, {**_setup(args).info, "tool": "floor"})


def _hvp_operator(s: _Setup, max_memory: str) -> Any:
    import zodmem as zm

    r = s.reference
    return zm.BatchedHessian(r.loss, max_memory=max_memory).operator(r.model, r.xs, r.ys)


def _ggn_operator(s: _Setup, max_memory: str) -> Any:
    import zodmem as zm

    r = s.reference
    transform = zm.BatchedGGN(r.predict, s.ggn_loss, max_memory=max_memory)
    return transform.operator(r.model, r.xs, r.ys)


def _anchor(block: Any, s: _Setup, constants: bool) -> Any:
    """`V -> block(flat, xs, ys, V)` under `jax.jit`, the weights and data its arguments
    (as a user whose weights change calls it) or, with `constants`, constants of the
    program, so that XLA folds the whole forward pass into it when it compiles it (a
    program for one set of weights only)."""
    import jax

    r = s.reference
    if constants:
        return jax.jit(lambda vectors: block(r.flat, r.xs, r.ys, vectors))
    compiled = jax.jit(block)
    return lambda vectors: compiled(r.flat, r.xs, r.ys, vectors)


def _jax_hvp(s: _Setup, constants: bool = False) -> Any:
    """The JAX anchor's block of HVPs, `V -> H V`, on the raveled parameters."""
    import jax

    loss = s.reference.loss_of_flat

    def block(flat, xs, ys, vectors):
        def product(v):
            return jax.jvp(jax.grad(lambda w: loss(w, xs, ys)), (flat,), (v,))[1]

        return jax.vmap(product, in_axes=1, out_axes=1)(vectors)

    return _anchor(block, s, constants)


def _jax_ggn(s: _Setup, constants: bool = False) -> Any:
    """The JAX anchor's block of GGN products, `V -> J^T (2 / N) J V`, as `_jax_hvp`."""
    import jax

    r = s.reference
    outputs, scale = r.of_flat(r.predict), 2.0 / r.xs.shape[0]

    def block(flat, xs, ys, vectors):
        def predictions(w):
            return outputs(w, xs, ys)

        _, pullback = jax.vjp(predictions, flat)

        def product(v):
            jv = jax.jvp(predictions, (flat,), (v,))[1]
            return pullback(scale * jv)[0]

        return jax.vmap(product, in_axes=1, out_axes=1)(vectors)

    return _anchor(block, s, constants)


def _block_case(args: argparse.Namespace, make: Any, tool: str) -> report.Case:
    """A block of products `make(setup)(V)`, timed over `--steady-calls` further calls."""
    s = _setup(args)
    products = make(s)
    return report.Case(lambda: products(s.vectors), {**s.info, "tool": tool}, args.steady_calls)


def zodmem_hvp_block(args: argparse.Namespace) -> report.Case:
    return _block_case(args, lambda s: _hvp_operator(s, args.operator_memory).mm, "zodmem")


def zodmem_ggn_block(args: argparse.Namespace) -> report.Case:
    return _block_case(args, lambda s: _ggn_operator(s, args.operator_memory).mm, "zodmem")


def jax_hvp_vmap(args: argparse.Namespace) -> report.Case:
    return _block_case(args, _jax_hvp, "jax")


def jax_ggn_vmap(args: argparse.Namespace) -> report.Case:
    return _block_case(args, _jax_ggn, "jax")


def jax_hvp_vmap_const(args: argparse.Namespace) -> report.Case:
    return _block_case(args, lambda s: _jax_hvp(s, constants=True), "jax")


def jax_ggn_vmap_const(args: argparse.Namespace) -> report.Case:
    return _block_case(args, lambda s: _jax_ggn(s, constants=True), "jax")


def _dense_case(args: argparse.Namespace, which: str) -> report.Case:
    import zodmem as zm

    s = _setup(args)
    r = s.reference
    if which == "ggn":
        transform = zm.BatchedGGN(r.predict, s.ggn_loss, max_memory=_DENSE_MEMORY)
    else:
        transform = zm.BatchedHessian(r.loss, max_memory=_DENSE_MEMORY)
    return report.Case(
        lambda: transform(r.model, r.xs, r.ys),
        {**s.info, "tool": "zodmem"},
        args.dense_steady_calls,
    )


def zodmem_ggn_dense(args: argparse.Namespace) -> report.Case:
    return _dense_case(args, "ggn")


def zodmem_hessian_dense(args: argparse.Namespace) -> report.Case:
    return _dense_case(args, "hessian")


def _jax_ggn_jacobian(s: _Setup) -> Any:
    import jax

    r = s.reference
    outputs, scale = r.of_flat(r.predict), 2.0 / r.xs.shape[0]

    def dense(flat):
        jacobian = jax.jacrev(outputs)(flat, r.xs, r.ys)
        return scale * (jacobian.T @ jacobian)

    return jax.jit(dense)


def jax_ggn_jacobian(args: argparse.Namespace) -> report.Case:
    s = _setup(args)
    dense = _jax_ggn_jacobian(s)
    return report.Case(
        lambda: dense(s.reference.flat), {**s.info, "tool": "jax"}, args.dense_steady_calls
    )


# -- curvlinops ----------------------------------------------------------------------


def _curvlinops(s: _Setup) -> tuple[Any, dict[str, Any]]:
    """curvlinops' operators on the same MLP, data and loss in PyTorch, and what to
    record of them; or None and the reason there are none."""
    import problems

    try:
        c = problems.curvlinops_operators(s.reference.problem)
    except ImportError as error:
        missing = f"torch or curvlinops-for-pytorch not installed ({error})"
        return None, {**s.info, "tool": "curvlinops", "missing": missing}
    return c, {**s.info, "tool": "curvlinops", **c.info}


def _torch_vectors(s: _Setup) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.array(s.vectors))


def torch_floor(args: argparse.Namespace) -> report.Case:
    _, info = _curvlinops(_setup(args))
    return report.Case(None, {**info, "tool": "floor"})


def _curvlinops_case(args: argparse.Namespace, which: str) -> report.Case:
    s = _setup(args)
    c, info = _curvlinops(s)
    if c is None:
        raise SystemExit(info["missing"])
    operator, vectors = c.operators[which], _torch_vectors(s)

    def compute():
        import torch

        with torch.no_grad():
            return (operator @ vectors).numpy()

    return report.Case(compute, info, args.steady_calls)


def curvlinops_hessian(args: argparse.Namespace) -> report.Case:
    return _curvlinops_case(args, "hessian")


def curvlinops_ggn(args: argparse.Namespace) -> report.Case:
    return _curvlinops_case(args, "ggn")


# -- correctness ---------------------------------------------------------------------


def verify(args: argparse.Namespace) -> report.Case:
    """Every block of products in one process, compared on the whole arrays."""
    import jax
    import numpy as np

    s = _setup(args)
    vectors = s.vectors
    hvp = np.asarray(_hvp_operator(s, args.operator_memory).mm(vectors))
    ggn = np.asarray(_ggn_operator(s, args.operator_memory).mm(vectors))
    jax_hvp = np.asarray(_jax_hvp(s)(vectors))
    jax_ggn = np.asarray(_jax_ggn(s)(vectors))
    dense = _ggn_operator(s, _DENSE_MEMORY).as_matrix()
    times = jax.jit(lambda g, v: g @ v)
    dense_times = np.asarray(times(dense, vectors))
    del dense
    jacobian_times = np.asarray(times(_jax_ggn_jacobian(s)(s.reference.flat), vectors))
    relative = report.relative_difference
    checks = {
        "zodmem-hvp-block vs jax-hvp-vmap": relative(hvp, jax_hvp),
        "zodmem-ggn-block vs jax-ggn-vmap": relative(ggn, jax_ggn),
        "zodmem-ggn-dense @ V vs zodmem-ggn-block": relative(dense_times, ggn),
        "jax-ggn-jacobian @ V vs zodmem-ggn-block": relative(jacobian_times, ggn),
    }
    c, info = _curvlinops(s)
    if c is None:
        checks["curvlinops"] = info["missing"]
    else:
        import torch

        with torch.no_grad():
            torch_hvp = (c.operators["hessian"] @ _torch_vectors(s)).numpy()
            torch_ggn = (c.operators["ggn"] @ _torch_vectors(s)).numpy()
        checks["curvlinops-hessian vs zodmem-hvp-block"] = relative(torch_hvp, hvp)
        checks["curvlinops-ggn vs zodmem-ggn-block"] = relative(torch_ggn, ggn)
    return report.Case(lambda: hvp, {**s.info, "tool": "check", "checks": checks})


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
    **{name: f"jax-{kind}-vmap" for name, kind in {**_KIND, **_CONSTANT_ANCHORS}.items()},
    "zodmem-ggn-dense": "jax-ggn-jacobian",
    "jax-ggn-jacobian": "jax-ggn-jacobian",
}


# -- the report ----------------------------------------------------------------------


def _above(name: str, by_case: dict[str, Any]) -> float | None:
    """The case's peak above `floor` (above `torch-floor` for curvlinops)."""
    floor_case = by_case.get("torch-floor" if name.startswith("curvlinops") else "floor")
    return report.above(by_case.get(name), floor_case)


def _per_vector(r: dict[str, Any]) -> float | None:
    if "steady_min_s" not in r or (r["case"] not in _KIND and r["case"] not in _CONSTANT_ANCHORS):
        return None
    return r["steady_min_s"] / r["info"]["vectors"]


def report_text(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_case = report.succeeded(results)
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

    def row(r: dict[str, Any]) -> list[Any] | None:
        name = r["case"]
        if name == "verify":
            return None
        per_vector = _per_vector(r)
        return [
            name,
            report.number(r.get("time_s")),
            report.number(r.get("steady_min_s"), ".3f"),
            report.number(None if per_vector is None else per_vector * 1e3),
            report.megabytes(r["peak_rss_bytes"]),
            "" if name == "floor" else report.megabytes(_above(name, by_case)),
            report.check_cell(r, by_case.get(_REFERENCE.get(name, ""))),
        ]

    lines = [
        report.describe_mlp(info, "Curvature")
        + f"; {info.get('vectors')} vectors; operators at max_memory="
        f"{info.get('operator_max_memory')}, dense matrices at max_memory={_DENSE_MEMORY}.",
        "",
        report.case_table(results, headers, row),
        "",
        "first call: wall time, tracing, compiling and planning included; steady: the "
        "fastest of the further calls; per vector: steady / vectors; peak - floor: peak "
        "resident memory above `floor` (above `torch-floor` for curvlinops; torch-floor's "
        "own is what importing torch and building its model adds); check: "
        "largest sampled difference from the JAX anchor of the same products (of the "
        "same matrix for the dense GGN), relative "
        "to the largest sampled |entry|.",
    ]
    if "torch-floor" in by_case:
        lines += ["", report.curvlinops_line(by_case["torch-floor"]["info"])]
    checks = by_case.get("verify", {}).get("info", {}).get("checks")
    if checks:
        lines += ["", "Correctness, whole (n, vectors) arrays (max |a - b| / max |b|):"]
        for what, value in checks.items():
            shown = f"{value:.1e}" if isinstance(value, float) else value
            lines.append(f"- {what}: {shown}")
    lines += report.section("Targets:", _targets(by_case, args))
    return "\n".join(lines)


def _verdict(what: str, value: float, limit: float, unit: str) -> str:
    return report.verdict(what, value, limit, unit, form=".3g")


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
                    above / report.MB,
                    budget / report.MB,
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
                    above / report.MB,
                    _DENSE_MEMORY_BYTES / report.MB,
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
    return lines


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vectors", type=int, default=64, help="vectors in each block")
    parser.add_argument(
        "--operator-memory", default="200MB", help="max_memory of the two operators"
    )
    parser.add_argument(
        "--dense-steady-calls", type=int, default=2, help="further calls of each dense case"
    )


if __name__ == "__main__":
    report.main(
        name="curvature",
        description=__doc__.splitlines()[0],
        cases=CASES,
        report=report_text,
        add_arguments=_add_arguments,
        # A block takes milliseconds: the fastest of many calls is steadier than of few.
        steady_calls=30,
    )
