"""The chains of zodmem's frames a call passes through, as functions and modules: what a
newcomer reads to follow `BatchedHessian(max_memory=...)(x)` and `zm.eigsh(op, 5)`.

    python benchmarks/call_paths.py             # the chain from the call to the user's fn
    python benchmarks/call_paths.py --deepest   # the deepest chain of zodmem frames
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

import zodmem as zm

ROOT = os.path.dirname(zm.__file__)


def _zodmem_frames(frame) -> list[tuple[str, str]]:
    """`(module, function)` of every zodmem frame below `frame`, innermost first."""
    chain = []
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(ROOT):
            chain.append((os.path.relpath(code.co_filename, ROOT), code.co_qualname))
        frame = frame.f_back
    return chain


def longest_chain(thunk: Callable[[], object], deepest: bool) -> list[tuple[str, str]]:
    """The longest chain of zodmem frames while `thunk` runs: at any call (`deepest`),
    or at a call of the user's function `loss`."""
    longest: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call" or (not deepest and frame.f_code.co_name != "loss"):
            return
        chain = _zodmem_frames(frame if deepest else frame.f_back)
        if len(chain) > len(longest):
            longest[:] = chain

    sys.setprofile(profile)
    try:
        thunk()
    finally:
        sys.setprofile(None)
    return list(reversed(longest))


def report(name: str, chain: list[tuple[str, str]]) -> None:
    modules = [module for module, _ in chain]
    crossings = sum(1 for a, b in zip(modules, modules[1:], strict=False) if a != b)
    print(f"## {name}: {len(chain)} zodmem frames, {crossings} module crossings")
    for module, function in chain:
        print(f"  {module}: {function}")


def loss(w):
    spread = 0.5 * jnp.sum(1.05 ** jnp.arange(w.size) * w**2)
    return spread + 0.01 * jnp.sum(jnp.tanh(w[:-1] * w[1:]))


def main() -> None:
    deepest = "--deepest" in sys.argv
    w = jnp.linspace(0.1, 1.0, 300)
    hessian = zm.BatchedHessian(loss, max_memory="100MB")
    report("BatchedHessian(max_memory='100MB')(x)", longest_chain(lambda: hessian(w), deepest))
    op = hessian.operator(w)
    report("zm.eigsh(op, 5)", longest_chain(lambda: zm.eigsh(op, 5, max_steps=300), deepest))


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
