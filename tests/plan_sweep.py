"""Plans of random small problems at random budgets, for checking that a plan depends on
the program, the budget and the devices alone.

`python plan_sweep.py [--warm] CASES.json` plans each `[case, budget]` pair of the file in
a fresh process (after compiling and running a larger program first, with `--warm`, so
that its heap differs) and prints one JSON line per pair: the plan's decision, or the
refusal's message. `tests/test_budget_reserve.py` compares them with its own process's.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import zodmem as zm

NUM_CASES = 12


def _loss(w, data):
    return jnp.sum(jnp.tanh(data @ w) ** 2) * jnp.mean(w**2)


def _outputs(w, data):
    return jnp.sin(data @ w)[:, None] * w[None, :]


def _element(x):
    return jnp.sum(jnp.tanh(jnp.outer(x, x)), axis=0)


def _batch_loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def case(index: int) -> tuple:
    """`(transform maker, arguments, output bytes)` of case `index`: a Hessian, a
    Jacobian, a chunked map or a microbatched loss of a few kB to a few hundred kB."""
    rng = np.random.default_rng(index)
    n, rows = int(rng.integers(8, 64)), int(rng.integers(2, 24))
    w = jnp.asarray(rng.normal(size=n), jnp.float32)
    data = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)
    makers = [
        (lambda budget: zm.BatchedHessian(_loss, max_memory=budget), (w, data), 4 * n * n),
        (
            lambda budget: zm.BatchedJacobian(_outputs, max_memory=budget, mode="rev"),
            (w, data),
            4 * rows * n * n,
        ),
        (lambda budget: zm.ChunkedVmap(_element, max_memory=budget), (data,), 4 * rows * n),
        (lambda budget: zm.Microbatcher(_batch_loss, max_memory=budget, argnums=1), (w, data), 4),
    ]
    return makers[index % 4]


def budget_of(index: int) -> int:
    """A budget between a tenth of and ten times the output, or a few hundred kB."""
    rng = np.random.default_rng(1000 + index)
    output = case(index)[2]
    return int(max(output, 2e5) * 10 ** rng.uniform(-1.2, 1.0))


def decide(index: int, budget: int) -> str:
    """The plan's decision at `budget`, or the refusal's message."""
    make, args, _ = case(index)
    try:
        return repr(make(budget).plan(*args).decision)
    except zm.MemoryBudgetError as error:
        return str(error)


def warm() -> None:
    """A larger program compiled and run, and memory taken and given back: a process whose
    heap differs from a fresh one's."""
    big = jnp.ones((1200, 1200))
    # The 6 MB input and its temporaries are what move the heap; a product of the whole
    # matrix with itself would only add seconds of arithmetic.
    jax.block_until_ready(
        jax.jit(lambda m: jnp.linalg.qr(jnp.sin(m)[:, :64] + m[:64].T)[0] * jnp.sum(m))(big)
    )
    del big


if __name__ == "__main__":
    if "--warm" in sys.argv:
        warm()
    pairs = json.loads(open(sys.argv[-1]).read())
    for index, budget in pairs:
        print(json.dumps(decide(index, budget)), flush=True)
