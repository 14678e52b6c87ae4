"""trainperf.watch: verdicts on synthetic loops, the analysis on faked timelines, no leaks."""

from __future__ import annotations

import importlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainperf._utils import imports as _imports
from trainperf.errors import DeviceError
from trainperf.monitor import Sample, StepRecord, Watch, WatchReport, analyse, watch


def sleepy_loader(n: int, seconds: float, batch: int = 16) -> Iterator[torch.Tensor]:
    for _ in range(n):
        time.sleep(seconds)
        yield torch.zeros(batch, 4)


def burn(seconds: float) -> None:
    # Busy-waits on the wall clock, so a step lasts `seconds` even on a contended CPU.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trainperf-watch-sampler"]


# --------------------------------------------------------------------------- synthetic loops


def test_a_loader_that_sleeps_is_input_bound() -> None:
    with watch(device="cpu") as w:
        for _ in w.iter(sleepy_loader(30, 0.015)):
            burn(0.002)
            w.step()
    report = w.report()
    assert report.verdict.kind == "input-bound", report
    assert report.wait_fraction > 0.5
    assert "autotune_loader" in report.verdict.fix
    assert report.steps == 30 and report.warmup_steps == 2
    assert report.samples_per_s is not None and report.samples_per_s > 0


def test_a_step_that_burns_cpu_is_compute_bound() -> None:
    batches = [torch.zeros(8, 4)] * 30  # ready at once: no wait
    with watch(device="cpu") as w:
        for _ in w.iter(batches):
            burn(0.01)
            w.step()
    report = w.report()
    assert report.verdict.kind == "compute-bound", report
    assert report.wait_fraction < 0.1
    assert "MixedPrecision" in report.verdict.fix
    assert "on the CPU" in report.verdict.summary


def test_a_stall_every_tenth_step_is_found_with_its_period() -> None:
    with watch(device="cpu") as w:
        for i, _ in enumerate(w.iter([torch.zeros(4)] * 50)):
            time.sleep(0.08 if i % 10 == 9 else 0.005)
            w.step()
    report = w.report()
    assert report.verdict.kind == "periodic-stalls", report
    assert report.stall_period == 10
    assert report.stall_steps == (9, 19, 29, 39, 49)
    assert "save_checkpoint" in report.verdict.fix
    assert "every 10 steps" in report.verdict.summary


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


def test_watch_does_not_initialise_cuda() -> None:
    was = torch.cuda.is_initialized()
    with watch() as w:
        for _ in w.iter([torch.zeros(2)] * 6):
            w.step()
    assert torch.cuda.is_initialized() == was
    if not was:
        assert w.report().device == "auto"


def test_samples_are_counted_from_batches_or_given() -> None:
    batches = [{"x": torch.zeros(5, 2), "y": torch.zeros(5)}, (torch.zeros(3), 1), "opaque"]
    with watch(device="cpu") as w:
        for _ in w.iter(batches):
            w.step()
        w.step(samples=7)
        with pytest.raises(ValueError, match="samples must be an int >= 0"):
            w.step(samples=-1)
    counts = [s.samples for s in w.report().timeline]
    assert counts == [5, 3, None, 7]


def test_the_report_prints_serialises_and_can_be_taken_inside_the_loop() -> None:
    with watch(device="cpu", warmup_steps=0) as w:
        for i, _ in enumerate(w.iter(sleepy_loader(8, 0.002))):
            w.step()
            if i == 5:
                partial = w.report()
    assert partial.steps == 6
    report = w.report()
    text = str(report)
    assert text.startswith(f"trainperf.watch: {report.verdict.kind}") and "fix:" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert "timeline" not in data and data["verdict"]["kind"] == report.verdict.kind
    full = json.loads(json.dumps(report.to_dict(timeline=True)))
    assert len(full["timeline"]) == 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"interval": 0}, "interval must be > 0"),
        ({"warmup_steps": -1}, "warmup_steps must be an int >= 0"),
        ({"device": "tpu"}, "invalid device 'tpu': expected 'cpu', 'cuda'"),
        ({"device": "meta"}, "device 'meta' is not supported here: expected 'cpu', 'cuda'"),
        ({"max_records": 0}, "max_records must be an int >= 1"),
        ({"max_records": 2.5}, "max_records must be an int >= 1"),
    ],
)
def test_watch_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        watch(**kwargs)  # type: ignore[arg-type]


def test_watch_checks_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match=r"device must be a str, int or torch\.device, got 1\.5"):
        watch(device=1.5)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"device 'cuda' needs CUDA.*use device='cpu' instead"):
        watch(device="cuda")


