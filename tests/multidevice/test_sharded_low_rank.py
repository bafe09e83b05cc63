"""`zm.low_rank` and `zm.LowRankDiagonal` on models whose variables are sharded over the
devices: `U` held leaf by leaf, `(r, *variable.shape)` and sharded as the variable, `d` and
every vector in the variables' structure and layout; the values those of the same model
on one device, where the result is flat.

Run in a process of its own with `--xla_force_host_platform_device_count=4` (or 8): the
device count is read here.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import zodmem as zm
from tests.multidevice.models import CNN, D, Dense, check_laid_out, layouts, mlp
from tests.multidevice.test_sharded_lanczos import operators

LAYOUTS = layouts(
    [("mlp", mlp, 8), ("cnn", lambda: CNN(jax.random.key(0)), 16)],
    (lambda: Dense(jax.random.key(0)), 8),
)


def vector_like(variables, space_of):
    """A fixed vector laid out like the variables, and the same one flat."""
    flat = jnp.cos(jnp.arange(space_of.size, dtype=jnp.float32))
    leaves = [v for v in jax.tree.leaves(variables) if eqx.is_inexact_array(v)]
    tree = space_of.from_flat(flat)
    tree = space_of.tree(
        jax.device_put(x, v.sharding) for x, v in zip(space_of.leaves(tree), leaves, strict=True)
    )
    return tree, flat


@pytest.mark.parametrize("model_fn, features, layout, kind", LAYOUTS)
def test_low_rank_like_one_device(model_fn, features, layout, kind):
    single, op, variables, mesh = operators(model_fn, features, layout, kind)
    expected = zm.low_rank(single, 3)
    with jax.sharding.set_mesh(mesh):
        posterior = zm.low_rank(op, 3)
        assert posterior.leafwise
        np.testing.assert_allclose(posterior.s, expected.s, rtol=1e-4)
        check_laid_out(posterior.U, variables, block=True)
        check_laid_out(posterior.d, variables, block=False)
        space = posterior._space
        v, flat = vector_like(variables, space)
        damping = 0.5
        results = {
            "mv": (posterior.mv(v), expected.mv(flat), 1e-4),
            "solve": (
                posterior.solve(v, damping=damping),
                expected.solve(flat, damping=damping),
                1e-5,
            ),
            "marginal_variances": (
                posterior.marginal_variances(damping=damping),
                expected.marginal_variances(damping=damping),
                1e-5,
            ),
            "diagonal": (posterior.diagonal(), expected.diagonal(), 1e-5),
        }
        for name, (got, want, rtol) in results.items():
            check_laid_out(got, variables, block=False)
            scale = float(jnp.max(jnp.abs(want)))
            np.testing.assert_allclose(
                space.to_flat(got), want, rtol=rtol, atol=rtol * scale, err_msg=name
            )
        np.testing.assert_allclose(
            posterior.logdet(damping=damping), expected.logdet(damping=damping), rtol=1e-5
        )
        draws = posterior.sample(jax.random.key(0), (2000,), damping=damping)
        check_laid_out(draws, variables, block=True)
        variances = space.to_flat(jax.tree.map(lambda x: jnp.var(x, axis=0), draws))
        ratio = variances / expected.marginal_variances(damping=damping)
        assert abs(float(jnp.mean(ratio)) - 1) < 0.02
        assert float(jnp.max(jnp.abs(ratio - 1))) < 0.25
        dense = expected.as_matrix()
        atol = 1e-4 * float(jnp.max(jnp.abs(dense)))
        np.testing.assert_allclose(posterior.as_matrix(), dense, rtol=1e-4, atol=atol)


def test_solve_inverts_mv():
    """Woodbury's solve undoes the damped product, leaf by leaf."""
    _, op, variables, mesh = operators(mlp, 8, "fsdp", AxisType.Auto)
    with jax.sharding.set_mesh(mesh):
        posterior = zm.low_rank(op, 4)
        v, _ = vector_like(variables, posterior._space)
        y = posterior.solve(v, damping=0.1)
        back = jax.tree.map(lambda a, b: a + 0.1 * b, posterior.mv(y), y)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(v), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_rank_zero_and_refusals():
    _, op, variables, mesh = operators(mlp, 8, "fsdp", AxisType.Auto)
    with jax.sharding.set_mesh(mesh):
        posterior = zm.low_rank(op, 0)
        assert posterior.s.shape == (0,)
        check_laid_out(posterior.U, variables, block=True)
        with pytest.raises(ValueError, match="d \\+ damping must be > 0"):
            posterior.logdet()
        with pytest.raises(ValueError, match="variables' structure"):
            posterior.mv(jnp.ones(posterior._space.size))


@pytest.mark.parametrize("model_fn, features, layout, kind", LAYOUTS)
@pytest.mark.parametrize("diagonal", ["exact", "estimate", "given"])
def test_the_diagonal_part_like_one_device(model_fn, features, layout, kind, diagonal):
    """`diagonal=` of sharded variables: `d`, what the top pairs leave of the diagonal,
    laid out like the variables and equal to one device's (the same probes)."""
    single, op, variables, mesh = operators(model_fn, features, layout, kind)
    options = dict(key=jax.random.key(4), num_probes=6) if diagonal == "estimate" else {}
    given = zm.diagonal(single) if diagonal == "given" else diagonal
    expected = zm.low_rank(single, 2, diagonal=given, **options)
    with jax.sharding.set_mesh(mesh):
        if diagonal == "estimate" and kind == AxisType.Explicit:
            with pytest.raises(ValueError, match="diagonal='estimate'.*Explicit mesh axes"):
                zm.low_rank(op, 2, diagonal=given, **options)
            return
        posterior = zm.low_rank(op, 2, diagonal=given, **options)
    check_laid_out(posterior.d, variables, block=False)
    scale = float(jnp.max(jnp.abs(expected.d)))
    np.testing.assert_allclose(
        posterior._space.to_flat(posterior.d), expected.d, rtol=1e-4, atol=1e-4 * scale
    )


def test_u_bytes_per_device():
    """Each device holds about 1/D of U's bytes under FSDP."""
    _, op, variables, mesh = operators(mlp, 8, "fsdp", AxisType.Auto)
    with jax.sharding.set_mesh(mesh):
        posterior = zm.low_rank(op, 3)
    total = sum(x.nbytes for x in jax.tree.leaves(posterior.U))
    per_device = {}
    for leaf in jax.tree.leaves(posterior.U):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert max(per_device.values()) <= 2 * total / D, (total, per_device)
