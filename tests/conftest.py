"""Test configuration: zodmem is imported under jaxtyping's import hook, so every
annotated function in the package is checked by beartype while the tests run."""

from jaxtyping import install_import_hook

with install_import_hook("zodmem", "beartype.beartype"):
    import zodmem  # noqa: F401

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


@pytest.fixture
def buffers_only(monkeypatch):
    """Budgets that bound the compiled call's own buffers only, as on an accelerator: the
    tens of MB a CPU process's compiles add beside them are left out of the plan, so that
    the planner's search can be tested on calls of a few kB."""
    from zodmem import _budget

    monkeypatch.setattr(_budget, "resident_bytes", lambda: None)
    monkeypatch.setattr(_budget, "RESERVE_CPU_BYTES", 0)


# The multi-device tests need several devices, which JAX fixes when it starts: they run
# in a process of their own (tests/test_multidevice.py starts it), never in this one.
collect_ignore = [] if len(jax.devices()) >= 4 else ["multidevice"]