def test_a_long_run_keeps_only_the_most_recent_steps() -> None:
    with watch(device="cpu", warmup_steps=2, max_records=4) as w:
        for i in range(11):
            w.step(samples=i)
            assert len(w._ends) < 8  # never more than 2 x max_records held
        inside = w.report()
    assert inside.steps == 11 and inside.dropped_steps == 7
    assert [s.index for s in inside.timeline] == [7, 8, 9, 10]
    assert [s.samples for s in inside.timeline] == [7, 8, 9, 10]
    # The first kept step starts where the last dropped one ended, not at 0.
    assert inside.timeline[0].start > 0
    assert inside.timeline[0].start + inside.timeline[0].duration == pytest.approx(
        inside.timeline[1].start
    )
    assert inside.warmup_steps == 2 and "figures over the last 4" in str(inside)
    assert inside.to_dict()["dropped_steps"] == 7


def test_the_sampler_keeps_only_the_most_recent_samples() -> None:
    with watch(device="cpu", interval=0.002, max_records=3) as w:
        deadline = time.perf_counter() + 5
        while w.report().dropped_samples == 0 and time.perf_counter() < deadline:
            time.sleep(0.01)
    report = w.report()
    assert report.dropped_samples > 0 and len(report.samples) == 3
    times = [s.time for s in report.samples]
    assert times == sorted(times)


def test_using_a_watch_outside_its_with_block_is_an_error() -> None:
    w = Watch(device="cpu")
    with pytest.raises(RuntimeError, match="needs a watch that ran"):
        w.report()
    with pytest.raises(RuntimeError, match=r"w\.step\(\) needs a running watch"):
        w.step()
    with pytest.raises(RuntimeError, match=r"w\.iter\(\) needs a running watch"):
        w.iter([1])
    with w:
        w.step()
    with pytest.raises(RuntimeError, match="entered once"), w:
        pass
    with pytest.raises(RuntimeError, match=r"w\.step\(\) needs a running watch"):
        w.step()
    assert w.report().steps == 1


# --------------------------------------------------------------------------- analysis


def steps(n: int, wait: float, compute: float, **extra: object) -> list[StepRecord]:
    out = []
    for i in range(n):
        busy = extra.get("gpu_busy")
        out.append(StepRecord(i, i * (wait + compute), wait, compute, 32, busy))  # type: ignore[arg-type]
    return out


def samples(n: int, util: float | None, process_cpu: float, host_cpu: float) -> list[Sample]:
    return [Sample(i * 0.1, util, 2**30 if util is not None else None, process_cpu, host_cpu)
            for i in range(n)]  # fmt: skip


def test_analyse_gpu_unused_when_cuda_never_started() -> None:
    report = analyse(steps(20, 0.0, 0.01), gpu_present=True, cuda_used=False)
    assert report.verdict.kind == "gpu-unused"
    assert "to_device" in report.verdict.fix and "never initialised CUDA" in report.verdict.summary


def test_analyse_gpu_unused_at_zero_utilisation() -> None:
    report = analyse(
        steps(120, 0.0, 0.01), samples(15, 0.0, 100, 50), gpu_present=True, cuda_used=True
    )
    assert report.verdict.kind == "gpu-unused"
    assert report.gpu_utilization_mean == 0.0


