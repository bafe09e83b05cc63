"""Tracebacks that point at the caller's line.

A mistake made by the caller (a bad option, a loss that is not a scalar) should show
the caller's frame and zodmem's message, not a column of zodmem's internals. zodmem's
files are registered with JAX's traceback filtering, as Equinox registers its own,
and the public entry points (`__call__`, `__check_init__`) are API boundaries: an
error that leaves one has the frames of zodmem, JAX and Equinox below it removed
(set `JAX_TRACEBACK_FILTERING=off` to see them all).
"""

from __future__ import annotations

import os

from jax._src import traceback_util

__all__ = ["public"]

traceback_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))

public = traceback_util.api_boundary
