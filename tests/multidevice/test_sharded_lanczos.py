"""The Lanczos estimators on models whose variables are sharded over the devices: the
basis, the probes and the eigenvectors stored leaf by leaf, each laid out like its
variable, never gathered; the values those of the same model on one device.

The models and layouts (FSDP, data and tensor parallel, on Auto and Explicit meshes) are
those of `tests/multidevice/models.py`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zodmem as zm
from tests.multidevice.models import (
    CNN,
    Block,
    D,
    Dense,
    check_laid_out,
    laid_out,
    layouts,
    mlp,
)


def data(features):
    x = jax.random.normal(jax.random.key(1), (16, features))
    y = jax.random.normal(jax.random.key(2), (16, 2))
    return x, y


def loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def hessian_operator(model, x, y):
    """The loss's Hessian as a lineax operator of the model's variables (the layout of
    each in its structure), products by forward-over-reverse."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def product(v):
        gradient = jax.grad(lambda p: loss(eqx.combine(p, static), x, y))
        return jax.jvp(gradient, (params,), (v,))[1]

    def struct(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)

    structure = jax.tree.map(struct, params)
    return lx.FunctionLinearOperator(product, structure, lx.symmetric_tag)


def operators(model_fn, features, layout, kind):
    """(one-device operator, sharded operator, sharded variables, mesh): a zodmem
    Hessian on Auto axes, the lineax one on Explicit axes (its batch replicated)."""
    model, (x, y) = model_fn(), data(features)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(kind,))
    sharded, xs, ys = laid_out(mesh, model, x, y, layout)
    if kind == AxisType.Explicit:
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, y))
    if kind == AxisType.Auto:
        single = zm.BatchedHessian(loss).operator(model, x, y)
        return single, zm.BatchedHessian(loss).operator(sharded, xs, ys), sharded, mesh
    with jax.sharding.set_mesh(mesh):
        op = hessian_operator(sharded, xs, ys)
    return hessian_operator(model, x, y), op, sharded, mesh


# On Explicit axes the model's own operations must be well typed: a layer whose weight is
# sharded over its outputs (FSDP) or replicated (data parallel), the batch replicated.
LAYOUTS = layouts(
    [
        ("mlp", mlp, 8),
        ("cnn", lambda: CNN(jax.random.key(0)), 16),
        ("transformer", lambda: Block(jax.random.key(0)), 16),
    ],
    (lambda: Dense(jax.random.key(0)), 8),
)


@pytest.mark.parametrize("model_fn, features, layout, kind", LAYOUTS)
def test_eigsh(model_fn, features, layout, kind):
    single, op, variables, mesh = operators(model_fn, features, layout, kind)
    expected, expected_vectors = zm.eigsh(single, 3, pytree=True)
    with jax.sharding.set_mesh(mesh):
        values, vectors = zm.eigsh(op, 3)
    np.testing.assert_allclose(values, expected, rtol=1e-4)
    check_laid_out(vectors, variables, block=True)
    # The top eigenvector, up to its sign.
    top = sum(
        jnp.vdot(a[-1], b[-1])
        for a, b in zip(*map(jax.tree.leaves, (vectors, expected_vectors)), strict=True)
    )
    assert abs(float(top)) > 0.999


@pytest.mark.parametrize(
    "model_fn, layout, kind",
    [
        (mlp, "fsdp", AxisType.Auto),
        (mlp, "tensor", AxisType.Auto),
        (lambda: Dense(jax.random.key(0)), "fsdp", AxisType.Explicit),
    ],
    ids=["mlp-fsdp-auto", "mlp-tensor-auto", "dense-fsdp-explicit"],
)
def test_spectral_density_and_logdet(model_fn, layout, kind):
    single, op, _, mesh = operators(model_fn, 8, layout, kind)
    key = jax.random.key(3)
    grid, density = zm.spectral_density(single, num_probes=3, num_steps=8, key=key)
    expected = zm.logdet(single, num_probes=3, key=key, damping=50.0)
    with jax.sharding.set_mesh(mesh):
        sharded_grid, sharded_density = zm.spectral_density(op, num_probes=3, num_steps=8, key=key)
        estimate = zm.logdet(op, num_probes=3, key=key, damping=50.0, batch_size=2)
    np.testing.assert_allclose(sharded_grid, grid, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sharded_density, density, rtol=1e-3, atol=1e-4 * density.max())
    np.testing.assert_allclose(estimate[0], expected[0], rtol=1e-4)


