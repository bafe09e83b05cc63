"""The spectral density of a symmetric operator by stochastic Lanczos quadrature: a Gauss
quadrature rule from each random probe's Lanczos steps (`lanczos_quadrature`), the probes
run in blocks by the probe engine, and the rules' mean smoothed on a grid
(`spectral_density`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Float, PRNGKeyArray, Real

from .._checks import Integer, Memory, Number, check_int, described, typechecked
from .._eager import one_program
from .._engine._layout import canonical_body
from .._operators._arguments import check_positive, key_or_default
from .._operators._flat import FlatView
from .._operators._vectors import VectorSpace, flat_space
from .._plan._memory import budget_bytes, format_bytes_up
from .._traceback import public
from ._lanczos import lanczos_step, space_product, symmetric_space, tridiagonal
from ._probes import ProbeJob, ProbeOptions, check_probe_blocks, run_probes
from ._random import probe_seeds, sign_probes

__all__ = ["lanczos_quadrature", "spectral_density"]

# The default kernel width, as a fraction of the nodes' spread, and grid size.
_SIGMA_FRACTION = 0.01
_GRID_POINTS = 512


def lanczos_quadrature(
    product: Callable, probe: Any, num_steps: Any, space: VectorSpace | None = None
) -> tuple[jax.Array, jax.Array]:
    """The Gauss quadrature rule of a symmetric operator's spectral measure seen from
    one probe vector: `num_steps` Lanczos steps (with full reorthogonalisation) from
    `probe / |probe|`.

    It is exact for polynomials of degree below `2 * num_steps`:
    `sum(weights * p(nodes)) == u^T p(A) u` with `u = probe / |probe|`. Traceable and
    vmappable over `probe` (one basis of `num_steps * n` numbers per probe).

    **Arguments:**

    - `product`: `v -> A v` for flat vectors of `A`'s size and dtype.
    - `probe`: a flat vector (any nonzero norm), of the dtype of the products, or a
      vector of `space` (leaf by leaf, laid out like the variables).
    - `num_steps`: the number of steps and of nodes, `1 <= num_steps <= n`.

    **Returns:**

    `(nodes, weights)`, each of shape `(num_steps,)`: the eigenvalues of the Lanczos
    tridiagonal matrix, and the squared first entries of its eigenvectors (summing
    to 1). After a breakdown (the Krylov space of `probe` is invariant), the steps go on
    in a new direction and its nodes get weight 0.
    """
    alphas, betas = lanczos_tridiagonal(product, probe, num_steps, space)
    nodes, vectors = jnp.linalg.eigh(tridiagonal(alphas, betas[:-1]))
    return nodes, vectors[0] ** 2


def lanczos_tridiagonal(
    product: Callable, probe: Any, num_steps: Any, space: VectorSpace | None = None
) -> tuple[jax.Array, jax.Array]:
    """The Lanczos tridiagonal matrix of `num_steps` steps from `probe / |probe|`, as
    its diagonal `alphas` and its couplings `betas`, each `(num_steps,)`: `betas[-1]`
    couples the last step to the next Lanczos vector (the residual of the Ritz pairs,
    and the entry a Gauss-Radau rule extends the matrix by). The probe is a vector of
    `space` (by default, a flat vector)."""
    if space is None:
        space = flat_space(probe.shape[-1], probe.dtype)
    n, owner = space.size, "lanczos_quadrature"
    num_steps = check_int(num_steps, "num_steps", owner=owner, minimum=1)
    if num_steps > n:
        raise ValueError(
            f"{owner}: `num_steps` must be at most the probe's size {n}, got num_steps={num_steps}."
        )
    dtype = space.dtype

    def body(j, carry):
        basis, alphas, betas, vector, fresh, norm = carry
        step = lanczos_step(space, product, basis, j, vector, fresh, norm)
        basis, alpha, beta, vector, fresh, norm, _ = step
        return basis, alphas.at[j].set(alpha), betas.at[j].set(beta), vector, fresh, norm

    init = (
        space.zeros(num_steps),
        jnp.zeros(num_steps, dtype),
        jnp.zeros(num_steps, dtype),
        space.normalised(probe),
        jnp.asarray(False),
        jnp.zeros((), dtype),
    )
    _, alphas, betas, _, _, _ = jax.lax.fori_loop(0, num_steps, canonical_body(body), init)
    return alphas, betas


class Quadrature(ProbeJob):
    """The Gauss quadrature rules of random sign probes (probe `i` drawn from
    `sign_probes(key, i)`): `num_steps` nodes and weights each; with `tridiagonals`,
    the Lanczos tridiagonal matrices they come from instead (`lanczos_tridiagonal`)."""

    key: jax.Array
    num: int = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    tridiagonals: bool = eqx.field(default=False, static=True)
    reduce: ClassVar[bool] = False
    what: ClassVar[str] = "probes"

    def count(self, view: FlatView) -> int:
        return self.num

    def block(self, view: FlatView, product: Callable, start: Any, size: int) -> Any:
        indices = start + jnp.arange(size, dtype=jnp.int32)
        probes = sign_probes(self.key, indices, view.size, view.dtype)
        run = lanczos_tridiagonal if self.tridiagonals else lanczos_quadrature
        return jax.vmap(lambda probe: run(product, probe, self.num_steps))(probes)


@eqx.filter_jit
def quadrature_rules(
    view: FlatView,
    space: VectorSpace,
    key: Any,
    num_probes: int,
    num_steps: int,
    options: ProbeOptions,
    *,
    tridiagonals: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The Gauss rules `(nodes, weights)` of `num_probes` sign probes of `key`, each
    `(num_probes, num_steps)`, in blocks that `options` plan; with `tridiagonals`, their
    Lanczos matrices `(alphas, betas)` instead, of the same shapes. For variables sharded
    over devices, each probe and its basis are laid out like them (`sharded_rules`)."""
    job = Quadrature(key, num_probes, num_steps, tridiagonals)
    if space.sharded:
        return sharded_rules(view, space, job, options)
    return run_probes(view, job, options)


