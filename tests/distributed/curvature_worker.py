"""One of two processes that take the curvature of a model laid out over both of them,
under `jax.distributed`: run as `python curvature_worker.py PORT PROCESS_ID`.

Each process holds four CPU devices, so the mesh spans eight devices in two processes.
The model's weights are split FSDP-style over the mesh (each leaf's first axis that
eight divides) and the batch over its examples, as global arrays each process makes
from its own part. `zm.eigsh` and `zm.trace` of the Gauss-Newton matrix are checked
against the same calls on the whole model held by one of this process's devices: the
values, and that the eigenvectors come back laid out like the weights (each process
holding only its devices' shares).

Prints `process <id>: OK <count> checks` and exits 0 when every check passes; prints
the error and exits 1 otherwise. `tests/distributed/test_distributed.py` launches it.
"""

import os
import sys

# Four CPU devices per process, set before jax is imported (see hessian_worker.py).
_flags = [
    flag
    for flag in os.environ.get("XLA_FLAGS", "").split()
    if not flag.startswith("--xla_force_host_platform_device_count")
]
os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=4"])
os.environ.pop("JAX_NUM_CPU_DEVICES", None)
os.environ["JAX_PLATFORMS"] = "cpu"

import traceback  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

with install_import_hook("zodmem", "beartype.beartype"):
    import zodmem as zm  # noqa: E402

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
DEVICES = NUM_PROCESSES * DEVICES_PER_PROCESS

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)


def logits(model, xs, labels):
    return jax.vmap(model)(xs)


LOSS = zm.losses.SoftmaxCrossEntropy(reduction="mean")


def make_problem():
    """The same model and data in every process (fixed seeds), process-local."""
    model = eqx.nn.MLP(8, 4, 16, 2, activation=jnp.tanh, key=jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda leaf: leaf.astype(jnp.float64) if eqx.is_inexact_array(leaf) else leaf, model
    )
    xs = jax.random.normal(jax.random.key(1), (32, 8), jnp.float64)
    labels = jnp.arange(32) % 4
    return model, xs, labels


def spec_of(leaf) -> P:
    """FSDP: the leaf's first axis that the device count divides, over `"d"`."""
    for axis, size in enumerate(leaf.shape):
        if size % DEVICES == 0:
            return P(*([None] * axis), "d")
    return P()


def global_problem(mesh):
    """The problem as global arrays over `mesh`, each process giving its own parts."""
    model, xs, labels = make_problem()

    def place(leaf):
        if not eqx.is_array(leaf):
            return leaf
        sharding = NamedSharding(mesh, spec_of(leaf))
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])

    batch = NamedSharding(mesh, P("d"))
    xs = jax.make_array_from_callback(xs.shape, batch, lambda index: xs[index])
    labels = jax.make_array_from_callback(labels.shape, batch, lambda index: labels[index])
    return jax.tree_util.tree_map(place, model), xs, labels


def check_laid_out_like(name, vectors, params) -> None:
    """Each leaf of `vectors` (a block of vectors, the block on the leading axis) is split
    as its weight is, and this process holds only its own devices' shares of it."""
    local = set(jax.local_devices())
    for got, weight in zip(
        jax.tree_util.tree_leaves(vectors), jax.tree_util.tree_leaves(params), strict=True
    ):
        expected = NamedSharding(weight.sharding.mesh, P(None, *weight.sharding.spec))
        assert got.sharding.is_equivalent_to(expected, got.ndim), (
            f"{name}: a leaf laid out as {got.sharding}, its weight as {weight.sharding}"
        )
        assert {shard.device for shard in got.addressable_shards} <= local, name
        assert len(got.addressable_shards) == DEVICES_PER_PROCESS, name


def local_values(tree):
    """The entries of a (possibly global) pytree that this process holds, gathered."""
    from jax.experimental import multihost_utils

    return jax.tree_util.tree_map(
        lambda leaf: np.asarray(multihost_utils.process_allgather(leaf, tiled=True)), tree
    )


def run_checks(mesh) -> int:
    passed = 0
    model, xs, labels = global_problem(mesh)
    local_model, local_xs, local_labels = make_problem()  # on this process's first device
    params = eqx.filter(model, eqx.is_inexact_array)

    op = zm.BatchedGGN(logits, LOSS).operator(model, xs, labels)
    local_op = zm.BatchedGGN(logits, LOSS).operator(local_model, local_xs, local_labels)

    values, vectors = zm.eigsh(op, 3, key=jax.random.key(2))
    expected, expected_vectors = zm.eigsh(local_op, 3, key=jax.random.key(2))
    np.testing.assert_allclose(local_values(values), np.asarray(expected), rtol=1e-8)
    passed += 1
    check_laid_out_like("eigsh's eigenvectors", vectors, params)
    gathered = local_values(vectors)
    flat = np.concatenate(
        [leaf.reshape(leaf.shape[0], -1) for leaf in jax.tree_util.tree_leaves(gathered)], axis=1
    )
    cosines = np.abs(np.sum(flat.T * np.asarray(expected_vectors), axis=0))
    np.testing.assert_allclose(cosines, 1.0, rtol=1e-6)
    passed += 1

    key = jax.random.key(3)
    trace = zm.trace(op, method="hutchinson", num_probes=16, key=key)
    expected = zm.trace(local_op, method="hutchinson", num_probes=16, key=key)
    np.testing.assert_allclose(local_values(trace[0]), np.asarray(expected[0]), rtol=1e-10)
    passed += 1

    # KFAC of the model split over both processes: the whole model's factors, and the
    # product and solve of a vector in the weights' structure laid out like the weights.
    kfac = zm.KFAC(logits, LOSS)(model, xs, labels)
    local_kfac = zm.KFAC(logits, LOSS)(local_model, local_xs, local_labels)
    np.testing.assert_allclose(
        local_values(kfac.as_matrix()), np.asarray(local_kfac.as_matrix()), rtol=1e-8, atol=1e-12
    )
    local_params = eqx.filter(local_model, eqx.is_inexact_array)
    for name, got, expected in [
        ("KFAC's product", kfac.mv(params), local_kfac.mv(local_params)),
        (
            "KFAC's solve",
            kfac.solve(params, damping=0.1),
            local_kfac.solve(local_params, damping=0.1),
        ),
    ]:
        check_laid_out_like(name, jax.tree_util.tree_map(lambda a: a[None], got), params)
        for a, b in zip(
            jax.tree_util.tree_leaves(local_values(got)),
            jax.tree_util.tree_leaves(expected),
            strict=True,
        ):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-8, atol=1e-12)
        passed += 1
    return passed


def main() -> None:
    port, process_id = int(sys.argv[1]), int(sys.argv[2])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
    )
    try:
        assert len(jax.devices()) == DEVICES, f"devices: {jax.devices()}"
        assert len(jax.local_devices()) == DEVICES_PER_PROCESS, f"local: {jax.local_devices()}"
        mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        passed = run_checks(mesh)
    except Exception:
        print(f"process {process_id}: FAILED", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print(f"process {process_id}: OK {passed} checks", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
