"""Memory budgets in the user's words: `"1.5GB"`, `"512MiB"`, `2**30`, `"auto"`.

`check_memory` validates a `max_memory` option when a transform is built (the value is
kept as written, so that it prints and saves as the user wrote it); `budget_bytes`
turns it into a number of bytes when the call is planned, reading the free memory of
the device for `"auto"`.
"""

from __future__ import annotations

import math
import operator
import re
from decimal import Decimal
from typing import Any

import jax

from ._checks import described

__all__ = [
    "AUTO_MARGIN",
    "budget_bytes",
    "check_memory",
    "check_size_or_memory",
    "format_bytes",
    "format_bytes_up",
    "free_memory",
]

# Units are case-insensitive; "B" alone is bytes. SI units count in powers of 1000,
# binary ones ("KiB", "MiB", ...) in powers of 1024.
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET = re.compile(
    r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[a-zA-Z]+)\s*$"
)

# "auto" leaves this share of the free memory to everything else the process and the
# runtime allocate (compilation, the allocator's own slack, other arrays made meanwhile).
AUTO_MARGIN = 0.2

_ALLOWED = (
    'an int (bytes), a string with a unit ("750MB", "1.5GB", "512MiB", "2GiB"; SI units '
    'count in 1000s, binary ones in 1024s), "auto" (the free memory of the device, less '
    f"{AUTO_MARGIN:.0%}), or None"
)


def _parse(value: Any) -> int | str | None:
    """The budget in bytes, `"auto"` or `None`; raises `ValueError`/`TypeError` with no
    owner (the caller adds it)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"got {value!r} of type bool")
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        match = _BUDGET.match(value)
        unit = match and _UNITS.get(match.group("unit").lower())
        if not unit:
            raise ValueError(f"got {value!r}, which is no number of bytes with a known unit")
        size = float(match.group("number")) * unit
        if not math.isfinite(size):
            raise ValueError(f"got {value!r}, which is not a finite number of bytes")
        if size < 1:
            raise ValueError(f"got {value!r}, which is less than one byte")
        # In decimal, not binary: "4.06kB" is 4060 bytes, not 4059.99... cut to 4059.
        return int(Decimal(match.group("number")) * unit)
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(f"got {described(value)}") from None
    if size < 1:
        raise ValueError(f"got {value!r}; a budget is a positive number of bytes")
    return size


def check_memory(value: Any, name: str = "max_memory", *, owner: str) -> None:
    """Refuse a budget that is not one of the forms `_ALLOWED` lists."""
    try:
        _parse(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{owner}: `{name}` must be {_ALLOWED}; {error}.") from None


def check_size_or_memory(
    size: Any, size_name: str, max_memory: Any, *, owner: str, meaning: str, blocks: str
) -> None:
    """A map's block size option (`size_name`, which means `meaning`) or a budget its
    `blocks` are planned to fit: exactly one of the two, the budget checked."""
    check_memory(max_memory, owner=owner)
    if (size is None) == (max_memory is None):
        raise ValueError(
            f"{owner}: give one of `{size_name}` ({meaning}) and `max_memory` (a budget the "
            f"{blocks} are planned to fit), got {size_name}={size!r} and "
            f"max_memory={max_memory!r}."
        )


def free_memory(device: Any = None) -> int:
    """The bytes free on `device` (the default device when `None`): what the allocator
    can still hand out on a GPU or TPU, `MemAvailable` of the machine on a CPU."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("zodmem cannot read the free memory of this machine for 'auto'.")


def budget_bytes(value: Any, device: Any = None) -> int | None:
    """`max_memory` as a number of bytes (`None` when no budget is set). `"auto"` is the
    free memory of `device` less `AUTO_MARGIN` of it."""
    parsed = _parse(value)
    if parsed == "auto":
        return int(free_memory(device) * (1 - AUTO_MARGIN))
    return parsed


def format_bytes(size: int | float) -> str:
    """`633 MB`, `1.50 GB`: bytes in SI units, three significant digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(size) >= scale:
            value = size / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(size)} B"


def format_bytes_up(size: int | float) -> str:
    """`size` as `format_bytes` writes it, rounded up, not to the nearest: a figure to
    pass back as a budget that is never below `size`."""
    size = math.ceil(size)
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            # Three significant digits, counted in whole bytes so that nothing rounds down.
            decimals = max(0, 3 - len(str(size // scale)))
            step = scale // 10**decimals
            steps = -(-size // step)
            return f"{Decimal(steps * step) / scale:.{decimals}f} {unit}"
    return f"{size} B"