def test_budget_per_device_refused():
    _, op, _, _ = operators(mlp, 8, "fsdp", AxisType.Auto)
    with pytest.raises(ValueError, match="bytes per device"):
        zm.spectral_density(op, num_probes=2, num_steps=8, max_memory=1000)


@pytest.mark.parametrize(
    "model_fn, features, layout",
    [
        (mlp, 8, "fsdp"),
        (mlp, 8, "tensor"),
        (lambda: CNN(jax.random.key(0)), 16, "fsdp"),
    ],
    ids=["mlp-fsdp-auto", "mlp-tensor-auto", "cnn-fsdp-auto"],
)
def test_diagonal_and_solve_in_the_variables_structure_are_laid_out_like_them(
    model_fn, features, layout
):
    single, op, variables, mesh = operators(model_fn, features, layout, AxisType.Auto)
    expected = zm.diagonal(single, pytree=True)
    rhs = jax.tree.map(jnp.ones_like, eqx.filter(model_fn(), eqx.is_inexact_array))
    expected_step = zm.solve(single, rhs, damping=10.0)
    with jax.sharding.set_mesh(mesh):
        diagonal = zm.diagonal(op, pytree=True, batch_size=8)
        laid = jax.tree.map(jnp.ones_like, eqx.filter(variables, eqx.is_inexact_array))
        step = zm.solve(op, laid, damping=10.0)
    for result, reference in ((diagonal, expected), (step, expected_step)):
        check_laid_out(result, variables, block=False)
        for a, b in zip(*map(jax.tree.leaves, (result, reference)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "model_fn, features, layout, kind",
    [
        (mlp, 8, "fsdp", AxisType.Auto),
        (mlp, 8, "tensor", AxisType.Auto),
        (lambda: CNN(jax.random.key(0)), 16, "fsdp", AxisType.Auto),
        (lambda: Dense(jax.random.key(0)), 8, "fsdp", AxisType.Explicit),
    ],
    ids=["mlp-fsdp-auto", "mlp-tensor-auto", "cnn-fsdp-auto", "dense-fsdp-explicit"],
)
def test_hutchinson_probes_are_laid_out_like_the_variables(model_fn, features, layout, kind):
    """Hutchinson's probes of a sharded model are drawn leaf by leaf in the variables'
    layout: the same signs as on one device, so the same estimates, and a diagonal's
    estimate and standard error come back laid out like the variables."""
    single, op, variables, mesh = operators(model_fn, features, layout, kind)
    key = jax.random.key(1)
    expected_trace = zm.trace(single, method="hutchinson", num_probes=7, key=key)
    expected = zm.diagonal(single, method="hutchinson", num_probes=7, key=key, pytree=True)
    with jax.sharding.set_mesh(mesh):
        trace = zm.trace(op, method="hutchinson", num_probes=7, key=key, batch_size=3)
        diagonal = zm.diagonal(
            op, method="hutchinson", num_probes=7, key=key, pytree=True, batch_size=3
        )
        flat = zm.diagonal(op, method="hutchinson", num_probes=7, key=key, batch_size=3)
    np.testing.assert_allclose(trace, expected_trace, rtol=1e-4)
    # Without `pytree=True` too: sharded variables' diagonals come back in their structure.
    for part, reference in zip((*diagonal, *flat), (*expected, *expected), strict=True):
        check_laid_out(part, variables, block=False)
        for a, b in zip(*map(jax.tree.leaves, (part, reference)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "estimate, vectors",
    [
        (lambda op: zm.eigsh(op, 5, max_steps=40, return_info=True), 40),
        (lambda op: zm.trace(op, method="hutchinson", num_probes=64, key=jax.random.key(0)), 64),
        (lambda op: zm.diagonal(op, batch_size=64), 64),
    ],
    ids=["eigsh-basis", "hutchinson-trace", "exact-diagonal"],
)
def test_compiled_bytes_per_device(estimate, vectors):
    """The bytes one device needs for an estimator's program, by XLA's count: at D
    devices, each device holds its share of the vectors the estimator keeps (eigsh's
    basis of 40, a block of 64 probes: random signs, unit vectors), and at most what
    one device holds beside them (the model, a product's temporaries). Vectors whole on
    every device would hold as much as one device does."""
    model = eqx.nn.MLP(32, 8, 256, 2, key=jax.random.key(0))
    x, y = jax.random.normal(jax.random.key(1), (D, 32)), jnp.zeros((D, 8))

    def per_device(devices):
        mesh = jax.make_mesh(
            (devices,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
        )
        sharded, xs, ys = laid_out(mesh, model, x, y, "fsdp" if devices > 1 else "data")
        op = zm.BatchedHessian(loss).operator(sharded, xs, ys)
        memory = jax.jit(lambda: estimate(op)).lower().compile().memory_analysis()
        return memory.temp_size_in_bytes + memory.output_size_in_bytes

    one, many = per_device(1), per_device(D)
    n = sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    held = vectors * n * 4
    assert one >= held  # the vectors, at least
    assert many <= held / D + (one - held), (one, many)


def test_eigsh_budget_counts_each_devices_share():
    """A budget bounds what one device holds: the same iteration that one device cannot
    hold within it runs with the model sharded over D devices."""
    model = eqx.nn.MLP(32, 8, 256, 2, key=jax.random.key(0))
    x, y = jax.random.normal(jax.random.key(1), (D, 32)), jnp.zeros((D, 8))
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Auto,))
    sharded, xs, ys = laid_out(mesh, model, x, y, "fsdp")

    def needs(model, x, y):
        op = zm.BatchedHessian(loss, max_memory=1000).operator(model, x, y)
        with pytest.raises(zm.MemoryBudgetError, match="per device") as error:
            zm.eigsh(op, 3, max_steps=40)
        return error.value.suggested_bytes

    one, many = needs(model, x, y), needs(sharded, xs, ys)
    assert many <= 0.5 * one, (one, many)
    with pytest.raises(zm.MemoryBudgetError):
        zm.eigsh(zm.BatchedHessian(loss, max_memory=many).operator(model, x, y), 3, max_steps=40)
    op = zm.BatchedHessian(loss, max_memory=many).operator(sharded, xs, ys)
    values, vectors = zm.eigsh(op, 3, max_steps=40, pytree=True)
    expected, _ = zm.eigsh(zm.BatchedHessian(loss).operator(model, x, y), 3, max_steps=40)
    np.testing.assert_allclose(values, expected, rtol=1e-4)
    check_laid_out(vectors, sharded, block=True)


@pytest.mark.parametrize("layout", ["fsdp", "data"])
def test_diagonal_and_trace_of_a_lineax_operator_on_explicit_axes(layout):
    """A lineax operator whose structure lies over Explicit axes takes its products on
    whole vectors laid out like it, outside any `shard_map`: the diagonal in the
    variables' structure comes back laid out like them, and the values and the trace
    are those of one device."""
    single, op, variables, mesh = operators(
        lambda: Dense(jax.random.key(0)), 8, layout, AxisType.Explicit
    )
    key = jax.random.key(1)
    expected = zm.diagonal(single, pytree=True)
    expected_trace = zm.trace(single, method="hutchinson", num_probes=8, key=key)
    with jax.sharding.set_mesh(mesh):
        diagonal = zm.diagonal(op, pytree=True, batch_size=8)
        trace = zm.trace(op, method="hutchinson", num_probes=8, key=key, batch_size=3)
    check_laid_out(diagonal, variables, block=False)
    for a, b in zip(*map(jax.tree.leaves, (diagonal, expected)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(trace, expected_trace, rtol=1e-4)


def test_what_explicit_axes_cannot_take_is_refused_in_words():
    """lineax's solvers make vectors untyped by the mesh, and a lineax operator's
    function runs on no device's share: a solve on Explicit axes, and probes spread
    over devices for such an operator, are refused with the way out."""
    _, op, variables, mesh = operators(
        lambda: Dense(jax.random.key(0)), 8, "fsdp", AxisType.Explicit
    )
    with jax.sharding.set_mesh(mesh):
        b = jax.tree.map(jnp.ones_like, eqx.filter(variables, eqx.is_inexact_array))
        with pytest.raises(ValueError, match="zm.solve: .*Explicit mesh axes.*Auto axes"):
            zm.solve(op, b, damping=1.0)
        with pytest.raises(ValueError, match="zm.marginal_variances: .*Explicit mesh axes"):
            zm.marginal_variances(op, [0, 1], damping=1.0)
        spread = NamedSharding(mesh, P("d"))
        with pytest.raises(ValueError, match="zm.diagonal: `sharding`.*sharding=None"):
            zm.diagonal(
                op, method="hutchinson", num_probes=8, key=jax.random.key(0), sharding=spread
            )


def gauss_newton_operator(model, x, y):
    """The mean squared error's Gauss-Newton matrix `2 J^T J / m` (positive
    semi-definite, and tagged so) as a lineax operator of the model's variables."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def predictions(p):
        return jax.vmap(eqx.combine(p, static))(x)

    def product(v):
        outputs, tangents = jax.jvp(predictions, (params,), (v,))
        return jax.vjp(predictions, params)[1](2 * tangents / outputs.size)[0]

    def struct(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)

    tags = (lx.symmetric_tag, lx.positive_semidefinite_tag)
    return lx.FunctionLinearOperator(product, jax.tree.map(struct, params), tags)


def zodmem_gauss_newton(model, x, y):
    """The mean squared error's Gauss-Newton matrix as zodmem's operator."""
    ggn = zm.BatchedGGN(lambda m, x, y: jax.vmap(m)(x), zm.losses.SquaredError(reduction="mean"))
    return ggn.operator(model, x, y)


@pytest.mark.parametrize("make", [gauss_newton_operator, zodmem_gauss_newton])
@pytest.mark.parametrize("layout", ["fsdp", "data"])
def test_solves_on_explicit_axes_are_laid_out_like_the_variables(layout, make):
    """On Explicit axes zm.solve runs its own conjugate gradients on vectors laid out
    like the variables: the solution of a right-hand side in the variables' structure
    comes back laid out like them, and every form of `b` and the marginal variances
    equal lineax's CG on one device, within the solve's tolerance; for a lineax operator
    and for zodmem's."""
    model, (x, y) = Dense(jax.random.key(0)), data(8)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Explicit,))
    sharded, _, _ = laid_out(mesh, model, x, y, layout)
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, y))
    single = make(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    rhs = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size) + 1.0).reshape(p.shape), params)
    flat = jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(rhs)])
    columns = jnp.stack([flat, jnp.sin(flat)], axis=1)
    options = dict(damping=0.5, rtol=1e-6, atol=1e-6)
    expected = zm.solve(single, rhs, **options)
    expected_flat = zm.solve(single, flat, **options)
    expected_columns = zm.solve(single, columns, **options)
    expected_variances = zm.marginal_variances(single, [0, 5, flat.size - 1], **options)
    with jax.sharding.set_mesh(mesh):
        op = make(sharded, xs, ys)
        variables = eqx.filter(sharded, eqx.is_inexact_array)
        laid = jax.tree.map(lambda r, v: jax.device_put(r, v.sharding), rhs, variables)
        step = zm.solve(op, laid, **options)
        step_flat = zm.solve(op, flat, **options)
        step_columns = zm.solve(op, columns, **options)
        variances = zm.marginal_variances(op, [0, 5, flat.size - 1], **options)
    check_laid_out(step, sharded, block=False)
    for a, b in zip(*map(jax.tree.leaves, (step, expected)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(step_flat, expected_flat, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(step_columns, expected_columns, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(variances, expected_variances, rtol=1e-4)
    assert step_columns.shape == columns.shape and variances.shape == (3,)
    # A residual check: the solution solves the damped system.
    with jax.sharding.set_mesh(mesh):
        residual = jax.tree.map(lambda a, s, b: a + 0.5 * s - b, op.mv(step), step, laid)
    assert max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(residual)) < 1e-4


def test_columns_on_explicit_axes_are_solved_in_one_loop_with_a_bar(capfd):
    """The columns of an `(n, k)` right-hand side, and the unit vectors of the marginal
    variances, are solved one after another in one compiled loop, which draws a bar of
    them with `progress=True` and none by default; each solve equals its column's."""
    model, (x, y) = Dense(jax.random.key(0)), data(8)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Explicit,))
    sharded, _, _ = laid_out(mesh, model, x, y, "fsdp")
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, y))
    options = dict(damping=0.5, rtol=1e-6, atol=1e-6)
    with jax.sharding.set_mesh(mesh):
        op = zodmem_gauss_newton(sharded, xs, ys)
        n = op.in_size()
        columns = jnp.cos(jnp.arange(3 * n, dtype=jnp.float32).reshape(n, 3))
        quiet = zm.solve(op, columns, **options)
        assert "columns" not in capfd.readouterr().err
        solved = zm.solve(op, columns, progress=True, **options)
        one = zm.solve(op, columns[:, 1], **options)
        zm.marginal_variances(op, [0, 3], progress=True, **options)
    err = capfd.readouterr().err
    assert "zm.solve columns" in err and "3/3" in err
    assert "zm.marginal_variances columns" in err and "2/2" in err
    np.testing.assert_allclose(solved, quiet, rtol=1e-6)
    np.testing.assert_allclose(solved[:, 1], one, rtol=1e-5, atol=1e-6)


