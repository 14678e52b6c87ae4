"""The verdict rules (``monitor/_rules.py``), each on hand-made figures: firing, not, edges."""

from __future__ import annotations

import dataclasses

import pytest

from tests.monitor._fakes import cpu_loop, figures
from trainperf.monitor import LoopSetup, Verdict
from trainperf.monitor._predict_step import BATCH_CALL
from trainperf.monitor._rules import (
    compute_bound,
    cpu_share,
    cpus_held_by_others,
    cpus_saturated,
    cuda_never_initialised,
    gpu_figures,
    gpu_idle,
    gpu_share,
    host_bound,
    input_bound,
    nvml_share,
    periodic_stalls,
    rank,
    saw_tooth,
    too_few_steps,
    waits_for_data,
    weight,
)


def nvml(percent: float, n: int = 3) -> tuple[float, ...]:
    return (percent,) * n


SAWTOOTH = (90.0, 5.0) * 3  # mean 47.5 %, standard deviation 42.5 points
STALLS = {"stall_period": 10, "stall_steps": (9, 19, 29), "stall_median_s": 0.2}


# --------------------------------------------------------------------------- derived figures


def test_nvml_share_needs_three_samples_over_a_second() -> None:
    assert nvml_share(figures(utilisation=nvml(40.0))) == pytest.approx(0.4)
    assert nvml_share(figures(utilisation=nvml(40.0, n=2))) is None
    assert nvml_share(figures(utilisation=nvml(40.0), nvml_window_s=1.0)) == pytest.approx(0.4)
    assert nvml_share(figures(utilisation=nvml(40.0), nvml_window_s=0.99)) is None
    assert nvml_share(figures()) is None


def test_gpu_share_is_the_smaller_of_the_span_and_nvml() -> None:
    assert gpu_share(figures(gpu_span=1.0, utilisation=nvml(30.0))) == pytest.approx(0.3)
    assert gpu_share(figures(gpu_span=0.2, utilisation=nvml(90.0))) == pytest.approx(0.2)
    assert gpu_share(figures(gpu_span=0.6)) == pytest.approx(0.6)
    assert gpu_share(figures(utilisation=nvml(30.0), nvml_window_s=0.5)) is None  # untrusted
    assert gpu_share(figures()) is None


def test_gpu_figures_name_what_was_used_and_what_was_not() -> None:
    both = gpu_figures(figures(gpu_span=1.0, utilisation=nvml(30.0)))
    assert both == (
        "NVML utilisation averages 30%; the steps' CUDA events span 100% of step time "
        "(an upper bound)"
    )
    short = gpu_figures(figures(utilisation=nvml(30.0), nvml_window_s=0.25))
    assert short.startswith("NVML utilisation (3 samples over 0.25 s) is not used")
    assert gpu_figures(figures()) == ""


def test_cpu_share_counts_the_usable_cpus() -> None:
    assert cpu_share(figures(process_cpu=400.0, cpus=8)) == pytest.approx(0.5)
    assert cpu_share(figures()) is None


def test_cpu_time_the_hypervisor_steals_is_not_spare() -> None:
    # Half of 8 CPUs used while half the time was stolen: all of what was left is used.
    stolen = figures(process_cpu=400.0, cpus=8, host_cpu=95.0, host_steal=50.0, wait_fraction=0.4)
    assert cpu_share(stolen) == pytest.approx(1.0)
    assert cpus_saturated(stolen)
    assert input_bound(stolen) is None  # not "waiting with CPUs to spare"
    verdict = host_bound(stolen)
    assert verdict is not None and verdict.summary.startswith("waiting for data while the CPUs")
    assert any("hypervisor withheld 50% of the CPU time (steal" in r for r in verdict.reasons)
    # A little steal is named nowhere and changes the share only by its own size.
    light = dataclasses.replace(stolen, host_steal=2.0, host_cpu=60.0)
    assert cpu_share(light) == pytest.approx(0.5 / 0.98)
    spare = input_bound(light)
    assert spare is not None and not any("steal" in r for r in spare.reasons), spare


