"""trainperf.loader._measure: steady-state windows (warm-up and prefetch burst excluded)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset, get_worker_info

from tests.loader._spies import record_closes
from trainperf.loader import WindowPolicy, measure
from trainperf.loader import _measure as measure_mod
from trainperf.loader._measure import batch_bytes, time_windows

BS = 8


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduled_batches(clock: FakeClock, arrivals: list[float]) -> Any:
    """next_batch() that advances the fake clock to each batch's arrival time."""
    it = iter(arrivals)

    def next_batch() -> int:
        clock.t = max(clock.t, next(it))
        return BS

    return next_batch


def test_warm_up_batches_are_excluded_from_the_rate() -> None:
    clock = FakeClock()
    # Two slow first batches (1 s each), then 0.01 s per batch: steady state is 800/s.
    arrivals = [1.0, 2.0] + [2.0 + 0.01 * i for i in range(1, 500)]
    timing = time_windows(scheduled_batches(clock, arrivals), skip=2, window_batches=4, clock=clock)
    assert timing.skipped == 2
    assert timing.samples_per_s == pytest.approx(800, rel=1e-6)
    assert timing.spread == pytest.approx(0, abs=1e-9)


def test_prefetch_burst_after_start_up_is_skipped_and_a_naive_window_overstates() -> None:
    workers, prefetch = 4, 2
    policy = WindowPolicy()
    # Start-up 1 s; meanwhile the pool filled its buffer, delivered at once; then the
    # steady state is one batch per 0.025 s (40 batches/s = 320 samples/s).
    buffered = workers * prefetch
    arrivals = [1.0] * (1 + buffered) + [1.0 + 0.025 * i for i in range(1, 2000)]
    skip = policy.skip_batches(workers, prefetch)
    window = policy.window_batches(workers, prefetch)
    assert skip == buffered + policy.extra_skip
    assert window == policy.buffer_multiple * buffered

    clock = FakeClock()
    next_batch = scheduled_batches(clock, arrivals)
    next_batch()  # the first batch, as measure() takes it for start-up
    timing = time_windows(next_batch, skip=skip, window_batches=window, clock=clock)
    assert timing.samples_per_s == pytest.approx(320, rel=0.01)
    assert timing.batches >= window * 2

    # The same data timed naively: two buffers' worth of batches from the first one.
    naive_rate = BS * 2 * buffered / (arrivals[2 * buffered] - arrivals[0])
    assert naive_rate > 1.5 * 320


