"""trainperf.loader._step: step_fn timed alone, and the cores it leaves to workers."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

from tests.loader._fakes import Waits, collate_ids, quick
from trainperf.loader import CandidateResult, tune_loader
from trainperf.loader._step import (
    cores_for_workers,
    loader_ceiling,
    main_process_cores,
    time_step,
)


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_step_cpu_counts_the_step_but_not_the_tuners_synchronize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.device

    # A CUDA run faked on the CPU: batches stay put, and synchronize spins for 5 ms as a
    # waiting CUDA synchronisation may.
    monkeypatch.setattr(trainperf.device, "to_device", lambda batch, device, **kw: batch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: _burn(0.005))
    cuda = torch.device("cuda")
    idle = time_step(Waits(), 4, {}, lambda b: None, cuda, math.inf).cpu_per_sample
    busy = time_step(Waits(), 4, {}, lambda b: _burn(0.004), cuda, math.inf).cpu_per_sample
    assert idle < 0.0002  # s of CPU per sample: the 5 ms synchronize is not the step's
    assert busy >= 0.0008  # 4 ms of CPU for a batch of 4 is 1 ms per sample


@pytest.mark.slow
def test_step_fn_gets_the_batch_moved_to_the_tuning_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.device

    moved: list[tuple[Any, torch.device]] = []
    real_to_device = trainperf.device.to_device

    def to_device(batch: Any, device: Any, **kw: Any) -> Any:
        moved.append((batch, device))
        return real_to_device(batch, device, **kw)

    monkeypatch.setattr(trainperf.device, "to_device", to_device)
    got: list[Any] = []
    r = tune_loader(Waits(), 4, **quick(max_workers=0, step_fn=got.append, collate_fn=collate_ids))
    assert r.step_samples_per_s is not None
    assert got and len(got) == len(moved) <= 6
    assert all(device == torch.device("cpu") for _, device in moved)
    for batch in got:
        assert batch["x"].device == torch.device("cpu") and batch["x"].shape == (4, 4)
        assert batch["ids"] == [int(v) for v in batch["x"][:, 0]]  # the collated batch itself


def test_step_fn_error_names_step_fn() -> None:
    def my_training_step(batch: Any) -> None:
        raise ZeroDivisionError("oops")

    with pytest.raises(
        RuntimeError, match=r"step_fn .*my_training_step raised on a batch .*moved to cpu.*oops"
    ) as info:
        tune_loader(Waits(), 4, **quick(max_workers=0, step_fn=my_training_step))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_batch_that_cannot_move_to_the_device_is_reported() -> None:
    class Stuck:
        def to(self, device: Any, **kw: Any) -> Any:
            raise TypeError("cannot move this")

    def collate_stuck(samples: list[Any]) -> Stuck:
        return Stuck()

    with pytest.raises(RuntimeError, match=r"moving a batch to cpu for step_fn failed.*cannot"):
        tune_loader(Waits(), 4, **quick(max_workers=0, step_fn=len, collate_fn=collate_stuck))


def test_main_process_cores_and_cores_for_workers() -> None:
    assert main_process_cores(8) == 1.0
    assert main_process_cores(8, 0.001, 123.0) == 0.12  # 1 ms of CPU per sample, 123/s
    assert main_process_cores(8, 0.0, 1e6) == 0.0
    assert main_process_cores(2, 0.01, 1000.0) == 2.0  # never more than every core
    assert [cores_for_workers(4, m) for m in (0.0, 0.4, 0.6, 1.0, 3.7, 4.0)] == [4, 4, 3, 3, 1, 1]


def test_loader_ceiling_scales_the_baseline_to_every_core() -> None:
    def zero(rate: float | None, main_cpu: float | None) -> CandidateResult:
        return CandidateResult(0, None, False, "ok", samples_per_s=rate, main_cpu=main_cpu)

    assert loader_ceiling(zero(100.0, 1.0), 4) == 400.0
    assert loader_ceiling(zero(100.0, 0.25), 4) == 1600.0  # loading waits 3/4 of the time
    assert loader_ceiling(zero(100.0, None), 4) == 400.0  # unknown: a whole core
    assert loader_ceiling(zero(100.0, 0.001), 1) == pytest.approx(10_000.0)  # at most 100x
    assert loader_ceiling(zero(None, 1.0), 4) == 0.0


def test_time_step_with_no_time_left_uses_the_warm_up_call() -> None:
    # The budget is kept: no call starts after the deadline (issue 20.11). The warm-up
    # call's figures stand in, marked partial.
    calls: list[int] = []
    t = time_step(Waits(), 4, {}, lambda b: calls.append(1), torch.device("cpu"), -math.inf)
    assert len(calls) == 1
    assert t.partial and t.calls == 0
    assert t.samples_per_s > 0 and t.cpu_per_sample >= 0 and t.longest_s > 0


def test_time_step_starts_no_call_the_last_one_says_ends_after_the_deadline() -> None:
    # 0.15 s a call, 0.25 s left: after the warm-up call (ends at about 0.15 s) a second
    # would end at 0.3 s, past the deadline, so it is not started (issue 20.11).
    starts: list[float] = []

    def step(batch: Any) -> None:
        starts.append(time.perf_counter())
        time.sleep(0.15)

    deadline = time.perf_counter() + 0.25
    t = time_step(Waits(), 4, {}, step, torch.device("cpu"), deadline)
    assert len(starts) == 1 and t.partial
    assert t.longest_s >= 0.15
    assert t.samples_per_s == pytest.approx(4 / 0.15, rel=0.5)
