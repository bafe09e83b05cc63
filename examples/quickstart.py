"""zodmem quickstart: the Hessian of a small network's loss, with and without zodmem.

The Hessian of a loss with respect to a model's n parameters is an n x n matrix.
`jax.hessian` builds it in one go, and on the way holds intermediates many times
its size. `zm.BatchedHessian` builds it one block of rows at a time, each written
straight into the result, so it needs about the Hessian itself and one block.

This script computes the same Hessian both ways, each in a fresh Python process so
that their peak memory can be measured separately, checks that the two agree, and
prints what each cost. Run it with

    python examples/quickstart.py

It takes about half a minute on a laptop CPU.
"""

import os
import resource
import subprocess
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import zodmem as zm

NBATCHES = 64


def make_problem():
    """A two-hidden-layer MLP and 256 data points: n = 6,337 parameters."""
    model_key, x_key, y_key = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(in_size=32, out_size=1, width_size=64, depth=2, key=model_key)
    x = jax.random.normal(x_key, (256, 32))
    y = jax.random.normal(y_key, (256,))
    return model, x, y


def loss(model, x, y):
    prediction = jax.vmap(model)(x)[:, 0]
    return jnp.mean((prediction - y) ** 2)


def hessian_with_jax(model, x, y):
    # jax.hessian wants a flat array of parameters: split the model's arrays from
    # its other fields (its activation function), and ravel them.
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)

    def loss_of_flat(flat):
        return loss(eqx.combine(unravel(flat), static), x, y)

    return jax.jit(jax.hessian(loss_of_flat))(flat)


def hessian_with_zodmem(model, x, y):
    # zodmem differentiates with respect to the model's floating-point arrays directly,
    # in NBATCHES blocks.
    return zm.BatchedHessian(loss, nbatches=NBATCHES)(model, x, y)


METHODS = {
    "jax.hessian": hessian_with_jax,
    f"zm.BatchedHessian(nbatches={NBATCHES})": hessian_with_zodmem,
}


def peak_memory_bytes():
    """This program's peak resident memory so far.

    On Linux, read `VmHWM` from /proc/self/status: there `ru_maxrss` carries over
    from the parent process, so a child would report at least its parent's size.
    """
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes, Linux: kB


def run_one(method, out_path):
    """Child process: compute one Hessian, save it, and print what it cost."""
    model, x, y = make_problem()
    jax.block_until_ready(eqx.filter_jit(loss)(model, x, y))  # start JAX up before measuring
    before = peak_memory_bytes()
    start = time.perf_counter()
    hessian = METHODS[method](model, x, y).block_until_ready()
    seconds = time.perf_counter() - start
    peak = peak_memory_bytes()
    np.save(out_path, np.asarray(hessian))
    print(before, peak, seconds)


def main():
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPU cores\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hessians = []
        for i, method in enumerate(METHODS):
            out_path = os.path.join(tmp, f"hessian_{i}.npy")
            child = [sys.executable, __file__, "--child", method, out_path]
            result = subprocess.run(child, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"{method} failed:\n{result.stderr}")
            before, peak, seconds = result.stdout.split()[-3:]
            rows.append((method, int(before), int(peak), float(seconds)))
            hessians.append(np.load(out_path))
        reference, ours = hessians
        difference = np.max(np.abs(ours - reference)) / np.max(np.abs(reference))

    n, megabytes = reference.shape[0], reference.nbytes / 1e6
    print(f"The Hessian of an MLP's loss: n = {n:,} parameters, H = {megabytes:.0f} MB.\n")
    print(f"{'method':<32}{'time':>8}{'peak memory':>14}{'used by the call':>19}")
    for method, before, peak, seconds in rows:
        used = (peak - before) / 1e9
        print(f"{method:<32}{seconds:>6.1f} s{peak / 1e9:>11.2f} GB{used:>16.2f} GB")
    print(
        "\ntime: the call, compilation included. 'used by the call': the peak less what the"
        "\nprocess held before it (Python, JAX, the model and the data)."
    )
    print(f"The two Hessians agree: largest difference {difference:.1e} of the largest entry.")
    (_, jax_before, jax_peak, jax_seconds), (_, zm_before, zm_peak, zm_seconds) = rows
    memory_ratio = (jax_peak - jax_before) / (zm_peak - zm_before)
    print(
        f"zodmem used {memory_ratio:.1f}x less memory than jax.hessian, "
        f"in {zm_seconds / jax_seconds:.2f}x its time."
    )
    if difference > 1e-5:
        sys.exit("The Hessians differ more than float32 rounding explains.")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        run_one(sys.argv[2], sys.argv[3])
    else:
        main()
