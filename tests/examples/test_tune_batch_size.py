"""examples/tune_batch_size.py: the training loop's gradient accumulation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainperf
from tests.examples._scripts import load_example, refused


@dataclass
class _FakeBatchSizeReport:
    """What the example reads from tune_batch_size's report, with fixed figures."""

    batch_size: int = 4
    accumulation_steps: int = 2
    effective_batch: int = 8

    def __str__(self) -> str:
        return f"chosen: batch_size={self.batch_size}"

    def input_pipeline(self, *_: Any) -> str:
        return "input pipeline: (fake)"


@dataclass
class _FakeLoaderReport:
    best_kwargs: dict[str, Any] = field(default_factory=lambda: {"num_workers": 0})


def _fake_tuners(monkeypatch: pytest.MonkeyPatch, report: _FakeBatchSizeReport) -> None:
    """tune_batch_size chooses ``report``; autotune_loader returns a plain shuffling loader."""
    monkeypatch.setattr(trainperf, "tune_batch_size", lambda *a, **k: report)

    def loader(data: Dataset[Any], batch_size: int, **_: Any) -> DataLoader[Any]:
        dl: DataLoader[Any] = DataLoader(data, batch_size, shuffle=True, drop_last=True)
        dl.tuning_report = _FakeLoaderReport()
        return dl

    monkeypatch.setattr(trainperf, "autotune_loader", loader)


def test_a_partial_accumulation_does_not_carry_into_the_next_epoch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("tune_batch_size", monkeypatch)
    _fake_tuners(monkeypatch, _FakeBatchSizeReport())
    optimizers: list[torch.optim.SGD] = []
    steps: list[int] = []

    class RecordingSGD(torch.optim.SGD):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            optimizers.append(self)
            self.register_step_pre_hook(lambda *_: steps.append(1))

    monkeypatch.setattr(torch.optim, "SGD", RecordingSGD)
    # 12 samples in batches of 4: 3 batches an epoch, 2 accumulated per update.
    argv = ["--device", "cpu", "--samples", "12", "--size", "8", "--epochs", "2"]
    assert example.main(argv) == 0
    assert "epoch 1: batch 4 x 2 accumulated = 8 per update" in capsys.readouterr().out
    (opt,) = optimizers
    assert len(steps) == 2  # one full accumulation an epoch
    leftover = [p.grad for g in opt.param_groups for p in g["params"]]
    assert all(g is None or not g.any() for g in leftover), "gradients left after the last epoch"


def test_an_epoch_too_short_for_one_update_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("tune_batch_size", monkeypatch)
    _fake_tuners(monkeypatch, _FakeBatchSizeReport(4, 4, 16))
    with pytest.raises(SystemExit, match="--samples 12 gives 3 batches of 4 an epoch, fewer than"):
        example.main(["--device", "cpu", "--samples", "12", "--size", "8"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # BatchNorm cannot train on one sample: tune_batch_size starts at min_size=2.
        (["--global-batch", "1"], "argument --global-batch: must be >= 2, got 1"),
        (["--max-size", "1"], "argument --max-size: must be >= 2, got 1"),
        (["--samples", "0"], "argument --samples: must be >= 2, got 0"),
        (["--size", "1"], "argument --size: must be >= 2, got 1"),
        (["--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
        (["--budget", "0"], "argument --budget: must be a finite number of seconds > 0"),
        (["--loader-budget", "inf"], "argument --loader-budget: must be a finite number"),
    ],
)
def test_bad_options_are_refused_before_tuning(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = load_example("tune_batch_size", monkeypatch)
    monkeypatch.setattr(trainperf, "tune_batch_size", lambda *a, **k: pytest.fail("tuned"))
    assert message in refused(example, argv, monkeypatch, capsys)


def test_tuning_starts_at_two_samples_for_batchnorm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("tune_batch_size", monkeypatch)
    _fake_tuners(monkeypatch, _FakeBatchSizeReport(2, 1, 2))
    calls: list[dict[str, Any]] = []
    fake = trainperf.tune_batch_size
    monkeypatch.setattr(
        trainperf, "tune_batch_size", lambda *a, **k: calls.append(k) or fake(*a, **k)
    )
    argv = ["--device", "cpu", "--samples", "4", "--size", "2", "--global-batch", "2"]
    assert example.main(argv) == 0
    assert calls[0]["min_size"] == 2
