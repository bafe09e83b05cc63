"""Save zodmem transforms, with the model inside them, and load them back.

Two stacks are saved:

- the Hessian of a loss with respect to a model's parameters, where `fn` is a plain
  function and the model is the argument being differentiated; and
- per-example Jacobians of a model's outputs with respect to its inputs, where the
  model itself is the `fn` of a transform inside another transform, so its weights
  travel in the file.

Both are loaded again and compared with the originals. Runs in a few seconds:

    python examples/save_and_load.py
"""

import os
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp

import zodmem as zm


# Functions are saved by their import path. This one lives in the script's main module,
# so the file can be loaded by this script; a function in an importable package can be
# loaded anywhere.
def mean_squared_error(model, xs, ys):
    return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)


def make_model(key):
    return eqx.nn.MLP(in_size=2, out_size=1, width_size=8, depth=2, key=key)


def main():
    model_key, data_key = jax.random.split(jax.random.key(0))
    model = make_model(model_key)
    xs = jax.random.normal(data_key, (32, 2))
    ys = jnp.sin(xs[:, :1]) * jnp.cos(xs[:, 1:])

    hessian = zm.BatchedHessian(mean_squared_error, nbatches=4)
    per_example_jacobian = zm.ChunkedVmap(zm.BatchedJacobian(model, mode="rev"), chunk_size=8)

    with tempfile.TemporaryDirectory() as directory:
        hessian_path = os.path.join(directory, "hessian.zm")
        jacobian_path = os.path.join(directory, "per_example_jacobian.zm")
        zm.save(hessian_path, hessian)
        zm.save(jacobian_path, per_example_jacobian)
        for path in (hessian_path, jacobian_path):
            print(f"saved {os.path.basename(path)}: {os.path.getsize(path)} bytes")

        # No module inside: nothing to pass as `like`.
        loaded_hessian = zm.load(hessian_path)
        # The model's skeleton (shapes only, no memory) tells `load` how to rebuild it;
        # its weights come from the file.
        skeleton = eqx.filter_eval_shape(make_model, jax.random.key(1))
        loaded_jacobian = zm.load(jacobian_path, like=skeleton)

    print(f"loaded {loaded_hessian.__class__.__name__}(nbatches={loaded_hessian.nbatches})")
    print(
        f"loaded {loaded_jacobian.__class__.__name__}(chunk_size={loaded_jacobian.chunk_size}) "
        f"of {loaded_jacobian.fn.__class__.__name__}(mode={loaded_jacobian.fn.mode!r}) "
        f"of {loaded_jacobian.fn.fn.__class__.__name__}"
    )

    H, H_loaded = hessian(model, xs, ys), loaded_hessian(model, xs, ys)
    J, J_loaded = per_example_jacobian(xs), loaded_jacobian(xs)
    same_hessian = bool(jnp.array_equal(H, H_loaded))
    same_jacobian = bool(jnp.array_equal(J, J_loaded))
    print(f"Hessian {H.shape}: identical after loading: {same_hessian}")
    print(f"per-example Jacobians {J.shape}: identical after loading: {same_jacobian}")
    if not (same_hessian and same_jacobian):
        raise SystemExit("the loaded transforms compute different results")


if __name__ == "__main__":
    main()
