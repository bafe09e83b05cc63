"""A call compiled for the abstract values of its arguments: its memory from XLA's own
account (`memory_analysis()`), and the executable, which the planned call runs on
concrete arguments without compiling again."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .._engine._layout import LOOPS, jaxpr_holds
from .._engine._sharding import Kept, is_explicit

__all__ = [
    "CPU_LEAN_OPTIONS",
    "CPU_PROBE_OPTIONS",
    "PROBE_OPTIONS",
    "Compiled",
    "abstract",
    "bind_compiled",
    "collector_paused",
    "compile_call",
    "compile_traced",
    "compiled_memory",
    "run_compiled",
    "runs_compiled",
    "trace_call",
    "traced_loops",
]


class Compiled(NamedTuple):
    """A call compiled for the abstract values of its arguments: its memory, from XLA's
    own account, and the executable, which runs the same call on concrete arguments of
    those shapes (`run_compiled`), compiling nothing more."""

    peak_bytes: int
    output_bytes: int
    executable: Any
    # The traced program (a `ClosedJaxpr`), which a plan kept on disk is checked against.
    program: Any = None


# A probe is compiled only for its memory: without the backend's code optimisations
# (LLVM's, on a CPU) and, on a CPU, with XLA's older fusion emitters. XLA assigns its
# buffers before either, so the memory is the same, at a fraction of the compile.
PROBE_OPTIONS = {"xla_backend_optimization_level": 0}
CPU_PROBE_OPTIONS = {**PROBE_OPTIONS, "xla_cpu_use_fusion_emitters": False}
# A call compiled lean on a CPU (`AbstractPlanned.compiled_lean`): XLA's older fusion
# emitters, with the backend's optimisations kept. Its compile heap is about half the
# default's, and its programs run as fast where they are large reductions over data.
CPU_LEAN_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@contextlib.contextmanager
def collector_paused() -> Any:
    """Python's cycle collector paused for the block: tracing and lowering a program
    makes many short-lived objects, and full collections among JAX's many live objects
    are a large part of a one-shot call's planning. Reference counting still
    frees everything that is not in a cycle; the collector resumes after."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def abstract(tree: Any) -> Any:
    """`tree` with its array leaves (tracers too) as `jax.ShapeDtypeStruct`s. A concrete
    array sharded over explicit mesh axes keeps its sharding, which a traced array shows
    (so a call planned on it spreads its work as the real call will). A weakly typed
    array (a Python number made an array) stays weak, so that the planned call promotes
    dtypes as the real one does."""

    def shape_of(leaf):
        if not eqx.is_array(leaf):
            return leaf
        sharding = None
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            if is_explicit(leaf.sharding):
                sharding = leaf.sharding
        weak = bool(getattr(jax.typeof(leaf), "weak_type", False))
        return jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype, sharding=sharding, weak_type=weak)

    return jax.tree_util.tree_map(shape_of, tree)


def trace_call(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)` traced, as `compile_call` takes them, for `compile_traced`: one trace
    serves every compile of the call (a probe's and the call's own)."""
    dynamic, static = eqx.partition(args, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))

    def call_of_arrays(dynamic):
        arrays, rest = eqx.partition(call(*eqx.combine(dynamic, static)), eqx.is_array)
        return arrays, Kept(rest)

    return jax.jit(call_of_arrays).trace(dynamic)


def traced_loops(traced: Any) -> bool:
    """Whether a traced call (`trace_call`) runs a loop, nested anywhere in it."""
    return jaxpr_holds(traced.jaxpr.jaxpr, LOOPS)


def compile_traced(traced: Any, options: dict[str, Any] | None = None) -> Compiled:
    """A traced call (`trace_call`) compiled with XLA's compiler `options` (`None`: its
    defaults; a probe's, `PROBE_OPTIONS`, make an executable only for its memory)."""
    executable = traced.lower().compile(compiler_options=options)
    analysis = executable.memory_analysis()
    output = int(analysis.output_size_in_bytes)
    return Compiled(int(analysis.temp_size_in_bytes) + output, output, executable, traced.jaxpr)


def compile_call(
    call: Callable[..., Any], *args: Any, options: dict[str, Any] | None = None
) -> Compiled:
    """`call(*args)` compiled, without running it.

    `args` may hold arrays, tracers or `ShapeDtypeStruct`s (as abstract values) and any
    other leaves (as constants). The peak is the output plus XLA's temporaries; the
    result's leaves that are not arrays take no memory and come back from the structure
    of the executable's output. `options` are XLA's compiler options (`None`: its
    defaults; a probe's, `PROBE_OPTIONS`, make an executable only for its memory).
    """
    return compile_traced(trace_call(call, *args), options)


def compiled_memory(call: Callable[..., Any], *args: Any) -> tuple[int, int]:
    """`(peak_bytes, output_bytes)` of `call(*args)` compiled (`compile_call`)."""
    compiled = compile_call(call, *args)
    return compiled.peak_bytes, compiled.output_bytes


def run_compiled(executable: Any, *args: Any) -> Any:
    """The result of the call compiled by `compile_call` for these arguments' shapes:
    their arrays go to the executable, and every other leaf is the constant it was
    compiled with."""
    arrays, kept = executable(eqx.filter(args, eqx.is_array))
    return eqx.combine(arrays, kept.value)


def bind_compiled(executable: Any, first: Any) -> Callable[..., Any]:
    """`lambda *rest: run_compiled(executable, first, *rest)`, with the arrays of `first`
    (a planned transform, whose arrays stay as they are) picked out once, not per call."""
    fixed = eqx.filter(first, eqx.is_array)

    def call(*rest: Any) -> Any:
        arrays, kept = executable((fixed, *eqx.filter(rest, eqx.is_array)))
        return eqx.combine(arrays, kept.value)

    return call


def runs_compiled(executable: Any, *args: Any) -> bool:
    """Whether `run_compiled(executable, *args)` runs these arguments: none is traced
    (under an outer `jax.jit` the call is traced into the outer program instead), and
    every array lies where the executable was compiled to find it."""

    # Flattened with their holes (`None`: a leaf that is not an array, or an argument the
    # program does not use, which is dropped when it is compiled and again when it is
    # called), so that the two line up.
    def flat(tree):
        return jax.tree_util.tree_leaves(tree, is_leaf=lambda leaf: leaf is None)

    arrays = flat(eqx.filter(args, eqx.is_array))
    expected = flat(executable.input_shardings[0])
    if len(arrays) != len(expected):
        return False
    for leaf, sharding in zip(arrays, expected, strict=True):
        if isinstance(leaf, jax.core.Tracer):
            return False
        if sharding is None or not isinstance(leaf, jax.Array):
            continue
        if not leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            return False
    return True