def test_windows_repeat_until_they_agree_or_the_cap() -> None:
    clock = FakeClock()
    # Alternating fast and slow windows never agree within 5 %.
    t, arrivals = 0.0, []
    for i in range(2000):
        t += 0.01 if (i // 30) % 2 == 0 else 0.03
        arrivals.append(t)
    policy = WindowPolicy(min_window_s=0.0, max_windows=4)
    timing = time_windows(
        scheduled_batches(clock, arrivals), skip=0, window_batches=30, policy=policy, clock=clock
    )
    assert len(timing.rates) == 4
    assert timing.spread is not None and timing.spread > 0.5


def test_a_window_lasts_at_least_min_window_s() -> None:
    clock = FakeClock()
    arrivals = [0.001 * i for i in range(1, 5000)]
    policy = WindowPolicy(min_window_s=0.5, min_windows=2)
    timing = time_windows(
        scheduled_batches(clock, arrivals), skip=0, window_batches=4, policy=policy, clock=clock
    )
    assert timing.batches >= 2 * 499  # two windows of >= 0.5 s at 1 ms per batch


def test_deadline_discards_a_partial_window() -> None:
    clock = FakeClock()
    arrivals = [0.1 * i for i in range(1, 100)]
    timing = time_windows(
        scheduled_batches(clock, arrivals), skip=2, window_batches=50, clock=clock, deadline=1.0
    )
    assert timing.budget_hit
    assert timing.rates == ()
    assert timing.samples_per_s is None


def test_a_wait_cut_by_the_deadline_ends_the_timing_with_the_windows_so_far() -> None:
    clock = FakeClock()
    arrivals = iter([0.01 * i for i in range(1, 60)])

    def next_batch() -> int:
        t = next(arrivals, None)
        if t is None:  # the workers stall; the wait for the next batch reaches the deadline
            clock.t = 5.0
            raise measure_mod._DeadlineReached
        clock.t = t
        return BS

    policy = WindowPolicy(min_window_s=0.0, min_windows=10, max_windows=10)
    timing = time_windows(
        next_batch, skip=2, window_batches=10, policy=policy, clock=clock, deadline=5.0
    )
    assert timing.budget_hit
    assert len(timing.rates) == 5
    assert timing.samples_per_s == pytest.approx(800)


def test_batch_bytes_walks_nested_batches() -> None:
    import numpy as np

    batch = {"x": torch.zeros(2, 3), "meta": [np.zeros(4, dtype=np.int16), "name", 3]}
    assert batch_bytes(batch) == 2 * 3 * 4 + 4 * 2


class SlowStart(Dataset[torch.Tensor]):
    """Each worker's first sample takes 0.6 s (a slow start-up); afterwards 2 ms."""

    def __init__(self) -> None:
        self.started = False

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if not self.started:
            self.started = True
            time.sleep(0.6)
        time.sleep(0.002)
        return torch.full((4,), float(i))


def test_measure_with_workers_reports_start_up_separately() -> None:
    r = measure(
        SlowStart(),
        BS,
        {},
        num_workers=2,
        prefetch_factor=2,
        pin_memory=False,
        deadline=time.perf_counter() + 20,
    )
    assert r.status == "ok", r.reason
    assert r.startup_s is not None and r.startup_s >= 0.6
    # Every window covers at least four prefetch buffers, and short datasets are cycled.
    assert r.windows >= 2
    assert r.batches >= r.windows * WindowPolicy().window_batches(2, 2)
    assert r.batches > 64 // BS
    assert r.samples_per_s is not None and r.samples_per_s > 0
    assert r.worker_peak_rss is not None and r.worker_peak_rss > 0
    assert r.worker_uss is not None and r.worker_uss > 0
    assert r.worker_cpu is not None and r.worker_cpu >= 0
    assert r.batch_bytes == BS * 4 * 4


def test_measure_without_workers_raises_dataset_errors() -> None:
    class Broken(Dataset[int]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            raise KeyError(i)

    with pytest.raises(KeyError):
        measure(
            Broken(),
            2,
            {},
            num_workers=0,
            prefetch_factor=None,
            pin_memory=False,
            deadline=time.perf_counter() + 5,
        )


def test_measure_empty_loader_raises() -> None:
    with pytest.raises(ValueError, match="yields no batch"):
        measure(
            TensorDataset(torch.zeros(3, 2)),
            8,
            {"drop_last": True},
            num_workers=0,
            prefetch_factor=None,
            pin_memory=False,
            deadline=time.perf_counter() + 5,
        )


def test_measure_skips_when_the_deadline_has_passed() -> None:
    r = measure(
        TensorDataset(torch.zeros(8, 2)),
        2,
        {},
        num_workers=1,
        prefetch_factor=2,
        pin_memory=False,
        deadline=time.perf_counter() - 1,
    )
    assert (r.status, r.fault) == ("skipped", "budget")
    assert math.isfinite(r.elapsed_s)


class SlowInWorkers(Dataset[torch.Tensor]):
    """Each sample takes ``sample_s`` in a worker (forever when None); instant in the main
    process."""

    def __init__(self, sample_s: float | None) -> None:
        self.sample_s = sample_s

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            time.sleep(120 if self.sample_s is None else self.sample_s)
        return torch.zeros(4)


def measure_until(
    dataset: Any, deadline_s: float, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[bool]]:
    closes = record_closes(monkeypatch)
    r = measure(
        dataset,
        BS,
        {},
        num_workers=2,
        prefetch_factor=2,
        pin_memory=False,
        deadline=time.perf_counter() + deadline_s,
        hang_timeout_s=30.0,
    )
    return r, closes


@pytest.mark.timeout(60)
def test_deadline_cuts_the_hang_timeout_and_a_silent_pool_is_a_possible_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r, closes = measure_until(SlowInWorkers(None), 1.5, monkeypatch)
    assert (r.status, r.fault) == ("failed", "hang")
    assert "1.5 s left of the time budget" in (r.reason or "")
    assert "budget_s" in (r.reason or "") and "may hang" in (r.reason or "")
    assert r.elapsed_s <= 1.5 + 1.0, "the deadline is a hard limit (plus cleanup)"
    assert closes == [True], "workers that may hang are killed, not joined"


@pytest.mark.timeout(60)
def test_deadline_during_slow_batches_is_the_budget_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 0.4 s per batch per worker: the first batch arrives, the skipped ones do not all.
    r, closes = measure_until(SlowInWorkers(0.05), 1.5, monkeypatch)
    assert (r.status, r.fault) == ("failed", "budget")
    assert r.startup_s is not None
    assert r.elapsed_s <= 1.5 + 1.0
    # A graceful stop would wait for each worker's batch in hand, past the deadline.
    assert closes == [True]
