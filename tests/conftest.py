"""Test configuration: zodmem is imported under jaxtyping's import hook, so every
annotated function in the package is checked by beartype while the tests run (in each
process that runs tests: not in the one that hands them to pytest-xdist's workers)."""

import os

# The tests compile hundreds of small programs and run each once or twice, so most of the
# suite's time is XLA compiling. Two settings of its CPU backend buy nothing at these sizes:
# - the backend's (LLVM's) optimisations, about a third of the suite's time;
# - its newer fusion emitters (MLIR), a third or more of what remains: the older emitters
#   generate the same fusions' code at less cost (jaxlib 0.10.0 has the flag too);
# - splitting each program's machine code into 32 parts generated on parallel threads:
#   for programs this small the threads cost more than they save, most of all with a
#   worker per core. One part takes a fifth less of XLA's compile time.
# All three come after XLA has assigned the program's buffers, so they change no program's
# meaning and no planned memory, only the speed of compiling and running, and every
# reference the tests compare with is compiled alike. A run that sets either keeps its own.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")]
    + [
        f"--{flag}={value}"
        for flag, value in [
            ("xla_backend_optimization_level", "0"),
            ("xla_cpu_use_fusion_emitters", "false"),
            ("xla_cpu_parallel_codegen_split_count", "1"),
        ]
        if flag not in os.environ.get("XLA_FLAGS", "")
    ]
).strip()

from pathlib import Path  # noqa: E402

import jax
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "zodmem",
    deadline=None,
    max_examples=10,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)
settings.load_profile("zodmem")


@pytest.fixture
def float64():
    """Double precision for a test (tight tolerances), restored afterwards. A module's
    tests all take it with `pytestmark = pytest.mark.usefixtures("float64")`."""
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


# Two suites run as steps of their own in `.ci/run`, and only when named on the command
# line (pytest collects a path it is given even where `collect_ignore` names it):
# - tests/multidevice needs 4 devices, which JAX fixes when it starts: it runs in a process
#   started with `XLA_FLAGS=--xla_force_host_platform_device_count=4`, and a run with
#   fewer devices leaves it out;
# - tests/distributed starts two processes of its own under `jax.distributed`.
MULTIDEVICE_DEVICES = 4
collect_ignore = ["distributed"]
if len(jax.devices()) < MULTIDEVICE_DEVICES:
    collect_ignore.append("multidevice")


def _import_zodmem_checked():
    """Import zodmem under jaxtyping's import hook, before any test module imports it."""
    from jaxtyping import install_import_hook

    with install_import_hook("zodmem", "beartype.beartype"):
        import zodmem

        # The public names are imported when first used: import them all here, where the
        # hook checks the types of every function they define.
        for name in [*zodmem.__all__, "losses"]:
            getattr(zodmem, name)


def _runs_no_test(config):
    """Whether this process only hands the tests to pytest-xdist's workers (`-n N`)."""
    workers = getattr(config.option, "numprocesses", None)
    return bool(workers) and not hasattr(config, "workerinput")


def pytest_configure(config):
    """Import zodmem checked where tests run; refuse to run tests/multidevice, named on
    the command line, with too few devices: every test there would fail on one device,
    for a reason its own failure does not say."""
    if not _runs_no_test(config):
        _import_zodmem_checked()
    if len(jax.devices()) >= MULTIDEVICE_DEVICES:
        return
    multidevice = Path(__file__).resolve().parent / "multidevice"
    root = config.invocation_params.dir
    for arg in config.args:
        path = (root / arg.split("::")[0]).resolve()
        if path == multidevice or multidevice in path.parents:
            raise pytest.UsageError(
                f"{arg} needs {MULTIDEVICE_DEVICES} devices and JAX has "
                f"{len(jax.devices())}: run it as `XLA_FLAGS=--xla_force_host_platform_"
                f"device_count={MULTIDEVICE_DEVICES} python -m pytest tests/multidevice`."
            )
