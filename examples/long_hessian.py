"""A Hessian streamed to disk with `zm.to_file`, then used straight from the file.

The Hessian of a small network's loss is written to a `.npy` file one block of rows
at a time, with a progress bar on stderr: neither the device nor this process ever
holds it whole, and a job killed
half-way would resume at the first block not on disk. Calling `to_file` again on the
finished file returns it without computing anything. The file is then used as a
read-only memmap, a band of rows at a time: its largest eigenvalues (by subspace
iteration, which needs only products H @ V), checked against `numpy.linalg.eigvalsh`.

    python examples/long_hessian.py
"""

import os
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zodmem as zm

model_key, x_key = jax.random.split(jax.random.key(0))
model = eqx.nn.MLP(8, 1, 32, 2, key=model_key)
xs = jax.random.normal(x_key, (128, 8))
ys = jnp.sin(xs[:, 0])


def loss(model, xs, ys):
    return jnp.mean((jax.vmap(model)(xs)[:, 0] - ys) ** 2)


hessian = zm.BatchedHessian(loss, nbatches=16, progress=True)  # a bar on stderr
path = os.path.join(tempfile.mkdtemp(), "hessian.npy")

start = time.perf_counter()
H = zm.to_file(path, hessian, model, xs, ys)
first = time.perf_counter() - start
n = H.shape[0]
print(f"Hessian ({n}, {n}) written to {os.path.basename(path)} in 16 blocks: {first:.1f} s")

start = time.perf_counter()
H = zm.to_file(path, hessian, model, xs, ys)
again = time.perf_counter() - start
print(f"second call on the finished file: {again:.2f} s, nothing recomputed")
print(f"a read-only memmap: {isinstance(H, np.memmap) and not H.flags.writeable}")


def matmul(H, V, rows=256):
    """H @ V, reading the file a band of rows at a time."""
    return np.concatenate([H[i : i + rows] @ V for i in range(0, H.shape[0], rows)])


# Subspace iteration: the eigenvalues of largest magnitude, from products with H only.
k = 8
V = np.linalg.qr(np.random.default_rng(0).normal(size=(n, k)))[0].astype(np.float32)
for _ in range(60):
    V = np.linalg.qr(matmul(H, V))[0]
ritz = np.linalg.eigvalsh(V.T @ matmul(H, V))
top = ritz[np.argsort(-np.abs(ritz))][:3]
print("three largest eigenvalues (from the file):", np.round(top, 4))

exact = np.linalg.eigvalsh(np.asarray(H, np.float64))
exact = exact[np.argsort(-np.abs(exact))][:3]
print(f"equal to numpy.linalg.eigvalsh: {np.allclose(top, exact, rtol=1e-3, atol=1e-5)}")
in_memory = np.asarray(hessian(model, xs, ys))
print(f"the file holds the in-memory Hessian: {np.allclose(H, in_memory, atol=1e-6)}")