@pytest.mark.parametrize(
    ("process_cpu", "host_cpu", "saturated"),
    [
        (640.0, None, True),  # 80 % of 8 CPUs: the edge
        (639.0, 10.0, False),
        (320.0, 90.0, True),  # 40 % of them on a host 90 % busy: the other edge
        (320.0, 89.9, False),
        (319.0, 99.0, False),
        (None, 99.0, False),  # no samples
    ],
)
def test_cpus_saturated_at_the_edges(
    process_cpu: float | None, host_cpu: float | None, saturated: bool
) -> None:
    assert cpus_saturated(figures(process_cpu=process_cpu, host_cpu=host_cpu)) is saturated


@pytest.mark.parametrize(
    ("utilisation", "window_s", "found"),
    [
        (SAWTOOTH, 2.0, True),
        (SAWTOOTH[:4], 2.0, False),  # 4 samples: a saw-tooth needs 5
        (SAWTOOTH, 0.5, False),  # NVML not trusted over half a second
        ((60.0, 20.0) * 3, 2.0, True),  # a swing of exactly 20 points: the edge
        ((59.8, 20.2) * 3, 2.0, False),
        ((99.8, 20.0) * 3, 2.0, True),  # mean 59.9 %
        ((100.0, 20.0) * 3, 2.0, False),  # mean 60 %: a busy GPU, not a saw-tooth
    ],
)
def test_saw_tooth_at_the_edges(
    utilisation: tuple[float, ...], window_s: float, found: bool
) -> None:
    text = saw_tooth(figures(utilisation=utilisation, nvml_window_s=window_s))
    assert bool(text) is found
    if found:
        assert text.endswith("(saw-tooth)") and "swings between" in text


@pytest.mark.parametrize(
    ("wait", "utilisation", "waiting"),
    [
        (0.25, (), True),  # the edge without a saw-tooth
        (0.2499, (), False),
        (0.10, SAWTOOTH, True),  # the edge with one
        (0.0999, SAWTOOTH, False),
    ],
)
def test_waits_for_data_at_the_edges(
    wait: float, utilisation: tuple[float, ...], waiting: bool
) -> None:
    assert waits_for_data(figures(wait_fraction=wait, utilisation=utilisation)) is waiting


# --------------------------------------------------------------------------- decisive rules


def test_too_few_steps_below_five() -> None:
    verdict = too_few_steps(figures(measured_steps=4))
    assert verdict is not None and verdict.kind == "inconclusive"
    assert verdict.summary == "4 measured step(s) after 2 warm-up; a verdict needs at least 5"
    assert "w.step()" in verdict.fix and verdict.reasons == ()
    assert too_few_steps(figures(measured_steps=5)) is None


@pytest.mark.parametrize("wall", [0.0, float("nan")])
def test_too_few_steps_when_the_steps_took_no_measurable_time(wall: float) -> None:
    # A clock that did not advance (frozen by a test library) measured nothing to judge:
    # "compute-bound, 0% waiting" would be made up.
    verdict = too_few_steps(figures(wall_s=wall, wait_fraction=0.0))
    assert verdict is not None and verdict.kind == "inconclusive"
    assert verdict.summary.startswith("the 20 measured steps took no measurable time")
    assert verdict.basis == "not predicted: steps of no time say nothing"


def test_too_few_steps_when_most_steps_took_no_time_on_a_coarse_clock() -> None:
    # Before: a clock that ticks every 15 ms under 1 ms steps puts the run's time on every
    # 15th step, and the verdict was "periodic-stalls, costing 100% of the run" (or
    # compute-bound, 0% waiting): the median step of 0 measured nothing to judge.
    verdict = too_few_steps(figures(wall_s=0.15, median_step_s=0.0))
    assert verdict is not None and verdict.kind == "inconclusive"
    assert verdict.summary.startswith("most of the 20 measured steps took no measurable time")
    assert "ticks longer than a step" in verdict.summary
    assert verdict.basis == "not predicted: steps of no time say nothing"


