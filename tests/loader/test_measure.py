"""trainperf.loader._measure: one configuration measured with real workers, within its deadline."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, SubsetRandomSampler, TensorDataset, get_worker_info

from tests.loader._spies import record_closes
from trainperf.loader import WindowPolicy, measure

BS = 8


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


@pytest.mark.slow  # about 3 s: 0.6 s start-up, windows
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


@pytest.mark.parametrize(
    ("samples", "drop_last", "fix"),
    [
        (3, True, "or drop_last=False (it keeps the last, smaller batch), or a batch_size of "
         "at most 3"),
        (0, False, "give a dataset with at least one batch of samples"),
        (-3, True, "sampler of 3 samples): give a sampler with at least one batch of samples, "
         "or drop_last=False (it keeps the last, smaller batch), or a batch_size of at most 3"),
    ],
)  # fmt: skip
def test_measure_empty_loader_raises_with_the_fixes_that_apply(
    samples: int, drop_last: bool, fix: str
) -> None:
    # samples < 0: 100 samples, and a sampler that draws -samples of them.
    kwargs: dict[str, object] = {"drop_last": drop_last}
    if samples < 0:
        kwargs["sampler"] = SubsetRandomSampler(range(-samples))
    with pytest.raises(ValueError, match="yields no batch") as info:
        measure(
            TensorDataset(torch.zeros(100 if samples < 0 else samples, 2)),
            8,
            kwargs,
            num_workers=0,
            prefetch_factor=None,
            pin_memory=False,
            deadline=time.perf_counter() + 5,
        )
    assert str(info.value).endswith(fix), str(info.value)


class ShardedStream(torch.utils.data.IterableDataset[int]):
    """12 samples, split between the DataLoader's workers: each worker's shard is shorter."""

    def __len__(self) -> int:
        return 12

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(worker, 12, workers))


def test_measure_sharded_stream_with_drop_last_offers_drop_last_false() -> None:
    # 12 samples >= batch_size 8, but each of the 2 workers has 6: drop_last drops them all.
    with pytest.raises(ValueError, match="yields no batch") as info:
        measure(
            ShardedStream(),
            8,
            {"drop_last": True},
            num_workers=2,
            prefetch_factor=2,
            pin_memory=False,
            deadline=time.perf_counter() + 30,
        )
    assert "or drop_last=False (it keeps the last, smaller batch)" in str(info.value)
    assert "a batch_size of at most" not in str(info.value)


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
    """Each sample takes ``sample_s`` in a worker (forever when None), after the worker's
    first ``fast`` samples; instant in the main process."""

    def __init__(self, sample_s: float | None, fast: int = 0) -> None:
        self.sample_s = sample_s
        self.fast = fast  # each worker counts its own calls
        self.calls = 0

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            self.calls += 1
            if self.calls > self.fast:
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_deadline_during_slow_batches_is_the_budget_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 0.4 s per batch per worker after its first: the first batch arrives, but not the
    # 6 skipped and 16 timed ones (4.4 s). It comes at once and the deadline leaves over
    # 2 s for it, so a busy host's slow worker start (about 1 s on 2 loaded cores) is not
    # a pool cut off before its first batch, which reads as a possible hang.
    r, closes = measure_until(SlowInWorkers(0.05, fast=BS), 3.0, monkeypatch)
    assert (r.status, r.fault) == ("failed", "budget")
    assert r.startup_s is not None
    assert r.elapsed_s <= 3.0 + 1.0
    # A graceful stop would wait for each worker's batch in hand, past the deadline.
    assert closes == [True]


def test_cpu_demand_counts_the_time_the_hypervisor_stole(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a VM whose CPUs other tenants share, stolen time is in neither run nor wait time:
    half a core measured while half the host's time was stolen is a whole core demanded."""
    from trainperf.loader import _measure

    class Workers:
        busy = 0.0

        def busy_seconds(self) -> float:
            return self.busy

    class HalfStolen:
        def share(self) -> float:
            return 0.5

    clock = iter([100.0, 102.0])
    main = iter([10.0, 10.5])
    monkeypatch.setattr(_measure.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(_measure, "thread_busy_seconds", lambda: next(main))
    monkeypatch.setattr(_measure, "StealMeter", HalfStolen)
    workers = Workers()
    readings = _measure._Readings(workers, 2, None, 0.0)  # type: ignore[arg-type]
    readings.windows_start()
    workers.busy = 2.0  # two workers, half a core each over the 2 s
    readings.windows_end()
    assert readings.worker_cpu == pytest.approx(2.0)
    assert readings.main_cpu == pytest.approx(0.5)


def test_measure_takes_numpy_numbers_as_python_ones() -> None:
    # Before: np.int64(8) reached DataLoader, which refused it, and a NumPy num_workers or
    # prefetch_factor reached the result, whose to_dict() json.dumps then refused.
    r = measure(
        TensorDataset(torch.zeros(32, 2)),
        np.int64(8),
        {},
        num_workers=np.int64(1),
        prefetch_factor=np.int64(2),
        pin_memory=False,
        deadline=time.perf_counter() + 3.0,
        hang_timeout_s=np.float64(10.0),
    )
    assert r.status == "ok", r.reason
    assert (r.num_workers, r.prefetch_factor) == (1, 2)
    assert (type(r.num_workers), type(r.prefetch_factor)) == (int, int)
    json.dumps(r.to_dict())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"batch_size": np.float64(8)}, r"batch_size must be an int >= 1, got .*8\.0"),
        ({"num_workers": -1}, "num_workers must be an int >= 0, got -1"),
        ({"prefetch_factor": 0}, "prefetch_factor must be None or an int >= 1, got 0"),
        ({"hang_timeout_s": math.nan}, "hang_timeout_s must be a positive number of seconds"),
    ],
)
def test_measure_refuses_bad_numbers_before_starting(kwargs: dict[str, Any], match: str) -> None:
    args = {"batch_size": 8, "num_workers": 1, "prefetch_factor": 2, **kwargs}
    batch_size = args.pop("batch_size")
    with pytest.raises(ValueError, match=match):
        measure(
            TensorDataset(torch.zeros(32, 2)),
            batch_size,
            {},
            pin_memory=False,
            deadline=time.perf_counter() + 5,
            **args,
        )
