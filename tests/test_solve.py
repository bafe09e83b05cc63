"""`solve`, `marginal_variances` and `covariance`: inverse products of curvature operators
and dense inverses, against NumPy's."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from helpers import (
    close,
    make_mlp,
    mixed_hessian,
    mixed_loss as loss,
    mixed_point as point,
    raveled,
)
from hypothesis import given, strategies as st

import zodmem as zm
from zodmem import covariance, marginal_variances, solve

pytestmark = pytest.mark.usefixtures("float64")

# Iterative solves meet rtol = atol = 1e-6 entrywise; well-conditioned systems land far
# closer, but the comparisons ask only for what the tolerances promise.
SOLVED = {"rtol": 1e-5, "atol": 1e-6}
# Positive-definite solves to 1e-9, compared at 1e-6: at one size, one compiled solve serves
# every test that asks for it.
TIGHT = {"rtol": 1e-9, "atol": 1e-9}


# The Hessian at `point()` is indefinite (one eigenvalue near -24) and singular; shifted by
# DAMPING it is indefinite and invertible, so its solves take the indefinite solver.
DAMPING = 0.5


@functools.cache
def hessian_operator():
    return zm.BatchedHessian(loss).operator(*point())


def flat_of(params):
    """The variables of `params`, raveled in leaf order, as NumPy."""
    leaves = [np.ravel(leaf) for leaf in jax.tree_util.tree_leaves(params) if eqx.is_array(leaf)]
    return np.concatenate(leaves)


def rhs(n, k=None, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n,) if k is None else (n, k))


def spd(n, seed, *, rank=None, shift=1.0):
    """A random symmetric positive-definite matrix (semi-definite of `rank` with
    `shift=0`)."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(n, n if rank is None else rank))
    return A @ A.T / n + shift * np.eye(n)


def in_units(C, scales):
    """`C` with its variables measured in other units: `D^1/2 C D^1/2`, `D = diag(scales)`."""
    root = np.sqrt(scales)
    return root[:, None] * C * root[None, :]


# -- solve -------------------------------------------------------------------------------


def test_hessian_flat_pytree_whole_x_and_columns():
    H = mixed_hessian() + DAMPING * np.eye(10)
    op = hessian_operator()
    params, _ = point()
    b = rhs(10)
    close(solve(op, jnp.asarray(b), damping=DAMPING), np.linalg.solve(H, b), **SOLVED)
    # The variables' pytree, and the whole of `x` (its int leaf ignored): both come back as
    # the variables' pytree, `None` at the int, as `mv` returns them.
    expected = np.linalg.solve(H, flat_of(params))
    variables = {**params, "n": None}
    for given_b in (variables, params):
        solved = solve(op, given_b, damping=DAMPING)
        assert solved["n"] is None
        close(flat_of(solved), expected, **SOLVED)
    B = rhs(10, 3)
    close(solve(op, jnp.asarray(B), damping=DAMPING), np.linalg.solve(H, B), **SOLVED)
    close(solve(op, jnp.zeros((10, 0)), damping=DAMPING), np.zeros((10, 0)))


def test_gauss_newton_operator_takes_cg_and_damping():
    model = make_mlp(2, 1, 4, 1)  # 17 parameters, activation functions as leaves
    inputs = np.linspace(-1, 1, 40).reshape(20, 2)
    targets = np.sin(np.arange(20.0)).reshape(20, 1)
    G = zm.BatchedGGN(lambda m, t, y: jax.vmap(m)(t), zm.losses.SquaredError())
    op = G.operator(model, inputs, targets)
    assert lx.is_positive_semidefinite(op)
    fn, flat = raveled(lambda m, t: jax.vmap(m)(t), model, inputs)
    J = np.asarray(jax.jit(jax.jacfwd(fn))(flat)).reshape(20, -1)
    dense = J.T @ J
    # ReLU units that no input switches on leave G singular: damping makes it solvable.
    assert np.linalg.matrix_rank(dense) < flat.size
    b = rhs(flat.size, seed=1)
    for damping in (0.05, 1.0):
        expected = np.linalg.solve(dense + damping * np.eye(flat.size), b)
        close(solve(op, jnp.asarray(b), damping=damping, rtol=1e-10, atol=1e-10), expected, 1e-6)


