"""Plans made as a user's process makes them: at XLA's default compiler options (the
suite compiles everything at the backend's lowest optimisation level, where a probe and
the program compiled for the call report the same memory), in a fresh process.

The planner compiles the two ends of its search as probes, without the backend's
optimisations, and compiles the chosen one again for the call; where that program's
peak is over the budget, it searches again from programs compiled for the call. Here the
programs compiled for the call are made to report more than their probes, as a backend
whose optimisations add temporaries would, so that the probe fits and the real program
does not."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    import zodmem as zm
    from zodmem._plan import _budget

    def f(x):
        return jnp.sum(jnp.sin(jnp.outer(x, x)) ** 2) + jnp.sum(x ** 4)

    x = jnp.linspace(0.1, 1.0, 256)
    whole = zm.BatchedHessian(f, max_memory="1GB", strategy="linearize").plan(x)
    compiled = []
    original = _budget.Planner.compile

    def compile(self, strategy, size, probe):
        result = original(self, strategy, size, probe)
        if not probe:  # the real program needs a fifth more than its probe reported
            result = result._replace(peak_bytes=int(result.peak_bytes * 1.2))
        compiled.append([strategy, size, probe, result.peak_bytes])
        return result

    _budget.Planner.compile = compile
    # A budget the whole work's probe fits and its real program does not.
    budget = int(whole.peak_bytes * 1.1 / (1 - _budget.RESERVE_SHARE))
    out = {"whole": [whole.block_size, whole.total, whole.peak_bytes], "budget": budget}
    try:
        plan = zm.BatchedHessian(f, max_memory=budget, strategy="linearize").plan(x)
        out["plan"] = [plan.block_size, plan.peak_bytes]
        H = zm.BatchedHessian(f, max_memory=budget, strategy="linearize")(x)
        out["value_error"] = float(jnp.abs(H - jax.jit(jax.hessian(f))(x)).max())
    except zm.MemoryBudgetError as error:
        out["refused"] = str(error)
        out["suggested"] = error.suggested_bytes
        out["compiled"] = list(compiled)
        suggested = zm.BatchedHessian(f, max_memory=error.suggested_bytes, strategy="linearize")
        again = suggested.plan(x)
        out["suggested_plan"] = [again.block_size, again.peak_bytes, again.budget_bytes]
    out.setdefault("compiled", compiled)
    print(json.dumps(out))
    """
)


def test_a_probe_that_fits_whose_real_program_does_not_is_planned_again():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # default options
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    block, total, _ = out["whole"]
    assert block == total  # with a large budget, everything in one block
    compiled = out["compiled"]
    # The whole work's probe fitted; its real program, compiled for the call, did not,
    # and the search went on among programs compiled for the call only.
    first_real = next(i for i, (_, size, probe, _) in enumerate(compiled) if not probe)
    assert compiled[first_real][1] == total and compiled[first_real][3] > out["budget"] * 0.95
    assert all(not probe for _, _, probe, _ in compiled[first_real + 1 :])
    assert len(compiled) > first_real + 1
    if "plan" in out:  # a smaller block fits
        assert out["plan"][0] < total and out["plan"][1] <= out["budget"]
        assert out["value_error"] < 1e-3
    else:  # no block fits: the budget suggested instead plans, with real programs' figures
        assert "cannot hold" in out["refused"] and out["suggested"] > out["budget"]
        _, peak, budget = out["suggested_plan"]
        assert peak <= budget