def test_analyse_on_a_coarse_clock_is_inconclusive_not_periodic_stalls() -> None:
    from trainperf.monitor import StepRecord, analyse

    # 1 ms steps timed by a clock that ticks every 15 ms: 14 steps of 0, then one of 15 ms.
    timeline = [
        StepRecord(i, start=0.015 * (i // 15), wait=0.0,
                   compute=0.015 if i % 15 == 0 else 0.0, samples=4, gpu_busy=None)
        for i in range(150)
    ]  # fmt: skip
    report = analyse(timeline)
    assert report.verdict.kind == "inconclusive", report
    assert report.findings == () and report.what_if().fixes == ()


def test_cuda_never_initialised_with_a_gpu_present() -> None:
    verdict = cuda_never_initialised(figures(cuda_used=False))
    assert verdict is not None and verdict.kind == "gpu-unused"
    assert "never initialised CUDA" in verdict.summary and "to_device" in verdict.fix
    assert cuda_never_initialised(figures()) is None
    assert cuda_never_initialised(figures(gpu_present=False, cuda_used=False)) is None


def test_gpu_idle_under_five_percent() -> None:
    verdict = gpu_idle(figures(utilisation=nvml(4.0)))
    assert verdict is not None and verdict.kind == "gpu-unused"
    assert "busy only 4%" in verdict.summary
    assert verdict.reasons == ("NVML utilisation averages 4%",)
    assert gpu_idle(figures(utilisation=nvml(5.0))) is None  # the edge: 5 % is not idle
    assert gpu_idle(figures(utilisation=nvml(4.0), gpu_present=False)) is None
    assert gpu_idle(figures()) is None  # nothing says how busy the GPU is


def test_gpu_idle_from_the_event_span_alone_and_not_from_untrusted_nvml() -> None:
    span = gpu_idle(figures(gpu_span=0.04))
    assert span is not None and any("span 4%" in r for r in span.reasons)
    assert gpu_idle(figures(utilisation=nvml(0.0), nvml_window_s=0.2)) is None


# --------------------------------------------------------------------------- candidates


def test_periodic_stalls_from_half_the_stall_share() -> None:
    verdict = periodic_stalls(figures(stall_fraction=0.05, **STALLS))
    assert verdict is not None and verdict.kind == "periodic-stalls"
    assert verdict.summary == (
        "every 10 steps one step takes 200 ms instead of 10.0 ms, costing 5% of the run"
    )
    assert verdict.reasons == ("stalled steps: 9, 19, 29",)
    assert "save_checkpoint" in verdict.fix
    assert periodic_stalls(figures(stall_fraction=0.0499, **STALLS)) is None
    scattered = {**STALLS, "stall_period": None}
    assert periodic_stalls(figures(stall_fraction=0.5, **scattered)) is None


def test_periodic_stalls_between_epochs_name_a_validation_pass_too() -> None:
    # Before: stalls once an epoch (a validation pass) were told "save checkpoints without
    # blocking ... or less often (every few hundred steps)", though the loop saved nothing.
    epoch = {**STALLS, "stall_steps": (10, 20, 30), "setup": LoopSetup(steps_per_epoch=10)}
    verdict = periodic_stalls(figures(stall_fraction=0.3, **epoch))
    assert verdict is not None
    assert verdict.summary.startswith("every 10 steps (between epochs) one step takes 200 ms")
    assert verdict.fix.startswith("something expensive runs between epochs: if it is a "
                                  "validation pass, validate every few epochs")  # fmt: skip
    assert verdict.fixes[0].basis.startswith("at most: the stalls come between epochs")
    other = periodic_stalls(figures(stall_fraction=0.3, **{**epoch, "setup": LoopSetup(
        steps_per_epoch=7)}))  # fmt: skip
    assert other is not None and "between epochs" not in other.summary + other.fix


def test_periodic_stalls_list_eight_steps_at_most() -> None:
    many = {**STALLS, "stall_steps": tuple(range(9, 100, 10))}
    verdict = periodic_stalls(figures(stall_fraction=0.3, **many))
    assert verdict is not None
    assert verdict.reasons == ("stalled steps: 9, 19, 29, 39, 49, 59, 69, 79 ...",)


def test_input_bound_when_waiting_with_cpus_to_spare() -> None:
    verdict = input_bound(figures(wait_fraction=0.3, process_cpu=100.0, host_cpu=20.0))
    assert verdict is not None and verdict.kind == "input-bound"
    assert verdict.summary == "the training step waits for data"
    assert verdict.reasons == (
        "30% of step time is spent waiting for the next batch",
        "this process and its workers use 12% of the 8 usable CPUs, the host is 20% busy",
    )
    assert "autotune_loader" in verdict.fix
    assert input_bound(figures(wait_fraction=0.2)) is None
    assert input_bound(figures(wait_fraction=0.3, process_cpu=700.0)) is None  # host-bound


def test_input_bound_names_the_saw_tooth() -> None:
    verdict = input_bound(figures(wait_fraction=0.15, utilisation=SAWTOOTH))
    assert verdict is not None and any("saw-tooth" in r for r in verdict.reasons)


def test_host_bound_when_waiting_on_saturated_cpus() -> None:
    verdict = host_bound(figures(wait_fraction=0.3, process_cpu=700.0))
    assert verdict is not None and verdict.kind == "host-bound"
    assert verdict.summary == "waiting for data while the CPUs are saturated"
    assert "image_loader" in verdict.fix
    assert host_bound(figures(wait_fraction=0.3, process_cpu=100.0)) is None


def test_host_bound_when_the_gpu_starves_on_saturated_cpus() -> None:
    hot = {"process_cpu": 700.0, "host_cpu": 95.0}
    verdict = host_bound(figures(gpu_span=0.49, **hot))
    assert verdict is not None and verdict.kind == "host-bound"
    assert verdict.summary == "the GPU is busy only 49% of the time while the CPUs are saturated"
    assert host_bound(figures(gpu_span=0.5, **hot)) is None  # the edge: half busy is enough
    assert host_bound(figures(**hot)) is None  # no GPU figures: nothing starves
    assert host_bound(figures(gpu_span=0.2)) is None  # CPUs to spare


def test_compute_bound_says_where_and_how_busy() -> None:
    cpu = compute_bound(figures(cuda_used=False, gpu_present=False, wait_fraction=0.02))
    assert cpu.kind == "compute-bound"
    assert cpu.summary == "the training step on the CPU is the limit; data arrives in time"
    assert cpu.reasons == ("only 2% of step time is spent waiting for data",)
    assert "MixedPrecision" in cpu.fix
    bound = compute_bound(figures(gpu_span=1.0))
    assert "on the GPU" in bound.summary
    assert any(r.startswith("the GPU is busy at most 100% of step time") for r in bound.reasons)
    measured = compute_bound(figures(gpu_span=1.0, utilisation=nvml(95.0)))
    assert any(r.startswith("the GPU is busy 95% of step time (NVML") for r in measured.reasons)


def test_without_a_measured_wait_nothing_waits_for_data() -> None:
    # w.step() without w.iter(): the time in next(loader) counts as step time, so a wait
    # fraction of 0 says nothing; 0.8 here stands for any figure the rules must not use.
    unmeasured = figures(wait_fraction=0.8, wait_measured=False, process_cpu=100.0)
    assert not waits_for_data(unmeasured)
    assert input_bound(unmeasured) is None
    assert host_bound(dataclasses.replace(unmeasured, process_cpu=700.0)) is None
    assert input_bound(figures(wait_fraction=0.8, process_cpu=100.0)) is not None


def test_compute_bound_does_not_claim_data_arrives_in_time_without_measuring_it() -> None:
    cpu = compute_bound(figures(cuda_used=False, gpu_present=False, wait_measured=False))
    assert cpu.kind == "compute-bound"
    assert "data arrives in time" not in cpu.summary
    assert cpu.summary == (
        "the training step on the CPU, or the data loading inside it, is the limit: data "
        "waiting was not measured"
    )
    assert cpu.reasons[0].startswith("data waiting was not measured: w.step() was called")
    assert not any("spent waiting for data" in r for r in cpu.reasons)
    assert cpu.fix.startswith("measure the data wait first: for batch in w.iter(loader):")
    gpu = compute_bound(figures(wait_measured=False, gpu_span=1.0, utilisation=nvml(95.0)))
    assert any(r.startswith("the GPU is busy 95% of step time") for r in gpu.reasons)


@pytest.mark.parametrize(
    ("process_cpu", "host_cpu", "held"),
    [
        (100.0, 90.0, True),  # 12 % of 8 CPUs on a host 90 % busy: the edge
        (100.0, 89.9, False),
        (319.0, 99.0, True),  # just under 40 % of the usable CPUs
        (320.0, 99.0, False),  # 40 %: this process is the one keeping the host busy
        (None, 99.0, False),  # no samples
        (100.0, None, False),
    ],
)
def test_cpus_held_by_others_at_the_edges(
    process_cpu: float | None, host_cpu: float | None, held: bool
) -> None:
    verdict = cpus_held_by_others(figures(process_cpu=process_cpu, host_cpu=host_cpu))
    assert (verdict is not None) is held
    if verdict is not None:
        assert process_cpu is not None
        assert verdict.kind == "host-bound"
        assert verdict.summary.startswith("other processes hold the host's CPUs: the host is")
        assert f"use {process_cpu / 800:.0%} of the 8 usable CPUs" in verdict.summary
        assert verdict.reasons[0] == "0% of step time is spent waiting for the next batch"
        assert "cannot be told from a compute-bound one" in verdict.reasons[1]
        assert "trainperf doctor" in verdict.fix and "MixedPrecision" not in verdict.fix


def test_a_wait_unmeasured_for_a_prefetch_thread_is_said_so_not_w_iter_never_called() -> None:
    # Before: the reason said "w.iter() never was" and the held-CPUs reason "wrap the
    # loader" although the loop wrapped it, in a prefetch thread: the watch's own note
    # (appended after) contradicted them.
    prefetched = LoopSetup(prefetch_thread="prefetch")
    unmeasured = figures(cuda_used=False, gpu_present=False, wait_measured=False)
    cpu = compute_bound(dataclasses.replace(unmeasured, setup=prefetched))
    assert cpu.reasons[0] == (
        "data waiting was not measured: w.iter() ran in thread 'prefetch' (a prefetch "
        "thread), not in the loop's, so the loop's own wait for each batch counts as step time"
    )
    assert cpu.fix.startswith(
        "measure the data wait first: wrap what the loop itself iterates, for batch in "
        "w.iter(prefetcher): ... w.step(), and watch again; if the step is still the limit"
    )
    assert not any("never was" in r or "w.iter(loader)" in r for r in cpu.reasons)
    held = cpus_held_by_others(cpu_loop(process_cpu=20.0, host_cpu=99.0, wait_measured=False,
                                        setup=prefetched))  # fmt: skip
    assert held is not None
    assert held.reasons[0] == (
        "data waiting was not measured: w.iter() ran in prefetch thread 'prefetch'; wrap what "
        "the loop itself iterates, for batch in w.iter(prefetcher)"
    )


def test_compute_bound_does_not_advise_mixed_precision_already_in_use() -> None:
    why = "auto: the CPU has no native bf16 (emulated bf16 is slower) -> fp32"
    fp32 = compute_bound(figures(cuda_used=False, precision=("fp32", why)))
    assert "autocast" not in fp32.fix and "lower precision is not advised" in fp32.fix
    assert f"MixedPrecision is in use and chose fp32 ({why})" in fp32.fix
    assert "channels_last" in fp32.fix
    bf16 = compute_bound(figures(precision=("bf16", "auto: cuda:0 has 9.0 -> bf16")))
    assert "already runs in bf16" in bf16.fix and "autocast" not in bf16.fix
    assert "bf16/fp16 autocast" in compute_bound(figures()).fix  # not in use: advised


# --------------------------------------------------------------------------- ranking


def test_weight_of_each_candidate() -> None:
    stalls = Verdict("periodic-stalls", "", (), "")
    assert weight(figures(stall_fraction=0.1), stalls) == 0.1  # the edge: it can lead
    assert weight(figures(stall_fraction=0.099), stalls) == 0.0  # an "also" finding only
    assert weight(figures(wait_fraction=0.4), Verdict("input-bound", "", (), "")) == 0.4
    host = Verdict("host-bound", "", (), "")
    assert weight(figures(wait_fraction=0.3, gpu_span=0.2), host) == 0.3  # waiting
    assert weight(figures(wait_fraction=0.0, gpu_span=0.2), host) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="only periodic-stalls, input-bound and host-bound"):
        weight(figures(), Verdict("compute-bound", "", (), ""))