def test_microbatched_dataset_hessian():
    rows = np.random.default_rng(10).normal(size=(5, 3))

    def example_loss(w, data):
        return jnp.mean(jnp.cosh(data @ w) + jnp.sin(data @ w) ** 2)

    w = jnp.asarray([0.3, -0.2, 0.5])
    transform = zm.Microbatcher(
        zm.BatchedHessian(example_loss), microbatch_size=2, argnums=(1,), accumulator="mean"
    )
    op = transform.operator(w, rows)
    # The mean over unequal microbatches (2, 2, 1) is the mean over the 5 rows.
    dense = np.asarray(jax.jit(jax.hessian(example_loss))(w, rows))
    b = rhs(3, 2)
    close(solve(op, jnp.asarray(b)), np.linalg.solve(dense, b), **SOLVED)


def test_lineax_operators_with_and_without_tags():
    A = spd(6, seed=2)
    b = rhs(6, seed=3)
    psd = lx.MatrixLinearOperator(jnp.asarray(A), lx.positive_semidefinite_tag)
    expected = np.linalg.solve(A + 0.3 * np.eye(6), b)
    close(solve(psd, jnp.asarray(b), damping=0.3, **TIGHT), expected, 1e-6, 1e-7)
    # Untagged and not symmetric: GMRES; a negative shift is allowed here.
    M = A + np.triu(np.ones((6, 6)), 1)
    plain = lx.MatrixLinearOperator(jnp.asarray(M))
    close(
        solve(plain, jnp.asarray(b), damping=-0.2),
        np.linalg.solve(M - 0.2 * np.eye(6), b),
        **SOLVED,
    )
    # A solver of one's own.
    close(solve(plain, jnp.asarray(b), solver=lx.LU()), np.linalg.solve(M, b), 1e-10, 1e-10)


def test_under_jit_with_traced_damping():
    op = hessian_operator()
    H = mixed_hessian()
    b = rhs(10)
    solved = jax.jit(lambda b, damping: solve(op, b, damping=damping))(jnp.asarray(b), 0.7)
    close(solved, np.linalg.solve(H + 0.7 * np.eye(10), b), **SOLVED)


def test_float32_stays_float32():
    params, data = point(jnp.float32)

    def model(params, data):
        return jnp.tanh(data @ params["w"] + params["b"])[:, None] * jnp.cos(params["m"])[0]

    G = zm.BatchedGGN(model, zm.losses.SquaredError(targets=None)).operator(params, data)
    b = jax.tree_util.tree_map(lambda leaf: leaf + 1 if eqx.is_array(leaf) else leaf, params)
    solved = solve(G, b, damping=DAMPING, rtol=1e-4, atol=1e-4)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(solved))
    fn, flat = raveled(model, *point())
    J = np.asarray(jax.jit(jax.jacfwd(fn))(flat)).reshape(-1, 10)
    expected = np.linalg.solve(J.T @ J + DAMPING * np.eye(10), flat_of(point()[0]) + 1)
    close(flat_of(solved), expected.astype(np.float32), 2e-3, 2e-3)


@given(n=st.sampled_from([2, 6]), seed=st.integers(0, 10**6), damping=st.floats(0.0, 10.0))
def test_sweep_over_spd_matrices(n, seed, damping):
    A = spd(n, seed, shift=0.1)
    b = rhs(n, seed=seed + 1)
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.positive_semidefinite_tag)
    expected = np.linalg.solve(A + damping * np.eye(n), b)
    close(solve(op, jnp.asarray(b), damping=damping, **TIGHT), expected, 1e-6, 1e-7)


def test_no_convergence_says_what_to_change():
    A = spd(8, seed=4, shift=1e-3)
    op = lx.MatrixLinearOperator(jnp.asarray(A), lx.positive_semidefinite_tag)
    b = jnp.asarray(rhs(8))
    with pytest.raises(
        RuntimeError, match=r"CG solve did not converge within max_steps=2.*damping"
    ):
        solve(op, b, max_steps=2)
    # Under jit: the same message, and a traced damping of the wrong sign for a
    # semi-definite operator, both raised when the compiled call runs.
    jitted = jax.jit(lambda b, damping: solve(op, b, damping=damping, max_steps=2))
    with pytest.raises(RuntimeError, match=r"did not converge within max_steps=2"):
        jax.block_until_ready(jitted(b, 0.0))
    with pytest.raises(RuntimeError, match="`damping` has the wrong sign"):
        jax.block_until_ready(jitted(b, -1.0))


