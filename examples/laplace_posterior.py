"""A Laplace posterior of a small network's parameters, from the top of its Gauss-Newton
matrix and the diagonal of the rest.

A network fitted to noisy data by least squares sits at the mode `theta*` of a posterior
whose Laplace approximation is `N(theta*, (G + prior I)^-1)`, with `G` the Gauss-Newton
matrix of the Gaussian negative log-likelihood and `prior` a Gaussian prior's precision.
`zm.low_rank(G, r, diagonal="exact")` keeps `G`'s top `r` eigenpairs (Lanczos, from
products) and the exact diagonal of what they leave out, `U diag(s) U^T + diag(d)`, whose
damped inverse, log-determinant, marginal variances and samples are exact and cost
`O(n r^2)`. For an MLP with 321 parameters fitted to 64 points, this script shows:

- the prior's precision chosen by the Laplace evidence, from the exact log-determinant
  of the approximation at each candidate;
- the posterior's standard deviations and log-determinant, checked against the dense
  `(n, n)` matrix of the same approximation;
- draws of the parameters from the posterior, and the predictions they make: through
  the linearised network their spread is the closed form `J (G + prior I)^-1 J^T`;
  through the network itself it is far wider, as is known of networks' Laplace
  posteriors (Immer, Korzepa and Bauer, 2021), so predict with the linearised one;
- where laplax is installed (`pip install laplax`), laplax's posteriors of the same
  network and data beside zodmem's: its low-rank one (LOBPCG, rank `r`, no diagonal)
  beside `zm.low_rank(G, r)`, the same approximation, and its full one (the dense
  inverse) beside the low-rank plus diagonal one, whose difference is the
  approximation's error.

Runs in about 20 seconds on a laptop CPU:

    python examples/laplace_posterior.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import zodmem as zm

jax.config.update("jax_enable_x64", True)

NOISE = 0.1  # the data's noise, and the likelihood's standard deviation
RANK = 20  # of 321 directions: G's eigenvalues past the 20th lie far below the prior's


def make_problem():
    key_model, key_noise = jax.random.split(jax.random.key(0))
    xs = jnp.linspace(-2, 2, 64)[:, None]
    ys = jnp.sin(2 * xs) + NOISE * jax.random.normal(key_noise, xs.shape)
    model = eqx.nn.MLP(1, 1, 16, 2, activation=jnp.tanh, key=key_model)
    return model, xs, ys


def predict(model, xs, ys):
    return jax.vmap(model)(xs)


def loss(model, xs, ys):
    """The Gaussian negative log-likelihood, up to a constant."""
    return 0.5 * jnp.sum((predict(model, xs, ys) - ys) ** 2) / NOISE**2


@eqx.filter_jit
def train(model, xs, ys, steps=1500, rate=1e-2):
    """Adam on the negative log-likelihood, in one compiled loop."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def step(carry, _):
        params, first, second, count = carry
        grads = jax.grad(lambda p: loss(eqx.combine(p, static), xs, ys))(params)
        count = count + 1
        first = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, first, grads)
        second = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, second, grads)

        def update(p, m, v):
            m_hat, v_hat = m / (1 - 0.9**count), v / (1 - 0.999**count)
            return p - rate * m_hat / (jnp.sqrt(v_hat) + 1e-8)

        return (jax.tree.map(update, params, first, second), first, second, count), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (params, *_), _ = jax.lax.scan(step, (params, zeros, zeros, 0), None, length=steps)
    return eqx.combine(params, static)


def relative(a, b):
    """The largest relative difference between two arrays, entry by entry."""
    return float(jnp.max(jnp.abs(a - b) / jnp.abs(b)))


