"""A Fisher forecast: how well would a measurement pin down a damped oscillator?

Before taking data, the Fisher matrix says how precisely a planned experiment can
measure a model's parameters. Here the signal is a damped oscillation plus an offset,

    s(t; A, gamma, omega, phi, c) = A exp(-gamma t) cos(omega t + phi) + c,

sampled at N = 200 times, with Gaussian noise whose covariance `C` is white noise plus
a correlated (Ornstein-Uhlenbeck) drift. The negative log-likelihood of data `d` is

    nll(theta) = 1/2 (d - s(theta))^T C^-1 (d - s(theta)) + constant,

and its Fisher information is computed in two ways:

(a) the generalised Gauss-Newton matrix `J^T C^-1 J`, `J` the Jacobian of the signal,
    by `zm.BatchedGGN(signal, zm.losses.SquaredError(covariance=C))`; and
(b) the Hessian of `nll` at the true parameters, by `zm.BatchedHessian`, with the
    noiseless signal as the data.

The Hessian of `nll` is `J^T C^-1 J - sum_i [C^-1 (d - s)]_i Hess(s_i)`: the model's
own curvature enters only multiplied by the residuals. The Fisher information is the
expectation of this Hessian over the noise, and the residuals average to zero at the
true parameters, so it is exactly `J^T C^-1 J`. With noiseless data the residuals are
zero and (b) equals (a) to round-off; with one noisy realisation, (b) is the observed
information and differs from the Fisher matrix by about a per cent.

The standard errors forecast for each parameter are the square roots of the diagonal
of `F^-1` (the others fitted too) and `1 / sqrt(F_ii)` (the others known). The
forecast error of a derived quantity, the quality factor `Q = omega / (2 gamma)`, is
`sqrt(grad Q^T F^-1 grad Q)`: that needs one solve `F x = grad Q`, done here by
conjugate gradients on `BatchedGGN(...).operator(...)`, which never forms `F`, and
checked against the dense solve.

Runs in a few seconds on a laptop CPU:

    python examples/fisher_forecast.py
"""

import jax
import jax.numpy as jnp
import lineax as lx

import zodmem as zm

jax.config.update("jax_enable_x64", True)  # F spans several decades; invert it in float64

NUM_TIMES = 200
DURATION = 10.0  # seconds
WHITE_SIGMA = 0.05  # standard deviation of the white noise
DRIFT_SIGMA = 0.03  # standard deviation of the correlated drift
DRIFT_TIME = 0.5  # its correlation time, seconds

TRUTH = {
    "amplitude": jnp.asarray(1.0),
    "decay": jnp.asarray(0.3),  # 1 / s
    "frequency": jnp.asarray(2 * jnp.pi * 1.3),  # rad / s
    "offset": jnp.asarray(0.02),
    "phase": jnp.asarray(0.4),  # rad
}


def signal(params, times, data):
    """The model's prediction at `times`; `data` is passed on to the loss."""
    envelope = params["amplitude"] * jnp.exp(-params["decay"] * times)
    return envelope * jnp.cos(params["frequency"] * times + params["phase"]) + params["offset"]


def noise_covariance(times):
    lags = jnp.abs(times[:, None] - times[None, :])
    drift = DRIFT_SIGMA**2 * jnp.exp(-lags / DRIFT_TIME)
    return WHITE_SIGMA**2 * jnp.eye(times.size) + drift


def quality_factor(params):
    return params["frequency"] / (2 * params["decay"])


def main():
    times = jnp.linspace(0.0, DURATION, NUM_TIMES)
    covariance = noise_covariance(times)
    loss = zm.losses.SquaredError(covariance=covariance)  # the data are the last argument

    def nll(params, times, data):
        return loss(signal(params, times, data), times, data)

    noiseless = signal(TRUTH, times, None)
    noise = jnp.linalg.cholesky(covariance) @ jax.random.normal(jax.random.key(0), (NUM_TIMES,))
    noisy = noiseless + noise

    # The variables are the dict's arrays in leaf order: its keys, sorted.
    names = sorted(TRUTH)
    n = len(names)
    print(f"damped oscillator, {n} parameters, {NUM_TIMES} samples over {DURATION:g} s")
    print(f"noise: white sigma {WHITE_SIGMA}, drift sigma {DRIFT_SIGMA} over {DRIFT_TIME} s")

    # (a) The Fisher matrix as the Gauss-Newton matrix J^T C^-1 J.
    fisher = zm.BatchedGGN(signal, loss)(TRUTH, times, noiseless)
    # (b) The Hessian of the negative log-likelihood at the truth, noiseless data.
    hessian = zm.BatchedHessian(nll, batch_size=2)
    at_truth = hessian(TRUTH, times, noiseless)
    observed = hessian(TRUTH, times, noisy)

    # Differences on the scale of each entry, sqrt(F_ii F_jj): the matrix's own units.
    scale = jnp.sqrt(jnp.outer(jnp.diag(fisher), jnp.diag(fisher)))
    difference = float(jnp.max(jnp.abs(at_truth - fisher) / scale))
    noisy_difference = float(jnp.max(jnp.abs(observed - fisher) / scale))
    print(f"\nFisher matrix {fisher.shape}, condition number {float(jnp.linalg.cond(fisher)):.3g}")
    print(f"max relative difference, Hessian at the truth vs GGN: {difference:.2e}")
    print(f"the GGN and the Hessian agree: {difference < 1e-10}")
    print(f"with one noisy realisation (the observed information): {noisy_difference:.2e}")

    covariance_of_estimates = jnp.linalg.inv(fisher)
    marginal = jnp.sqrt(jnp.diag(covariance_of_estimates))
    conditional = 1 / jnp.sqrt(jnp.diag(fisher))
    print("\nforecast       true value   std. error  (others known)   relative")
    for i, name in enumerate(names):
        value = float(TRUTH[name])
        print(
            f"{name:<12} {value:>11.4f}  {float(marginal[i]):>11.2e}  "
            f"{float(conditional[i]):>14.2e}  {float(marginal[i]) / abs(value):>9.2%}"
        )

    # A derived quantity: sigma_Q^2 = grad Q^T F^-1 grad Q, with F^-1 grad Q by CG on the
    # operator, F never formed. The gradient is a dict shaped like the parameters, and
    # so is the solution; the operator is tagged positive semi-definite, as CG needs.
    operator = zm.BatchedGGN(signal, loss).operator(TRUTH, times, noiseless)
    gradient = jax.grad(quality_factor)(TRUTH)
    solver = lx.CG(rtol=1e-12, atol=1e-12, max_steps=200)
    solution = lx.linear_solve(operator, gradient, solver)
    x = solution.value
    print(f"\nCG on the operator: {int(solution.stats['num_steps'])} steps")

    flat_gradient = jnp.stack([gradient[name] for name in names])
    dense = jnp.linalg.solve(fisher, flat_gradient)
    flat_x = jnp.stack([x[name] for name in names])
    solve_error = float(jnp.max(jnp.abs(flat_x - dense)) / jnp.max(jnp.abs(dense)))
    print(f"CG solve equals the dense solve: {solve_error < 1e-8} (relative {solve_error:.1e})")
    q = float(quality_factor(TRUTH))
    sigma_q = float(jnp.sqrt(flat_gradient @ flat_x))
    print(f"quality factor Q = {q:.3f} +- {sigma_q:.3f} ({sigma_q / q:.2%})")


if __name__ == "__main__":
    main()
