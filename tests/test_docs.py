"""Every public name of zodmem (its `__all__`, and the public methods of its classes) has
a docstring with an example and an entry in the API reference, and every example in the
documentation runs: the fenced Python blocks of the `!!! example` boxes of every public
docstring, and those of every page under `docs/` and the README."""

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
import zodmem.contract

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


def _public_methods(klass):
    """`(name, function)` of the public methods zodmem defines on `klass` or its bases."""
    for attr, member in inspect.getmembers(klass, inspect.isfunction):
        if not attr.startswith("_") and member.__module__.startswith("zodmem"):
            yield attr, member


# The methods a transform fills in: documented once, on the bases of `zodmem.contract`.
CONTRACT_METHODS = {
    attr
    for name in zodmem.contract.__all__
    if inspect.isclass(getattr(zodmem.contract, name))
    for attr, _ in _public_methods(getattr(zodmem.contract, name))
}


def _public_api():
    """`(name, object)` of every name in `zodmem.__all__` and of every public method of
    its classes (properties are described in their class's docstring) but those of the
    contract. A method that several classes inherit is named once, by the first of them."""
    seen = set()
    for name in zodmem.__all__:
        obj = getattr(zodmem, name)
        yield name, obj
        if inspect.isclass(obj):
            for attr, member in _public_methods(obj):
                if attr not in CONTRACT_METHODS and id(member) not in seen:
                    seen.add(id(member))
                    yield f"{name}.{attr}", member


def _contract():
    """`(name, object)` of `zodmem.contract`'s names and of its classes' public methods."""
    for name in zodmem.contract.__all__:
        obj = getattr(zodmem.contract, name)
        yield f"contract.{name}", obj
        if inspect.isclass(obj):
            for attr, member in _public_methods(obj):
                if member.__qualname__.split(".")[0] == name:
                    yield f"contract.{name}.{attr}", member


PUBLIC_API = dict(_public_api())
# Public names whose docstrings have no example yet. Each is an expected failure, and a
# strict one: once its example is written the test passes, and the name must go from here.
WITHOUT_EXAMPLE: set[str] = set()


def test_every_public_name_is_in_zodmem_all():
    exported = {
        name
        for name, obj in vars(zodmem).items()
        if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
    }
    assert exported <= set(zodmem.__all__), sorted(exported - set(zodmem.__all__))
    assert all(hasattr(zodmem, name) for name in zodmem.__all__)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(strict=True, reason="no example yet")
            if name in WITHOUT_EXAMPLE
            else (),
        )
        for name in sorted(PUBLIC_API)
    ],
)
def test_public_docstring_has_an_example(name):
    doc = PUBLIC_API[name].__doc__
    assert doc, f"zodmem.{name} has no docstring"
    assert list(_examples(doc)), f"the docstring of zodmem.{name} has no `!!! example` box"


# `::: identifier` lines: where mkdocstrings renders an object's docstring into a page.
_DIRECTIVE = re.compile(r"^::: *(?P<identifier>[\w.]+)", re.M)


def _resolve(identifier):
    """The object a `:::` identifier names: the longest importable module, then attributes."""
    parts = identifier.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(identifier)


def _api_reference():
    """`{id(object): page}` of every object the pages under docs/ render with `:::`."""
    rendered = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for match in _DIRECTIVE.finditer(page.read_text()):
            obj = _resolve(match.group("identifier"))
            rendered.setdefault(id(obj), str(page.relative_to(ROOT)))
    return rendered


API_REFERENCE = _api_reference()


@pytest.mark.parametrize("name", sorted(PUBLIC_API))
def test_public_name_is_in_the_api_reference(name):
    assert id(PUBLIC_API[name]) in API_REFERENCE, (
        f"no page under docs/ renders zodmem.{name} (a `::: zodmem.{name}` line)"
    )


CONTRACT = dict(_contract())


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_contract_is_documented(name):
    """The contract's example is its module's (a whole transform); each of its names and
    methods needs a docstring and a place in the API reference."""
    assert CONTRACT[name].__doc__, f"zodmem.{name} has no docstring"
    assert id(CONTRACT[name]) in API_REFERENCE, (
        f"no page under docs/ renders zodmem.{name} (a `::: zodmem.{name}` line)"
    )


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
