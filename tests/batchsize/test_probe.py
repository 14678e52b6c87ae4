"""One size run: the warm-up and window rules, and the probe with a real (tiny) step."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tests.batchsize._fakes import QUICK, Trainer, same_state, sample, state_of
from trainperf.batchsize._agree import Agreement
from trainperf.batchsize._memory import HostMemory, MemoryReader
from trainperf.batchsize._probe import Prober
from trainperf.batchsize._probe_rules import (
    is_out_of_memory,
    status_of,
    steps_per_window,
    warmed_up,
)
from trainperf.batchsize._state import SavedState


def test_out_of_memory_errors_are_recognised_and_others_are_not() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    # Before: Python's MemoryError (numpy building a batch) and "cannot allocate memory"
    # escaped the tuner instead of marking the size oom.
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("[enforce fail] Cannot allocate memory"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))  # only RuntimeError


@pytest.mark.parametrize(
    "text",
    [
        "CUDA driver error: out of memory",  # a driver API call (NVRTC, a CUDA graph)
        "HIP error: out of memory",  # ROCm's "CUDA error: out of memory"
        "NPU out of memory. Tried to allocate 2.00 GiB",
        "out of memory",
    ],
)
def test_a_runtime_error_that_says_out_of_memory_is_out_of_memory(text: str) -> None:
    # Before: these escaped the tuner as the step's own error instead of marking the size
    # oom, though the allocator's texts (CUDA, the CPU's) were caught.
    assert is_out_of_memory(RuntimeError(text))
    assert not is_out_of_memory(ValueError(text))  # only RuntimeError, as before


def test_a_real_cpu_allocation_failure_counts_as_out_of_memory() -> None:
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as e:
        assert is_out_of_memory(e)
    else:  # pragma: no cover - a host with four exbibytes
        pytest.skip("the allocation succeeded")


def test_warm_up_ends_when_two_steps_agree_and_at_the_cap() -> None:
    assert not warmed_up([0.5])
    assert not warmed_up([5.0, 0.1])  # the first step compiled: still settling
    assert warmed_up([5.0, 0.1, 0.12])
    assert not warmed_up([0.1, 0.2, 0.1, 0.2])
    assert warmed_up([0.1, 0.2] * 4)  # eight steps: the cap


def test_windows_hold_enough_steps_for_a_quarter_second() -> None:
    assert steps_per_window(0.001) == 250
    assert steps_per_window(0.25) == 1
    assert steps_per_window(3.0) == 1
    assert steps_per_window(0.0) == 100_000  # capped


def test_status_is_oom_first_then_the_headroom() -> None:
    assert status_of(True, 10, 100.0) == "oom"
    assert status_of(False, 101, 100.0) == "over-headroom"
    assert status_of(False, 100, 100.0) == "ok"
    assert status_of(False, None, 100.0) == "ok"  # not measured: only an OOM stops it


def prober(t: Trainer, memory: MemoryReader | None = None, **kw: object) -> Prober:
    state = SavedState.save([t.model, t.opt])
    kw.setdefault("usable", lambda: None)
    return Prober(
        t, sample, torch.device("cpu"), memory or MemoryReader(), state, Agreement(),
        deadline=kw.pop("deadline", math.inf), policy=QUICK, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_probe_warms_up_times_windows_and_puts_the_state_back() -> None:
    t = Trainer()
    before = state_of(t.model, t.opt)
    c = prober(t, per_rank=64)(16)
    assert c.status == "ok" and c.samples_per_s is not None and c.samples_per_s > 0
    assert c.warmup_steps >= 2 and c.windows >= 2 and c.steps >= c.windows
    assert c.accumulation_steps == 4
    assert len(t.sizes) == c.warmup_steps + c.steps and set(t.sizes) == {16}
    assert same_state(before, state_of(t.model, t.opt))


def test_an_out_of_memory_error_is_caught_and_the_size_marked() -> None:
    t = Trainer(oom_above=8)
    before = state_of(t.model, t.opt)
    c = prober(t)(16)
    assert c.status == "oom" and c.samples_per_s is None
    assert "simulated above 8" in (c.reason or "")
    assert same_state(before, state_of(t.model, t.opt))  # gradients and moments dropped
    assert prober(t)(8).status == "ok"  # and the next size runs normally


def test_another_error_propagates_after_the_state_is_restored() -> None:
    t = Trainer(error_at=16, error=KeyError("a bug in the step"))
    t(sample(4))  # moments exist
    before = state_of(t.model, t.opt)
    with pytest.raises(KeyError, match="a bug in the step"):
        prober(t)(16)
    assert same_state(before, state_of(t.model, t.opt))


def test_a_sample_of_the_wrong_size_is_refused_by_name() -> None:
    t = Trainer()
    p = prober(t)
    p.sample = lambda n: sample(n + 1)
    with pytest.raises(ValueError, match=r"sample\(8\) returned a batch of 9 samples"):
        p(8)


@pytest.mark.slow  # 64 MiB written at every step
def test_a_peak_past_the_usable_memory_is_over_headroom() -> None:
    big = 64 * 2**20

    def hungry(batch: object) -> None:
        x = torch.ones(big // 4)  # 64 MiB that lives through the step
        x.add_(1.0)

    t = Trainer()
    p = prober(t, memory=HostMemory(), usable=lambda: 16.0 * 2**20)
    p.step = hungry
    c = p(4)
    assert c.status == "over-headroom" and c.peak_memory is not None and c.peak_memory > 16 * 2**20
    assert "usable" in (c.reason or "")


def test_the_deadline_cuts_the_timing_after_one_window() -> None:
    t = Trainer()
    c = prober(t, deadline=time.perf_counter())(8)
    assert c.status == "ok" and c.windows == 1
    assert c.reason == "the budget cut the timing short"


def test_past_the_deadline_the_warm_up_stops_after_two_steps() -> None:
    t = Trainer()
    times = iter([1.0, 0.1, 1.0, 0.1, 1.0, 0.1, 1.0, 0.1])  # never two alike: 8 without a deadline

    def erratic(batch: object) -> None:
        time.sleep(next(times, 0.1) / 20)

    p = prober(t, deadline=time.perf_counter())
    p.step = erratic
    c = p(4)
    assert c.warmup_steps == 2 and c.windows == 1
