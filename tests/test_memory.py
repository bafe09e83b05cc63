"""Reading `max_memory`: the forms a budget takes, and the messages for the others."""

import numpy as np
import pytest

from zodmem._memory import budget_bytes, check_memory


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
    from zodmem._memory import format_bytes_up

    assert budget_bytes("4.06 kB") == 4060 and budget_bytes("19.3MB") == 19_300_000
    for size in (4060, 1_500_000_001, 999_999, 19_310_000, 123_456_789):
        assert budget_bytes(format_bytes_up(size)) >= size
    assert format_bytes_up(1_500_000_001) == "1.51 GB"
