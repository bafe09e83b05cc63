"""Jacobians, Hessians, Hessian-vector products and per-example derivatives, with zodmem.

The classic batched-derivative workflows, written for JAX and zodmem:

1. the Jacobian of `tanh(W x + b)` one row at a time (a Python loop of
   vector-Jacobian products) and all at once (`zm.BatchedJacobian`);
2. forward against reverse mode, on a tall and on a wide Jacobian;
3. Jacobians with respect to the weights and the bias, through a pytree of
   parameters and `zm.jacobian_to_pytree`;
4. the Hessian as the Jacobian of the Jacobian, against `zm.BatchedHessian` and
   `jax.hessian`, and a Hessian-vector product that needs no Hessian;
5. per-example Jacobians and Hessians over a batch of 64 with `zm.ChunkedVmap`;
6. a critic with two outputs and auxiliary diagnostics (`has_aux=True`).

Every result is checked against plain JAX. The timings of section 2 are printed as
ratios and depend on the machine; everything else prints the same on every run.
Runs in a few seconds on a laptop CPU:

    python examples/jacobians_tutorial.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import zodmem as zm

D = 16  # the layer's width


def predict(weight, bias, x):
    """One dense layer with a tanh activation."""
    return jnp.tanh(weight @ x + bias)


def agree(actual, expected, rtol=1e-5):
    """Whether two (pytrees of) arrays are equal up to float32 rounding."""
    pairs = zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True)
    return all(
        a.shape == e.shape and np.allclose(a, e, rtol=rtol, atol=rtol * np.max(np.abs(e)))
        for a, e in pairs
    )


def heading(title):
    print(f"\n== {title}")


def best_time(fn, *args, repeats=5):
    """The shortest of a few runs, after a first run that compiles."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def row_by_row_and_vectorised(weight, bias, x):
    heading("1. The Jacobian of tanh(W x + b), row by row and vectorised")
    out, vjp = jax.vjp(lambda x: predict(weight, bias, x), x)
    # One vector-Jacobian product per output element: row i is e_i^T J.
    rows = [vjp(unit)[0] for unit in jnp.eye(out.size)]
    row_by_row = jnp.stack(rows)
    vectorised = zm.BatchedJacobian(predict_of_x)(x, weight, bias)
    print(f"Jacobian shape {vectorised.shape}: {len(rows)} VJPs in a Python loop, or one call")
    print(f"row-by-row and vectorised Jacobians agree: {agree(vectorised, row_by_row)}")
    print(f"equal to jax.jacrev: {agree(vectorised, jax.jacrev(predict_of_x)(x, weight, bias))}")
    # Rows in blocks of 4: the same Jacobian, a quarter of the products at a time.
    in_blocks = zm.BatchedJacobian(predict_of_x, mode="rev", batch_size=4)(x, weight, bias)
    print(f"in blocks of 4 rows, the Jacobian is the same: {agree(in_blocks, vectorised)}")
    print(f"J[0, :4] = {np.round(np.asarray(vectorised[0, :4]), 4)}")


def predict_of_x(x, weight, bias):
    """`predict` with the input first: zodmem differentiates with respect to argument 0."""
    return predict(weight, bias, x)


def forward_and_reverse():
    heading("2. Forward against reverse mode")
    print("Forward mode builds a Jacobian a column (JVP) at a time, reverse mode a row (VJP)")
    print("at a time: forward pays off for tall Jacobians (few inputs, many outputs), reverse")
    print('for wide ones. mode="auto" picks forward when there are no more inputs than outputs.')
    key_w, key_x = jax.random.split(jax.random.key(1))
    for label, n_in, n_out in [("tall", 32, 2048), ("wide", 2048, 32)]:
        weight = jax.random.normal(key_w, (n_out, n_in)) / jnp.sqrt(n_in)
        bias = jnp.zeros(n_out)
        x = jax.random.normal(key_x, (n_in,))
        forward = zm.BatchedJacobian(predict_of_x, mode="fwd")
        reverse = zm.BatchedJacobian(predict_of_x, mode="rev")
        same = agree(forward(x, weight, bias), reverse(x, weight, bias))
        forward_time = best_time(forward, x, weight, bias)
        reverse_time = best_time(reverse, x, weight, bias)
        faster, slower = (
            ("forward", "reverse") if forward_time < reverse_time else ("reverse", "forward")
        )
        ratio = max(forward_time, reverse_time) / min(forward_time, reverse_time)
        print(f"{label}: Jacobian {n_out} x {n_in}, the modes agree: {same}")
        print(f"  {faster} mode was {ratio:.0f}x faster than {slower} (timings vary by machine)")


def weights_and_bias(weight, bias, x):
    heading("3. Jacobians with respect to the weights and the bias")
    params = {"W": weight, "b": bias}

    def predict_of_params(params, x):
        return predict(params["W"], params["b"], x)

    flat = zm.BatchedJacobian(predict_of_params, nbatches=4)(params, x)
    blocks = zm.jacobian_to_pytree(flat, params)
    expected_w, expected_b = jax.jacrev(predict, argnums=(0, 1))(weight, bias, x)
    print(f"flat Jacobian {flat.shape}: the {weight.size} weights, then the {bias.size} biases")
    print(f"as a pytree: W {blocks['W'].shape}, b {blocks['b'].shape}")
    same = agree(blocks["W"], expected_w) and agree(blocks["b"], expected_b)
    print(f"equal to jax.jacrev(predict, argnums=(0, 1)): {same}")


