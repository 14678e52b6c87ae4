"""examples/checkpoint_across_devices.py: a step count that trains nothing is refused."""

from __future__ import annotations

import pytest

from tests.examples._scripts import load_example, refused


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_fewer_than_one_step_is_refused(
    steps: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("checkpoint_across_devices", monkeypatch)
    err = refused(example, ["--steps", steps], monkeypatch, capsys)
    assert f"argument --steps: must be >= 1, got {steps}" in err
