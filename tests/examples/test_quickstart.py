"""examples/quickstart.py: options that would break a stage are refused before any work."""

from __future__ import annotations

import pytest

from tests.examples._scripts import load_example, refused


@pytest.mark.parametrize(
    ("option", "minimum"),
    [
        ("--per-class", 1),
        ("--image-size", 4),  # 2x2 maps at the second BatchNorm: 4 values at batch 1
        ("--epochs", 1),
        ("--ddp-epochs", 1),
        ("--batch-size", 1),
    ],
)
@pytest.mark.parametrize("below", [1, 2])
def test_integer_options_below_their_minimum_are_refused(
    option: str,
    minimum: int,
    below: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    value = minimum - below
    err = refused(example, [option, str(value)], monkeypatch, capsys)
    assert f"argument {option}: must be >= {minimum}, got {value}" in err


@pytest.mark.parametrize("budget", ["0", "-1", "inf", "nan"])
def test_a_tune_budget_that_is_no_positive_time_is_refused(
    budget: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --tune-budget 0 passed the up-front checks and failed only at the tuning stage.
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    err = refused(example, ["--tune-budget", budget], monkeypatch, capsys)
    assert "argument --tune-budget: must be a finite number of seconds > 0" in err


def test_a_batch_size_of_one_is_refused_for_the_ddp_stage(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    err = refused(example, ["--batch-size", "1"], monkeypatch, capsys)
    assert "--batch-size 1 gives each rank of the DDP stage (half of it) a batch of 0" in err
    assert "--skip-ddp" in err


def test_too_few_images_for_one_batch_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    err = refused(example, ["--per-class", "2", "--batch-size", "32"], monkeypatch, capsys)
    assert "--per-class 2 makes 8 images, fewer than one batch of 32" in err
    assert "pass --per-class 8 or more" in err


def test_too_few_images_for_a_batch_on_each_ddp_rank_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: accepted, as if on 2 ranks; on 4 GPUs each rank gets 2 of the 8 images, fewer
    # than its batch of 4 (half of --batch-size), so the DDP stage trains on nothing.
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(example.torch.cuda, "device_count", lambda: 4)
    err = refused(example, ["--per-class", "2", "--batch-size", "8"], monkeypatch, capsys)
    assert "--per-class 2 makes 8 images, 2 for each of the DDP stage's 4 ranks" in err
    assert "fewer than its batch of 4 (half of --batch-size 8)" in err
    assert "pass --per-class 4 or more, a smaller --batch-size, or --skip-ddp" in err