def test_solve_refuses_bad_input():
    op = hessian_operator()
    params, _ = point()
    b = jnp.ones(10)
    psd = lx.MatrixLinearOperator(jnp.eye(3), lx.positive_semidefinite_tag)
    refusals = [
        (ValueError, r"`b` must be a flat vector of shape \(10,\), an \(10, k\)", jnp.ones(9)),
        (ValueError, r"`b` must be a flat vector.*shape \(3, 10\)", jnp.ones((3, 10))),
        (TypeError, r"`b` has dtype float32.*cast it", jnp.ones(10, jnp.float32)),
        (TypeError, r"`b`\['w'\] has dtype int", {**params, "w": jnp.ones(3, int)}),
        (ValueError, r"`b`\['m'\] must be an array of shape \(2, 3\)", {**params, "m": 1.0}),
    ]
    for error, match, bad in refusals:
        with pytest.raises(error, match=match):
            solve(op, bad)
    options = [
        (TypeError, r"`rtol` must be a real number, got '1e-6' of type str", {"rtol": "1e-6"}),
        (ValueError, r"`atol` must be a finite number >= 0.0, got atol=-1.0", {"atol": -1}),
        (TypeError, r"`damping` must be a real number, got True", {"damping": True}),
        (TypeError, r"`damping` must be a real number, got an array", {"damping": jnp.ones(2)}),
        (
            ValueError,
            r"`damping` must be a finite real number, got damping=nan",
            {"damping": np.nan},
        ),
        (ValueError, r"`max_steps` must be a positive int, got max_steps=0", {"max_steps": 0}),
        (TypeError, r"`solver` must be None .* got 'cg'", {"solver": "cg"}),
        (ValueError, r"rtol=0 and atol=0 the solve never converges", {"rtol": 0, "atol": 0}),
    ]
    for error, match, kwargs in options:
        with pytest.raises(error, match=match):
            solve(op, b, **kwargs)
    with pytest.raises(ValueError, match=r"`damping` must be >= 0 for a positive semi-definite"):
        solve(psd, jnp.ones(3), damping=-0.1)
    with pytest.raises(TypeError, match=r"zm.solve: `operator` must be a linear operator"):
        solve(np.eye(3), jnp.ones(3))
    jacobian = zm.BatchedJacobian(lambda w: jnp.outer(w, w)).operator(jnp.ones(3))
    with pytest.raises(ValueError, match=r"zm.solve: `operator` must be square"):
        solve(jacobian, jnp.ones(3))


# -- marginal variances ------------------------------------------------------------------


def test_marginal_variances_are_the_inverse_diagonal():
    op = hessian_operator()
    inverse = np.linalg.inv(mixed_hessian() + DAMPING * np.eye(10))
    indices = [9, 0, 4]
    expected = np.diagonal(inverse)[indices]
    close(marginal_variances(op, indices, damping=DAMPING), expected, **SOLVED)
    close(marginal_variances(op, np.asarray(indices), damping=DAMPING), expected, **SOLVED)
    close(marginal_variances(op, [], damping=DAMPING), np.zeros(0))


def test_marginal_variances_refuse_bad_indices():
    op = hessian_operator()
    refusals = [
        (ValueError, r"`indices` must lie in \[0, 10\) \(the operator's size\), got 10", [1, 10]),
        (ValueError, r"must lie in \[0, 10\).*got -1", [-1]),
        (TypeError, r"`indices\[...\]` must be an int, got 1.5", [1.5]),
        (TypeError, r"`indices` must be a 1-d array of ints, got dtype float", jnp.ones(2)),
        (TypeError, r"`indices` must be a 1-d array of ints.*shape \(1, 2\)", np.ones((1, 2), int)),
        (TypeError, r"`indices` must be a sequence of ints", 3),
    ]
    for error, match, bad in refusals:
        with pytest.raises(error, match=match):
            marginal_variances(op, bad, damping=DAMPING)
    small = lx.MatrixLinearOperator(jnp.asarray(spd(3, seed=12)), lx.positive_semidefinite_tag)
    with pytest.raises(RuntimeError, match=r"`indices` must lie in \[0, 3\)"):
        jax.block_until_ready(jax.jit(lambda i: marginal_variances(small, i))(jnp.asarray([3])))


# -- covariance --------------------------------------------------------------------------


@given(n=st.sampled_from([1, 6, 10]), seed=st.integers(0, 10**6))
def test_covariance_sweep(n, seed):
    F = spd(n, seed, shift=0.5)
    inverse = np.linalg.inv(F)
    C, errors = covariance(jnp.asarray(F))
    close(C, inverse, 1e-9, 1e-12)
    close(errors, np.sqrt(np.diagonal(inverse)), 1e-9, 1e-12)


