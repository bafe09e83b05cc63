"""`import zodmem` is light: what a first call does not need is imported when first used."""

import subprocess
import sys


def _printed(code):
    """The lines `code` prints in a fresh Python process."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")


def test_import_leaves_the_checker_and_scipy_for_the_first_call():
    code = (
        "import sys, zodmem\n"
        "print(sorted(m for m in ('beartype', 'scipy', 'matplotlib') if m in sys.modules))\n"
        "import jax.numpy as jnp\n"
        "zodmem.BatchedHessian(jnp.sum)(jnp.ones(2))\n"
        "print('beartype' in sys.modules)\n"
    )
    out = _printed(code)
    assert out[0] == "[]", out
    assert out[1] == "True"  # a checked call imports it, and checks its arguments


def test_public_names_are_imported_when_first_used():
    code = (
        "import sys, zodmem\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('zodmem.'))\n"
        "print(loaded())\n"
        "zodmem.ChunkedVmap\n"
        "print(any(m.startswith(('zodmem._estimators', 'zodmem._approximations')) "
        "for m in loaded()), 'zodmem._transforms._vmap' in loaded())\n"
        "print(sorted(set(zodmem.__all__) - set(dir(zodmem))), zodmem.eigsh.__module__)\n"
    )
    out = _printed(code)
    assert out[0] == "['zodmem._traceback']", out
    assert out[1] == "False True", out  # a map needs neither the estimators nor KFAC
    assert out[2] == "[] zodmem._estimators._eigsh", out
