"""Reading `max_memory`: the forms a budget takes, and the messages for the others."""

import jax.numpy as jnp
import numpy as np
import pytest

import zodmem as zm
from zodmem._plan._memory import budget_bytes, check_memory


@pytest.mark.parametrize(
    "value, expected",
    [("750MB", 750 * 10**6), ("1.5GB", 1_500_000_000), ("512MiB", 512 * 2**20), (1024, 1024)],
)
def test_budgets_in_bytes(value, expected):
    check_memory(value, owner="Owner")
    assert budget_bytes(value) == expected


@pytest.mark.parametrize("value", ["1e400GB", "1e300TB", "9e999B"])
def test_a_budget_too_large_for_a_float_is_not_finite(value):
    with pytest.raises(ValueError) as error:
        check_memory(value, owner="Owner")
    message = str(error.value)
    assert f"got {value!r}, which is not a finite number of bytes" in message
    assert "less than one byte" not in message


@pytest.mark.parametrize("value", ["0.5B", "0GB", "1e-12MB"])
def test_a_budget_under_one_byte(value):
    with pytest.raises(ValueError, match=f"got {value!r}, which is less than one byte"):
        check_memory(value, owner="Owner")


@pytest.mark.parametrize("value", ["nanGB", "infGB", "-1GB", "1.5", "12 parsecs"])
def test_a_budget_that_is_no_number_with_a_unit(value):
    with pytest.raises(ValueError, match=f"got {value!r}, which is no number of bytes with a"):
        check_memory(value, owner="Owner")


def test_a_budget_of_another_type_is_named_in_full():
    with pytest.raises(TypeError, match=r"got np\.float64\(1000\.0\) of type numpy\.float64\.$"):
        check_memory(np.float64(1e3), owner="Owner")
    assert budget_bytes(np.int64(2048)) == 2048


def test_decimal_budgets_are_read_exactly_and_written_up():
    """A figure a refusal writes reads back as at least the bytes it stands for: decimal
    fractions are not cut by binary rounding, and nothing is written rounded down."""
    from zodmem._plan._memory import format_bytes_up

    assert budget_bytes("4.06 kB") == 4060 and budget_bytes("19.3MB") == 19_300_000
    for size in (4060, 1_500_000_001, 999_999, 19_310_000, 123_456_789):
        assert budget_bytes(format_bytes_up(size)) >= size
    assert format_bytes_up(1_500_000_001) == "1.51 GB"


# --- "auto" under a container's limit ---------------------------------------------------


def fake_machine(tmp_path, monkeypatch, cgroup_lines, files, available=20 * 2**30):
    """A machine with `available` bytes in MemAvailable, this process in the cgroups
    that `cgroup_lines` name, and the cgroup files `files` (path under the mount: text)."""
    from zodmem._plan import _memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    proc = tmp_path / "cgroup"
    proc.write_text("\n".join(cgroup_lines) + "\n")
    root = tmp_path / "sys"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    monkeypatch.setattr(_memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(_memory, "PROC_CGROUP", str(proc))
    monkeypatch.setattr(_memory, "CGROUP_ROOT", str(root))


def test_auto_reads_a_cgroup_v2_limit_below_memavailable(tmp_path, monkeypatch):
    from zodmem._plan._memory import AUTO_MARGIN, budget_of, free_memory_of

    fake_machine(
        tmp_path,
        monkeypatch,
        ["0::/job/step"],
        {
            "job/memory.max": "max\n",
            "job/step/memory.max": "2000000000\n",
            "job/step/memory.current": "500000000\n",
            # Page cache that the kernel reclaims before it kills: not counted as used.
            "job/step/memory.stat": "anon 400000000\ninactive_file 100000000\n",
        },
    )
    free = free_memory_of()
    assert free.bytes == 2_000_000_000 - 400_000_000
    assert "cgroup v2" in free.source and "memory.max" in free.source
    budget, source = budget_of("auto")
    assert budget == int(1_600_000_000 * (1 - AUTO_MARGIN))
    assert "cgroup v2" in source
    plan = zm.BatchedHessian(jnp.sum, max_memory="auto").plan(jnp.ones(4))
    assert plan.budget_bytes == budget and plan.budget_source == source
    assert "cgroup v2" in repr(plan)


def test_auto_takes_the_least_limit_of_the_cgroup_and_its_parents(tmp_path, monkeypatch):
    from zodmem._plan._memory import free_memory_of

    fake_machine(
        tmp_path,
        monkeypatch,
        ["0::/job/step"],
        {
            "job/memory.max": "1000000000\n",
            "job/memory.current": "300000000\n",
            "job/step/memory.max": "max\n",
            "job/step/memory.current": "200000000\n",
        },
    )
    free = free_memory_of()
    assert free.bytes == 700_000_000 and "job/memory.max" in free.source


def test_auto_reads_a_cgroup_v1_limit(tmp_path, monkeypatch):
    from zodmem._plan._memory import free_memory_of

    fake_machine(
        tmp_path,
        monkeypatch,
        ["5:cpu,cpuacct:/grp", "4:memory:/grp", "0::/"],
        {
            "memory/grp/memory.limit_in_bytes": "3000000000\n",
            "memory/grp/memory.usage_in_bytes": "1000000000\n",
            "memory/grp/memory.stat": "cache 1\ntotal_inactive_file 250000000\n",
            # No limit is written as a page-rounded 2**63 - 1.
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    free = free_memory_of()
    assert free.bytes == 3_000_000_000 - 750_000_000 and "cgroup v1" in free.source


def test_a_container_that_sees_its_cgroup_at_the_root(tmp_path, monkeypatch):
    # Inside a container the cgroup's path names the host's hierarchy; the container's own
    # group is mounted at the root.
    from zodmem._plan._memory import free_memory_of

    fake_machine(
        tmp_path,
        monkeypatch,
        ["0::/kubepods/pod1234/container"],
        {"memory.max": "4000000000\n", "memory.current": "1000000000\n"},
    )
    assert free_memory_of().bytes == 3_000_000_000


def test_auto_keeps_memavailable_where_the_limit_leaves_more(tmp_path, monkeypatch):
    from zodmem._plan._memory import budget_of, free_memory_of

    fake_machine(
        tmp_path,
        monkeypatch,
        ["0::/job"],
        {"job/memory.max": "64000000000\n", "job/memory.current": "1000000000\n"},
        available=5 * 2**30,
    )
    free = free_memory_of()
    assert free.bytes == 5 * 2**30 and "MemAvailable" in free.source
    assert budget_of("1GB") == (10**9, "given") and budget_of(None) == (None, None)


def test_auto_without_any_limit_is_memavailable(tmp_path, monkeypatch):
    from zodmem._plan._memory import free_memory_of

    fake_machine(tmp_path, monkeypatch, ["0::/"], {"memory.max": "max\n"}, available=7 * 2**30)
    assert free_memory_of() == (7 * 2**30, "MemAvailable of " + str(tmp_path / "meminfo"))