def test_own_solves_on_explicit_axes_refuse_what_cg_cannot_take():
    """Explicit axes take zodmem's own CG only: an operator not tagged semi-definite
    (CG may divide by a vanishing curvature) and a lineax solver given are refused in
    words that name the way out; so is a solve that does not converge."""
    model, (x, y) = Dense(jax.random.key(0)), data(8)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Explicit,))
    sharded, _, _ = laid_out(mesh, model, x, y, "fsdp")
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, y))
    with jax.sharding.set_mesh(mesh):
        op = gauss_newton_operator(sharded, xs, ys)
        b = jax.tree.map(jnp.ones_like, eqx.filter(sharded, eqx.is_inexact_array))
        with pytest.raises(ValueError, match=r"zm.solve: .*own conjugate.*`solver=CG"):
            zm.solve(op, b, damping=1.0, solver=lx.CG(rtol=1e-6, atol=1e-6))
        with pytest.raises(RuntimeError, match="did not converge within max_steps=1 "):
            zm.solve(op, b, damping=1e-3, max_steps=1)
        with pytest.raises(ValueError, match="zm.solve: `damping` must be >= 0"):
            zm.solve(op, b, damping=-1.0)


def test_eigsh_of_zodmem_s_operator_on_explicit_axes():
    """zodmem's own operator of a model laid out over Explicit axes: its Lanczos basis and
    eigenvectors laid out like the weights, the eigenvalues those of one device."""
    model, (x, y) = Dense(jax.random.key(0)), data(8)
    mesh = jax.make_mesh((D,), ("d",), axis_types=(AxisType.Explicit,))
    sharded, _, _ = laid_out(mesh, model, x, y, "fsdp")
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, y))
    expected, _ = zm.eigsh(zodmem_gauss_newton(model, x, y), 2)
    with jax.sharding.set_mesh(mesh):
        values, vectors = zm.eigsh(zodmem_gauss_newton(sharded, xs, ys), 2)
    np.testing.assert_allclose(values, expected, rtol=1e-4)
    check_laid_out(vectors, sharded, block=True)