def test_rank_puts_the_heaviest_first_and_the_rest_as_findings() -> None:
    f = figures(wait_fraction=0.4, stall_fraction=0.3, **STALLS)
    stalls, waiting = periodic_stalls(f), input_bound(f)
    assert stalls is not None and waiting is not None
    assert rank(f, [stalls, waiting]) == (waiting, (stalls,))
    tie = figures(wait_fraction=0.3, stall_fraction=0.3, **STALLS)
    first, second = periodic_stalls(tie), input_bound(tie)
    assert first is not None and second is not None
    assert rank(tie, [first, second]) == (first, (second,))  # a tie keeps the rule order


def test_rank_falls_back_to_compute_bound() -> None:
    f = figures(stall_fraction=0.07, **STALLS)  # stalls worth a finding, not the verdict
    stalls = periodic_stalls(f)
    assert stalls is not None
    assert rank(f, [stalls]) == (compute_bound(f), (stalls,))
    assert rank(figures(), []) == (compute_bound(figures()), ())


def test_rank_says_the_cpus_are_held_instead_of_compute_bound() -> None:
    held = figures(process_cpu=80.0, host_cpu=99.0)  # 10 % of 8 CPUs on a saturated host
    verdict = cpus_held_by_others(held)
    assert verdict is not None
    assert rank(held, []) == (verdict, ())
    # A GPU that NVML shows busy is the limit still; the held CPUs are a finding.
    busy = dataclasses.replace(held, gpu_span=1.0, utilisation=nvml(90.0))
    busy_verdict = cpus_held_by_others(busy)
    assert rank(busy, []) == (compute_bound(busy), (busy_verdict,))
    # The event span alone is only an upper bound: it does not show the GPU busy.
    assert rank(dataclasses.replace(held, gpu_span=1.0), [])[0].kind == "host-bound"
    unmeasured = cpus_held_by_others(dataclasses.replace(held, wait_measured=False))
    assert unmeasured is not None
    assert unmeasured.reasons[0].startswith("data waiting was not measured: wrap the loader")
    # A candidate that explains the run leads, and the held CPUs follow it.
    waiting = dataclasses.replace(held, wait_fraction=0.5)
    main = input_bound(waiting)
    assert main is not None
    assert rank(waiting, [main]) == (main, (cpus_held_by_others(waiting),))


