"""The chains of zodmem's frames a call passes through, as functions and modules: what a
newcomer reads to follow `BatchedHessian(max_memory=...)(x)` and `zm.eigsh(op, 5)`.

    python benchmarks/call_paths.py             # the chain from the call to the user's fn
    python benchmarks/call_paths.py --deepest   # the deepest chain of zodmem frames
"""

import os
import sys

import jax
import jax.numpy as jnp

jax.config.update("jax_platforms", "cpu")
import zodmem as zm

ROOT = os.path.dirname(zm.__file__)
deepest = []


def prof_to_fn(frame, event, arg):
    # The zodmem frames between the user's call and the user's function, where the
    # function is reached through the block loop (the deepest such chain).
    if event != "call" or frame.f_code.co_name != "loss":
        return
    chain = []
    f = frame.f_back
    while f is not None:
        if f.f_code.co_filename.startswith(ROOT):
            chain.append((os.path.relpath(f.f_code.co_filename, ROOT), f.f_code.co_qualname))
        f = f.f_back
    if len(chain) > len(deepest):
        deepest[:] = chain


def prof_deepest(frame, event, arg):
    if event != "call":
        return
    chain = []
    f = frame
    while f is not None:
        if f.f_code.co_filename.startswith(ROOT):
            chain.append((os.path.relpath(f.f_code.co_filename, ROOT), f.f_code.co_qualname))
        f = f.f_back
    if len(chain) > len(deepest):
        deepest[:] = chain


prof = prof_deepest if "--deepest" in sys.argv else prof_to_fn


def report(name, thunk):
    deepest.clear()
    sys.setprofile(prof)
    thunk()
    sys.setprofile(None)
    chain = list(reversed(deepest))
    mods = [m for m, _ in chain]
    crossings = sum(1 for a, b in zip(mods, mods[1:]) if a != b)
    print(f"## {name}: {len(chain)} zodmem frames, {crossings} module crossings")
    for m, q in chain:
        print(f"  {m}: {q}")


def loss(w):
    return 0.5 * jnp.sum(1.05 ** jnp.arange(w.size) * w**2) + 0.01 * jnp.sum(
        jnp.tanh(w[:-1] * w[1:])
    )


w = jnp.linspace(0.1, 1.0, 300)
report(
    "BatchedHessian(max_memory='100MB')(x)", lambda: zm.BatchedHessian(loss, max_memory="100MB")(w)
)
op = zm.BatchedHessian(loss, max_memory="100MB").operator(w)
report("zm.eigsh(op, 5)", lambda: zm.eigsh(op, 5, max_steps=300))
