"""examples/diagnose_my_loop.py: options that would leave an empty epoch are refused."""

from __future__ import annotations

import pytest

from tests.examples._scripts import load_example, refused


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["--delay-ms", "-1"], "argument --delay-ms: must be a finite number of ms >= 0"),
        (["--delay-ms", "nan"], "argument --delay-ms: must be a finite number of ms >= 0"),
    ],
)
def test_bad_options_are_refused_before_training(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --steps 0 used to reach DataLoader and fail with RandomSampler's num_samples=0 traceback.
    example = load_example("diagnose_my_loop", monkeypatch)
    monkeypatch.setattr(example, "train", lambda *a: pytest.fail("trained"))
    assert message in refused(example, argv, monkeypatch, capsys)
