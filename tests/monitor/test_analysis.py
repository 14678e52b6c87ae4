"""analyse() (``monitor/_analysis.py``): verdicts on faked timelines and samples."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from tests.monitor._fakes import doubling_timeline, samples, steps
from trainperf.monitor import LoopSetup, Sample, StepRecord, analyse


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


def _every_eighth(slow_wait: bool) -> list[StepRecord]:
    """160 steps of 2 ms; every 8th takes 150 ms more, waiting for data or in the step."""
    out, t = [], 0.0
    for i in range(160):
        extra = 0.150 if i % 8 == 0 else 0.0
        wait, own = (0.0002 + extra, 0.002) if slow_wait else (0.0002, 0.002 + extra)
        out.append(StepRecord(i, t, wait, own, 8, None))
        t += wait + own
    return out


def test_batches_arriving_in_bursts_are_not_periodic_stalls() -> None:
    # 8 workers started together deliver their batches together: every 8th step waits.
    setup = LoopSetup(num_workers=8, prefetch_factor=2, batch_size=8)
    bursts = analyse(_every_eighth(slow_wait=True), cpus=2, setup=setup)
    assert bursts.verdict.kind == "input-bound", bursts
    assert bursts.stall_period is None
    assert all(f.kind != "periodic-stalls" for f in bursts.findings)
    # The same time spent in the step itself (a synchronous save) is a periodic stall.
    saves = analyse(_every_eighth(slow_wait=False), cpus=2, setup=setup)
    assert saves.stall_period == 8
    assert "periodic-stalls" in {saves.verdict.kind, *(f.kind for f in saves.findings)}


def test_a_stall_in_a_loop_that_waits_is_compared_as_a_whole_step() -> None:
    # 100 ms steps, 95 ms of them waiting; every 5th step spends 30 ms more in the step
    # itself: it takes 130 ms against the median 100 ms, not "35 ms instead of 100 ms"
    # (its own time against a whole step's).
    timeline, t = [], 0.0
    for i in range(100):
        own = 0.035 if i % 5 == 3 else 0.005
        timeline.append(StepRecord(i, t, 0.095, own, 8, None, 0.001, 0.0))
        t += 0.095 + own
    report = analyse(timeline, cpus=2)
    (stalls,) = [f for f in (report.verdict, *report.findings) if f.kind == "periodic-stalls"]
    assert stalls.summary.startswith("every 5 steps one step takes 130 ms instead of 100.0 ms")


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


@pytest.mark.parametrize("n", [0, 1, 2])
def test_too_few_steps_names_the_warmup_that_ran(n: int) -> None:
    # Before: "0 measured step(s) after 2 warm-up" when fewer than 2 steps ran at all.
    report = analyse(steps(n, 0.0, 0.01), warmup_steps=2)
    assert report.warmup_steps == n
    assert report.verdict.summary.startswith(f"0 measured step(s) after {n} warm-up;")


def test_analyse_counts_dropped_steps_in_indices_and_warmup() -> None:
    steps = [StepRecord(100 + i, i * 0.02, 0.015, 0.005, 32, None) for i in range(20)]
    report = analyse(steps, warmup_steps=2, dropped_steps=100)
    assert report.steps == 120 and report.warmup_steps == 2
    assert report.wall_s == pytest.approx(20 * 0.02)  # the warm-up was among the dropped
    with pytest.raises(ValueError, match="dropped_steps must be an int >= 0, got -1"):
        analyse(steps, dropped_steps=-1)


def test_analyse_takes_steps_of_no_time_with_gpu_spans() -> None:
    # A made-up or re-analysed timeline whose steps took no time: no share of step time
    # to give, not a ZeroDivisionError.
    report = analyse(steps(10, 0.0, 0.0, gpu_busy=0.0), gpu_present=True, cuda_used=True)
    assert report.wall_s == 0.0 and report.gpu_busy_fraction is None
    assert report.to_dict()["gpu_busy_fraction"] is None


def test_analyse_calls_steps_of_no_time_inconclusive() -> None:
    report = analyse(steps(10, 0.0, 0.0))
    assert report.verdict.kind == "inconclusive" and report.what_if().fixes == ()
    assert "no measurable time" in str(report)


def test_analyse_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="cpus must be an int >= 1, got 0"):
        analyse([], cpus=0)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0, got -1"):
        analyse([], warmup_steps=-1)
    with pytest.raises(ValueError, match="dropped_samples must be an int >= 0, got -3"):
        analyse([], dropped_samples=-3)
    with pytest.raises(ValueError, match=r"cpus must be an int >= 1, got 2\.0"):
        analyse([], cpus=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"wait": math.nan}, r"timeline\[3\] \(step 3\) has wait=nan"),
        ({"compute": math.inf}, r"timeline\[3\] \(step 3\) has compute=inf"),
        ({"wait": -0.01}, r"timeline\[3\] \(step 3\) has wait=-0\.01"),
        ({"start": math.nan}, r"has start=nan"),
        ({"gpu_busy": math.nan}, r"has gpu_busy=nan"),
        ({"cpu_delay": math.inf}, r"has cpu_delay=inf"),
        ({"samples": -32}, r"timeline\[3\] \(step 3\) has samples=-32; drop or repair"),
        # Before: a negative CUDA-event span passed, and its negative busy share made a
        # "gpu-unused" verdict.
        ({"gpu_busy": -0.01}, r"timeline\[3\] \(step 3\) has gpu_busy=-0\.01"),
        ({"wait_cpu": -0.001}, r"timeline\[3\] \(step 3\) has wait_cpu=-0\.001"),
        ({"cpu_delay": -0.002}, r"timeline\[3\] \(step 3\) has cpu_delay=-0\.002"),
        ({"samples": 10**400}, r"timeline\[3\] \(step 3\) has samples=1000"),
    ],
)
def test_analyse_refuses_step_times_that_are_no_times(bad: dict[str, Any], match: str) -> None:
    # A NaN step made a compute-bound verdict with a NaN median (and a to_dict() that
    # strict JSON refuses); a negative wait a negative share of time waiting.
    timeline = steps(10, 0.005, 0.01)
    timeline[3] = dataclasses.replace(timeline[3], **bad)
    with pytest.raises(ValueError, match=match):
        analyse(timeline)


@pytest.mark.parametrize(
    ("timeline", "match"),
    [
        # 30 steps of 1e307 s: each finite, 3e308 s in all (an infinite wall time).
        (
            [StepRecord(i, 0.0, 0.0, 1e307, 32, None) for i in range(30)],
            r"wait \+ compute add up past float range .*timeline\[0\] \(step 0\) has "
            r"wait=0\.0, compute=1e\+307",
        ),
        (
            [StepRecord(i, 0.0, 1e308, 1e308, 32, None) for i in range(10)],
            r"wait \+ compute add up past float range",
        ),
        (
            [StepRecord(i, i * 0.01, 0.0, 0.01, 32, None, wait_cpu=1e308) for i in range(10)],
            r"wait_cpu add up past float range .*timeline\[0\] \(step 0\) has wait_cpu=1e\+308\); "
            r"drop or repair that step",
        ),
        (
            [StepRecord(i, 0.0, 0.0, 0.01, 10**308, None) for i in range(10)],
            r"samples add up past float range",
        ),
        # 5e-324 s steps (no clock's): 8 measured steps in 4e-323 s is inf steps/s.
        (
            [StepRecord(i, 0.0, 0.0, 5e-324, 32, None) for i in range(10)],
            r"steps 2 to 9 took 4e-323 s in all, which makes inf steps/s",
        ),
        # Finite steps/s, but 1e300 samples a step in 8 ns is inf samples/s.
        (
            [StepRecord(i, 0.0, 0.0, 1e-9, 10**300, None) for i in range(10)],
            r"steps 2 to 9 took 8e-09 s in all, which makes inf samples/s",
        ),
    ],
    ids=["wall", "one-step", "wait_cpu", "samples", "steps-per-s", "samples-per-s"],
)
def test_analyse_refuses_figures_past_float_range(timeline: list[StepRecord], match: str) -> None:
    # Before: an inf wall time or rate that made to_dict() invalid strict JSON, or a bare
    # OverflowError from the means.
    with pytest.raises(ValueError, match=match):
        analyse(timeline)


def test_analyse_refuses_a_rate_past_float_range_since_a_change() -> None:
    # The steps since a lasting change in step time are what the predictions multiply.
    timeline = [StepRecord(i, 0.0, 0.0, 0.01 if i < 20 else 1e-320, 32, None) for i in range(40)]
    with pytest.raises(ValueError, match=r"steps 20 to 39 took .* s in all, which makes inf"):
        analyse(timeline)


def test_analyse_refuses_sample_figures_past_float_range() -> None:
    bad = [Sample(i * 0.01, None, None, 1e308, 10.0) for i in range(10)]
    with pytest.raises(ValueError, match=r"process_cpu add up past float range .*samples\[0\]"):
        analyse(steps(10, 0.0, 0.01), bad)


def test_analyse_refuses_samples_that_are_not_finite() -> None:
    bad = [*samples(4, None, 50.0, 20.0), Sample(0.5, None, None, math.nan, 20.0)]
    with pytest.raises(ValueError, match=r"samples\[4\] has process_cpu=nan"):
        analyse(steps(10, 0.0, 0.01), bad)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        # NumPy 2 writes np.int64(32), NumPy 1 writes 32.
        (
            {"samples": "int64"},
            r"timeline\[3\] \(step 3\) has samples=(np\.int64\()?32\)?; make it int\(samples\)",
        ),
        ({"samples": 32.0}, r"has samples=32\.0; make it int\(samples\)"),
        ({"samples": 32.5}, r"has samples=32\.5; drop or repair that step"),
        ({"samples": True}, r"has samples=True; drop or repair that step"),
        # Before: "drop or repair that step", where w.step(samples=...) hints int(samples).
        ({"samples": "tensor"}, r"has samples=tensor\(32\); make it int\(samples\)"),
        ({"wait": "float32"}, r"has wait=(np\.float32\()?0\.015\)?; make it float\(wait\)"),
    ],
    ids=["numpy-int", "float", "fraction", "bool", "tensor", "numpy-float"],
)
def test_analyse_refuses_step_figures_that_are_no_python_numbers(
    bad: dict[str, Any], match: str
) -> None:
    # Before: they passed the checks and reached report.timeline, whose to_dict() json.dumps
    # refused ("int64 is not JSON serializable"); 32.5 and True made a fractional samples/s.
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    made = {"int64": np.int64(32), "tensor": torch.tensor(32), "float32": np.float32(0.015)}
    timeline = steps(10, 0.015, 0.005)
    timeline[3] = dataclasses.replace(
        timeline[3], **{k: made.get(v, v) if isinstance(v, str) else v for k, v in bad.items()}
    )
    with pytest.raises(ValueError, match=r"analyse\(\) needs .*" + match):
        analyse(timeline)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"gpu_utilization": -5.0}, r"samples\[2\] has gpu_utilization=-5\.0; drop or repair"),
        ({"process_cpu": -100.0}, r"samples\[2\] has process_cpu=-100\.0"),
        ({"host_cpu": -1.0}, r"samples\[2\] has host_cpu=-1\.0"),
        ({"workers_cpu": -1.0}, r"samples\[2\] has workers_cpu=-1\.0"),
        ({"host_steal": -0.5}, r"samples\[2\] has host_steal=-0\.5"),
        ({"gpu_memory_used": -1}, r"samples\[2\] has gpu_memory_used=-1"),
        ({"gpu_memory_used": 1.5}, r"samples\[2\] has gpu_memory_used=1\.5; drop or repair"),
        ({"gpu_memory_used": 2.0**30}, r"has gpu_memory_used=1073741824\.0; make it int\("),
        ({"process_cpu": True}, r"samples\[2\] has process_cpu=True; drop or repair"),
        ({"gpu_memory_used": "int64"}, r"has gpu_memory_used=(np\.int64\()?7\)?; make it int"),
    ],
    ids=[
        "gpu-negative",
        "cpu-negative",
        "host-negative",
        "workers-negative",
        "steal-negative",
        "memory-negative",
        "memory-fraction",
        "memory-float",
        "cpu-bool",
        "memory-numpy",
    ],
)
def test_analyse_refuses_sample_figures_that_are_no_measurements(
    bad: dict[str, Any], match: str
) -> None:
    # Before: gpu_utilization=-5 made a "gpu-unused" verdict, process_cpu=-100 a negative
    # mean CPU, and a NumPy gpu_memory_used a to_dict() json.dumps refused.
    np = pytest.importorskip("numpy")
    quiet = [Sample(i * 0.1, 50.0, 2**30, 100.0, 20.0, 10.0, 0.0) for i in range(5)]
    quiet[2] = dataclasses.replace(
        quiet[2], **{k: np.int64(7) if v == "int64" else v for k, v in bad.items()}
    )
    with pytest.raises(ValueError, match=r"analyse\(\) needs .*" + match):
        analyse(steps(20, 0.0, 0.01), quiet, gpu_present=True, cuda_used=True)


def test_analyse_takes_samples_before_the_watch_began() -> None:
    # A sample's time, like a step's start, is a clock reading: negative is before the
    # origin, not a wrong figure.
    early = [Sample(i * 0.1 - 0.05, None, None, 50.0, 20.0) for i in range(5)]
    report = analyse(steps(20, 0.0, 0.01), early)
    assert report.process_cpu_mean == pytest.approx(50.0)


def test_a_report_of_real_figures_is_strict_json() -> None:
    report = analyse(steps(10, 0.005, 0.01), samples(5, None, 50.0, 20.0))
    json.dumps(report.to_dict(timeline=True), allow_nan=False)


def test_analyse_without_a_measured_wait_says_so() -> None:
    # 80 % of each step is a data wait that happened outside w.iter, so it is compute here.
    unmeasured = steps(60, 0.0, 0.02)
    report = analyse(unmeasured, wait_measured=False)
    assert report.wait_fraction is None
    assert report.verdict.kind == "compute-bound"
    assert "data arrives in time" not in report.verdict.summary
    text = str(report)
    assert "data wait not measured (wrap the loader: w.iter(loader))" in text
    assert "waiting for data" not in text.splitlines()[1]
    assert report.to_dict()["wait_fraction"] is None
    assert analyse(unmeasured).wait_fraction == 0.0  # measured: a real 0


def test_a_wait_unmeasured_for_a_prefetch_thread_names_it_in_the_report() -> None:
    # Before: the report's rate line said "wrap the loader" of a loop that had wrapped it,
    # in a prefetch thread.
    setup = LoopSetup(prefetch_thread="prefetch")
    report = analyse(steps(60, 0.0, 0.02), wait_measured=False, setup=setup)
    line = str(report).splitlines()[1]
    assert line.endswith("data wait not measured (w.iter() ran in prefetch thread 'prefetch')")
    assert "never was" not in report.verdict.reasons[0]
    assert report.to_dict()["setup"]["prefetch_thread"] == "prefetch"


def test_analyse_on_a_host_other_processes_keep_busy() -> None:
    busy_host = samples(15, None, 20, 99)  # this process: a fifth of one of 4 CPUs
    report = analyse(steps(60, 0.0, 0.02), busy_host, cpus=4)
    assert report.verdict.kind == "host-bound", report
    assert report.verdict.summary.startswith("other processes hold the host's CPUs")
    quiet = analyse(steps(60, 0.0, 0.02), samples(15, None, 20, 30), cpus=4)
    assert quiet.verdict.kind == "compute-bound"


def test_analyse_passes_the_precision_in_use_to_the_rules() -> None:
    why = "auto: the CPU has no native bf16 (emulated bf16 is slower) -> fp32"
    report = analyse(steps(60, 0.0, 0.02), precision=("fp32", why))
    assert report.verdict.kind == "compute-bound"
    assert why in report.verdict.fix and "autocast" not in report.verdict.fix


# --------------------------------------------------------------------------- the loop now


def test_a_lasting_change_makes_the_verdict_about_the_steps_since() -> None:
    timeline = doubling_timeline()
    quiet = [Sample(i * 0.1, None, None, 30.0, 20.0, 5.0) for i in range(30)]
    report = analyse(timeline, quiet, cpus=2, setup=LoopSetup(num_workers=2))
    # Over the whole run 24.5 % of step time waits, under the 25 % that is input-bound.
    assert report.wait_fraction == pytest.approx(0.245, abs=0.001)
    assert report.regime_start == 60
    assert report.verdict.kind == "input-bound", report
    assert report.verdict.reasons[0].startswith(
        "the step time rose lastingly at step 60, from a median of 5.2 ms to 8.0 ms (1.54x): "
        "these figures and predictions cover the 60 steps since"
    )
    assert "37% of step time is spent waiting" in report.verdict.reasons[1]
    # The prediction is for the loop now: 2 workers deliver every 8 ms (16 ms each); the
    # tuner's 4 (enough for the 5 ms step) would deliver every 4 ms, and the step keeps its
    # 0.1 ms of taking each batch: 8 ms -> 5.1 ms.
    assert report.verdict.fixes[0].predicted_speedup == pytest.approx(8.0 / 5.1)
    assert "the step time changed at step 60" in str(report)
    steady = analyse(timeline[60:], quiet, cpus=2, setup=LoopSetup(num_workers=2))
    assert steady.regime_start is None
    # what_if() multiplies the rate of the loop now (8 samples per 8.0 ms step), not the
    # whole run's (which averages in the faster first half).
    table = report.what_if()
    assert table.samples_per_s == pytest.approx(1000.0, rel=1e-3)
    assert report.samples_per_s is not None and report.samples_per_s > 1200
    assert "now 1,000.0 samples/s" in str(table)


def test_the_measured_cpu_figures_reach_the_predictions() -> None:
    # 16 ms waits of which 1.6 ms on a CPU, 4 ms steps: test_predict's sleepy loader.
    timeline = [StepRecord(i, i * 0.02, 0.016, 0.004, 8, None, 0.0016, 0.001) for i in range(40)]
    hot = [Sample(i * 0.1, None, None, 100.0, 99.0, 60.0) for i in range(8)]
    report = analyse(timeline, hot, cpus=2, setup=LoopSetup(num_workers=0, torch_threads=1))
    loader = report.verdict.fixes[0]
    assert loader.call == "trainperf.autotune_loader(dataset, batch_size, step_fn=train_step)"
    assert loader.predicted_speedup == pytest.approx(5.0)
    assert report.setup == LoopSetup(num_workers=0, torch_threads=1)
    assert report.to_dict()["setup"]["torch_threads"] == 1
    unmeasured = analyse(timeline, hot, cpus=2, wait_measured=False)
    assert unmeasured.verdict.kind != "input-bound"


def test_cpu_time_the_hypervisor_stole_is_counted_and_shown() -> None:
    # Waiting 75 % of the time, 4 of 8 CPUs used: input-bound with CPUs to spare, unless
    # the hypervisor stole half the time; then the CPUs this VM got were all in use.
    def samples_with(steal: float | None) -> list[Sample]:
        return [Sample(i * 0.1, None, None, 400.0, 70.0, 300.0, steal) for i in range(10)]

    timeline = [StepRecord(i, i * 0.02, 0.015, 0.005, 8, None, 0.01, 0.0) for i in range(40)]
    spare = analyse(timeline, samples_with(None), cpus=8)
    assert spare.verdict.kind == "input-bound" and spare.host_steal_mean is None
    stolen = analyse(timeline, samples_with(50.0), cpus=8)
    assert stolen.host_steal_mean == pytest.approx(50.0)
    assert stolen.verdict.kind == "host-bound", stolen
    assert any("hypervisor withheld 50% of the CPU time" in r for r in stolen.verdict.reasons)
    assert "the hypervisor withheld 50%" in str(stolen).splitlines()[2]
    assert stolen.to_dict()["host_steal_mean"] == pytest.approx(50.0)


def _stalls_over_every_period(durations: list[float], first: int) -> tuple[int | None, list[int]]:
    """The period search before it was bounded: every period that fits three stalls."""
    import statistics

    from trainperf.monitor._analysis import STALL_FACTOR

    median = statistics.median(durations)
    mad = statistics.median(abs(d - median) for d in durations)
    threshold = max(STALL_FACTOR * median, median + 6 * 1.4826 * mad)
    slow = [first + i for i, d in enumerate(durations) if d > threshold]
    last = first + len(durations) - 1
    if len(slow) >= 3:
        for period in range(2, (len(durations) - 1) // 2 + 1):
            phases: dict[int, int] = {}
            for i in slow:
                phases[i % period] = phases.get(i % period, 0) + 1
            phase, hits = max(phases.items(), key=lambda kv: (kv[1], -kv[0]))
            slots = len(range(first + (phase - first) % period, last + 1, period))
            if hits >= 3 and hits >= 0.75 * slots and hits >= 0.6 * len(slow):
                return period, [i for i in slow if i % period == phase]
    return None, slow


def test_the_bounded_period_search_finds_what_trying_every_period_finds() -> None:
    # The search used to try every period for every slow step: ~40 s for a report after
    # 100k steps. Bounding the periods to those that can explain 60 % of the slow steps
    # must not change any answer.
    import random

    from trainperf.monitor._analysis import _find_stalls

    rng = random.Random(0)
    periodic = 0
    for _ in range(400):
        n = rng.randrange(20, 300)
        period = rng.randrange(2, 40)
        phase, noise = rng.randrange(period), rng.choice([0.0, 0.02, 0.1, 0.3])
        durations = [
            0.1 if (i % period == phase and rng.random() > 0.1) or rng.random() < noise
            else 0.01 * (1 + 0.05 * rng.random())
            for i in range(n)
        ]  # fmt: skip
        found, slow, _ = _find_stalls(durations, 2)
        assert (found, slow) == _stalls_over_every_period(durations, 2)
        periodic += found is not None
    assert periodic > 50  # the cases include periodic stalls that are found


def test_analyse_takes_numpy_counts_and_reports_python_ints() -> None:
    # Before: the checks accepted NumPy integers and passed them on, so the report held
    # np.int64 figures that json.dumps refuses.
    np = pytest.importorskip("numpy")
    timeline = [StepRecord(100 + i, i * 0.02, 0.015, 0.005, 32, None) for i in range(20)]
    plain = analyse(timeline, cpus=4, warmup_steps=2, dropped_steps=100, dropped_samples=3)
    numpy = analyse(
        timeline,
        cpus=np.int64(4),
        warmup_steps=np.int64(2),
        dropped_steps=np.int64(100),
        dropped_samples=np.int64(3),
    )
    data = numpy.to_dict()
    assert json.loads(json.dumps(data)) == data == plain.to_dict()
    assert type(numpy.cpus) is int and type(numpy.warmup_steps) is int