def main():
    model, xs, ys = make_problem()
    model = train(model, xs, ys)
    mode, unravel = ravel_pytree(eqx.filter(model, eqx.is_inexact_array))
    _, static = eqx.partition(model, eqx.is_inexact_array)
    n = mode.size
    fit = loss(model, xs, ys)
    print(f"trained: {n} parameters, negative log-likelihood {float(fit):.2f}")

    # G = J^T J / NOISE^2, the Fisher information of the Gaussian likelihood.
    likelihood = zm.losses.SquaredError(weights=1 / NOISE**2, reduction="sum")
    G = zm.BatchedGGN(predict, likelihood).operator(model, xs, ys)
    posterior = zm.low_rank(G, RANK, diagonal="exact")
    print(
        f"zm.low_rank(G, {RANK}, diagonal='exact'): eigenvalues {float(posterior.s[0]):.3g} "
        f"to {float(posterior.s[-1]):.3g}"
    )

    # The prior's precision that maximises the Laplace approximation of the evidence,
    # log p(data | prior) = -fit - prior |mode|^2 / 2 + n log(prior) / 2
    #                       - log det(G + prior I) / 2 + constant,
    # from the exact log-determinant of the approximation, cheap for every prior.
    def evidence(prior):
        logdet = posterior.logdet(damping=prior)
        return -fit - prior * jnp.sum(mode**2) / 2 + n * jnp.log(prior) / 2 - logdet / 2

    priors = 10.0 ** np.arange(-2, 3.25, 0.25)
    prior = float(priors[np.argmax([evidence(p) for p in priors])])
    print(f"the prior precision of largest evidence: {prior:.3g}")

    std = jnp.sqrt(posterior.marginal_variances(damping=prior))
    dense = posterior.as_matrix() + prior * jnp.eye(n)
    print(
        "marginal variances equal the dense inverse's diagonal:",
        bool(jnp.allclose(std**2, jnp.diag(jnp.linalg.inv(dense)), rtol=1e-8)),
    )
    print(
        "log-determinant equals slogdet's:",
        bool(jnp.allclose(posterior.logdet(damping=prior), jnp.linalg.slogdet(dense)[1])),
    )
    print(
        "diagonal equals G's:",
        bool(jnp.allclose(posterior.diagonal(), zm.diagonal(G), rtol=1e-8, atol=1e-10)),
    )

    # Draws of the parameters from the posterior N(mode, (G + prior I)^-1).
    count = 4000
    draws = mode + posterior.sample(jax.random.key(1), (count,), damping=prior)
    # A sample variance's relative standard error is sqrt(2 / count).
    error = jnp.abs(jnp.var(draws, axis=0) / std**2 - 1)
    print(
        f"the {count} draws' variances lie within 5 standard errors of the marginal ones:",
        bool(jnp.all(error < 5 * np.sqrt(2 / count))),
    )

    # Predictions: the linearised network's variance J (G + prior I)^-1 J^T in closed
    # form, and the spread of the draws' predictions, through the linearised network and
    # through the network itself.
    x_test = jnp.linspace(-3, 3, 7)[:, None]

    def predictions(flat):
        return jax.vmap(eqx.combine(unravel(flat), static))(x_test)[:, 0]

    at_mode = predictions(mode)
    jacobian = jax.jacfwd(predictions)(mode)  # (7, n)
    linearised = jnp.sum(jacobian * posterior.solve(jacobian.T, damping=prior).T, axis=1)
    through_linear = at_mode + (draws - mode) @ jacobian.T
    through_network = jax.vmap(predictions)(draws)
    # A sample standard deviation's relative standard error is 1 / sqrt(2 count).
    error = jnp.abs(jnp.std(through_linear, axis=0) / jnp.sqrt(linearised) - 1)
    print(
        "the draws' spread through the linearised network matches J (G + prior I)^-1 J^T:",
        bool(jnp.all(error < 5 / np.sqrt(2 * count))),
    )
    print("\n   x   at the mode   linearised std   std of draws: linearised   network")
    for row in zip(
        x_test[:, 0],
        at_mode,
        jnp.sqrt(linearised),
        jnp.std(through_linear, axis=0),
        jnp.std(through_network, axis=0),
        strict=True,
    ):
        print("{:5.1f} {:13.4f} {:16.4f} {:26.4f} {:9.4f}".format(*row))
    # The network itself spreads far wider at the draws than its linearisation does, as
    # is known of networks' Laplace posteriors: predict with the linearised network.

    compare_with_laplax(model, static, xs, ys, G, posterior, prior, jacobian, x_test)


def compare_with_laplax(model, static, xs, ys, G, posterior, prior, jacobian, x_test):
    try:
        from laplax.curv import create_ggn_mv, create_posterior_fn
        from laplax.eval.pushforward import (
            lin_pred_mean,
            lin_pred_var,
            lin_setup,
            set_lin_pushforward,
        )
        from laplax.util.mv import diagonal
    except ImportError:
        print("\nlaplax is not installed (pip install laplax): no comparison with it.")
        return

    params = eqx.filter(model, eqx.is_inexact_array)

    def model_fn(input, params):
        return eqx.combine(params, static)(input)

    # laplax's "mse" curvature is 2 J^T J; its `sigma_squared` multiplies the curvature,
    # so 1 / (2 NOISE^2) makes the same J^T J / NOISE^2 as zodmem's.
    data = {"input": xs, "target": ys}
    ggn_mv = create_ggn_mv(model_fn, params, data, loss_fn="mse")
    prior_arguments = {"prior_prec": prior, "sigma_squared": 1 / (2 * NOISE**2)}
    finishers = [lin_setup, lin_pred_mean, lin_pred_var]

    def laplax_posterior(kind, **options):
        posterior_fn = create_posterior_fn(kind, mv=ggn_mv, layout=params, **options)
        state = posterior_fn(prior_arguments)
        variances = diagonal(state.cov_mv(state.state), layout=params)
        predictive = set_lin_pushforward(
            model_fn, params, posterior_fn, prior_arguments, pushforward_fns=finishers
        )
        return jnp.sqrt(variances), jax.vmap(predictive)(x_test)["pred_var"][:, 0]

    def zodmem_posterior(low_rank):
        variances = low_rank.marginal_variances(damping=prior)
        predictive = jnp.sum(jacobian * low_rank.solve(jacobian.T, damping=prior).T, axis=1)
        return jnp.sqrt(variances), predictive

    rows = [
        (
            f"The same approximation, rank {RANK} and no diagonal",
            "zm.low_rank(G, r)",
            zodmem_posterior(zm.low_rank(G, RANK)),
            "laplax 'lobpcg'",
            laplax_posterior("lobpcg", rank=RANK, key=jax.random.key(2)),
        ),
        (
            f"Rank {RANK} and the diagonal, beside the full posterior",
            "zm.low_rank(G, r, 'exact')",
            zodmem_posterior(posterior),
            "laplax 'full'",
            laplax_posterior("full"),
        ),
    ]
    for title, ours_name, (ours_std, ours_var), theirs_name, (std, var) in rows:
        print(f"\n{title}: {ours_name} beside {theirs_name}")
        print("  the first 6 parameters' standard deviations; predictive variances at x = -3, 0, 3")
        for name, stds, variances in ((ours_name, ours_std, ours_var), (theirs_name, std, var)):
            shown = " ".join(f"{v:.4f}" for v in stds[:6])
            print(f"  {name:28s} std {shown}   var {' '.join(f'{v:.2e}' for v in variances[::3])}")
        print(
            f"  max relative difference: standard deviations {relative(ours_std, std):.2e}, "
            f"predictive variances {relative(ours_var, var):.2e}"
        )


if __name__ == "__main__":
    main()
