"""trainperf.bench._model_run: the run-time rule and the limit's refusal, without a model."""

from __future__ import annotations

import pytest
import torch

from trainperf.bench._common import RunTimeLimitExceeded
from trainperf.bench._model_run import MIN_COMPARABLE_BATCH, RunTimeLimit, Settings, _run_time_fix


@pytest.mark.parametrize(
    ("batch_size", "train", "fixes"),
    [
        (256, False, "use a smaller batch_size (e.g. batch_size=32), a smaller image_size, "),
        (1, False, "use a smaller image_size, "),  # no batch smaller than 1
        (4, True, "use a smaller image_size, "),  # 1 would fit, but training needs 2
    ],
)
def test_the_batch_suggested_fits_the_limit_or_none_is(
    batch_size: int, train: bool, fixes: str
) -> None:
    settings = Settings(batch_size, 224, 100, 1, 2)
    estimate, fix = _run_time_fix(settings, 10.0, 300.0, train=train)
    assert estimate == 1020.0  # 2 warm-up batches and 100 timed, 10 s each
    assert fix is not None and fix.startswith(fixes)


@pytest.mark.parametrize("max_seconds", [1020.0, None])
def test_a_run_within_the_limit_or_without_one_has_no_fix(max_seconds: float | None) -> None:
    settings = Settings(256, 224, 100, 1, 2)
    assert _run_time_fix(settings, 10.0, max_seconds, train=False) == (1020.0, None)


def test_on_cuda_fewer_iterations_or_a_larger_limit_come_first_and_the_batch_is_floored() -> None:
    # On a GPU a batch's time is not in proportion to its images (a small batch under-feeds
    # it), so fewer iterations come first, and a smaller batch is never below
    # MIN_COMPARABLE_BATCH, where the result is not comparable.
    settings = Settings(256, 224, 100, 1, 2)
    limit = RunTimeLimit("resnet50 fp32", settings, torch.device("cuda", 0), 300.0, train=False)
    with pytest.raises(RunTimeLimitExceeded) as caught:
        limit.check(10.0, "the second warm-up batch")  # 1020 s
    assert str(caught.value).endswith(
        "more than max_seconds=300: use fewer iterations (e.g. iterations=22), a larger "
        f"max_seconds (e.g. max_seconds=1300), a smaller batch_size (e.g. "
        f"batch_size={MIN_COMPARABLE_BATCH}) or a smaller image_size"
    )
    # A batch already at the floor is not suggested smaller.
    at_floor = Settings(MIN_COMPARABLE_BATCH, 224, 100, 1, 2)
    _, fix = _run_time_fix(at_floor, 10.0, 300.0, train=False, cuda=True)
    assert fix == (
        "use fewer iterations (e.g. iterations=22), a larger max_seconds (e.g. "
        "max_seconds=1300) or a smaller image_size"
    )


def test_the_refusal_counts_one_iteration_in_words() -> None:
    settings = Settings(8, 64, 1, 1, 2)
    limit = RunTimeLimit("resnet50 fp32", settings, torch.device("cpu"), 1.0, train=False)
    with pytest.raises(RunTimeLimitExceeded, match=r"\(2 warm-up, 1 timed in 1 iteration\) "):
        limit.check(10.0, "the second warm-up batch")


def test_a_refusal_is_a_value_error_and_a_run_within_the_limit_is_not_refused() -> None:
    settings = Settings(8, 64, 2, 1, 2)
    limit = RunTimeLimit("resnet50 fp32", settings, torch.device("cpu"), 300.0, train=False)
    limit.check(1.0, "the second warm-up batch")  # 4 s
    with pytest.raises(ValueError, match=r"more than max_seconds=300: use "):
        limit.check(100.0, "the second warm-up batch")  # 400 s
    assert limit.passed_by(301.0) and not limit.passed_by(300.0)