def hessians(weight, bias, x):
    heading("4. The Hessian as the Jacobian of the Jacobian")

    def energy(x, weight, bias):
        return jnp.sum(predict(weight, bias, x) ** 2)

    gradient = zm.BatchedJacobian(energy, mode="rev")  # a scalar's Jacobian is its gradient
    nested = zm.BatchedJacobian(gradient, mode="fwd")(x, weight, bias)
    direct = zm.BatchedHessian(energy, batch_size=4)(x, weight, bias)
    reference = jax.hessian(energy)(x, weight, bias)
    print(f"Hessian of a scalar energy, shape {direct.shape}")
    print(f"Jacobian of Jacobian equals jax.hessian: {agree(nested, reference)}")
    print(f"BatchedHessian equals jax.hessian: {agree(direct, reference)}")
    # For a vector output, nested Jacobians give one Hessian per output element.
    vector = zm.BatchedJacobian(zm.BatchedJacobian(predict_of_x))(x, weight, bias)
    vector_reference = jax.hessian(predict_of_x)(x, weight, bias)
    print(
        f"Hessians of all {D} outputs, shape {vector.shape}: "
        f"equal to jax.hessian: {agree(vector, vector_reference)}"
    )

    # A Hessian-vector product needs no Hessian: forward mode over the gradient.
    v = jnp.linspace(-1.0, 1.0, D)
    _, hvp = jax.jvp(
        jax.grad(energy), (x, weight, bias), (v, jnp.zeros_like(weight), jnp.zeros_like(bias))
    )
    print(f"Hessian-vector product equals H @ v: {agree(hvp, direct @ v)}")
    print(f"H @ v [:4] = {np.round(np.asarray(hvp[:4]), 4)}")


def per_example(weight, bias):
    heading("5. Per-example Jacobians and Hessians over a batch of 64")
    xs = jax.random.normal(jax.random.key(2), (64, D))

    def energy(x, weight, bias):
        return jnp.sum(predict(weight, bias, x) ** 2)

    # 16 examples at a time; the weights and bias are shared by every example.
    jacobians = zm.ChunkedVmap(
        zm.BatchedJacobian(predict_of_x), chunk_size=16, in_axes=(0, None, None)
    )(xs, weight, bias)
    hessians = zm.ChunkedVmap(
        zm.BatchedHessian(energy, nbatches=2), chunk_size=16, in_axes=(0, None, None)
    )(xs, weight, bias)
    print(f"per-example Jacobians {jacobians.shape}, Hessians {hessians.shape}")
    expected_j = jax.vmap(jax.jacrev(predict_of_x), in_axes=(0, None, None))(xs, weight, bias)
    expected_h = jax.vmap(jax.hessian(energy), in_axes=(0, None, None))(xs, weight, bias)
    print(f"equal to jax.vmap(jax.jacrev): {agree(jacobians, expected_j)}")
    print(f"equal to jax.vmap(jax.hessian): {agree(hessians, expected_h)}")
    traces = jnp.trace(hessians[:3], axis1=1, axis2=2)
    print(f"traces of the first three Hessians: {np.round(np.asarray(traces), 4)}")


def critic_with_aux():
    heading("6. A critic with two outputs and auxiliary diagnostics")
    key_1, key_2, key_x = jax.random.split(jax.random.key(3), 3)
    heads = {"q1": jax.random.normal(key_1, (D,)), "q2": jax.random.normal(key_2, (D,))}
    state = jax.random.normal(key_x, (D,))

    def critic(state, heads):
        features = jnp.tanh(state)
        values = jnp.stack([features @ heads["q1"], features @ heads["q2"]])
        return values, {"values": values, "feature_norm": jnp.linalg.norm(features)}

    jacobian, aux = zm.BatchedJacobian(critic, has_aux=True)(state, heads)
    expected, expected_aux = jax.jacrev(critic, has_aux=True)(state, heads)
    print(f"Jacobian of (q1, q2) with respect to the state: {jacobian.shape}")
    print(
        f"equal to jax.jacrev(has_aux=True), aux included: "
        f"{agree(jacobian, expected) and agree(aux, expected_aux)}"
    )
    print(
        f"values = {np.round(np.asarray(aux['values']), 4)}, "
        f"feature norm = {float(aux['feature_norm']):.4f}"
    )


def main():
    key_w, key_b, key_x = jax.random.split(jax.random.key(0), 3)
    weight = jax.random.normal(key_w, (D, D)) / jnp.sqrt(D)
    bias = jax.random.normal(key_b, (D,))
    x = jax.random.normal(key_x, (D,))

    row_by_row_and_vectorised(weight, bias, x)
    forward_and_reverse()
    weights_and_bias(weight, bias, x)
    hessians(weight, bias, x)
    per_example(weight, bias)
    critic_with_aux()


if __name__ == "__main__":
    main()
