"""A call compiled for the abstract values of its arguments: its memory from XLA's own
account (`memory_analysis()`), and the executable, which the planned call runs on
concrete arguments without compiling again."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ._memo import signature_of
from ._sharding import Kept, is_explicit

__all__ = [
    "CPU_PROBE_OPTIONS",
    "PROBE_OPTIONS",
    "Compiled",
    "LEAN_CPU_OPTIONS",
    "abstract",
    "bind_compiled",
    "collector_paused",
    "lean_call",
    "compile_call",
    "compiled_memory",
    "heap_released_after_compiles",
    "is_traced",
    "release_heap",
    "run_compiled",
    "runs_compiled",
]


class Compiled(NamedTuple):
    """A call compiled for the abstract values of its arguments: its memory, from XLA's
    own account, and the executable, which runs the same call on concrete arguments of
    those shapes (`run_compiled`), compiling nothing more."""

    peak_bytes: int
    output_bytes: int
    executable: Any


# A probe is compiled without the backend's code optimisations (LLVM's, on a CPU) and, on
# a CPU, with XLA's older fusion emitters: XLA assigns its buffers before either, so the
# memory is the same (to the byte, on the reference Hessian's probes: 0.633, 0.648 and
# 8.55 GB at 1, 25 and 12,577 rows a block), at about a third of the cost.
PROBE_OPTIONS = {"xla_backend_optimization_level": 0}
CPU_PROBE_OPTIONS = {**PROBE_OPTIONS, "xla_cpu_use_fusion_emitters": False}


# A program to run, compiled with XLA's older CPU fusion emitters: the compiler's heap,
# which on a CPU is part of the process's peak, is about a third (eigsh on the reference
# Hessian: 20-30 MB against 75-110 MB) and the compile shorter. The run is as fast for
# one product at a time (eigsh) and up to twice as slow for wide blocks of products
# (Hutchinson's probes, 25 a block). For one-shot programs under a budget, where the
# compile is most of the cost.
LEAN_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@contextlib.contextmanager
def collector_paused() -> Any:
    """Python's cycle collector paused for the block: tracing and lowering a program
    makes many short-lived objects, and a full collection among JAX's own objects
    costs a one-shot call about a tenth of its planning. Reference counting still
    frees everything that is not in a cycle; the collector resumes after."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def release_heap() -> None:
    """Hand the memory the compiler freed back to the operating system. glibc keeps it
    otherwise, and a call would carry the compile's heap (tens of MB on a CPU) into the
    run, beside the result and the blocks' working memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to release this way


# The event JAX records after each compile by the backend, with its duration.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# A compile shorter than this leaves too little heap to be worth the release (a release
# walks the whole heap: 0.2-15 ms on the reference Hessian).
RELEASE_AFTER_S = 0.05
_releasing = threading.local()
_listening = False


def _after_compile(event: str, duration: float, **_: Any) -> None:
    if event == _BACKEND_COMPILE and duration >= RELEASE_AFTER_S:
        if getattr(_releasing, "depth", 0):
            release_heap()


@contextlib.contextmanager
def heap_released_after_compiles() -> Any:
    """Within the block, each compile of this thread that takes at least
    `RELEASE_AFTER_S` hands its freed heap back (`release_heap`) before its program
    runs. A transform compiled on its first call then runs its blocks beside the result
    without the compiler's leftover heap: on the reference Hessian (633 MB) the peak
    above the process's floor went from 0.72-0.74 GB to 0.68 GB."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_after_compile)
        _listening = True
    _releasing.depth = getattr(_releasing, "depth", 0) + 1
    try:
        yield
    finally:
        _releasing.depth -= 1


def is_traced(tree: Any) -> bool:
    """Whether any leaf of `tree` is traced (a call inside an outer transform's program)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


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


def compile_call(
    call: Callable[..., Any],
    *args: Any,
    probe: bool = False,
    options: dict[str, Any] | None = None,
) -> Compiled:
    """`call(*args)` compiled, without running it.

    `args` may hold arrays, tracers or `ShapeDtypeStruct`s (as abstract values) and any
    other leaves (as constants). The peak is the output plus XLA's temporaries; the
    result's leaves that are not arrays take no memory and come back from the structure
    of the executable's output. A `probe` is compiled only for its memory
    (`PROBE_OPTIONS`, on a CPU `CPU_PROBE_OPTIONS`): its executable is not one to run.
    Otherwise `options` are XLA's compiler options (`None`: its defaults).
    """
    dynamic, static = eqx.partition(args, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))

    def call_of_arrays(dynamic):
        arrays, rest = eqx.partition(call(*eqx.combine(dynamic, static)), eqx.is_array)
        return arrays, Kept(rest)

    lowered = jax.jit(call_of_arrays).lower(dynamic)
    if probe:
        options = CPU_PROBE_OPTIONS if jax.default_backend() == "cpu" else PROBE_OPTIONS
    executable = lowered.compile(compiler_options=options)
    analysis = executable.memory_analysis()
    output = int(analysis.output_size_in_bytes)
    return Compiled(int(analysis.temp_size_in_bytes) + output, output, executable)


def compiled_memory(call: Callable[..., Any], *args: Any) -> tuple[int, int]:
    """`(peak_bytes, output_bytes)` of `call(*args)` compiled (`compile_call`)."""
    compiled = compile_call(call, *args)
    return compiled.peak_bytes, compiled.output_bytes


# Programs compiled by `lean_call`, by function, argument structure, shapes, dtypes,
# placements and constants.
_LEAN: dict[Any, Any] = {}
_MAX_LEAN = 32


def lean_call(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)` run by a program compiled once per function and argument signature
    with `LEAN_CPU_OPTIONS` on a CPU; `jax.jit`'s own call elsewhere, under an outer
    transform (a traced argument), or for an argument spread over several devices.
    Leaves of `args` that are not arrays are constants of the program, as for
    `eqx.filter_jit`."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    signatures = [signature_of(leaf) for leaf in leaves]
    concrete = all(
        not isinstance(leaf, jax.core.Tracer)
        and (signature is None or len(leaf.sharding.device_set) == 1)
        for leaf, signature in zip(leaves, signatures, strict=True)
    )
    key = None
    if concrete and jax.default_backend() == "cpu":
        signature = tuple(
            ("constant", leaf) if signature is None else signature
            for leaf, signature in zip(leaves, signatures, strict=True)
        )
        key = (call, treedef, signature)
        try:
            hash(key)
        except TypeError:
            key = None
    if key is None:
        return eqx.filter_jit(call)(*args)
    if key not in _LEAN:
        if len(_LEAN) >= _MAX_LEAN:
            _LEAN.pop(next(iter(_LEAN)))
        with collector_paused(), heap_released_after_compiles():
            compiled = compile_call(call, *abstract(args), options=LEAN_CPU_OPTIONS)
        _LEAN[key] = compiled.executable
    return run_compiled(_LEAN[key], *args)


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
