"""The background sampler (``monitor/_sampler.py``): its thread, its samples, its bound."""

from __future__ import annotations

import time

import pytest

from tests.monitor._fakes import sampler_threads, sleepy_loader
from trainperf.monitor import watch


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
    with watch(device="cpu", interval=0.002, max_records=3) as w:
        deadline = time.perf_counter() + 5
        while w.report().dropped_samples == 0 and time.perf_counter() < deadline:
            time.sleep(0.01)
    report = w.report()
    assert report.dropped_samples > 0 and len(report.samples) == 3
    times = [s.time for s in report.samples]
    assert times == sorted(times)
