"""Complex numbers, mixed precisions and auxiliary values in `BatchedJacobian` and
`BatchedHessian`: the values *and dtypes* of `jax.jacfwd`, `jax.jacrev` and
`jax.hessian`, their refusals, and messages that say what went wrong."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MODES, close, raveled
from hypothesis import given, strategies as st

import zodmem as zm
from zodmem.compat import zodiax as zc

pytestmark = pytest.mark.usefixtures("float64")

# Inputs go to the device by `jax.device_put` of NumPy arrays, which compiles nothing;
# `jnp.asarray` would compile a small program for each new shape and dtype.


def block_options(total):
    """Ways to cut `total` products that give different programs: one block, blocks of
    one, a count that does not divide (a remainder block), and a size above the total.
    (How counts and sizes turn into blocks is swept in test_blocks.py and the
    transforms' own tests; here the dtypes are the point.)"""
    yield {}
    yield {"nbatches": total}
    yield {"nbatches": 2}
    yield {"batch_size": total + 2}


@eqx.filter_jit
def _together(transforms, *args):
    return [transform(*args) for transform in transforms]


def together(transforms, *args):
    """Call every transform on the same inputs inside one compiled function (one program
    rather than one per transform), and the first on its own, outside any other jit."""
    first = transforms[0](*args)
    return [first, *_together(transforms[1:], *args)]


def phase(x):
    """A real `x` of 4 variables, complex outputs: jax.jacfwd's Jacobian is complex."""
    return jnp.exp(1j * x[:2]) * x[2:]


# --- a real x with complex outputs ---------------------------------------------------


def test_complex_outputs_of_a_real_x_give_jacfwds_complex_jacobian():
    x = jnp.arange(4.0)
    expected = eqx.filter_jit(jax.jacfwd(phase))(x)
    assert expected.dtype == jnp.complex128
    transforms = [
        zm.BatchedJacobian(phase, mode=mode, **options)
        for mode in ("auto", "fwd")
        for options in block_options(4)
    ]
    for actual in together(transforms, x):
        close(actual, expected)


def test_pytree_outputs_with_one_complex_leaf_choose_forward_mode():
    def fn(x):
        return {"real": jnp.sum(x), "complex": jnp.exp(1j * x[0])}

    x = jnp.arange(5.0)  # 5 variables, 2 outputs: "auto" would pick reverse mode
    close(zm.BatchedJacobian(fn, nbatches=2)(x), eqx.filter_jit(jax.jacfwd(fn))(x))


def test_reverse_mode_refuses_complex_outputs_as_jacrev_does():
    x = jnp.arange(4.0)
    with pytest.raises(TypeError, match="requires real-valued outputs"):
        jax.jacrev(phase)(x)
    for options in ({}, {"nbatches": 2}):
        with pytest.raises(TypeError, match="BatchedJacobian: mode='rev' requires real-valued"):
            zm.BatchedJacobian(phase, mode="rev", **options)(x)
    # zodiax's single block is jax.jacrev: the drop-in refuses alike.
    with pytest.raises(TypeError, match="requires real-valued outputs"):
        zc.jacobian(phase, x, nbatches=1)
    close(zc.jacobian(phase, x, nbatches=2)[0], eqx.filter_jit(jax.jacfwd(phase))(x))


def test_a_hessian_of_a_complex_valued_function_of_real_variables_is_refused():
    def fn(x):
        return jnp.sum(jnp.exp(1j * x))

    with pytest.raises(TypeError):
        jax.hessian(fn)(jnp.ones(3))
    with pytest.raises(TypeError, match="BatchedHessian: .*real floating-point scalar.*holo"):
        zm.BatchedHessian(fn)(jnp.ones(3))


# --- complex variables -----------------------------------------------------------------


def holo(z):
    """Holomorphic in every variable, complex outputs of another size than the input."""
    return jnp.stack([jnp.sin(z[0]) * z[1], z[1] ** 3 - z[2], jnp.exp(z[0] * z[2])])


def holo_loss(z):
    return jnp.sum(holo(z) ** 2) + z[0] * z[1] * z[2]


@pytest.mark.parametrize("cls", [zm.BatchedJacobian, zm.BatchedHessian])
@pytest.mark.parametrize("mode", MODES)
def test_complex_variables_need_holomorphic(cls, mode):
    x = {"real": jnp.ones(2), "complex": jnp.ones(3, jnp.complex128)}
    fn = (lambda x: holo(x["complex"])) if cls is zm.BatchedJacobian else None
    fn = fn or (lambda x: holo_loss(x["complex"]).real)
    with pytest.raises(TypeError, match=rf"{cls.__name__}: x\['complex'\] has the complex dtype"):
        cls(fn, mode=mode)(x)


@pytest.mark.parametrize("cls", [zm.BatchedJacobian, zm.BatchedHessian])
def test_holomorphic_refuses_real_variables_and_real_outputs(cls):
    z = jax.device_put(np.asarray([0.3 + 0.1j, -0.2 + 0.4j, 0.5 - 0.3j]))
    fn = holo if cls is zm.BatchedJacobian else holo_loss
    with pytest.raises(TypeError, match=r"holomorphic=True every variable must be complex.*x\[1\]"):
        cls(lambda x: fn(x[0] + x[1]), holomorphic=True)((z, jnp.ones(3)))
    with pytest.raises(TypeError, match="holomorphic=True `fn` must return (a )?complex"):
        cls(lambda z: jnp.abs(fn(z)), holomorphic=True)(z)


def test_holomorphic_jacobians_equal_jacfwd_in_every_mode_and_block():
    z = jax.device_put(np.asarray([0.3 + 0.1j, -0.2 + 0.4j, 0.5 - 0.3j]))
    expected = eqx.filter_jit(jax.jacfwd(holo, holomorphic=True))(z)
    close(jax.jit(jax.jacrev(holo, holomorphic=True))(z), expected)
    transforms = [
        zm.BatchedJacobian(holo, mode=mode, holomorphic=True, **options)
        for mode in MODES
        for options in block_options(3)
    ]
    for actual in together(transforms, z):
        close(actual, expected)


def test_holomorphic_hessians_equal_jax_hessian_in_every_mode_and_block():
    z = jax.device_put(np.asarray([0.3 + 0.1j, -0.2 + 0.4j, 0.5 - 0.3j]))
    expected = eqx.filter_jit(jax.hessian(holo_loss, holomorphic=True))(z)
    assert expected.dtype == jnp.complex128
    transforms = [
        zm.BatchedHessian(holo_loss, mode=mode, holomorphic=True, **options)
        for mode in MODES
        for options in block_options(3)
    ]
    for actual in together(transforms, z):
        close(actual, expected)


def test_holomorphic_complex64():
    z = jax.device_put(np.asarray([0.3 + 0.1j, -0.2 + 0.4j, 0.5 - 0.3j], np.complex64))
    jacobian = eqx.filter_jit(jax.jacfwd(holo, holomorphic=True))(z)
    hessian = eqx.filter_jit(jax.hessian(holo_loss, holomorphic=True))(z)
    jacobians = [zm.BatchedJacobian(holo, mode=m, holomorphic=True, nbatches=2) for m in MODES]
    for J in together(jacobians, z):
        close(J, jacobian, rtol=1e-5, atol=1e-6)
    hessians = [zm.BatchedHessian(holo_loss, mode=m, holomorphic=True, nbatches=2) for m in MODES]
    for H in together(hessians, z):
        close(H, hessian, rtol=1e-5, atol=1e-5)


# --- dtypes of mixed precisions --------------------------------------------------------

FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@given(
    in_dtypes=st.lists(st.sampled_from((jnp.float32, jnp.float64)), min_size=1, max_size=2),
    out_dtype=st.sampled_from(FLOATS),
    mode=st.sampled_from(("fwd", "rev")),
    nbatches=st.integers(1, 3),
)
def test_jacobian_dtypes_are_jaxs(in_dtypes, out_dtype, mode, nbatches):
    x = [jnp.linspace(0.1, 0.5, 3, dtype=d) for d in in_dtypes]

    def fn(x):
        total = sum(jnp.sum(leaf.astype(jnp.float64) ** 2) for leaf in x)
        return (jnp.arange(4.0) * total).astype(out_dtype)

    fn_of_flat, flat = raveled(fn, x)
    reference = eqx.filter_jit((jax.jacfwd if mode == "fwd" else jax.jacrev)(fn_of_flat))(flat)
    J = zm.BatchedJacobian(fn, mode=mode, nbatches=nbatches)(x)
    rtol = 1e-12 if jnp.finfo(reference.dtype).bits == 64 else 1e-2
    close(J, reference, rtol=rtol, atol=rtol)


def test_named_dtype_cases():
    x32 = jnp.ones(3, jnp.float32)
    for out_dtype in (jnp.bfloat16, jnp.float16):

        def fn(x, out_dtype=out_dtype):
            return (2 * x).astype(out_dtype)

        J = zm.BatchedJacobian(fn, mode="fwd")(x32)
        # JAX's dtypes read from its traced shapes: no program to compile for them.
        assert J.dtype == out_dtype == jax.eval_shape(jax.jacfwd(fn), x32).dtype
    J = zm.BatchedJacobian(lambda x: (2 * x).astype(jnp.float64), mode="rev")(x32)
    jacrev = jax.jacrev(lambda x: (2 * x).astype(jnp.float64))
    assert J.dtype == jnp.float32 == jax.eval_shape(jacrev, x32).dtype


def mixed_loss(params):
    a, b = params["a"], params["b"]
    return jnp.sum(a**2) * jnp.sum(jnp.sin(b)) + jnp.sum(a.astype(jnp.float64) * b[:2] ** 3)


def test_hessian_to_pytree_blocks_have_jax_hessians_dtypes():
    params = {
        "a": jax.device_put(np.asarray([0.3, -0.4], np.float32)),
        "b": jax.device_put(np.asarray([0.1, 0.2, 0.7])),
    }
    expected = eqx.filter_jit(jax.hessian(mixed_loss))(params)
    assert expected["a"]["b"].dtype == jnp.float32 and expected["b"]["a"].dtype == jnp.float64
    transforms = [
        zm.BatchedHessian(mixed_loss, mode=mode, nbatches=nbatches)
        for mode, nbatches in itertools.product(MODES, (2, 5))
    ]
    for H in together(transforms, params):
        close(zm.hessian_to_pytree(H, params), expected, rtol=1e-6, atol=1e-6)


# --- auxiliary values that are not arrays ----------------------------------------------


def with_aux(x):
    return jnp.sin(x) * x[0], {"label": "hi", "count": 3, "nothing": None, "sum": jnp.sum(x)}


def scalar_with_aux(x):
    value, aux = with_aux(x)
    return jnp.sum(value), aux


@eqx.filter_jit
def aux_references(x):
    """JAX's results for the test below, in one program shared by its parametrisations.

    jax.hessian itself fails on such an aux (jacfwd batches it): the Hessian of the value
    and the aux of one call stand for it."""
    J_jax, aux_jax = jax.jacrev(with_aux, has_aux=True)(x)
    H_jax = jax.hessian(lambda x: scalar_with_aux(x)[0])(x)
    return J_jax, aux_jax, H_jax, scalar_with_aux(x)[1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("jit", [True, False])
def test_aux_with_non_array_leaves_is_returned_unchanged(mode, jit):
    x = jax.device_put(np.asarray([0.5, -0.2, 0.9]))
    J_jax, aux_jax, H_jax, scalar_aux = aux_references(x)
    J, aux = zm.BatchedJacobian(with_aux, has_aux=True, mode=mode, jit=jit, nbatches=2)(x)
    close(J, J_jax)
    close(aux, aux_jax)
    H, aux = zm.BatchedHessian(scalar_with_aux, has_aux=True, mode=mode, jit=jit, nbatches=2)(x)
    close(H, H_jax)
    close(aux, scalar_aux)


def test_aux_that_is_only_a_string():
    x = jnp.ones(2)
    _, aux = zm.BatchedJacobian(lambda x: (x, "only"), has_aux=True)(x)
    assert aux == "only"
    _, aux = zm.BatchedHessian(lambda x: (jnp.sum(x**2), None), has_aux=True)(x)
    assert aux is None


# --- messages ----------------------------------------------------------------------


@pytest.mark.parametrize("cls", [zm.BatchedJacobian, zm.BatchedHessian])
def test_integer_only_x_is_described_by_its_dtypes(cls):
    x = {"steps": jnp.arange(3, dtype=jnp.int32), "count": 2}
    with pytest.raises(ValueError) as info:
        cls(lambda x: jnp.sum(x["steps"]) * 1.0)(x)
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}: `x` has no inexact-array leaves")
    assert "x['steps']: int32[3]" in message and "x['count']: 2 (int)" in message
    assert "Tracer" not in message


def test_block_count_errors_name_the_transform_and_the_mode():
    with pytest.raises(
        ValueError,
        match=r"BatchedJacobian: nbatches=3 is larger than the number of output elements, 2 "
        r"\(mode 'auto' chose reverse mode.*so `nbatches` counts output elements\)",
    ):
        zm.BatchedJacobian(lambda x: x[:2], nbatches=3)(jnp.ones(5))
    with pytest.raises(ValueError, match=r"BatchedJacobian: nbatches=3 .* variables, 2 \(mode"):
        zm.BatchedJacobian(lambda x: jnp.tile(x, 3), nbatches=3)(jnp.ones(2))
    with pytest.raises(ValueError, match=r"BatchedHessian: nbatches=3 .* variables, 2"):
        zm.BatchedHessian(jnp.sum, nbatches=3)(jnp.ones(2))


def test_reference_flat_dtypes_follow_the_leaves():
    # The flat vector of mixed float32/float64 leaves is float64, as ravel_pytree makes it.
    x = {"a": np.float32(1.0) * jnp.ones(2, jnp.float32), "b": jnp.ones(1)}
    assert zm.BatchedHessian(lambda x: jnp.sum(x["a"]) * jnp.sum(x["b"]) ** 2)(x).dtype == (
        jnp.float64
    )
