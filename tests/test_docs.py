"""Every example in the documentation runs: the fenced Python blocks of the `!!! example`
boxes of every public docstring, and those of every page under `docs/` and the README."""

import importlib
import inspect
import os
import pkgutil
import re
import sys
import textwrap
from pathlib import Path

import pytest

import zodmem

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)
# An admonition box: its title line, then every line indented deeper or blank.
_EXAMPLE_BOX = re.compile(
    r"^(?P<indent> *)!!! example[^\n]*\n(?P<body>(?:(?P=indent) +\S[^\n]*\n|\s*\n)*)", re.M
)


def _public_modules():
    """`zodmem` and its public submodules (`zodmem.compat.*`)."""
    yield zodmem
    for info in pkgutil.walk_packages(zodmem.__path__, "zodmem."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield importlib.import_module(info.name)


def _documented():
    """`(name, docstring)` of every public object of zodmem and its public methods."""
    seen = set()
    for module in _public_modules():
        names = getattr(module, "__all__", None) or [
            n for n in vars(module) if not n.startswith("_")
        ]
        if module.__doc__:
            yield module.__name__, module.__doc__
        for name in names:
            obj = getattr(module, name)
            if id(obj) in seen or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            seen.add(id(obj))
            if obj.__doc__:
                yield f"{module.__name__}.{name}", obj.__doc__
            if inspect.isclass(obj):
                inherited = {}
                for klass in reversed(obj.__mro__):
                    inherited.update(vars(klass))
                for attr, member in inherited.items():
                    function = member.fget if isinstance(member, property) else member
                    if (
                        not attr.startswith("_")
                        and inspect.isfunction(function)
                        and function.__module__.startswith("zodmem")
                        and function.__doc__
                        and id(function) not in seen
                    ):
                        seen.add(id(function))
                        yield f"{module.__name__}.{name}.{attr}", function.__doc__


def _examples(doc):
    for box in _EXAMPLE_BOX.finditer(inspect.cleandoc(doc) + "\n"):
        for match in _BLOCK.finditer(box.group("body")):
            yield textwrap.dedent(match.group("code"))


DOCSTRING_EXAMPLES = {
    f"{name}[{number}]": code
    for name, doc in _documented()
    for number, code in enumerate(_examples(doc), 1)
}


def test_the_public_docstrings_have_examples():
    documented = {name.split("[")[0] for name in DOCSTRING_EXAMPLES}
    for name in zodmem.__all__ if hasattr(zodmem, "__all__") else []:
        assert f"zodmem.{name}" in documented


@pytest.mark.parametrize("name", sorted(DOCSTRING_EXAMPLES))
def test_docstring_example_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    code = DOCSTRING_EXAMPLES[name]
    exec(compile(code, name, "exec"), {"__name__": "__docs__"})


sys.path.insert(0, str(ROOT / "docs" / "_scripts"))
from check_examples import run_page  # noqa: E402

PAGES = sorted(
    str(page.relative_to(ROOT))
    for page in (ROOT / "docs").rglob("*.md")
    if _BLOCK.search(page.read_text())
) + ["README.md"]


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_page(ROOT / page), f"an example on {page} failed (see the output above)"
    assert os.getcwd() == str(tmp_path)
