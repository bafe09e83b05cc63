"""Run the Python examples of the documentation pages, so that none of them goes stale.

    python docs/_scripts/check_examples.py                  # every page under docs/
    python docs/_scripts/check_examples.py docs/index.md    # some pages

The fenced ```python blocks of a page run in order in one namespace, as a reader
would paste them into one session. Blocks inside admonitions (indented) count too.
A block whose text contains `# docs: skip` is left out. Exits non-zero if any block
raises, after reporting the page, the block and the traceback.
"""

from __future__ import annotations

import re
import sys
import textwrap
import time
import traceback
import types
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)


def run_page(page: Path) -> bool:
    text = page.read_text()
    # The blocks run in a module of their own, as a script's would: the functions they
    # define can be found by import (`zm.save` records them as `__docs__:name`).
    module = types.ModuleType("__docs__")
    sys.modules["__docs__"] = module
    start = time.perf_counter()
    blocks = [textwrap.dedent(m.group("code")) for m in _BLOCK.finditer(text)]
    try:
        for number, code in enumerate(blocks, 1):
            if "# docs: skip" in code:
                continue
            try:
                exec(compile(code, f"{page}[block {number}]", "exec"), module.__dict__)
            except Exception:
                print(f"FAILED: {page}, block {number}:\n{code}\n{traceback.format_exc()}")
                return False
    finally:
        del sys.modules["__docs__"]
    print(
        f"ok: {page.relative_to(DOCS.parent)} ({len(blocks)} blocks, "
        f"{time.perf_counter() - start:.1f} s)"
    )
    return True


def main(argv: list[str]) -> int:
    pages = [Path(p).resolve() for p in argv] or sorted(DOCS.rglob("*.md"))
    failed = [page for page in pages if not run_page(page)]
    if failed:
        print(f"{len(failed)} of {len(pages)} pages have failing examples")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
