"""`zodmem.compat.zodiax` against the installed `zodiax.diffops` 0.5."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zodiax.diffops as zd
from helpers import close, make_mlp
from jax.flatten_util import ravel_pytree

import zodmem.compat.zodiax as zc

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


# Built lazily: float64 is enabled only while the tests run.
TREES = {
    "dict": lambda: {
        "a": jax.device_put(np.arange(3.0) / 3),
        "b": jnp.asarray(0.5),
        "c": jax.device_put(np.ones((1, 2))),
    },
    "nested": lambda: (
        [jax.device_put(np.linspace(-1, 1, 4).reshape(2, 2)), jnp.asarray(0.3)],
        {"z": jax.device_put(np.arange(2.0))},
    ),
    "mixed-precision": lambda: {
        "single": jax.device_put(np.asarray([0.25, -0.5], np.float32)),
        "double": jax.device_put(np.asarray([1.5, 0.1, 0.2, -0.7])),
    },
}


def variables_vector(x):
    return jnp.concatenate([jnp.ravel(leaf).astype(jnp.float64) for leaf in jax.tree.leaves(x)])


def mixing(rows, cols, seed=0.0):
    """A fixed dense matrix (a NumPy constant, so it costs nothing to compile)."""
    return np.cos(np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) * 0.7 + seed)


def outputs(x):
    v = variables_vector(x)
    return jnp.sin(mixing(4, v.size) @ v).reshape(2, 2) * jnp.sum(v**2)


def loss(x):
    v = variables_vector(x)
    return jnp.sum(jnp.sin(mixing(3, v.size, 1.0) @ v)) + jnp.sum(v**2) ** 2


def derivatives(module, x, options, jit=True, checkpoint=False):
    """`module.jacobian` and `module.hessian` for each nbatches, in one compiled function.

    zodiax runs its block loop eagerly when called outside `jax.jit`; compiling all
    cases at once keeps these tests quick without changing the numbers.
    """

    @jax.jit
    def run(x):
        return [
            (
                module.jacobian(outputs, x, nbatches, jit, checkpoint)[0],
                module.hessian(loss, x, nbatches=nbatches, jit=jit, checkpoint=checkpoint)[0],
            )
            for nbatches in options
        ]

    return run(x)


@pytest.mark.parametrize("name", TREES)
def test_same_results_as_zodiax(name):
    x = TREES[name]()
    n = ravel_pytree(x)[0].size
    options = sorted({1, 2, 3, n})
    actual, expected = derivatives(zc, x, options), derivatives(zd, x, options)
    close(actual, expected)
    # hessian_to_pytree gives zodiax's layout (zodiax's cannot be compiled).
    H = actual[-1][1]
    close(jax.jit(zc.hessian_to_pytree)(H, x), zd.hessian_to_pytree(H, x))
    # unflatten maps a flat vector back to x's structure, as zodiax's (ravel_pytree's) does.
    H, unflatten = zc.hessian(loss, x, nbatches=n)
    close(H, expected[-1][1])
    flat = jax.device_put(np.linspace(-2, 2, n))
    # ravel_pytree's flat x and unflattened vector, compiled as one program.
    raveled, unraveled = jax.jit(lambda x, flat: (ravel_pytree(x)[0], ravel_pytree(x)[1](flat)))(
        x, flat
    )
    close(unflatten(flat), unraveled)
    close(unflatten(raveled), x)


def test_called_directly():
    x = TREES["dict"]()
    flat = jax.device_put(np.linspace(-2, 2, 6))

    @jax.jit
    def zodiax_s(x, flat):
        """zodiax's results, and its unflatten's, in one program."""
        J_zodiax, unflatten_zodiax = zd.jacobian(outputs, x, 1)
        H_zodiax = zd.hessian(loss, x, nbatches=6)[0]
        return J_zodiax, H_zodiax, unflatten_zodiax(flat), unflatten_zodiax(H_zodiax[0])

    J_zodiax, H_zodiax, flat_zodiax, row_zodiax = zodiax_s(x, flat)
    J, unflatten = zc.jacobian(outputs, x, 2)
    close(J, J_zodiax)
    H, _ = zc.hessian(loss, x, nbatches=6)
    close(H, H_zodiax)
    close(zc.hessian_to_pytree(H, x), zd.hessian_to_pytree(H_zodiax, x))
    close(unflatten(flat), flat_zodiax)
    close(unflatten(jax.device_put(np.asarray(H)[0])), row_zodiax)


def test_jit_and_checkpoint_flags():
    x = TREES["nested"]()
    expected = derivatives(zd, x, [2])
    flags = [(False, False), (True, True), (False, True)]

    @jax.jit
    def every_flag(x):
        """`derivatives(zc, x, [2], jit, checkpoint)` for each flag pair, in one program."""
        return [
            [
                (
                    zc.jacobian(outputs, x, 2, jit, checkpoint)[0],
                    zc.hessian(loss, x, nbatches=2, jit=jit, checkpoint=checkpoint)[0],
                )
            ]
            for jit, checkpoint in flags
        ]

    for actual in every_flag(x):
        close(actual, expected)
    close(zc.hessian(loss, x, 3, False, True)[0], expected[0][1])


def test_a_single_array_and_a_pytree_output():
    x = jax.device_put(np.linspace(0.1, 0.9, 5))
    close(derivatives(zc, x, [1, 4, 5]), derivatives(zd, x, [1, 4, 5]))

    def tree_out(x):
        return {"grid": outputs(x), "total": loss(x)}

    # zodiax handles a pytree output only without batching; zodmem in any number of blocks.
    expected = jax.jit(lambda x: zd.jacobian(tree_out, x, 1)[0])(x)
    close(zc.jacobian(tree_out, x, 1)[0], expected)
    close(zc.jacobian(tree_out, x, 3)[0], expected)


def test_errors_where_zodiax_raises():
    x = TREES["dict"]()  # n = 6
    for module in (zd, zc):
        with pytest.raises(ValueError, match=r"nbatches=7 is too large for n=6 parameters"):
            module.jacobian(outputs, x, nbatches=7)
        with pytest.raises(ValueError, match=r"nbatches=9 is too large for n=6 parameters"):
            module.hessian(loss, x, nbatches=9)
        with pytest.raises(ValueError, match=r"H has shape \(5, 5\), but x flattens to 6"):
            module.hessian_to_pytree(jnp.zeros((5, 5)), x)


def test_bad_nbatches_is_refused_plainly():
    """zodiax divides by zero or fails deep inside; zodmem says what is wrong."""
    x = TREES["dict"]()
    for fn in (zc.jacobian, zc.hessian):
        owner = fn.__name__
        with pytest.raises(ValueError, match=rf"{owner}: `nbatches` must be a positive int, got "):
            fn(loss, x, 0)
        with pytest.raises(ValueError, match="got nbatches=-2"):
            fn(loss, x, -2)
        with pytest.raises(
            TypeError, match=rf"{owner}: `nbatches` must be a positive int, got 2.5"
        ):
            fn(loss, x, 2.5)
        with pytest.raises(TypeError, match="got True"):
            fn(loss, x, True)
    with pytest.raises(ZeroDivisionError):
        zd.hessian(loss, x, 0)
    # NumPy integers are ints to zodiax, and so to zodmem.
    expected = jax.jit(lambda x: zd.hessian(loss, x, np.int64(2))[0])(x)
    close(zc.hessian(loss, x, np.int64(2))[0], expected)


@pytest.mark.parametrize("nbatches", [1, 2])
def test_python_floats_are_variables_as_in_zodiax(nbatches):
    """zodiax ravels a Python float into its variables, as jax.grad takes one."""

    def cubic(x):
        return x["s"] ** 3 * jnp.sum(x["v"] ** 2)

    cases = [
        (cubic, {"s": 2.0, "v": jax.device_put(np.asarray([0.5, -1.0], np.float32))}),
        (lambda s: s**3, 2.0),
        (lambda s: s[0] * s[1] ** 2, (2.0, 3.0)),
    ]
    for f, x in cases:
        k = min(nbatches, sum(np.size(leaf) for leaf in jax.tree.leaves(x)))
        H, unflatten = zc.hessian(f, x, k)
        flat = jnp.ones(H.shape[0])

        # zodiax's results in one program: x is a constant of it, its Python floats as
        # zodiax sees them called eagerly.
        @jax.jit
        def zodiax_s(flat, f=f, x=x, k=k):
            H_zodiax, unflatten_zodiax = zd.hessian(f, x, k)
            return H_zodiax, unflatten_zodiax(flat), zd.jacobian(f, x, k)[0]

        H_zodiax, unflattened, J_zodiax = zodiax_s(flat)
        close(H, H_zodiax)
        close(unflatten(flat), unflattened)
        close(zc.jacobian(f, x, k)[0], J_zodiax)
        # zodiax's hessian_to_pytree reads leaf shapes, so it needs x's floats as arrays.
        close(zc.hessian_to_pytree(H, x), zd.hessian_to_pytree(H, jax.tree.map(jnp.asarray, x)))


def test_mlp_works_where_zodiax_fails():
    mlp = make_mlp(2, 1, 3, 1)  # n = 2 * 3 + 3 + 3 + 1 = 13
    inputs = jax.device_put(np.linspace(-1, 1, 8).reshape(4, 2))

    def mse(model):
        return jnp.mean((jax.vmap(model)(inputs) - 0.5) ** 2)

    def predictions(model):
        return jax.vmap(model)(inputs)[:, 0]

    # zodiax ravels every leaf, the activation functions included.
    with pytest.raises(TypeError, match="Cannot determine dtype"):
        zd.hessian(mse, mlp, nbatches=2)
    with pytest.raises(TypeError, match="Cannot determine dtype"):
        zd.jacobian(predictions, mlp, 2)

    # zodmem differentiates the model's arrays and holds its functions fixed: check against
    # zodiax on the arrays alone.
    params, fixed = eqx.partition(mlp, eqx.is_inexact_array)

    @jax.jit
    def zodiax_on_params(params):
        hessians = [
            zd.hessian(lambda p: mse(eqx.combine(p, fixed)), params, nbatches=k)[0]
            for k in (1, 4, 13)
        ]
        return hessians, zd.jacobian(lambda p: predictions(eqx.combine(p, fixed)), params, 3)[0]

    hessians, jacobian = zodiax_on_params(params)
    for nbatches, expected in zip((1, 4, 13), hessians, strict=True):
        H, unflatten = zc.hessian(mse, mlp, nbatches=nbatches)
        close(H, expected)
    close(zc.jacobian(predictions, mlp, 3)[0], jacobian)

    rebuilt = unflatten(ravel_pytree(params)[0])
    assert rebuilt.activation is mlp.activation
    close(eqx.filter(rebuilt, eqx.is_array), params)
    blocks = eqx.filter_jit(zc.hessian_to_pytree)(H, mlp)
    assert blocks.layers[0].weight.layers[1].bias.shape == (3, 2, 1)
    assert blocks.activation is None
