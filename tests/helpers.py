"""What the tests share: one comparison of pytrees, and reference computations."""

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.flatten_util import ravel_pytree
from jax.tree_util import keystr


def close(actual, expected, rtol=None, atol=None, *, dtypes=True, exact=False):
    """Assert that two pytrees agree: the same structure, and leaf by leaf the same
    shapes, dtypes (unless `dtypes=False`) and values, to `rtol`/`atol` or bit for bit
    with `exact=True`. Leaves that are not arrays are compared with `==`.

    The tolerances default to 1e-12 for 64-bit leaves and 1e-5 for narrower ones."""
    actual_leaves, actual_def = jax.tree_util.tree_flatten(actual)
    expected_leaves, expected_def = jax.tree_util.tree_flatten(expected)
    assert actual_def == expected_def, f"structures differ: {actual_def} != {expected_def}"
    for path, a, e in zip(
        [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]],
        actual_leaves,
        expected_leaves,
        strict=True,
    ):
        if not eqx.is_array_like(e) or isinstance(e, (str, bool)) or e is None:
            assert a == e, f"leaf{path}: {a!r} != {e!r}"
            continue
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"leaf{path}: shape {a.shape} != {e.shape}"
        if dtypes:
            assert a.dtype == e.dtype, f"leaf{path}: dtype {a.dtype} != {e.dtype}"
        wide = not jnp.issubdtype(e.dtype, jnp.inexact) or jnp.finfo(e.dtype).bits == 64
        default = 1e-12 if wide else 1e-5
        if exact or not jnp.issubdtype(e.dtype, jnp.inexact):
            np.testing.assert_array_equal(a, e, err_msg=f"leaf{path}")
        else:
            np.testing.assert_allclose(
                a,
                e,
                rtol=default if rtol is None else rtol,
                atol=default if atol is None else atol,
                err_msg=f"leaf{path}",
            )


def tree_size(tree):
    """Total number of elements over the array leaves of `tree`."""
    return sum(math.prod(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(tree))


def raveled(fn, x, *args, **kwargs):
    """The reference: `fn` as a function of the flat inexact leaves of `x`, and that vector."""
    params, fixed = eqx.partition(x, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)

    def fn_of_flat(z):
        return fn(eqx.combine(unravel(z), fixed), *args, **kwargs)

    return fn_of_flat, flat


def as_tree(flat, like):
    """A flat vector shaped like the variables of `like` (None at the other leaves)."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    pieces, start = [], 0
    for leaf in leaves:
        if not eqx.is_inexact_array(leaf):
            pieces.append(None)
            continue
        size = np.size(leaf)
        pieces.append(np.reshape(flat[start : start + size], np.shape(leaf)).astype(leaf.dtype))
        start += size
    return jax.tree_util.tree_unflatten(treedef, pieces)


def mixed_loss(params, data):
    """A scalar loss of a pytree of mixed shapes (and an int leaf held fixed), with an
    indefinite, singular Hessian at `mixed_point()`."""
    z = data @ params["w"] + jnp.sum(params["m"]) * params["b"]
    return jnp.sum(jnp.cosh(z)) + jnp.sum(params["m"] ** 3) * params["b"] ** 2


def mixed_point(dtype=jnp.float64):
    """`(params, data)` for `mixed_loss`: 10 variables in three leaves, and `"n"`, an int."""
    params = {
        "b": jnp.asarray(0.7, dtype),
        "m": jnp.arange(6.0, dtype=dtype).reshape(2, 3) / 7,
        "n": 3,  # not a variable: held fixed
        "w": jnp.linspace(-0.5, 0.5, 3, dtype=dtype),
    }
    return params, jnp.arange(12.0, dtype=dtype).reshape(4, 3) / 10


@functools.cache
def mixed_hessian():
    """JAX's dense Hessian of `mixed_loss` at `mixed_point()`, as NumPy (computed once)."""
    fn, flat = raveled(mixed_loss, *mixed_point())
    return np.asarray(jax.jit(jax.hessian(fn))(flat))


def make_mlp(in_size, out_size, width, depth, seed=0):
    """An `eqx.nn.MLP` in float64 with random weights, built without tracing its init."""
    shapes = eqx.filter_eval_shape(
        eqx.nn.MLP, in_size, out_size, width, depth, key=jax.random.key(0), dtype=jnp.float64
    )
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            # Put by `device_put`, which compiles nothing (`jnp.asarray` compiles a cast).
            return jax.device_put(rng.uniform(-1, 1, leaf.shape).astype(leaf.dtype))
        return leaf

    return jax.tree_util.tree_map(fill, shapes)


# --- what the derivative sweeps draw -----------------------------------------------------

MODES = ("auto", "fwd", "rev")


@st.composite
def leaf_sizes(draw, max_total=20, max_leaves=3):
    """The sizes of 1 to `max_leaves` variable leaves, `n` = their total in [1, max_total]."""
    n = draw(st.integers(1, max_total))
    num_leaves = draw(st.integers(1, min(max_leaves, n)))
    cuts = draw(
        st.lists(
            st.integers(1, max(n - 1, 1)),
            min_size=num_leaves - 1,
            max_size=num_leaves - 1,
            unique=True,
        )
    )
    return np.diff([0, *sorted(cuts), n]).tolist()


@st.composite
def block_options(draw, products):
    """One way to cut `products` products into blocks, as keyword arguments: none, a
    count up to `products`, or a size up to a little beyond it."""
    option = draw(st.sampled_from(["nbatches", "batch_size", None]))
    if option is None:
        return {}
    return {option: draw(st.integers(1, products + (2 if option == "batch_size" else 0)))}


def check_init(cls, fn=jnp.sin, **config):
    """Run the validation of `cls` on `config` as given, skipping `__init__` (its
    converters and the type checks the tests run under): every `__check_init__` in the
    class's MRO, as Equinox runs them."""
    instance = object.__new__(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "fn"}
    for name, value in {**defaults, "fn": fn, **config}.items():
        object.__setattr__(instance, name, value)
    for klass in reversed(cls.__mro__):
        if "__check_init__" in vars(klass):
            vars(klass)["__check_init__"](instance)
    return instance


def built_kfac_factors(operator, params):
    """A built curvlinops `KFACLinearOperator`'s factors, per module in its order, and
    its dense matrix over the `params` it was given: `(inputs, gradients, matrix)`."""
    import torch

    operator.compute_kronecker_factors()
    names = list(operator._mapping)
    inputs = [operator._input_covariances[name].numpy() for name in names]
    gradients = [operator._gradient_covariances[name].numpy() for name in names]
    n = sum(p.numel() for p in params)
    return inputs, gradients, (operator @ torch.eye(n, dtype=torch.float64)).numpy()
