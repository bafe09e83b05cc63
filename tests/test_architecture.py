"""The layout of zodmem's source holds its architecture: each folder is a layer, and a
module imports only from its own layer or the layers below it, never the top-level
package (at module level or inside a function); a name another module imports is not
private; no module grows past 500 lines, and no function past 80 lines of code (its
docstring aside)."""

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
    "_influence",
    "_approximations",
    "_estimators",
    "_transforms",
    "_operators",
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
    """`(line, module parts, names)` of every import of zodmem's own modules in `path`,
    wherever it stands (in functions too), relative or absolute (`import zodmem`, `from
    zodmem.x import y`); `names` are the names a `from` import takes."""
    return _imports_in(path.read_text(), _dotted(path)[:-1])


def _imports_in(source: str, package: list[str]):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            names = [alias.name for alias in node.names]
            if node.module:
                yield node.lineno, base + node.module.split("."), names
            else:
                for name in names:
                    yield node.lineno, base + [name], []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zodmem":
            yield node.lineno, node.module.split(".")[1:], [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "zodmem":
                    yield node.lineno, alias.name.split(".")[1:], []


def _is_module(parts: list[str]) -> bool:
    place = ROOT.joinpath(*parts)
    return place.with_suffix(".py").exists() or (place / "__init__.py").exists()


@pytest.mark.parametrize("path", MODULES, ids=lambda path: "/".join(_dotted(path)))
def test_imports_run_down_the_layers(path):
    here = _layer(_dotted(path))
    upward = [
        f"line {line}: {'.'.join(target)}"
        for line, target, _ in _imports(path)
        if _layer(target) < here
    ]
    assert not upward, f"{path.relative_to(ROOT)} imports from a layer above it: {upward}"


def _private_names(imports) -> list[str]:
    return [
        f"line {line}: {name} from {'.'.join(target)}"
        for line, target, names in imports
        for name in names
        if name.startswith("_") and not name.startswith("__") and not _is_module(target + [name])
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda path: "/".join(_dotted(path)))
def test_no_private_name_crosses_modules(path):
    crossing = _private_names(_imports(path))
    assert not crossing, (
        f"{path.relative_to(ROOT)} imports private names of other modules (a name that "
        f"two modules share is not private: name it without the underscore): {crossing}"
    )


def test_the_checks_see_imports_in_functions_and_private_names():
    """An `import zodmem` inside a function of a lower layer is an upward edge, and a
    private function taken from another module is a private name crossing modules."""
    source = (
        "def f():\n"
        "    import zodmem\n"
        "    from zodmem._estimators._eigsh import eigsh\n"
        "    from .._engine._blocks import _private_helper, map_blocks\n"
        "    from .._engine import _blocks\n"
    )
    imports = list(_imports_in(source, ["_approximations"]))
    here = _layer(["_approximations"])
    assert [line for line, target, _ in imports if _layer(target) < here] == [2]
    assert _private_names(imports) == ["line 4: _private_helper from _engine._blocks"]


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
