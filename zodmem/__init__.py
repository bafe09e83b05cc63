"""zodmem: memory-bounded JAX transforms, written as Equinox modules.

The public names are imported when first used (`zm.BatchedHessian` imports the
derivatives, not the estimators or KFAC), so that `import zodmem` itself is light.
"""

import importlib as _importlib
import typing as _typing

from . import _traceback  # noqa: F401  (registers zodmem's files for traceback filtering)

# Each public name and the module that defines it.
_EXPORTS = {
    "AbstractOperator": "._operators._base",
    "AbstractTransform": "._transforms._base",
    "AccumulationType": "._transforms._microbatch",
    "Accumulator": "._transforms._microbatch",
    "ApproximationError": "._approximations._error",
    "BatchedGGN": "._transforms._ggn",
    "BatchedHessian": "._transforms._hessian",
    "BatchedJacobian": "._transforms._jacobian",
    "BlockDiagonal": "._operators._block_diagonal",
    "CheckpointedScan": "._transforms._scan",
    "ChunkedVmap": "._transforms._vmap",
    "EKFAC": "._approximations._kfac",
    "KFAC": "._approximations._kfac",
    "KroneckerFactored": "._operators._kronecker",
    "LowRankDiagonal": "._operators._low_rank_diagonal",
    "MemoryBudgetError": "._plan._plans",
    "Microbatcher": "._transforms._microbatch",
    "Plan": "._plan._plans",
    "SerialisationError": "._serialise",
    "SlicedScan": "._transforms._scan",
    "Static": "._static",
    "approximation_error": "._approximations._error",
    "covariance": "._estimators._covariance",
    "diagonal": "._estimators._diagonal",
    "eigsh": "._estimators._eigsh",
    "hessian_to_pytree": "._pytree",
    "influence": "._influence._influence",
    "influence_scorer": "._influence._influence",
    "jacobian_to_pytree": "._pytree",
    "load": "._serialise",
    "logdet": "._estimators._logdet",
    "low_rank": "._estimators._low_rank",
    "marginal_variances": "._estimators._solve",
    "save": "._serialise",
    "solve": "._estimators._solve",
    "spectral_density": "._estimators._spectral",
    "to_file": "._stream._api",
    "to_host": "._stream._api",
    "trace": "._estimators._diagonal",
    "trace_function": "._estimators._logdet",
}

if _typing.TYPE_CHECKING:  # for type checkers and readers: the same names, imported at once
    from . import losses as losses
    from ._approximations._error import (
        ApproximationError as ApproximationError,
        approximation_error as approximation_error,
    )
    from ._approximations._kfac import EKFAC as EKFAC, KFAC as KFAC
    from ._estimators._covariance import covariance as covariance
    from ._estimators._diagonal import diagonal as diagonal, trace as trace
    from ._estimators._eigsh import eigsh as eigsh
    from ._estimators._logdet import logdet as logdet, trace_function as trace_function
    from ._estimators._low_rank import low_rank as low_rank
    from ._estimators._solve import marginal_variances as marginal_variances, solve as solve
    from ._estimators._spectral import spectral_density as spectral_density
    from ._influence._influence import influence as influence, influence_scorer as influence_scorer
    from ._operators._base import AbstractOperator as AbstractOperator
    from ._operators._block_diagonal import BlockDiagonal as BlockDiagonal
    from ._operators._kronecker import KroneckerFactored as KroneckerFactored
    from ._operators._low_rank_diagonal import LowRankDiagonal as LowRankDiagonal
    from ._plan._plans import MemoryBudgetError as MemoryBudgetError, Plan as Plan
    from ._pytree import (
        hessian_to_pytree as hessian_to_pytree,
        jacobian_to_pytree as jacobian_to_pytree,
    )
    from ._serialise import SerialisationError as SerialisationError, load as load, save as save
    from ._static import Static as Static
    from ._stream._api import to_file as to_file, to_host as to_host
    from ._transforms._base import AbstractTransform as AbstractTransform
    from ._transforms._ggn import BatchedGGN as BatchedGGN
    from ._transforms._hessian import BatchedHessian as BatchedHessian
    from ._transforms._jacobian import BatchedJacobian as BatchedJacobian
    from ._transforms._microbatch import (
        AccumulationType as AccumulationType,
        Accumulator as Accumulator,
        Microbatcher as Microbatcher,
    )
    from ._transforms._scan import CheckpointedScan as CheckpointedScan, SlicedScan as SlicedScan
    from ._transforms._vmap import ChunkedVmap as ChunkedVmap

__all__ = [
    "AbstractOperator",
    "AbstractTransform",
    "BlockDiagonal",
    "AccumulationType",
    "Accumulator",
    "ApproximationError",
    "BatchedGGN",
    "BatchedHessian",
    "BatchedJacobian",
    "CheckpointedScan",
    "ChunkedVmap",
    "EKFAC",
    "KFAC",
    "KroneckerFactored",
    "LowRankDiagonal",
    "MemoryBudgetError",
    "Microbatcher",
    "Plan",
    "SerialisationError",
    "SlicedScan",
    "Static",
    "approximation_error",
    "covariance",
    "diagonal",
    "eigsh",
    "hessian_to_pytree",
    "influence",
    "influence_scorer",
    "jacobian_to_pytree",
    "load",
    "logdet",
    "low_rank",
    "marginal_variances",
    "save",
    "solve",
    "spectral_density",
    "to_file",
    "to_host",
    "trace",
    "trace_function",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> _typing.Any:
    if name == "losses":
        value: _typing.Any = _importlib.import_module(".losses", __name__)
    elif name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name], __name__), name)
    else:
        raise AttributeError(f"module 'zodmem' has no attribute {name!r}")
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "losses"})
