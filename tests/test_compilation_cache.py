"""With JAX's persistent compilation cache set (`jax_compilation_cache_dir`), a second
process that runs the same calls compiles nothing the cache can hold: the planning of a
budget, the blocks' program, an estimator's and a streamed job's programs come from the
cache. Each run is a fresh process with JAX's default compiler options."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax import monitoring

    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    counts = {}
    monitoring.register_event_listener(
        lambda name, **kwargs: counts.__setitem__(name, counts.get(name, 0) + 1)
    )
    import zodmem as zm

    def f(x):
        return jnp.sum(jnp.sin(x) ** 3) + jnp.sum(jnp.outer(x, x[:7]) ** 2)

    x = jnp.linspace(0.1, 1.0, 40)
    H = zm.BatchedHessian(f, max_memory="40kB")(x)
    planned = zm.BatchedHessian(f, max_memory="40kB").plan(x)
    vals, _ = zm.eigsh(zm.BatchedHessian(f).operator(x), 3)
    written = zm.to_file(sys.argv[2], zm.BatchedHessian(f, batch_size=16), x)
    H, written = np.asarray(H), np.asarray(written)
    assert np.abs(H - np.asarray(jax.jit(jax.hessian(f))(x))).max() < 1e-4
    assert np.abs(written - H).max() < 1e-4
    counts = {k: v for k, v in counts.items() if "compilation_cache" in k}
    print(json.dumps({**counts, "plan": [planned.block_size, planned.compiles]}))
    """
)


def _run(tmp_path, name):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # default options
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "cache"), str(tmp_path / f"{name}.npy")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_again(tmp_path):
    cached = "/jax/compilation_cache/"
    first = _run(tmp_path, "first")
    assert first.get(cached + "cache_misses", 0) > 0
    second = _run(tmp_path, "second")
    # Nothing the first process compiled is compiled again: the programs holding a host
    # callback (eigsh's Ritz step, the file's writes) JAX caches in no process, and the
    # planning of the budget is read from the plan the first process kept, with the one
    # program it chose, from the cache.
    assert cached + "cache_misses" not in second
    assert (
        0
        < second[cached + "cache_hits"]
        < first[cached + "cache_misses"] + first.get(cached + "cache_hits", 0)
    )
    assert first["plan"][1] > 1
    assert second["plan"] == [first["plan"][0], 1]
