"""examples/quickstart.py: options that would break a stage are refused before any work."""

from __future__ import annotations

import pytest

from tests.examples._scripts import load_example, refused


@pytest.mark.parametrize(
    ("option", "minimum"),
    [
        ("--per-class", 1),
        ("--image-size", 2),
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