def sharded_rules(
    view: FlatView, space: VectorSpace, job: Quadrature, options: ProbeOptions
) -> tuple[jax.Array, jax.Array]:
    """`quadrature_rules` for variables sharded over devices: the probes of `job` run one
    block of `batch_size` at a time (by default as many as `max_memory` holds bases of,
    per device, else one), each probe `sign_probes(key, i)` drawn leaf by leaf in the
    variables' layout, its basis `(num_steps, *leaf.shape)` a leaf, sharded as the leaf."""
    if options.sharding is not None:
        raise ValueError(
            f"{options.owner}: `sharding` spreads probes over devices, but the operator's "
            "variables are sharded over them already; leave `sharding` None."
        )
    size = probe_block(space, job.num_steps, job.num, options)
    product = space_product(view, space)
    run = lanczos_tridiagonal if job.tridiagonals else lanczos_quadrature

    def one(seed):
        probe = space.map(lambda leaf: leaf[0], space.signs(seed[None]))
        return run(product, probe, job.num_steps, space)

    seeds = probe_seeds(job.key, jnp.arange(job.num, dtype=jnp.int32))
    if space.explicit:
        # A Lanczos step's branches, mapped over a block, become selects that the types
        # of Explicit axes refuse: there the probes of a block run one after another.
        size = None
    return jax.lax.map(one, seeds, batch_size=size)