def test_covariance_shaped_like_x():
    params, _ = point()
    F = spd(10, seed=11)
    inverse = np.linalg.inv(F)
    C, errors = covariance(jnp.asarray(F), like=params)
    assert errors["n"] is None
    assert errors["b"].shape == () and errors["m"].shape == (2, 3) and errors["w"].shape == (3,)
    close(flat_of(errors), np.sqrt(np.diagonal(inverse)), 1e-9)
    close(C, inverse, 1e-9, 1e-12)


def test_singular_or_indefinite_f_is_refused():
    singular = spd(6, seed=5, rank=3, shift=0.0)
    indefinite = spd(6, seed=6) - 3 * np.eye(6)
    with pytest.raises(ValueError, match=r"singular to working precision.*pseudo_inverse=True"):
        covariance(jnp.asarray(singular))
    with pytest.raises(
        ValueError,
        match=r"not positive definite: scaled to a unit diagonal, its smallest eigenvalue is -",
    ):
        covariance(jnp.asarray(indefinite))
    # Two variables that the data tell apart by a rounding error, in different units:
    # it factors, but with a vanishing pivot.
    tiny = np.eye(6)
    tiny[0, 1] = tiny[1, 0] = np.nextafter(1.0, 0.0)
    tiny = in_units(tiny, 2.0 ** np.arange(-10, 20, 5))
    with pytest.raises(
        ValueError,
        match=r"singular to working precision: scaled to a unit diagonal, pivot 1 of its",
    ):
        covariance(jnp.asarray(tiny))
    jitted = jax.jit(covariance)
    for F, match in ((singular, "singular to working precision"), (tiny, "pivot of its Cholesky")):
        with pytest.raises(RuntimeError, match=match):
            jax.block_until_ready(jitted(jnp.asarray(F)))


def test_covariance_refuses_alike_eagerly_and_under_jit():
    singular = jnp.asarray(spd(6, seed=5, rank=3, shift=0.0))  # its factor breaks down
    indefinite = jnp.asarray(spd(6, seed=6) - 3 * np.eye(6))
    way_out = r"\. Pass pseudo_inverse=True for the pseudo-inverse, or add a small multiple"
    refusals = [
        (singular, r"`F` is singular to working precision: scaled to a unit diagonal, "),
        (indefinite, r"`F` is not positive definite"),
    ]
    for F, match in refusals:
        message = rf"^zm\.covariance: {match}.*{way_out}"
        with pytest.raises(ValueError, match=message):
            covariance(F)
        for jitted in (eqx.filter_jit(covariance), jax.jit(covariance)):
            with pytest.raises(RuntimeError, match=rf"(?m){message[1:]}") as raised:
                jax.block_until_ready(jitted(F))
            other = "not positive definite" if F is singular else "singular to working"
            assert other not in str(raised.value)


