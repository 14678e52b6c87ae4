"""trainperf.batchsize._accumulation: the optimizer's share charged as accumulation runs it."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from trainperf.batchsize import BatchSizeCandidate, BatchSizeReport, tune_batch_size
from trainperf.batchsize._accumulation import (
    OptimizerClock,
    accumulated_seconds,
    accumulation_notes,
    known_optimizers,
)

pytestmark = pytest.mark.usefixtures("quick")

OPTIMIZER_S = 0.030


class SlowSGD(torch.optim.SGD):
    """SGD whose step costs 30 ms more (a large model's Adam); its step calls SGD's, which
    torch hooks too once any SGD exists: one step, timed once."""

    def step(self, closure: Any = None) -> Any:
        time.sleep(OPTIMIZER_S)
        return super().step(closure)


def test_the_optimizer_time_is_kept_once_per_per_rank_samples() -> None:
    # 10 ms forward+backward, 20 ms optimizer at 8 samples; 64 per update: 8 accumulate
    assert accumulated_seconds(0.030, 0.020, 8, 64) == pytest.approx(0.0125)
    assert accumulated_seconds(0.030, 0.020, 64, 64) == pytest.approx(0.030)
    assert accumulated_seconds(0.030, 0.0, 8, 64) == pytest.approx(0.030)  # nothing timed
    # k steps at once: the same arithmetic on the window's totals
    assert accumulated_seconds(10 * 0.030, 10 * 0.020, 8, 64) == pytest.approx(10 * 0.0125)


def test_the_optimizers_are_those_passed_and_those_their_schedulers_drive() -> None:
    m = nn.Linear(2, 2)
    a, b = (torch.optim.SGD(m.parameters(), lr=0.1) for _ in range(2))
    sched = torch.optim.lr_scheduler.StepLR(b, 1)
    assert known_optimizers([m, a, sched, b]) == [a, b]
    assert known_optimizers([m]) == []


def test_the_clock_times_each_step_once_and_removes_its_hooks() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = SlowSGD([w], lr=0.1)
    w.sum().backward()
    with OptimizerClock([opt], torch.device("cpu")) as clock:
        assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 1
        opt.step()
        opt.step()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert clock.steps == 2  # SlowSGD.step and SGD.step inside it: one step each
    assert clock.seconds() >= 2 * OPTIMIZER_S


def test_the_clock_removes_its_hooks_when_the_block_raises() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(KeyError, match="a bug"), OptimizerClock([opt], torch.device("cpu")):
        raise KeyError("a bug")
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_the_report_says_whether_the_optimizer_was_charged_as_accumulation_runs_it() -> None:
    accumulating = [BatchSizeCandidate(8, "ok", samples_per_s=10.0, accumulation_steps=8)]
    whole = [BatchSizeCandidate(64, "ok", samples_per_s=10.0, accumulation_steps=1)]
    (charged,) = accumulation_notes(64, True, accumulating)
    assert "once per 64 samples" in charged and "timed" in charged
    (caveat,) = accumulation_notes(64, False, accumulating)
    assert "no optimizer passed" in caveat and "look slower" in caveat
    assert accumulation_notes(None, False, accumulating) == ()  # no global_batch
    assert accumulation_notes(64, False, whole) == ()  # nothing accumulates


# ----------------------------------------------------------------- in tune_batch_size


def forward_backward(n: int) -> None:
    """Fastest per sample at 4: 2 ms at 4, 8 ms at 8, 32 ms at 16, 128 ms at 32."""
    time.sleep(0.002 * (n / 4) ** 2)


def slow_optimizer_tune(**kw: Any) -> tuple[BatchSizeReport, SlowSGD]:
    model = nn.Linear(4, 1)
    opt = SlowSGD(model.parameters(), lr=0.0)
    kw.setdefault("model", model)
    kw.setdefault("optimizer", opt)
    trained = kw["model"]

    def step(batch: torch.Tensor) -> None:
        forward_backward(len(batch))
        trained(batch[:, : trained.in_features]).sum().backward()
        opt.step()

    report = tune_batch_size(
        step, lambda n: torch.zeros(n, 4), device="cpu", min_size=4,
        budget_s=8.0, progress=False, cache=False, **kw,
    )  # fmt: skip
    return report, opt


def test_with_global_batch_a_small_size_with_accumulation_beats_a_slow_optimizer() -> None:
    # Per sample, with the optimizer once per 32 samples as training will run it:
    # 4: 0.5 + 0.94 ms, 8: 1.0 + 0.94, 16: 2.0 + 0.94, 32: 4.0 + 0.94. Charged one
    # optimizer step per micro-batch (the old measurement): 4: 8 ms, 8: 4.75, 16: 3.9.
    report, opt = slow_optimizer_tune(global_batch=32)
    assert (report.batch_size, report.accumulation_steps) == (4, 8), str(report)
    assert any("once per 32 samples" in n for n in report.notes)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


@pytest.mark.filterwarnings("ignore:tune_batch_size. step made gradients")  # never stepped
def test_without_an_optimizer_known_the_report_says_the_caveat() -> None:
    # The optimizer step runs steps neither passed nor found (it steps none of model's
    # parameters): each micro-batch is charged a whole optimizer step, as before.
    unrelated = nn.Linear(1, 1)
    report, _ = slow_optimizer_tune(global_batch=32, model=unrelated, optimizer=None, max_size=8)
    assert any("no optimizer passed" in n for n in report.notes)


def test_the_hooks_are_removed_when_the_step_raises_in_a_timed_window() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(batch: torch.Tensor) -> None:
        if opt._optimizer_step_pre_hooks:  # inside a timed window, the optimizer hooked
            raise KeyError("a bug in the step")
        opt.step()

    with pytest.raises(KeyError, match="a bug in the step"):
        tune_batch_size(
            step, lambda n: torch.zeros(n, 4), model=model, optimizer=opt, device="cpu",
            min_size=4, global_batch=32, budget_s=5.0, progress=False, cache=False,
        )  # fmt: skip
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
