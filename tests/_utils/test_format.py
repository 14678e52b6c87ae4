"""``format_bytes`` and ``plural``: sizes and counts in words."""

from __future__ import annotations

import pytest

from trainperf._utils.format import format_bytes, plural


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (None, "-"),
        (512, "512 B"),
        (2048, "2 KiB"),
        (300 * 2**20, "300 MiB"),
        (1536 * 2**20, "1.5 GiB"),
        (1023 * 2**30, "1023.0 GiB"),
        # Before: everything from 1 GiB up stayed in GiB ("4294967296.0 GiB" for 4 EiB).
        (2**40, "1.0 TiB"),
        (int(2.5 * 2**40), "2.5 TiB"),
        (3 * 2**50, "3.0 PiB"),
        (4 * 2**60, "4.0 EiB"),
        (2048 * 2**60, "2048.0 EiB"),  # past the largest unit, it stays the largest
    ],
)
def test_format_bytes_scales_to_the_largest_unit_that_fits(n: float | None, words: str) -> None:
    assert format_bytes(n) == words


def test_plural_is_singular_for_one_only() -> None:
    assert [plural(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert plural(1, "batch", "batches") == "1 batch"
    assert plural(3, "batch", "batches") == "3 batches"
