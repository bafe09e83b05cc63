"""Standard errors of a neural network's parameters from its Fisher information, in 1 GB.

A simulation study. Data are drawn from a known "teacher" MLP (16 inputs, 8 tanh
hidden units, 1 output, n = 145 parameters) with Gaussian noise of known standard
deviation `sigma`, and an MLP of the same shape is fitted to them by maximum
likelihood. The negative log-likelihood is

    nll(params) = sum_i (model(x_i) - y_i)^2 / (2 sigma^2) + constant,

and the Fisher information of the parameters is the Hessian of `nll` at the fit, with
the data replaced by their expectation under the fitted model (the model's own
predictions); the Hessian with the observed data, the observed information, differs
from it by a term proportional to the residuals, which averages to zero. The
covariance of the estimates is the pseudo-inverse of the Fisher information, and the
square roots of its diagonal are their standard errors. Since the true parameters are
known here, the standard errors can be checked: about 95% of the estimates should lie
within two standard errors of the truth.

The Hessian itself is small (145 x 145), but `jax.hessian` computes it with the
intermediates of one Hessian-vector product per parameter for all 65,536 data points
at once, more than the 1 GB this script allows itself for computing it (on top of
what the process holds already: JAX, the data, the fit). XLA's memory analysis of the
compiled `jax.hessian` says so without running it. The same analysis picks the number
of blocks that keeps `zm.BatchedHessian` within the budget, and that computes the
Hessians here; the growth of the process's peak memory while it runs is printed too.

Runs in about half a minute on a laptop CPU:

    python examples/fisher_information.py
"""

import resource
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

import zodmem as zm

jax.config.update("jax_enable_x64", True)  # a covariance wants a well-resolved inverse

BUDGET_BYTES = 1_000_000_000  # 1 GB
NUM_POINTS = 65_536
IN_SIZE, WIDTH = 16, 8
SIGMA = 0.1  # the noise's standard deviation, taken as known
FIT_STEPS = 200


def make_teacher(key):
    """A one-hidden-layer tanh MLP with weights of unit scale: distinct, active units."""
    model_key, *layer_keys = jax.random.split(key, 5)
    teacher = eqx.nn.MLP(IN_SIZE, "scalar", WIDTH, depth=1, activation=jnp.tanh, key=model_key)
    hidden, output = teacher.layers
    return eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight, m.layers[1].bias),
        teacher,
        (
            jax.random.normal(layer_keys[0], hidden.weight.shape),
            jax.random.normal(layer_keys[1], hidden.bias.shape),
            jax.random.normal(layer_keys[2], output.weight.shape),
            jax.random.normal(layer_keys[3], output.bias.shape),
        ),
    )


def nll(model, x, y):
    residuals = jax.vmap(model)(x) - y
    return 0.5 * jnp.sum(residuals**2) / SIGMA**2


def fit(model, x, y):
    """Minimise the negative log-likelihood with L-BFGS, full batch."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def objective(params):
        return nll(eqx.combine(params, static), x, y)

    optimiser = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(objective)

    def step(carry, _):
        params, state = carry
        value, grad = value_and_grad(params, state=state)
        updates, state = optimiser.update(
            grad, state, params, value=value, grad=grad, value_fn=objective
        )
        return (optax.apply_updates(params, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, optimiser.init(params)), length=FIT_STEPS)
    return eqx.combine(params, static)


def xla_bytes(function, *args):
    """XLA's estimate of a jitted function's memory (arguments, output and temporaries),
    from compiling it, without running it."""
    stats = jax.jit(function).lower(*args).compile().memory_analysis()
    return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def batched_hessian_bytes(nbatches, static, params, x, y):
    """`xla_bytes` of `zm.BatchedHessian(nll, nbatches=nbatches)` at these arguments."""
    # jit=False: the jax.jit in xla_bytes compiles the whole computation at once.
    hessian = zm.BatchedHessian(nll, nbatches=nbatches, jit=False)
    return xla_bytes(lambda params: hessian(eqx.combine(params, static), x, y), params)


def peak_memory_bytes():
    """This process's peak resident memory so far (Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def gb(nbytes):
    return f"{nbytes / 1e9:.2f} GB"


