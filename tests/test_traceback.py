"""A mistake made by the caller shows the caller's frame and zodmem's message, not a
column of zodmem's internals."""

import os
import traceback

import jax
import jax.numpy as jnp
import pytest

import zodmem as zm

ZODMEM = os.path.dirname(os.path.abspath(zm.__file__))


def frames_of(error):
    return [frame.filename for frame in traceback.extract_tb(error.__traceback__)]


def not_a_scalar(x):
    return x**2


MISTAKES = {
    "hessian of a non-scalar": lambda: zm.BatchedHessian(not_a_scalar)(jnp.ones(3)),
    "hessian inside jit": lambda: jax.jit(zm.BatchedHessian(not_a_scalar))(jnp.ones(3)),
    "jacobian of an int x": lambda: zm.BatchedJacobian(jnp.sin)(jnp.arange(3)),
    "too many blocks": lambda: zm.BatchedJacobian(jnp.sin, nbatches=9)(jnp.ones(3)),
    "mismatched batch": lambda: zm.ChunkedVmap(jnp.add, chunk_size=2)(jnp.ones(3), jnp.ones(4)),
    "scan of a scalar": lambda: zm.SlicedScan(lambda c, x: (c, x))(0.0, jnp.asarray(1.0)),
    "bad chunk size": lambda: zm.ChunkedVmap(jnp.sin, chunk_size=0),
    "bad mode": lambda: zm.BatchedHessian(jnp.sum, mode="sideways"),
    "bad length": lambda: zm.CheckpointedScan(lambda c, x: (c, x), length=-1),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_the_traceback_ends_at_the_callers_line(name):
    with pytest.raises((TypeError, ValueError)) as info:
        MISTAKES[name]()
    files = frames_of(info.value)
    assert files[0] == os.path.abspath(__file__)
    inside = [f for f in files if f.startswith(ZODMEM)]
    assert not inside, f"zodmem frames in the traceback: {inside}"
    assert str(info.value).split(":")[0] in {
        "BatchedHessian",
        "BatchedJacobian",
        "ChunkedVmap",
        "SlicedScan",
        "CheckpointedScan",
    }
