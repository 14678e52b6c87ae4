"""The background sampler (``monitor/_sampler.py``): its thread, its samples, its bound."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader

from tests.monitor._fakes import sampler_threads, sleepy_loader
from trainperf.monitor import StepRecord, analyse, watch
from trainperf.monitor._sampler import _Sampler


def test_the_sampler_thread_stops_on_exit_even_after_an_error() -> None:
    before = sampler_threads()
    with pytest.raises(KeyError), watch(device="cpu", interval=0.01) as w:
        assert len(sampler_threads()) == len(before) + 1
        w.step()
        raise KeyError("boom")
    assert sampler_threads() == before
    with watch(device="cpu", interval=0.01):
        pass
    assert sampler_threads() == before


def test_background_samples_cover_the_loop() -> None:
    with watch(device="cpu", interval=0.01) as w:
        for _ in w.iter(sleepy_loader(15, 0.02)):
            w.step()
    report = w.report()
    assert len(report.samples) >= 1
    assert all(s.gpu_utilization is None and s.process_cpu >= 0 for s in report.samples)
    assert report.process_cpu_mean is not None and report.host_cpu_mean is not None


def test_the_sampler_keeps_only_the_most_recent_samples() -> None:
    with watch(device="cpu", interval=0.01, max_records=3) as w:
        deadline = time.perf_counter() + 5
        while w.report().dropped_samples == 0 and time.perf_counter() < deadline:
            time.sleep(0.01)
    report = w.report()
    assert report.dropped_samples > 0 and len(report.samples) == 3
    times = [s.time for s in report.samples]
    assert times == sorted(times)


class _Busy(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample is 20 ms of CPU work in a worker."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return torch.zeros(2)


@pytest.mark.slow  # two workers start and compute for about a second
def test_the_workers_cpu_is_sampled_apart_from_the_loops() -> None:
    loader = DataLoader(_Busy(), batch_size=2, num_workers=2, timeout=60)
    with watch(device="cpu", interval=0.05) as w:
        for _ in w.iter(loader):
            w.step()
    report = w.report()
    assert report.samples and all(s.workers_cpu is not None for s in report.samples)
    assert all(s.process_cpu >= (s.workers_cpu or 0.0) for s in report.samples)
    # The workers are found within half a second of starting, and keep a core busy or
    # wait for one: most of the second they ran, their CPU shows.
    assert max(s.workers_cpu or 0.0 for s in report.samples) > 20.0
    assert report.setup.num_workers == 2


class _ReusedPid:
    """A cached ``psutil.Process`` whose PID now belongs to a younger process: psutil reads
    the newcomer's CPU times against the old ones and reports a negative percent."""

    def cpu_percent(self, interval: float | None = None) -> float:
        return -812.5


def test_a_worker_whose_pid_was_reused_counts_no_negative_cpu() -> None:
    # Before: the negative percent went into workers_cpu and process_cpu, and a live
    # w.report() raised analyse()'s "negative sample figure" ValueError on the user's loop.
    sampler = _Sampler(interval=1.0, t0=time.perf_counter(), gpu=False)
    sampler._children = {4242: _ReusedPid()}  # type: ignore[dict-item]
    sampler._me = _ReusedPid()  # type: ignore[assignment]
    sample = sampler._sample()
    assert (sample.workers_cpu, sample.process_cpu) == (0.0, 0.0)
    step = StepRecord(index=0, start=0.0, wait=0.0, compute=0.01, samples=1, gpu_busy=None)
    analyse([step], [sample], warmup_steps=0)  # no ValueError