# --------------------------------------------------------------------------- predictions


def test_every_candidate_carries_its_fixes_and_the_best_prediction() -> None:
    waiting = input_bound(cpu_loop(wait_fraction=0.8, wait_cpu_s=0.0016, process_cpu=20.0))
    assert waiting is not None
    assert [f.call for f in waiting.fixes] == [
        "trainperf.autotune_loader(dataset, batch_size, step_fn=train_step)"
    ]
    assert waiting.predicted_speedup == pytest.approx(5.0)  # worked out in test_predict
    assert waiting.basis == waiting.fixes[0].basis
    stalls = periodic_stalls(figures(stall_fraction=0.2, **STALLS))
    assert stalls is not None and stalls.predicted_speedup == pytest.approx(1.25)
    assert stalls.fixes[0].call.startswith("trainperf.Checkpointer(")
    on_gpu = input_bound(figures(wait_fraction=0.6, wait_cpu_s=0.006, process_cpu=100.0))
    assert on_gpu is not None  # a CUDA loop: GPU decoding is a fix too
    assert {f.call.split("(")[0] for f in on_gpu.fixes} == {
        "trainperf.autotune_loader", "trainperf.pipelines.image_loader",
    }  # fmt: skip
    assert on_gpu.predicted_speedup == max(f.predicted_speedup for f in on_gpu.fixes)