def probe_block(space: VectorSpace, num_steps: int, num_probes: int, options: ProbeOptions) -> int:
    """Probes a block for sharded variables: `batch_size`, or as many whose Lanczos bases
    (`num_steps` vectors each, counted per device) `max_memory` holds, else 1; refused in
    words, naming the budget that fits, where not even one basis fits."""
    check_probe_blocks(options)
    if options.batch_size is not None:
        return min(int(options.batch_size), num_probes)
    budget = budget_bytes(options.max_memory)
    if budget is None:
        return 1
    # A probe's basis and its few working vectors (the probe, the residual, an image).
    per_probe = space.bytes_per_device(num_steps + 4)
    if per_probe > budget:
        raise ValueError(
            f"{options.owner}: one probe's Lanczos basis of {num_steps} vectors takes "
            f"{format_bytes_up(per_probe)} per device, over max_memory="
            f"{options.max_memory!r}; give max_memory={per_probe} or more (bytes per "
            "device), or fewer `num_steps`."
        )
    return max(1, min(num_probes, budget // per_probe))


def _density(
    nodes: jax.Array, weights: jax.Array, grid: Any, sigma: Any
) -> tuple[jax.Array, jax.Array]:
    """The rules' mean, each node a Gaussian of width `sigma`, on the grid (its points,
    or their number), one program where it is called eagerly."""
    if isinstance(grid, int):
        return _density_on(nodes, weights, None, sigma, grid)
    return _density_on(nodes, weights, grid, sigma, None)


@one_program(static=("points",))
def _density_on(
    nodes: Any, weights: Any, grid: Any, sigma: Any, points: int | None
) -> tuple[Any, Any]:
    dtype = nodes.dtype
    lower, upper = jnp.min(nodes), jnp.max(nodes)
    if sigma is None:
        # Nodes a few roundings apart (an operator whose eigenvalues are all equal)
        # would narrow the kernel, and the grid, to a few representable numbers: the
        # width is at least the precision's square root times the nodes' magnitude.
        scale = jnp.maximum(jnp.abs(lower), jnp.abs(upper))
        sigma = jnp.maximum(
            _SIGMA_FRACTION * (upper - lower), math.sqrt(jnp.finfo(dtype).eps) * scale
        )
        # Every node zero: no scale to go by, so that of a spread of 1.
        sigma = jnp.where(sigma > 0, sigma, _SIGMA_FRACTION)
    if grid is None:
        grid = jnp.linspace(lower - 3 * sigma, upper + 3 * sigma, points, dtype=dtype)
    # The mean over probes of each rule's weights on Gaussians at its nodes.
    offsets = (grid[:, None] - nodes.reshape(-1)[None, :]) / sigma
    kernel = jnp.exp(-0.5 * offsets**2) / (sigma * math.sqrt(2 * math.pi))
    density = kernel @ weights.reshape(-1) / nodes.shape[0]
    return grid, density.astype(dtype)


@public
@typechecked
def spectral_density(
    operator: lx.AbstractLinearOperator,
    *,
    num_probes: Integer = 10,
    num_steps: Integer = 40,
    key: PRNGKeyArray | None = None,
    grid: Integer | Real[Array | np.ndarray, " points"] | None = None,
    sigma: Number | None = None,
    batch_size: Integer | None = None,
    max_memory: Memory = None,
    sharding: NamedSharding | None = None,
    progress: bool | None = None,
) -> tuple[Float[Array, " points"], Float[Array, " points"]]:
    """The eigenvalue density of a symmetric operator, estimated by stochastic Lanczos
    quadrature (Ubaru, Chen and Saad, 2017) from products with vectors only.

    Use it to see the whole spectrum of a Hessian or Gauss-Newton matrix too large to
    diagonalise: its bulk, its outliers, its negative part. Each of `num_probes`
    Rademacher probes gives a Gauss quadrature rule of `num_steps` nodes (see
    `lanczos_quadrature`); the density is the mean of the rules, each node a Gaussian
    of width `sigma` weighted by its weight. It is the density of eigenvalues per unit
    of the operator's size: it integrates to about 1, and `n * density` counts the
    eigenvalues per unit length.

    **Arguments:**

    - `operator`: a symmetric real operator, as for `zm.eigsh`.
    - `num_probes`: how many random sign probes; probe `i` is a hash of `i` and the
      key's words, whatever the batches.
    - `num_steps`: the Lanczos steps (products, and nodes) per probe; more than the
      operator's size `n` is cut to `n` (then the rules are exact).
    - `key`: the `jax.random` key of the probes (default `jax.random.key(0)`).
    - `grid`: the points to evaluate the density at: a 1-D array, or a number of points
      spread evenly over `[min node - 3 sigma, max node + 3 sigma]` (default 512).
    - `sigma`: the Gaussian kernel's width; by default 1% of the distance between the
      smallest and the largest node, and at least the square root of the dtype's
      precision (`jnp.finfo(dtype).eps`) times the largest node's magnitude (0.01 when
      every node is 0): the nodes of an operator whose eigenvalues are all equal differ
      only by rounding, and the density is then one Gaussian at their value.
    - `batch_size`, `max_memory`: at most one: the probes per block (vmapped together),
      given, or as many as fit the budget, planned as any transform's blocks. By default
      the options of the operator's transform, or for any other operator all probes in
      one block. Where the operator's variables are sharded over several devices, each
      probe and its basis are laid out like them (see the estimators' page): a block
      is one probe by default, and `max_memory` counts each basis per device, refused
      before it runs, with the bytes that fit, where not even one fits.
    - `sharding`: a `NamedSharding` whose first entry names the mesh axes that split the
      probes over devices; by default the operator's transform's (none where the
      operator's variables are sharded over the devices already).
    - `progress`: a progress bar of the blocks of probes done; by default the
      transform's.

    **Returns:**

    `(grid, density)`, two 1-D arrays of the operator's dtype.

    **Cost:** `num_probes * num_steps` products; memory for one block's bases, `num_steps
    * n` numbers a probe, beside the products' own.

    !!! example

        ```python
        import jax.numpy as jnp
        import lineax as lx
        import zodmem as zm

        spectrum = jnp.concatenate([jnp.zeros(50), jnp.full(50, 10.0)])
        op = lx.DiagonalLinearOperator(spectrum)
        grid, density = zm.spectral_density(op, num_steps=10)
        # half of the eigenvalues lie near 10
        near_ten = (grid > 5) * density
        assert abs(jnp.sum(near_ten) * (grid[1] - grid[0]) - 0.5) < 0.05
        ```
    """
    owner = "zm.spectral_density"
    space, view = symmetric_space(operator, owner)
    num_probes = check_int(num_probes, "num_probes", owner=owner, minimum=1)
    num_steps = min(check_int(num_steps, "num_steps", owner=owner, minimum=1), view.size)
    key = key_or_default(key, owner)
    if grid is None:
        grid = _GRID_POINTS
    elif isinstance(grid, (int, np.integer)) and not isinstance(grid, (bool, np.bool_)):
        grid = check_int(grid, "grid", owner=owner, minimum=2)
    elif eqx.is_array_like(grid) and not isinstance(grid, (bool, np.bool_, float, complex)):
        grid = jnp.asarray(grid, view.dtype)
        if grid.ndim != 1:
            raise ValueError(
                f"{owner}: `grid` must be a 1-D array of points or a number of points, "
                f"got an array of shape {grid.shape}."
            )
    else:
        raise TypeError(
            f"{owner}: `grid` must be None, a number of points (an int >= 2) or a 1-D "
            f"array of points, got {described(grid)}."
        )
    sigma = check_positive(sigma, "sigma", owner, optional=True)
    if sigma is not None:
        sigma = jnp.asarray(sigma, view.dtype)
    options = ProbeOptions(owner, max_memory, batch_size, sharding, progress)
    nodes, weights = quadrature_rules(view, space, key, num_probes, num_steps, options)
    return _density(nodes, weights, grid, sigma)