def test_analyse_input_bound_names_the_saw_tooth() -> None:
    utils = [90.0, 5.0] * 10
    sawtooth = [Sample(i * 0.1, u, 2**30, 50, 20) for i, u in enumerate(utils)]
    report = analyse(steps(60, 0.015, 0.005), sawtooth, gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "input-bound"
    assert any("saw-tooth" in r for r in report.verdict.reasons)
    assert report.gpu_memory_max == 2**30


def test_analyse_host_bound_when_workers_saturate_the_cpus() -> None:
    hot = samples(15, 40.0, 780, 99)  # 7.8 of 8 CPUs busy
    report = analyse(steps(60, 0.015, 0.005), hot, gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "host-bound"
    assert "image_loader" in report.verdict.fix


def test_analyse_host_bound_when_the_gpu_starves_without_waiting_for_data() -> None:
    gpu_steps = steps(120, 0.0, 0.01, gpu_busy=0.002)  # GPU busy 20% of each step
    hot = samples(15, 20.0, 400, 95)
    report = analyse(gpu_steps, hot, gpu_present=True, cuda_used=True, cpus=4)
    assert report.verdict.kind == "host-bound"
    assert report.gpu_busy_fraction == pytest.approx(0.2)


def test_analyse_compute_bound_on_a_busy_gpu() -> None:
    busy = steps(60, 0.0005, 0.02, gpu_busy=0.0195)
    report = analyse(busy, samples(15, 98.0, 100, 10), gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "compute-bound"
    assert "on the GPU" in report.verdict.summary
    assert any("busy 95%" in r for r in report.verdict.reasons)


# The CUDA-event span of a step is host time when the stream is idle: ~100 % for a loop that
# launches nothing or launches slowly. These timelines span 100 % of every step.


def test_analyse_a_full_event_span_at_idle_utilisation_is_gpu_unused() -> None:
    spanned = steps(120, 0.0, 0.01, gpu_busy=0.01)
    idle = [Sample(i * 0.1, float(i % 3), 2**30, 100, 20) for i in range(15)]  # 0-2 %
    report = analyse(spanned, idle, gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "gpu-unused", report
    assert report.gpu_busy_fraction == pytest.approx(1.0)  # still reported, as the span
    assert "busy only 1%" in report.verdict.summary
    assert any("span 100%" in r and "upper bound" in r for r in report.verdict.reasons)


def test_analyse_a_full_event_span_with_saturated_cpus_is_host_bound() -> None:
    spanned = steps(120, 0.0, 0.01, gpu_busy=0.01)  # no data wait
    hot = samples(15, 30.0, 390, 98)  # 3.9 of 4 CPUs busy
    report = analyse(spanned, hot, gpu_present=True, cuda_used=True, cpus=4)
    assert report.verdict.kind == "host-bound", report
    assert "busy only 30%" in report.verdict.summary


def test_analyse_ignores_samples_taken_long_after_the_loop() -> None:
    loop = steps(120, 0.0, 0.01)  # 1.2 s of steps
    during = [Sample(0.05 * i, 95.0, 2**30, 100, 10) for i in range(26)]  # to 1.25 s
    idle_after = [Sample(1.3 + 0.05 * i, 0.0, 2**30, 1, 1) for i in range(60)]
    report = analyse(loop, during + idle_after, gpu_present=True, cuda_used=True, cpus=8)
    # Samples up to the loop's end, and the first after it (NVML's figure covers the period
    # before it), count; the idle tail of a report made later does not.
    assert report.gpu_utilization_mean == 95.0
    assert report.verdict.kind == "compute-bound", report


def test_analyse_follows_the_gpu_past_the_end_of_the_hosts_loop() -> None:
    # The host queued 20 steps in 0.2 s; the GPU needed 1.5 s for them (the spans say so), and
    # NVML saw it busy all that time. The window runs to the GPU's end, long enough for NVML.
    queued = steps(20, 0.0, 0.01, gpu_busy=0.075)
    busy = [Sample(0.1 * i, 95.0, 2**30, 100, 10) for i in range(16)]  # 0 .. 1.5 s
    idle = [Sample(1.6 + 0.1 * i, 0.0, 2**30, 1, 1) for i in range(30)]
    report = analyse(queued, busy + idle, gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "compute-bound", report
    assert report.gpu_utilization_mean == pytest.approx(95.0, abs=6.0)
    assert any("busy 9" in r for r in report.verdict.reasons)


def test_analyse_does_not_trust_nvml_over_a_short_window() -> None:
    # 0.2 s of steps: NVML's figure (averaged over up to a second) mostly shows what came
    # before the loop, so a 0 % reading must not make it "gpu-unused".
    short = steps(20, 0.0, 0.01, gpu_busy=0.01)
    zero = [Sample(0.05 * i, 0.0, 2**30, 100, 10) for i in range(6)]
    report = analyse(short, zero, gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "compute-bound", report
    assert any("is not used" in r and "at least that long" in r for r in report.verdict.reasons)


def test_analyse_a_full_event_span_at_high_utilisation_is_compute_bound() -> None:
    spanned = steps(120, 0.0, 0.01, gpu_busy=0.01)
    report = analyse(spanned, samples(15, 95.0, 100, 10), gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "compute-bound", report
    assert any("busy 95%" in r for r in report.verdict.reasons)


def test_analyse_without_nvml_takes_the_event_span_as_a_bound() -> None:
    spanned = steps(120, 0.0, 0.01, gpu_busy=0.01)
    report = analyse(spanned, gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "compute-bound"
    assert any("busy at most 100%" in r for r in report.verdict.reasons)


def test_analyse_a_saw_tooth_with_a_modest_wait_is_input_bound() -> None:
    sawtooth = [Sample(i * 0.1, u, 2**30, 50, 20) for i, u in enumerate([90.0, 5.0] * 10)]
    modest = steps(60, 0.003, 0.017)  # 15 % of step time waiting: under 25 %
    report = analyse(modest, sawtooth, gpu_present=True, cuda_used=True, cpus=8)
    assert report.verdict.kind == "input-bound", report
    assert any("saw-tooth" in r for r in report.verdict.reasons)
    flat = samples(20, 47.5, 50, 20)  # the same mean without the swing
    assert analyse(modest, flat, gpu_present=True, cuda_used=True, cpus=8).verdict.kind == (
        "compute-bound"
    )
    little = steps(60, 0.001, 0.019)  # 5 %: the saw-tooth alone does not make it input-bound
    assert analyse(little, sawtooth, gpu_present=True, cuda_used=True, cpus=8).verdict.kind == (
        "compute-bound"
    )


def test_analyse_finds_a_stall_every_tenth_step_in_thirty() -> None:
    timeline = steps(30, 0.0, 0.01)
    for i in (9, 19, 29):
        timeline[i] = StepRecord(i, timeline[i].start, 0.0, 0.2, 32, None)
    report = analyse(timeline)  # 28 measured steps: period 10 is past a third of them
    assert report.verdict.kind == "periodic-stalls", report
    assert report.stall_period == 10 and report.stall_steps == (9, 19, 29)


def test_analyse_ignores_scattered_slow_steps() -> None:
    timeline = steps(60, 0.0, 0.01)
    for i in (5, 17, 18, 41):
        timeline[i] = StepRecord(i, timeline[i].start, 0.0, 0.2, 32, None)
    report = analyse(timeline)
    assert report.stall_period is None and report.verdict.kind == "compute-bound"
    assert set(report.stall_steps) == {5, 17, 18, 41}


def test_analyse_needs_enough_steps() -> None:
    report = analyse(steps(6, 0.0, 0.01), warmup_steps=2)
    assert report.verdict.kind == "inconclusive"
    assert "w.step()" in report.verdict.fix
    assert "inconclusive" in str(report)


def test_analyse_counts_dropped_steps_in_indices_and_warmup() -> None:
    steps = [StepRecord(100 + i, i * 0.02, 0.015, 0.005, 32, None) for i in range(20)]
    report = analyse(steps, warmup_steps=2, dropped_steps=100)
    assert report.steps == 120 and report.warmup_steps == 2
    assert report.wall_s == pytest.approx(20 * 0.02)  # the warm-up was among the dropped
    with pytest.raises(ValueError, match="dropped_steps and dropped_samples must be >= 0"):
        analyse(steps, dropped_steps=-1)


def test_analyse_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="cpus must be >= 1"):
        analyse([], cpus=0)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        analyse([], warmup_steps=-1)


# --------------------------------------------------------------------------- plot


def _report() -> WatchReport:
    return analyse(steps(20, 0.01, 0.01), samples(10, 50.0, 100, 30), cuda_used=True)


def test_plot_without_matplotlib_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = _imports.is_available
    monkeypatch.setattr(_imports, "is_available", lambda n: n != "matplotlib" and real(n))
    with pytest.raises(ModuleNotFoundError, match=r"pip install .trainperf\[plot\]."):
        _report().plot(tmp_path / "timeline.png")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = _report().plot(tmp_path / "timeline.png")
    assert out == tmp_path / "timeline.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- CUDA


@pytest.mark.requires_cuda
def test_a_gpu_loop_is_timed_with_cuda_events() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    # At least 1.5 s of GPU work, each step waited for (loss.item() in a real loop does the
    # same), so the host's loop lasts as long as the GPU's and NVML (averaged over up to a
    # second) samples the work itself.
    end = time.perf_counter() + 1.5
    with watch(interval=0.02) as w:
        for batch in w.iter(itertools.repeat(x)):
            for _ in range(4):
                batch = batch @ x
            torch.cuda.synchronize()
            w.step()
            if time.perf_counter() > end:
                break
    report = w.report()
    assert report.device == f"cuda:{torch.cuda.current_device()}"
    assert all(s.gpu_busy is not None and s.gpu_busy > 0 for s in report.timeline)
    assert report.gpu_busy_fraction is not None and report.gpu_busy_fraction > 0.5
    assert report.verdict.kind == "compute-bound", report


@pytest.mark.requires_cuda
def test_a_cpu_loop_on_a_gpu_machine_leaves_the_gpu_unused() -> None:
    torch.zeros(1, device="cuda")  # CUDA is up, but the loop never touches the GPU
    # NVML averages over up to a second: let earlier GPU work (other tests) age out of it.
    # (NVML counts the whole device, so another process using this GPU would fail this test.)
    torch.cuda.synchronize()
    time.sleep(1.1)
    with watch(interval=0.02) as w:
        for _ in w.iter([torch.zeros(8)] * 250):  # 250 x 5 ms: over NVML's second
            burn(0.005)
            w.step()
    report = w.report()
    # The idle stream's events span the host time of each step: the span alone says ~100 %.
    assert report.gpu_busy_fraction is not None and report.gpu_busy_fraction > 0.5
    # NVML's utilisation, sampled through the loop, is what shows the GPU idle.
    assert report.gpu_utilization_mean is not None, "NVML gave no utilisation samples"
    assert report.verdict.kind == "gpu-unused", report


def test_watch_is_only_the_function() -> None:
    import trainperf

    assert trainperf.watch is watch and callable(watch)
    with pytest.raises(ModuleNotFoundError, match=r"trainperf\.watch"):
        importlib.import_module("trainperf.watch")
