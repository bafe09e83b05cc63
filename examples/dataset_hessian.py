"""The Hessian of a loss over a whole dataset, a microbatch at a time.

The Hessian of a mean loss with respect to a model's parameters is the mean, over the
examples, of each example's Hessian, so it can be accumulated a microbatch at a time:

    zm.Microbatcher(zm.BatchedHessian(loss), microbatch_size=m, argnums=(1, 2),
                    accumulator="mean")

cuts the data (arguments 1 and 2 of `loss(model, x, y)`) into microbatches of `m`
examples, takes each microbatch's Hessian in blocks of columns, and averages them,
weighting each microbatch by its size: `m` need not divide the number of examples.
Peak memory then depends on the microbatch and the block, not on the dataset.

The script

1. checks the stack against `jax.hessian` of the full-batch loss on a small case, in
   float64, with a microbatch size that does not divide the dataset; and
2. prints XLA's memory analysis of the compiled computations for a larger case
   (n = 2,361 parameters, 50,000 examples) -- `jax.hessian`, `zm.BatchedHessian` on
   the full batch, and the microbatched stack -- without running them.

Runs in about twenty seconds on a laptop CPU:

    python examples/dataset_hessian.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import zodmem as zm

jax.config.update("jax_enable_x64", True)


def loss(model, x, y):
    """Mean squared error of a scalar-output model over a (micro)batch."""
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_problem(key, num_examples, in_size, width, dtype):
    model_key, x_key, y_key = jax.random.split(key, 3)
    model = eqx.nn.MLP(in_size, "scalar", width, depth=2, activation=jnp.tanh, key=model_key)
    model = jax.tree_util.tree_map(
        lambda leaf: leaf.astype(dtype) if eqx.is_array(leaf) else leaf, model
    )
    x = jax.random.normal(x_key, (num_examples, in_size), dtype)
    y = jnp.sin(jnp.sum(x, axis=1)) + 0.1 * jax.random.normal(y_key, (num_examples,), dtype)
    return model, x, y


def full_batch_hessian_with_jax(model, x, y):
    """`jax.hessian` of the full-batch loss, as a function of the raveled parameters."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    return jax.hessian(lambda flat: loss(eqx.combine(unravel(flat), static), x, y))(flat)


def dataset_hessian(microbatch_size, nbatches, jit=True):
    return zm.Microbatcher(
        zm.BatchedHessian(loss, nbatches=nbatches, jit=jit),
        microbatch_size=microbatch_size,
        argnums=(1, 2),
        accumulator="mean",
    )


def xla_bytes(hessian_of, model, x, y):
    """XLA's estimate of the memory (arguments, output, temporaries) of computing the
    Hessian with `hessian_of(model, x, y)`, from compiling it, without running it."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    compute = jax.jit(lambda params, x, y: hessian_of(eqx.combine(params, static), x, y))
    stats = compute.lower(params, x, y).compile().memory_analysis()
    return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def check_small_case():
    print("== A small case, checked against jax.hessian (float64)")
    model, x, y = make_problem(jax.random.key(0), 1000, in_size=4, width=8, dtype=jnp.float64)
    stack = dataset_hessian(microbatch_size=256, nbatches=4)
    hessian = stack(model, x, y)
    expected = eqx.filter_jit(full_batch_hessian_with_jax)(model, x, y)
    n = hessian.shape[0]
    difference = float(jnp.max(jnp.abs(hessian - expected)) / jnp.max(jnp.abs(expected)))
    sizes = [min(256, len(x) - start) for start in range(0, len(x), 256)]
    print(f"n = {n} parameters, {len(x)} examples in microbatches of {tuple(sizes)}")
    print(
        f"Hessian {hessian.shape}; equal to jax.hessian of the full-batch loss: "
        f"{difference < 1e-12}"
    )
    print(f"trace {float(jnp.trace(hessian)):.6f}")
    print(f"H[0, :4] = {np.round(np.asarray(hessian[0, :4]), 6)}")


def memory_of_a_larger_case():
    print("\n== A larger case: XLA's memory analysis, nothing run (float32)")
    num_examples = 50_000
    model, x, y = make_problem(
        jax.random.key(1), num_examples, in_size=16, width=40, dtype=jnp.float32
    )
    n = sum(leaf.size for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"n = {n:,} parameters, {num_examples:,} examples of {x.shape[1]} features; "
        f"the Hessian itself is {n * n * 4 / 1e6:.1f} MB"
    )
    cases = {
        "jax.hessian, full batch": lambda m, x, y: full_batch_hessian_with_jax(m, x, y),
        "zm.BatchedHessian(nbatches=16), full batch": zm.BatchedHessian(
            loss, nbatches=16, jit=False
        ),
    }
    for microbatch_size in (4096, 1024):
        cases[f"Microbatcher(BatchedHessian(nbatches=16), microbatch_size={microbatch_size})"] = (
            dataset_hessian(microbatch_size, nbatches=16, jit=False)
        )
    for name, hessian_of in cases.items():
        print(f"{name:<72} {xla_bytes(hessian_of, model, x, y) / 1e9:>7.2f} GB")


def main():
    check_small_case()
    memory_of_a_larger_case()


if __name__ == "__main__":
    main()
