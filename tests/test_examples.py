"""Every script in examples/ runs to the end and prints what it promises.

Each script runs in its own Python process, as a user would run it. These tests are
marked `examples`: `pytest -m "not examples"` leaves them out, `nox -s examples` runs
only them.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.py"))

# A line (or part of one) that each script prints only when its result came out right.
KEY_LINES = {
    "quickstart.py": ["The two Hessians agree"],
    "save_and_load.py": [
        "Hessian (105, 105): identical after loading: True",
        "per-example Jacobians (32, 1, 2): identical after loading: True",
    ],
    "jacobians_tutorial.py": [
        "row-by-row and vectorised Jacobians agree: True",
        "Jacobian of Jacobian equals jax.hessian: True",
        "equal to jax.vmap(jax.hessian): True",
        "equal to jax.jacrev(has_aux=True), aux included: True",
    ],
    "fisher_information.py": [
        ": over the budget",
        "-> nbatches=",
        "F @ v equals a Hessian-vector product: True",
        "estimates lie within two standard errors of the truth",
    ],
    "long_hessian.py": [
        "nothing recomputed",
        "a read-only memmap: True",
        "equal to numpy.linalg.eigvalsh: True",
        "the file holds the in-memory Hessian: True",
    ],
    "dataset_hessian.py": [
        "equal to jax.hessian of the full-batch loss: True",
        "Microbatcher(BatchedHessian(nbatches=16), microbatch_size=1024)",
    ],
    "fisher_forecast.py": [
        "the GGN and the Hessian agree: True",
        "CG solve equals the dense solve: True",
        "quality factor Q = ",
    ],
    "hessian_spectrum.py": [
        "equal to jnp.linalg.eigh's top 5: True",
        "trace equal to the sum of the eigenvalues: True",
        "Hutch++ estimate within 3 standard errors",
        "exact diagonal equals the dense one: True",
        "spectral density integrates to 1.000",
    ],
    "influence_flipped_labels.py": [
        "self-influence equals the dense formula: True",
        "flipped labels among the top 48 self-influence scores",
    ],
    "sharded_hessian.py": [
        "sharded Hessian equals jax.hessian: True",
        "column split P(None, 'd') equals jax.hessian: True",
        "per-device: output",
        "per-device output is the share: True",
        "Plan(BatchedHessian: ",
    ],
}


def test_the_examples_are_found():
    assert {path.name for path in EXAMPLES} >= set(KEY_LINES) - {"quickstart.py"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_every_example_says_what_it_shows(path):
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and len(docstring.splitlines()) >= 3, f"{path.name} needs a top docstring"


@pytest.mark.examples
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_runs(path):
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=EXAMPLES_DIR.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout
    assert result.returncode == 0, f"{path.name} failed:\n{output}\n{result.stderr[-4000:]}"
    for line in KEY_LINES.get(path.name, []):
        assert line in output, f"{path.name} did not print {line!r}:\n{output}"
    # The scripts print their checks as True/False; none may come out False.
    assert ": False" not in output, f"{path.name} reports a failed check:\n{output}"
