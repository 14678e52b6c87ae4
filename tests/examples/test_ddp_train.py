"""examples/ddp_train.py: rank and epoch counts below one are refused before any launch."""

from __future__ import annotations

import pytest

import trainperf.ddp
from tests.examples._scripts import load_example, refused


@pytest.mark.parametrize("option", ["--nprocs", "--epochs", "--batch-size"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_counts_below_one_are_refused(
    option: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("ddp_train", monkeypatch)
    monkeypatch.setattr(trainperf.ddp, "launch", lambda *a, **k: pytest.fail("launched"))
    err = refused(example, [option, value], monkeypatch, capsys)
    assert f"argument {option}: must be >= 1, got {value}" in err


def test_a_negative_hang_timeout_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("ddp_train", monkeypatch)
    monkeypatch.setattr(trainperf.ddp, "launch", lambda *a, **k: pytest.fail("launched"))
    err = refused(example, ["--hang-timeout", "-5"], monkeypatch, capsys)
    assert "argument --hang-timeout: must be >= 0 (0: off), got -5.0" in err


@pytest.mark.parametrize(
    ("global_batch", "lr"), [(1, 0.01 / 64), (8, 0.01 / 8), (64, 0.01), (128, 0.01)]
)
def test_the_default_lr_is_scaled_down_below_a_global_batch_of_64(
    global_batch: int, lr: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At 0.01, SGD with momentum reached a NaN loss on this data at global batches <= 8.
    example = load_example("ddp_train", monkeypatch)
    assert example.default_lr(global_batch) == pytest.approx(lr)
