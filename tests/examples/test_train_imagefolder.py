"""examples/train_imagefolder.py: options the training cannot run with are refused up front."""

from __future__ import annotations

import pytest

from tests.examples._scripts import load_example, refused


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # BatchNorm refuses a training batch of one sample, after the folder was made.
        (["--batch-size", "1"], "argument --batch-size: must be >= 2, got 1"),
        (["--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
        (["--size", "0"], "argument --size: must be >= 1, got 0"),
        (["--images-per-class", "0"], "argument --images-per-class: must be >= 1, got 0"),
        (["--tune-budget", "0"], "argument --tune-budget: must be a finite number of seconds"),
        # Fewer generated images than one batch: the loader refused them, with a traceback.
        (["--images-per-class", "1"], "makes 3 images, fewer than one batch of --batch-size 16"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = load_example("train_imagefolder", monkeypatch)
    monkeypatch.setattr(example, "make_folder", lambda *a: pytest.fail("made a folder"))
    assert message in refused(example, argv, monkeypatch, capsys)
