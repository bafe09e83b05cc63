"""Convolutions in the bodies of the block loops are written in the form a CPU runs fast
(`_layout.canonical_body`): the values are those of the body as written, for any
dimension numbers, strides, dilations and groups, under `jax.grad` and `jax.vmap` too,
and a compiled loop holds no convolution in another form."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close
from jax import lax

import zodmem as zm
from zodmem._engine._layout import canonical_body, holds, holds_convolution

pytestmark = pytest.mark.usefixtures("float64")

RNG = np.random.default_rng(0)


def conv(spec, lhs_shape, rhs_shape, **options):
    lhs = jnp.asarray(RNG.normal(size=lhs_shape))
    rhs = jnp.asarray(RNG.normal(size=rhs_shape))

    def body(i, carry):
        out = lax.conv_general_dilated(carry[0] * (1.0 + i), rhs, dimension_numbers=spec, **options)
        return carry[0], carry[1] + jnp.sum(out**2)

    return body, (lhs, jnp.zeros((), lhs.dtype))


CASES = {
    "NCHW": (("NCHW", "OIHW", "NCHW"), (2, 3, 9, 8), (4, 3, 3, 3), {"padding": "SAME"}),
    "NHWC": (("NHWC", "HWIO", "NHWC"), (2, 9, 8, 3), (3, 3, 3, 4), {"padding": "VALID"}),
    "mixed": (("NCHW", "HWIO", "NHWC"), (2, 3, 9, 8), (3, 2, 3, 5), {"padding": ((1, 0), (2, 1))}),
    "1d": (("NCH", "OIH", "NCH"), (3, 2, 17), (4, 2, 5), {"padding": "SAME"}),
    "3d": (("NCDHW", "OIDHW", "NCDHW"), (1, 2, 5, 6, 4), (3, 2, 2, 3, 2), {"padding": "VALID"}),
    "strided": (
        ("NCHW", "OIHW", "NCHW"),
        (2, 4, 11, 10),
        (6, 2, 3, 3),
        {
            "padding": ((1, 1), (0, 2)),
            "window_strides": (2, 1),
            "rhs_dilation": (1, 2),
            "lhs_dilation": (2, 1),
            "feature_group_count": 2,
        },
    ),
    "batch groups": (
        ("NCHW", "OIHW", "NCHW"),
        (4, 3, 6, 6),
        (6, 3, 3, 3),
        {"padding": "VALID", "batch_group_count": 2},
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_a_loop_body_with_convolutions_gives_the_same_values(name):
    spec, lhs_shape, rhs_shape, options = CASES[name]
    options = {"window_strides": (1,) * (len(lhs_shape) - 2), **options}
    body, init = conv(spec, lhs_shape, rhs_shape, **options)

    def loop(body):
        return jax.jit(lambda init: lax.fori_loop(0, 3, body, init))(init)

    close(loop(canonical_body(body)), loop(body), rtol=1e-12)


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.GroupNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1)
        self.norm = eqx.nn.GroupNorm(2, 4)
        self.head = eqx.nn.Linear(4, 3, key=k2)

    def __call__(self, image):
        hidden = jnp.tanh(self.norm(self.conv(image)))
        return self.head(jnp.mean(hidden, axis=(1, 2)))


def net_loss(net, images, labels):
    logits = jax.vmap(net)(images)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


@eqx.filter_jit  # one program rather than one per operation of the Hessian
def dense_hessian(net, images, labels):
    """`jax.hessian` of `net_loss` in the raveled variables of `net`."""
    params, static = eqx.partition(net, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    return jax.hessian(lambda p: net_loss(eqx.combine(unravel(p), static), images, labels))(flat)


def _net_problem():
    net = Net(jax.random.key(0))
    images = jnp.asarray(RNG.normal(size=(4, 2, 5, 5)))
    labels = jnp.arange(4) % 3
    return net, images, labels


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_hessian_products_of_a_convolutional_network_in_blocks(mode):
    net, images, labels = _net_problem()
    dense = dense_hessian(net, images, labels)
    vectors = jnp.asarray(RNG.normal(size=(dense.shape[0], 3)))
    operator = zm.BatchedHessian(net_loss, batch_size=2, mode=mode).operator(net, images, labels)
    close(operator.mm(vectors), dense @ vectors, rtol=1e-10)


def test_gradient_through_a_reduction_whose_loop_body_holds_convolutions():
    net, images, labels = _net_problem()
    batch = zm.Microbatcher(net_loss, microbatch_size=2, argnums=(1, 2), accumulator="mean")
    close(
        eqx.filter_grad(batch)(net, images, labels),
        eqx.filter_jit(eqx.filter_grad(net_loss))(net, images, labels),
        rtol=1e-10,
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's layouts")
def test_a_compiled_loop_holds_convolutions_in_the_fast_form_only():
    spec, lhs_shape, rhs_shape, _ = CASES["NCHW"]
    body, init = conv(spec, lhs_shape, rhs_shape, window_strides=(1, 1), padding="SAME")

    def labels(body):
        program = jax.jit(lambda init: lax.fori_loop(0, 3, body, init)).lower(init).compile()
        return set(re.findall(r"dim_labels=([0-9a-z_>-]+)", program.as_text()))

    assert labels(body) - {"b01f_01io->b01f"}  # what the rewrite is for
    assert labels(canonical_body(body)) == {"b01f_01io->b01f"}


def test_a_body_without_convolutions_is_evaluated_as_it_is():
    def body(i, carry):
        return carry * 2.0 + i

    close(
        jax.jit(lambda c: lax.fori_loop(0, 4, canonical_body(body), c))(jnp.ones(3)),
        jax.jit(lambda c: lax.fori_loop(0, 4, body, c))(jnp.ones(3)),
    )


def test_auto_mode_takes_forward_over_reverse_where_fn_holds_a_convolution():
    # Reverse-over-reverse products of a convolution run slowly; "auto" finds the
    # convolution in fn's program (here inside Equinox's own jit of the layer).
    net = Net(jax.random.key(1))
    images = jnp.asarray(RNG.normal(size=(3, 2, 5, 5)))
    labels = jnp.arange(3) % 3
    assert holds_convolution(lambda n: net_loss(n, images, labels), net)
    assert not holds_convolution(lambda w: jnp.sum(jnp.tanh(w) ** 2), jnp.ones(3))
    assert holds_convolution(jax.jit(lambda n: net_loss(n, images, labels)), net)
    expected = dense_hessian(net, images, labels)
    hessian = zm.BatchedHessian(net_loss, nbatches=3)(net, images, labels)
    close(hessian, expected, rtol=1e-10)
    assert hessian.dtype == expected.dtype


def test_auto_mode_takes_forward_over_reverse_where_fn_holds_a_loop():
    def rollout(w, x0):
        def step(x, _):
            x = jnp.tanh(w[:3] * x + w[3:])
            return x, x

        _, xs = lax.scan(step, x0, None, length=5)
        return jnp.sum(xs**2)

    w, x0 = jnp.linspace(-0.5, 0.7, 6), jnp.asarray([0.3, -0.2, 0.9])
    assert holds(lambda w: rollout(w, x0), w, primitives=(lax.scan_p, lax.while_p))
    expected = jax.jit(jax.hessian(rollout))(w, x0)
    close(zm.BatchedHessian(rollout, nbatches=2)(w, x0), expected, rtol=1e-12)
    operator = zm.BatchedHessian(rollout).operator(w, x0)
    close(operator.mv(jnp.eye(6)[2]), expected[:, 2], rtol=1e-12)
