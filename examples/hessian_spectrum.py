"""The spectrum of a small network's loss Hessian, from products only.

A network's loss Hessian tells how sharp the minimum it sits in is (its largest
eigenvalues), how much curvature there is overall (its trace), and how the curvature is
spread: a bulk of eigenvalues near zero and a few outliers, for most networks. None of
that needs the `n x n` matrix. Here, for an MLP with a few hundred parameters (small
enough to check every figure against `jnp.linalg.eigh` of `jax.hessian`):

- the 5 largest eigenvalues by Lanczos, `zm.eigsh(op, 5)`, with the number of products
  it took;
- the trace, exactly from `n` products (`zm.trace(op)`) and estimated from 60
  (`method="hutch++"`), with its standard error;
- the diagonal, exactly and by `method="diag++"`;
- the eigenvalue density by stochastic Lanczos quadrature, `zm.spectral_density`,
  plotted beside a histogram of the true eigenvalues (`hessian_spectrum.png`, when
  matplotlib is installed).

`op = zm.BatchedHessian(loss, max_memory=...).operator(model, xs, ys)` is the Hessian at
the trained model as a lineax operator: each product is one Hessian-vector product, and
the estimators take their products in blocks planned from the budget.

Runs in about half a minute on a laptop CPU:

    python examples/hessian_spectrum.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zodmem as zm

jax.config.update("jax_enable_x64", True)


def make_problem():
    key_model, key_x = jax.random.split(jax.random.key(0))
    model = eqx.nn.MLP(3, 1, 16, 2, activation=jnp.tanh, key=key_model, dtype=jnp.float64)
    xs = jax.random.normal(key_x, (128, 3), jnp.float64)
    ys = jnp.sin(xs[:, :1]) * jnp.cos(xs[:, 1:2]) + 0.3 * xs[:, 2:]
    return model, xs, ys


def loss(model, xs, ys):
    return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)


@eqx.filter_jit
def train_step(model, xs, ys):
    grads = eqx.filter_grad(loss)(model, xs, ys)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))


def main():
    model, xs, ys = make_problem()
    for _ in range(300):
        model = train_step(model, xs, ys)
    print(f"trained: loss {float(loss(model, xs, ys)):.4f}")

    hessian = zm.BatchedHessian(loss, max_memory="200MB")
    op = hessian.operator(model, xs, ys)
    n = op.in_size()
    print(f"n = {n} parameters")

    # The reference: the dense Hessian and its eigenvalues, possible only because n is small.
    dense = hessian(model, xs, ys)
    eigenvalues = np.linalg.eigvalsh(np.asarray(dense))

    top, vectors, info = zm.eigsh(op, 5, tol=1e-8, return_info=True)
    print(f"top 5 eigenvalues: {np.array2string(np.asarray(top), precision=5)}")
    print(f"Lanczos took {int(info.num_products)} products (n = {n})")
    agree = np.allclose(np.asarray(top), eigenvalues[-5:], rtol=1e-6)
    print(f"equal to jnp.linalg.eigh's top 5: {agree}")
    residual = op.mm(vectors) - vectors * top
    print(f"largest residual |H v - lambda v|: {float(jnp.max(jnp.abs(residual))):.1e}")

    exact = float(zm.trace(op))
    estimate, error = zm.trace(op, method="hutch++", num_probes=60, key=jax.random.key(1))
    print(f"trace: exact {exact:.4f}, Hutch++ with 60 products {float(estimate):.4f}")
    print(f"trace equal to the sum of the eigenvalues: {np.isclose(exact, eigenvalues.sum())}")
    within = abs(float(estimate) - exact) <= 3 * float(error)
    print(f"Hutch++ estimate within 3 standard errors ({float(error):.1e}): {within}")

    diagonal = zm.diagonal(op)
    print(f"exact diagonal equals the dense one: {np.allclose(diagonal, np.diag(dense))}")
    sketched, _ = zm.diagonal(op, method="diag++", num_probes=150, key=jax.random.key(2))
    relative = float(jnp.linalg.norm(sketched - diagonal) / jnp.linalg.norm(diagonal))
    print(f"Diag++ with 150 products: relative error {relative:.2f}")

    grid, density = zm.spectral_density(op, num_probes=20, num_steps=60, key=jax.random.key(3))
    mass = float(jnp.sum(density) * (grid[1] - grid[0]))
    print(f"spectral density integrates to {mass:.3f}")
    # The bulk near zero: the kernel (1% of the spectrum's width) spreads it over about
    # +-0.2, so the share is counted over |lambda| < 0.25.
    bulk = float(jnp.sum(jnp.where(jnp.abs(grid) < 0.25, density, 0)) * (grid[1] - grid[0]))
    true_bulk = float(np.mean(np.abs(eigenvalues) < 0.25))
    print(f"share of eigenvalues in |lambda| < 0.25: density {bulk:.2f}, exact {true_bulk:.2f}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.hist(eigenvalues, bins=80, density=True, alpha=0.4, label="eigenvalues (dense)")
    axes.plot(grid, density, label="stochastic Lanczos quadrature")
    axes.set_yscale("log")
    axes.set_ylim(1e-3, None)
    axes.set_xlabel("eigenvalue")
    axes.set_ylabel("density")
    axes.legend()
    figure.tight_layout()
    figure.savefig("hessian_spectrum.png", dpi=120)
    print("plot written to hessian_spectrum.png")


if __name__ == "__main__":
    main()
