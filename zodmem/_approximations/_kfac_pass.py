"""KFAC's builds, compiled lean.

A KFAC or EKFAC build reduces its statistics over the data once per call, in a program
of many backward passes whose compile, not its run, sets the build's peak on a CPU. The
build's program (`lean_jit`) and its planned passes over the data (`StatisticsPass`)
are compiled with the platform's lean options (`Policy.lean_options`; a CPU's: XLA's
older fusion emitters, with the backend's optimisations kept). On the five models of
`benchmarks/models.py` this takes a fifth to a half off the build's peak above the
floor, its time within the noise.
"""

from __future__ import annotations

from typing import ClassVar

from .._transforms._microbatch import Microbatcher

__all__ = ["StatisticsPass"]


class StatisticsPass(Microbatcher):
    """`zm.Microbatcher` over KFAC's statistics, its planned call compiled lean; its
    messages are `zm.Microbatcher`'s."""

    compiled_lean: ClassVar[bool] = True

    @property
    def _owner(self) -> str:
        return "Microbatcher"
