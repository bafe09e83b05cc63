"""A Griffe extension for zodmem's API pages.

Equinox modules are dataclasses, whose generated `__init__` has no docstring of its
own, so inspection finds the one it inherits from `object` ("Initialize self. See
help(type(self))..."). With `merge_init_into_class`, that sentence would be appended
to every class page; drop it and keep only the generated signature.
"""

from __future__ import annotations

from typing import Any

import griffe

_INHERITED = "Initialize self."


class DropInheritedInitDocstring(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        docstring = func.docstring
        if func.name == "__init__" and docstring and docstring.value.startswith(_INHERITED):
            func.docstring = None