def test_the_decisive_verdicts_say_what_they_cannot_predict() -> None:
    few = too_few_steps(figures(measured_steps=2))
    assert few is not None and few.predicted_speedup == 1.0 and few.fixes == ()
    assert few.basis == "not predicted: 2 step(s) say too little"
    unused = cuda_never_initialised(figures(cuda_used=False))
    assert unused is not None and unused.fixes[0].finding == "gpu-unused"
    assert unused.basis.startswith("not predicted")
    idle = gpu_idle(figures(utilisation=nvml(1.0)))
    assert idle is not None and idle.fixes == unused.fixes


def test_compute_bound_predicts_mixed_precision_and_a_larger_batch() -> None:
    cpu = compute_bound(cpu_loop(setup=LoopSetup(cpu_native_bf16=False)))
    assert [f.call for f in cpu.fixes] == ["trainperf.MixedPrecision()"]
    assert cpu.predicted_speedup == 1.0 and "no native bf16" in cpu.basis
    setup = LoopSetup(gpu_name="NVIDIA A100-SXM4-80GB", gpu_capability=(8, 0))
    gpu = compute_bound(figures(gpu_span=0.4, setup=setup))
    assert [f.call for f in gpu.fixes] == [
        BATCH_CALL, "trainperf.MixedPrecision()",
    ]  # fmt: skip
    assert gpu.predicted_speedup == 2.0  # a GPU busy 40 %: a doubled batch beats bf16
    assert compute_bound(figures(precision=("bf16", "x"))).fixes == ()  # nothing left


