"""examples/quickstart.py: options that would break a stage are refused before any work."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

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


def test_too_few_images_for_one_batch_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    err = refused(example, ["--per-class", "2", "--batch-size", "32"], monkeypatch, capsys)
    assert "--per-class 2 makes 8 images, fewer than one batch of 32" in err
    assert "pass --per-class 8 or more" in err


def test_too_few_images_for_stage_5_do_not_blame_the_batch_size(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    err = refused(example, ["--per-class", "1", "--batch-size", "1"], monkeypatch, capsys)
    assert "--per-class 1 makes 4 images, fewer than the 8 that stage 5 checks" in err
    assert "pass --per-class 2 or more\n" in err  # no smaller --batch-size: it would not help


def test_too_few_images_for_a_batch_on_each_ddp_rank_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # On 16 GPUs each rank gets 0 of the 8 images, fewer than its batch of 1 (8 // 16, at
    # least 1), so the DDP stage would train on nothing.
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example, "stage_doctor", lambda: pytest.fail("ran before refusing"))
    with_ranks(example, 16, monkeypatch)
    err = refused(example, ["--per-class", "2", "--batch-size", "8"], monkeypatch, capsys)
    assert "--per-class 2 makes 8 images, 0 for each of the DDP stage's 16 ranks" in err
    assert "fewer than its batch of 1 (--batch-size 8 split over 16 ranks, at least 1 each)" in err
    # A smaller --batch-size cannot help: each rank's batch is at least 1 already.
    assert "pass --per-class 4 or more, or --skip-ddp" in err and "smaller" not in err


def with_ranks(example: ModuleType, ranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``ddp_ranks()`` count ``ranks`` GPUs, without any GPU."""
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(example.torch.cuda, "device_count", lambda: ranks)


def launched_batch(
    example: ModuleType, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> dict[str, int]:
    """The per-rank batch and rank count that the DDP stage hands ``launch_all`` for ``argv``."""
    launched: dict[str, int] = {}

    def fake_launch_all(
        fn: object, root: str, epochs: int, batch: int, *, nprocs: int
    ) -> list[float]:
        launched.update(batch=batch, nprocs=nprocs)
        return [0.0] * nprocs

    monkeypatch.setattr(example.trainperf.ddp, "launch_all", fake_launch_all)
    example.stage_ddp(Path("unused"), example.parse_args(argv))
    return launched


@pytest.mark.parametrize(("ranks", "per_rank"), [(2, 16), (3, 10), (4, 8), (8, 4), (64, 1)])
def test_the_ddp_stage_splits_batch_size_over_its_ranks(
    ranks: int, per_rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: every rank got --batch-size // 2, so 8 GPUs trained on a global batch of 128
    # for --batch-size 32 (and 64 GPUs were refused: 4 images each, fewer than 16).
    example = load_example("quickstart", monkeypatch)
    with_ranks(example, ranks, monkeypatch)
    argv = ["--per-class", "64", "--batch-size", "32"]
    assert launched_batch(example, argv, monkeypatch) == {"batch": per_rank, "nprocs": ranks}


def test_enough_images_for_the_split_batch_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: refused on 4 GPUs, as if each rank needed half of --batch-size 8 (4 > 8 // 4).
    example = load_example("quickstart", monkeypatch)
    with_ranks(example, 4, monkeypatch)
    argv = ["--per-class", "2", "--batch-size", "8"]
    assert launched_batch(example, argv, monkeypatch) == {"batch": 2, "nprocs": 4}


def test_a_batch_size_below_the_rank_count_gives_each_rank_a_batch_of_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: --batch-size 1 was refused (half of it is 0) although one sample a rank works.
    example = load_example("quickstart", monkeypatch)
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: False)
    argv = ["--per-class", "2", "--batch-size", "1"]
    assert launched_batch(example, argv, monkeypatch) == {"batch": 1, "nprocs": 2}
