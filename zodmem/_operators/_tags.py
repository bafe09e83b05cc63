"""What `lineax` asks of zodmem's explicit symmetric operators (`LowRankDiagonal`,
`BlockDiagonal`, `KroneckerFactored`), registered once for each by `register_symmetric`.

lineax reads an operator's structure through functions dispatched on its type
(`lx.is_symmetric`, `lx.diagonal`, ...); these operators are all real and symmetric, hold
their own cheap products (so linearising, materialising and conjugating return them as
they are) and compute their own diagonal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lineax as lx

__all__ = ["register_symmetric"]


def register_symmetric(
    cls: type,
    *,
    positive_semidefinite: bool,
    diagonal: Callable[[Any], bool] = lambda operator: False,
    tridiagonal: Callable[[Any], bool] | None = None,
) -> None:
    """Register `cls` with lineax as a real symmetric operator.

    - `positive_semidefinite`: whether every instance is;
    - `diagonal(operator)`: whether an instance is diagonal (and so also triangular);
    - `tridiagonal(operator)`: whether it is tridiagonal (by default, when diagonal).
    """
    tridiagonal = diagonal if tridiagonal is None else tridiagonal
    lx.is_symmetric.register(cls)(lambda operator: True)
    lx.is_positive_semidefinite.register(cls)(lambda operator: positive_semidefinite)
    lx.is_negative_semidefinite.register(cls)(lambda operator: False)
    lx.has_unit_diagonal.register(cls)(lambda operator: False)
    for structure in (lx.is_diagonal, lx.is_lower_triangular, lx.is_upper_triangular):
        structure.register(cls)(diagonal)
    lx.is_tridiagonal.register(cls)(tridiagonal)
    for itself in (lx.linearise, lx.materialise, lx.conj):
        itself.register(cls)(lambda operator: operator)
    lx.diagonal.register(cls)(lambda operator: operator.diagonal())
