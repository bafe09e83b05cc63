"""Developer sessions: `nox -s tests`, `nox -s oldest`, `nox -s examples`, `nox -s peers`,
`nox -s lint`, `nox -s docs`, `nox -s benchmarks`."""

import nox
import nox.project

nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "auto", "tests", *session.posargs)


# The tests `oldest` runs: the transforms against plain JAX, then the sharded engine on 4
# CPU devices (its use of explicit mesh axes sets the oldest jax). tests/test_budget.py is
# left out: one of its budgets is sized from a map's compiled peak, which XLA fuses away
# in jax 0.10.0.
OLDEST_TESTS = [
    "tests/test_hessian.py",
    "tests/test_jacobian.py",
    "tests/test_vmap.py",
    "tests/test_microbatch.py",
    "tests/test_scan.py",
    "tests/test_checks.py",
]


@nox.session(python="3.11")
def oldest(session: nox.Session) -> None:
    """Run a quick part of the tests on the oldest versions pyproject.toml allows: every
    dependency pinned to its lower bound, on the oldest Python (name test files as
    arguments to choose the single-device ones)."""
    dependencies = nox.project.load_toml("pyproject.toml")["project"]["dependencies"]
    pins = [requirement.replace(">=", "==") for requirement in dependencies]
    if any("==" not in pin for pin in pins):
        session.error(f"every dependency needs a lower bound to pin, got {dependencies}")
    session.install(*pins, "pytest", "pytest-xdist", "hypothesis")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pytest", "-n", "auto", *(session.posargs or OLDEST_TESTS))
    # JAX fixes its devices when it starts: the multi-device tests get a process of their own.
    devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    session.run("python", "-m", "pytest", "-n", "auto", "tests/multidevice", env=devices)


@nox.session
def examples(session: nox.Session) -> None:
    """Run every script in examples/ and check what it prints."""
    session.install("-e", ".[test]")
    session.run(
        "python", "-m", "pytest", "-m", "examples", "tests/test_examples.py", *session.posargs
    )


@nox.session
def peers(session: nox.Session) -> None:
    """Run powerpax's, optax's and zodiax's own tests against zodmem's compat namespaces
    (downloads their source distributions from PyPI; name peers as arguments to choose)."""
    # The test extras hold the peers themselves, for the helpers their tests import.
    session.install("-e", ".[test]")
    session.run("python", "tests/peers/run_peers.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "zodmem", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "zodmem", "tests", "benchmarks", "examples")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".", "pyright")
    session.run("pyright", "zodmem")


@nox.session
def docs(session: nox.Session) -> None:
    """Run the pages' examples, draw the benchmark plots and build the site."""
    session.install("-e", ".[docs]")
    session.run("python", "docs/_scripts/check_examples.py")
    session.run("python", "benchmarks/plots.py")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def benchmarks(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "benchmarks/hessian_memory.py", *session.posargs)
    session.run("python", "benchmarks/budgets.py", *session.posargs)
