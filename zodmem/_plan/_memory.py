"""Memory budgets in the user's words: `"1.5GB"`, `"512MiB"`, `2**30`, `"auto"`.

`check_memory` validates a `max_memory` option when a transform is built (the value is
kept as written, so that it prints and saves as the user wrote it); `budget_bytes`
turns it into a number of bytes when the call is planned, reading the free memory of
the device for `"auto"` (on a CPU, the machine's `MemAvailable` or the container's
cgroup limit, whichever leaves less; `budget_of` says which). `resident_bytes` reads
this process's own memory, which the planner reports beside a plan.
"""

from __future__ import annotations

import math
import operator
import os
import re
from decimal import Decimal
from typing import Any, NamedTuple

import jax

from .._checks import check_int, described

__all__ = [
    "AUTO_MARGIN",
    "FreeMemory",
    "budget_bytes",
    "budget_of",
    "cgroup_free",
    "check_memory",
    "check_size_or_memory",
    "format_bytes",
    "format_bytes_up",
    "free_memory",
    "free_memory_of",
    "resident_bytes",
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


def check_size_or_memory(transform: Any, size_name: str, meaning: str, blocks: str) -> None:
    """A map's block size option (its field `size_name`, a positive int that means
    `meaning`) or its budget `max_memory`, which its `blocks` are planned to fit: exactly
    one of the two, each checked."""
    owner = transform._owner
    size, max_memory = getattr(transform, size_name), transform.max_memory
    check_int(size, size_name, owner=owner, minimum=1, optional=True)
    check_memory(max_memory, owner=owner)
    if (size is None) == (max_memory is None):
        raise ValueError(
            f"{owner}: give one of `{size_name}` ({meaning}) and `max_memory` (a budget the "
            f"{blocks} are planned to fit), got {size_name}={size!r} and "
            f"max_memory={max_memory!r}."
        )


# Where the machine's and the container's memory are read ("auto"); tests point them at
# files of their own.
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "no limit" as a huge number (a page-rounded 2**63 - 1).
_NO_LIMIT = 2**60


class FreeMemory(NamedTuple):
    """The bytes `"auto"` may plan against, and where the figure came from."""

    bytes: int
    source: str


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _stat(path: str, key: str) -> int:
    """A counter of a cgroup's `memory.stat` (0 where it cannot be read)."""
    try:
        with open(path) as file:
            for line in file:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(mount: str, path: str) -> list[str]:
    """The directories of the cgroup at `path` and of its ancestors under `mount`, the
    cgroup's own first. In a container that sees only its own cgroup at the mount's root
    the path does not exist there, and the root itself is the container's cgroup."""
    parts = [part for part in path.strip("/").split("/") if part]
    dirs = [os.path.join(mount, *parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [directory for directory in dirs if os.path.isdir(directory)] or [mount]


def cgroup_free() -> FreeMemory | None:
    """The memory this process's control group may still take: the least, over the group
    and its ancestors, of its limit less what it uses (page cache that can be reclaimed
    left out). cgroup v2 (`memory.max`) first, then v1 (`memory.limit_in_bytes`); `None`
    where no group sets a limit."""
    try:
        with open(PROC_CGROUP) as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    found: list[FreeMemory] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one unified hierarchy
            version, mount, limit_file, usage_file, cache = (
                "v2",
                CGROUP_ROOT,
                "memory.max",
                "memory.current",
                "inactive_file",
            )
        elif "memory" in controllers.split(","):  # v1: the memory controller's own mount
            version, mount, limit_file, usage_file, cache = (
                "v1",
                os.path.join(CGROUP_ROOT, "memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
        else:
            continue
        for directory in _cgroup_dirs(mount, path):
            limit = _read_int(os.path.join(directory, limit_file))
            if limit is None:
                continue
            used = _read_int(os.path.join(directory, usage_file)) or 0
            used -= min(used, _stat(os.path.join(directory, "memory.stat"), cache))
            found.append(
                FreeMemory(
                    max(0, limit - used),
                    f"cgroup {version} {os.path.join(directory, limit_file)}: limit "
                    f"{format_bytes(limit)}, {format_bytes(used)} in use",
                )
            )
    return min(found, key=lambda free: free.bytes) if found else None


def free_memory_of(device: Any = None) -> FreeMemory:
    """The bytes free for `device` (the default device when `None`) and where the figure
    came from: on a GPU or TPU what its allocator can still hand out; on a CPU
    `MemAvailable` of the machine, or the container's control group where its limit
    leaves less, as a job under a scheduler expects."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
            return FreeMemory(
                limit - used,
                f"{device.platform} allocator of {device}: limit {format_bytes(limit)}, "
                f"{format_bytes(used)} in use",
            )
    available = None
    try:
        with open(MEMINFO) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    group = cgroup_free()
    if available is None and group is None:
        raise RuntimeError("zodmem cannot read the free memory of this machine for 'auto'.")
    if available is None or (group is not None and group.bytes < available):
        return group
    return FreeMemory(available, f"MemAvailable of {MEMINFO}")


def free_memory(device: Any = None) -> int:
    """The bytes free for `device` (`free_memory_of` says where they came from)."""
    return free_memory_of(device).bytes


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux), or `None`. Read around compiles for
    `Plan.compile_bytes` only, never for a plan's choice."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def budget_bytes(value: Any, device: Any = None) -> int | None:
    """`max_memory` as a number of bytes (`None` when no budget is set). `"auto"` is the
    free memory of `device` less `AUTO_MARGIN` of it."""
    return budget_of(value, device)[0]


def budget_of(value: Any, device: Any = None) -> tuple[int | None, str | None]:
    """`max_memory` as a number of bytes and where that figure came from: `"given"` for
    a budget the user wrote, the source of the free memory for `"auto"`, `None` without
    a budget."""
    parsed = _parse(value)
    if parsed == "auto":
        free = free_memory_of(device)
        return int(free.bytes * (1 - AUTO_MARGIN)), (
            f"auto: {1 - AUTO_MARGIN:.0%} of {format_bytes(free.bytes)} free ({free.source})"
        )
    return parsed, None if parsed is None else "given"


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