def test_held_cpus_predict_the_wait_for_a_cpu_gone() -> None:
    held = cpus_held_by_others(cpu_loop(process_cpu=20.0, host_cpu=99.0, cpu_delay_s=0.010))
    assert held is not None and held.predicted_speedup == pytest.approx(2.0)
    assert held.fixes[0].call.startswith("stop or move the other jobs")


OVERSUBSCRIBED = {
    "process_cpu": 180.0, "workers_cpu": 120.0, "host_cpu": 95.0,
    "setup": LoopSetup(torch_threads=16, num_workers=2),
}  # fmt: skip


def test_host_bound_names_torch_threads_that_oversubscribe_the_cpus() -> None:
    verdict = host_bound(cpu_loop(wait_fraction=0.1, **OVERSUBSCRIBED))
    assert verdict is not None and verdict.kind == "host-bound"
    assert verdict.summary == "torch's 16 threads oversubscribe the 2 usable CPUs"
    assert verdict.reasons[0] == (
        "torch runs 16 threads on 2 usable CPUs while the DataLoader workers keep 1.2 cores "
        "busy and other processes 0.1: 1 would fit (torch.set_num_threads)"
    )
    assert verdict.fixes[0].call == "torch.set_num_threads(1)"
    # Waiting as well: the waiting verdict, with the threads among its reasons and fixes.
    waiting = host_bound(cpu_loop(wait_fraction=0.3, **OVERSUBSCRIBED))
    assert waiting is not None and waiting.summary.startswith("waiting for data")
    assert any(r.startswith("torch runs 16 threads") for r in waiting.reasons)
    assert "torch.set_num_threads(1)" in [f.call for f in waiting.fixes]


def test_oversubscribed_threads_are_host_bound_on_a_host_others_keep_busy() -> None:
    # This tree uses 35 % of its CPUs (not saturated), the host is 98 % busy.
    setup = LoopSetup(torch_threads=16, num_workers=2)
    busy = cpu_loop(wait_fraction=0.3, process_cpu=70.0, workers_cpu=40.0, host_cpu=98.0,
                    setup=setup)  # fmt: skip
    verdict = host_bound(busy)
    assert verdict is not None
    assert verdict.summary == (
        "waiting for data while torch's 16 threads oversubscribe the busy CPUs"
    )
    quiet = dataclasses.replace(busy, host_cpu=50.0)
    assert host_bound(quiet) is None  # idle CPUs: the threads crowd nothing


def test_oversubscription_weighs_the_share_of_threads_that_do_not_fit() -> None:
    f = cpu_loop(wait_fraction=0.1, **OVERSUBSCRIBED)
    verdict = host_bound(f)
    assert verdict is not None
    assert weight(f, verdict) == pytest.approx(1 - 1 / 16)
    main, _ = rank(f, [verdict])
    assert main is verdict  # it leads over compute-bound
