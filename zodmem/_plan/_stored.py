"""Plans kept beside JAX's persistent compilation cache, so that a second process running
the same script plans nothing again.

Where the user has set `jax_compilation_cache_dir` (a local folder), each plan made with a
budget is written to `<that folder>/zodmem-plans/<key>.json`. The key is a sha256 of what
a plan may depend on and can be read without tracing: the versions of zodmem, JAX and
jaxlib, the devices, the transform's class, the shapes, dtypes and placements of the
arrays, the other leaves as text, the budget and the planned call. The record holds the
chosen strategy and block size and a sha256 of the program compiled for them.

A later process with the same key compiles that one candidate (its executable comes from
JAX's cache), and takes the plan only where the program it traced has the recorded
sha256 (the same computation: a function of the same name edited between the runs gives
another program) and its peak, read from XLA again, fits the budget. Otherwise it plans
as if nothing were kept, and keeps the new plan. A folder that cannot be read or written
only costs the planning: nothing here raises.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
from typing import Any

import equinox as eqx
import jax

from .._digest import ADDRESS, as_text, program_digest
from .._engine._sharding import placement

__all__ = ["StoredPlan", "stored_plans"]

_FOLDER = "zodmem-plans"


@functools.cache
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _folder() -> str | None:
    """The folder of kept plans: inside the user's persistent compilation cache, when
    that is a local folder; `None` where there is none."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache or "://" in str(cache):
        return None
    return os.path.join(os.fspath(cache), _FOLDER)


class StoredPlan:
    """The kept plan of one call: `choice()` reads it, `keep()` writes it."""

    def __init__(self, folder: str, key: str):
        self.path = os.path.join(folder, f"{key}.json")

    def choice(self, strategies: tuple) -> tuple[Any, int, str] | None:
        """`(strategy, block_size, program sha256)` kept for this call, or `None`."""
        try:
            with open(self.path) as file:
                record = json.load(file)
            named = {as_text(strategy): strategy for strategy in strategies}
            return named[record["strategy"]], int(record["block_size"]), str(record["program"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def keep(self, strategy: Any, block_size: int, program: Any) -> None:
        """Write the plan (`program`: the traced program compiled for it), atomically."""
        record = {
            "strategy": as_text(strategy),
            "block_size": int(block_size),
            "program": program_digest(program),
        }
        folder = os.path.dirname(self.path)
        try:
            os.makedirs(folder, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(handle, "w") as file:
                json.dump(record, file)
            os.replace(temporary, self.path)
        except OSError:
            return


def stored_plans(tree: Any, budget: int, run: Any) -> StoredPlan | None:
    """The kept plan of planning `tree` (the transform, arguments and keyword arguments)
    at `budget` bytes for the call `run`, where plans are kept (`_folder`)."""
    folder = _folder()
    if folder is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts = [
        f"zodmem {_version('zodmem')}, jax {jax.__version__}, jaxlib {_version('jaxlib')}",
        f"{jax.process_count()} processes: "
        + ", ".join(f"{d.platform}:{d.device_kind}" for d in jax.devices()),
        f"budget {budget}, call {as_text(run)}",
        ADDRESS.sub("", str(treedef)),
    ]
    for leaf in leaves:
        if eqx.is_array(leaf):
            weak = bool(getattr(jax.typeof(leaf), "weak_type", False))
            parts.append(f"{leaf.dtype}{list(leaf.shape)} weak={weak} {placement(leaf)}")
        else:
            parts.append(as_text(leaf))
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return StoredPlan(folder, key)
