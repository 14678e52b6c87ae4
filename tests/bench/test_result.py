"""trainperf.bench._result: BenchResult's report."""

from __future__ import annotations

import pytest

from trainperf.bench import BenchResult


def _result(iterations: int) -> BenchResult:
    return BenchResult(
        "resnet50", "fp32", "cpu", None, 1, 32, 1, 1, False, False, False, False, False,
        "2.5.0", (0.5,) * iterations, (2.0,) * iterations, 2.0, None, (),
    )  # fmt: skip


@pytest.mark.parametrize(("iterations", "words"), [(1, "1 iteration,"), (3, "3 iterations,")])
def test_the_summary_counts_iterations_in_words(iterations: int, words: str) -> None:
    # Before: "median of 1 iterations" for `trainperf bench model --iterations 1`.
    assert f"(median of {words} batch 1, 32px)" in _result(iterations).summary()
