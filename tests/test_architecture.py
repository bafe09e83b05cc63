"""The layout of zodmem's source holds its architecture: each folder is a layer, and a
module imports only from its own layer or the layers below it; no module grows past
500 lines, and no function past 80 lines of code (its docstring aside)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "zodmem"
# From the top down: a layer may import from itself and from those after it. The public
# modules (`__init__`, `losses`, `contract`, `compat/`) stand above them all, and the
# shared utilities (`_checks`, `_pytree`, ...) below them all.
LAYERS = [
    "_stream",
    "_serialise",
    "_approximations",
    "_transforms",
    "_curvature",
    "_plan",
    "_engine",
]
PUBLIC = {"__init__", "losses", "contract", "compat"}
MODULES = sorted(ROOT.rglob("*.py"))


def _dotted(path: Path) -> list[str]:
    return list(path.relative_to(ROOT).with_suffix("").parts)


def _layer(parts: list[str]) -> int:
    top = parts[0] if parts else "__init__"
    if top in PUBLIC:
        return -1
    return LAYERS.index(top) if top in LAYERS else len(LAYERS)


def _imports(path: Path):
    """`(line, module parts)` of every relative import in `path`, wherever it stands."""
    package = _dotted(path)[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                yield node.lineno, base + node.module.split(".")
            else:
                for alias in node.names:
                    yield node.lineno, base + [alias.name]


@pytest.mark.parametrize("path", MODULES, ids=lambda path: "/".join(_dotted(path)))
def test_imports_run_down_the_layers(path):
    here = _layer(_dotted(path))
    upward = [
        f"line {line}: {'.'.join(target)}"
        for line, target in _imports(path)
        if _layer(target) < here
    ]
    assert not upward, f"{path.relative_to(ROOT)} imports from a layer above it: {upward}"


def _code_lines(node: ast.AST) -> int:
    lines = node.end_lineno - node.lineno + 1
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        lines -= body[0].end_lineno - body[0].lineno + 1
    return lines


@pytest.mark.parametrize("path", MODULES, ids=lambda path: "/".join(_dotted(path)))
def test_modules_and_functions_stay_small(path):
    source = path.read_text()
    assert source.count("\n") <= 500, f"{path.relative_to(ROOT)} has {source.count(chr(10))} lines"
    long = [
        (node.name, _code_lines(node))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > 80
    ]
    assert not long, f"functions over 80 lines of code in {path.relative_to(ROOT)}: {long}"