def main():
    teacher_key, x_key, noise_key, start_key = jax.random.split(jax.random.key(0), 4)
    teacher = make_teacher(teacher_key)
    x = jax.random.normal(x_key, (NUM_POINTS, IN_SIZE))
    y = jax.vmap(teacher)(x) + SIGMA * jax.random.normal(noise_key, (NUM_POINTS,))

    params, static = eqx.partition(teacher, eqx.is_inexact_array)
    truth, unravel = ravel_pytree(params)
    n = truth.size
    # The fit starts near the truth, so that it finds the optimum whose hidden units are
    # labelled as the teacher's (permuting them gives the same network).
    start = truth + 0.05 * jax.random.normal(start_key, (n,))
    model = eqx.filter_jit(fit)(eqx.combine(unravel(start), static), x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    estimate, _ = ravel_pytree(params)
    predictions = jax.vmap(model)(x)
    residual_rms = float(jnp.sqrt(jnp.mean((predictions - y) ** 2)))
    print(f"MLP {IN_SIZE} -> {WIDTH} (tanh) -> 1 fitted to {NUM_POINTS:,} points, sigma = {SIGMA}")
    print(f"n = {n} parameters; residual RMS at the fit {residual_rms:.3f}")
    print(f"the Hessian is {n} x {n} float64 = {n * n * 8 / 1e6:.2f} MB; budget {gb(BUDGET_BYTES)}")

    # Memory, from XLA's analysis of the compiled functions; nothing big is run.
    def nll_of_flat(flat):
        return nll(eqx.combine(unravel(flat), static), x, predictions)

    naive = xla_bytes(jax.hessian(nll_of_flat), estimate)
    verdict = "over" if naive > BUDGET_BYTES else "within"
    print(f"\njax.hessian would need {gb(naive)}: {verdict} the budget")
    nbatches = None
    for candidate in (1, 2, 4, 8, 16, 32, 64):
        needed = batched_hessian_bytes(candidate, static, params, x, predictions)
        print(f"zm.BatchedHessian(nbatches={candidate}) would need {gb(needed)}")
        if needed <= BUDGET_BYTES:
            nbatches = candidate
            break
    if nbatches is None:
        raise SystemExit("no block count tried fits in the budget")
    print(f"-> nbatches={nbatches} fits in the budget")

    # The Fisher information: the Hessian at the fit, with the model's predictions as data.
    hessian = zm.BatchedHessian(nll, nbatches=nbatches)
    before = peak_memory_bytes()
    fisher = hessian(model, x, predictions).block_until_ready()
    observed = hessian(model, x, y).block_until_ready()
    added = peak_memory_bytes() - before
    # A check that needs no Hessian: one Hessian-vector product, forward over reverse.
    v = jax.random.normal(jax.random.key(1), (n,))
    _, product = jax.jvp(jax.grad(nll_of_flat), (estimate,), (v,))
    product_error = float(jnp.max(jnp.abs(fisher @ v - product)) / jnp.max(jnp.abs(product)))
    print(
        f"\nFisher information {fisher.shape}; F @ v equals a Hessian-vector product: "
        f"{product_error < 1e-10}"
    )
    print(f"computing the two Hessians raised this process's peak memory by {gb(added)}")
    difference = float(jnp.linalg.norm(observed - fisher) / jnp.linalg.norm(fisher))
    print(f"the observed information (with the data y) differs from it by {difference:.1%}")
    eigenvalues = jnp.linalg.eigvalsh(fisher)
    print(f"its eigenvalues run from {float(eigenvalues[0]):.3g} to {float(eigenvalues[-1]):.3g}")

    covariance = jnp.linalg.pinv(fisher, hermitian=True)
    standard_errors = jnp.sqrt(jnp.diag(covariance))
    z = (estimate - truth) / standard_errors
    covered = int(jnp.sum(jnp.abs(z) < 2))

    # Flat order is leaf order: hidden weights (8 x 16), hidden biases, output weights, bias.
    named = {
        "hidden weight [0, 0]": 0,
        "hidden weight [3, 5]": 3 * IN_SIZE + 5,
        "hidden bias [2]": WIDTH * IN_SIZE + 2,
        "output weight [0]": WIDTH * IN_SIZE + WIDTH,
        "output weight [7]": WIDTH * IN_SIZE + WIDTH + 7,
        "output bias": n - 1,
    }
    assert float(truth[named["hidden weight [3, 5]"]]) == float(teacher.layers[0].weight[3, 5])
    print("\nparameter               true   estimate  standard error")
    for name, i in named.items():
        print(
            f"{name:<21} {float(truth[i]):>7.4f}  {float(estimate[i]):>8.4f}  "
            f"{float(standard_errors[i]):>13.4f}"
        )
    print(f"\n{covered} of {n} estimates lie within two standard errors of the truth")


if __name__ == "__main__":
    main()