def test_pseudo_inverse_of_a_rank_deficient_f():
    F = spd(6, seed=7, rank=4, shift=0.0)
    C, errors = covariance(jnp.asarray(F), pseudo_inverse=True)
    # The Moore-Penrose inverse of F in units of a unit diagonal, in F's units again.
    units = 1 / np.diagonal(F)
    pinv = in_units(np.linalg.pinv(in_units(F, units)), units)
    close(C, pinv, 1e-8, 1e-10)
    close(errors, np.sqrt(np.diagonal(pinv)), 1e-8, 1e-10)
    # A larger cutoff drops more directions.
    w, V = np.linalg.eigh(in_units(F, units))
    kept = w > 0.5 * w.max()
    close(
        covariance(jnp.asarray(F), pseudo_inverse=True, rcond=0.5)[0],
        in_units((V[:, kept] / w[kept]) @ V[:, kept].T, units),
        1e-8,
        1e-10,
    )
    indefinite = spd(6, seed=8) - 3 * np.eye(6)
    with pytest.raises(
        ValueError, match=r"not positive semi-definite: scaled to a unit diagonal, its smallest"
    ):
        covariance(jnp.asarray(indefinite), pseudo_inverse=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("pseudo_inverse", [False, True])
def test_covariance_of_variables_in_different_units(dtype, pseudo_inverse):
    # One variable a thousand times better determined than the rest is no singular matrix.
    F = np.diag([1e6] + [1.0] * 19).astype(dtype)
    C, errors = covariance(jnp.asarray(F), pseudo_inverse=pseudo_inverse)
    close(C, np.diag([1e-6] + [1.0] * 19).astype(dtype))
    close(errors, np.asarray([1e-3] + [1.0] * 19, dtype))
    tiny = np.diag([1.0, 1e-20, 2.0, 3.0]).astype(dtype)  # a unit with 1e-10 in it
    close(covariance(jnp.asarray(tiny))[1], np.sqrt(1 / np.diagonal(tiny)))


@pytest.mark.parametrize(
    "dtype, span, rtol", [(np.float64, 6, 1e-9), (np.float64, 12, 1e-9), (np.float32, 6, 1e-4)]
)
@pytest.mark.parametrize("pseudo_inverse", [False, True])
def test_covariance_of_a_badly_scaled_matrix(dtype, span, rtol, pseudo_inverse):
    well_conditioned = spd(8, seed=13)
    scales = np.logspace(-span, span, 8)[np.random.default_rng(14).permutation(8)]
    F = in_units(well_conditioned, scales)
    inverse = np.linalg.inv(F)
    C, errors = covariance(jnp.asarray(F, dtype), pseudo_inverse=pseudo_inverse)
    # Entrywise, relative to each entry's own units `1 / sqrt(d_i d_j)`.
    close(in_units(np.asarray(C, float), scales), in_units(inverse, scales), rtol, rtol)
    assert C.dtype == errors.dtype == dtype
    close(errors, np.sqrt(np.diagonal(inverse)).astype(dtype), rtol, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_singular_matrix_in_different_units_is_refused(dtype):
    scales = np.logspace(-6, 6, 6)[::-1]
    singular = in_units(spd(6, seed=15, rank=4, shift=0.0), scales).astype(dtype)
    with pytest.raises(ValueError, match=r"singular to working precision.*pseudo_inverse=True"):
        covariance(jnp.asarray(singular))
    # The pseudo-inverse in the variables' own units is a generalised inverse: F G F = F.
    G, errors = covariance(jnp.asarray(singular), pseudo_inverse=True)
    rtol = 1e-4 if dtype == np.float32 else 1e-9
    close(
        in_units(singular @ np.asarray(G, float) @ singular, 1 / scales),
        in_units(singular, 1 / scales),
        rtol,
        rtol,
    )
    close(errors, np.sqrt(np.diagonal(np.asarray(G))))
    # A variable the data do not touch (a zero row) has no error, and leaves the others'.
    F = np.diag([1e6, 0.0, 4.0]).astype(dtype)
    with pytest.raises(ValueError, match=r"singular to working precision"):
        covariance(jnp.asarray(F))
    close(covariance(jnp.asarray(F), pseudo_inverse=True)[1], np.asarray([1e-3, 0.0, 0.5], dtype))


def test_covariance_refuses_bad_input():
    F = jnp.asarray(spd(6, seed=9))
    params, _ = point()
    refusals = [
        (TypeError, r"`F` must be an \(n, n\) array.*got \[\[1.0\]\] of type list", [[1.0]], {}),
        (ValueError, r"`F` must be a square \(n, n\) array, got shape \(6, 2\)", F[:, :2], {}),
        (ValueError, r"got shape \(6,\)", F[0], {}),
        (TypeError, r"real floating dtype, got int", jnp.eye(6, dtype=int), {}),
        (TypeError, r"real floating dtype, got complex", F.astype(complex), {}),
        (ValueError, r"`F` is not symmetric \(\|F v - F\^T v\| is", F + jnp.triu(F, 1), {}),
        (ValueError, r"`rcond` applies only with pseudo_inverse=True", F, {"rcond": 0.1}),
        (
            ValueError,
            r"`rcond` must be a finite number >= 0.0",
            F,
            {"pseudo_inverse": True, "rcond": -1},
        ),
        (TypeError, r"`pseudo_inverse` must be True or False, got 1", F, {"pseudo_inverse": 1}),
        (ValueError, r"`like` has 10 scalar variables, but `F` is 6 x 6", F, {"like": params}),
        (ValueError, r"`like` has no inexact-array leaves", F, {"like": {"n": 3}}),
    ]
    for error, match, bad, kwargs in refusals:
        with pytest.raises(error, match=match):
            covariance(bad, **kwargs)


def test_right_hand_sides_in_blocks_with_a_bar(capfd):
    H = mixed_hessian() + DAMPING * np.eye(10)
    op = hessian_operator()
    B = rhs(10, 5, seed=3)
    solved = solve(op, jnp.asarray(B), damping=DAMPING, batch_size=2, progress=True)
    close(solved, np.linalg.solve(H, B), **SOLVED)
    assert "zm.solve right-hand sides" in capfd.readouterr().err
    inverse = np.linalg.inv(H)
    close(
        marginal_variances(op, [0, 3, 7], damping=DAMPING, batch_size=1),
        np.diag(inverse)[[0, 3, 7]],
        **SOLVED,
    )
