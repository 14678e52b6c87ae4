"""trainperf.bench._result: BenchResult's report."""

from __future__ import annotations

import pytest

from trainperf.bench import BenchResult


def _result(iterations: int) -> BenchResult:
    return BenchResult(
        model="resnet50",
        precision="fp32",
        device="cpu",
        gpu_name=None,
        batch_size=1,
        image_size=32,
        batches_per_iteration=1,
        warmup_batches=1,
        train=False,
        channels_last=False,
        tf32_matmul=False,
        tf32_cudnn=False,
        cudnn_benchmark=False,
        torch_version="2.5.0",
        iteration_seconds=(0.5,) * iterations,
        iteration_images_per_s=(2.0,) * iterations,
        images_per_s=2.0,
        comparison=None,
        notes=(),
    )


@pytest.mark.parametrize(("iterations", "words"), [(1, "1 iteration,"), (3, "3 iterations,")])
def test_the_summary_counts_iterations_in_words(iterations: int, words: str) -> None:
    # Before: "median of 1 iterations" for `trainperf bench model --iterations 1`.
    assert f"(median of {words} batch 1, 32px)" in _result(iterations).summary()
