"""The verdict side of ``trainperf.watch()``: :func:`analyse` (report types: ``_report``).

:class:`~trainperf.monitor.Watch` records a timeline (one :class:`StepRecord` per step) and
background :class:`Sample` s; :func:`analyse` turns them into a :class:`WatchReport` whose
:class:`Verdict` names what limits the loop, the numbers behind it, and the trainperf tool
that fixes it. Import these from :mod:`trainperf.monitor`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from trainperf.monitor._report import Sample, StepRecord, Verdict, VerdictKind, WatchReport

__all__ = ["Sample", "StepRecord", "Verdict", "VerdictKind", "WatchReport", "analyse"]

MIN_STEPS = 5  # measured steps needed for a verdict
INPUT_BOUND_WAIT = 0.25  # share of step time spent waiting for data
SAWTOOTH_WAIT = 0.10  # with a saw-tooth GPU utilisation, this much waiting is input-bound
CPU_SATURATED = 0.8  # share of the usable CPUs this process and its workers use
HOST_SATURATED = 90.0  # host CPU percent, with the process using at least half its share
GPU_IDLE_UTIL = 5.0  # percent
NVML_MIN_WINDOW_S = 1.0  # NVML's utilisation averages over 1/6 s to 1 s, by product
STALL_FACTOR = 2.5  # a stall is a step this many times the median (and far outside the noise)
STALL_SHARE = 0.1  # share of run time lost to periodic stalls that makes them the verdict

_FIXES: dict[str, str] = {
    "input-bound": (
        "feed the loop faster: trainperf.autotune_loader() picks num_workers, prefetch_factor "
        "and pin_memory for this machine; trainperf.pipelines.image_loader decodes images on "
        "the GPU"
    ),
    "host-bound": (
        "the CPUs are saturated: move decoding and augmentation to the GPU "
        "(trainperf.pipelines.image_loader), rent 4-8 cores per GPU, and check "
        "`trainperf doctor` for thread oversubscription"
    ),
    "compute-bound": (
        "the training step itself is the limit: use bf16/fp16 autocast "
        "(trainperf.amp.MixedPrecision), channels_last for convolutional models, and a larger "
        "batch if memory allows"
    ),
    "gpu-unused": (
        "move the model and each batch to the GPU: model.to(device) and "
        "batch = trainperf.to_device(batch, device), with device = trainperf.best_device()"
    ),
    "periodic-stalls": (
        "something expensive runs every few steps inside the loop: save checkpoints less often "
        "(trainperf.save_checkpoint every few hundred steps or per epoch), and move image "
        "saving and logging out of the loop"
    ),
    "inconclusive": "watch more steps: call w.step() once at the end of each training step",
}


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _find_stalls(durations: Sequence[float], first: int) -> tuple[int | None, list[int], float]:
    """Steps far slower than the median, and their period if they recur every N steps."""
    if len(durations) < MIN_STEPS:
        return None, [], 0.0
    median = statistics.median(durations)
    mad = statistics.median(abs(d - median) for d in durations)
    threshold = max(STALL_FACTOR * median, median + 6 * 1.4826 * mad)
    slow = [first + i for i, d in enumerate(durations) if d > threshold]
    total = sum(durations)
    last = first + len(durations) - 1
    if len(slow) >= 3:
        # Up to the longest period that fits three stalls: p, p + N, p + 2N.
        for period in range(2, (len(durations) - 1) // 2 + 1):
            phases: dict[int, int] = {}
            for i in slow:
                phases[i % period] = phases.get(i % period, 0) + 1
            phase, hits = max(phases.items(), key=lambda kv: (kv[1], -kv[0]))
            slots = len(range(first + (phase - first) % period, last + 1, period))
            # Most of the phase's steps stall, and most stalls are on the phase: random
            # slow steps (contention, GC) pass neither test.
            if hits >= 3 and hits >= 0.75 * slots and hits >= 0.6 * len(slow):
                periodic = [i for i in slow if i % period == phase]
                lost = sum(durations[i - first] - median for i in periodic)
                return period, periodic, lost / total if total > 0 else 0.0
    return None, slow, 0.0


def analyse(
    timeline: Sequence[StepRecord],
    samples: Sequence[Sample] = (),
    *,
    device: str = "cpu",
    gpu_present: bool = False,
    cuda_used: bool = False,
    cpus: int = 1,
    warmup_steps: int = 2,
    dropped_steps: int = 0,
    dropped_samples: int = 0,
) -> WatchReport:
    """Turn a step timeline and background samples into a :class:`WatchReport`.

    :class:`Watch` calls this; it is public so recorded timelines can be re-analysed.

    How busy the GPU was is judged from the smaller of NVML's mean utilisation and the
    CUDA-event span (``gpu_busy_fraction``): the span is only an upper bound, since on an
    idle stream it measures host time between the two events. Without NVML samples the span
    alone is used, and a GPU the loop barely uses cannot then be told from a busy one.

    Args:
        timeline: the steps, in order.
        samples: background samples (GPU utilisation, CPU).
        device: what the loop ran on, for the report.
        gpu_present: a GPU is visible to this process.
        cuda_used: the process initialised CUDA during the watch.
        cpus: CPUs this process may use.
        warmup_steps: leading steps to leave out of the figures, counted from the run's
            first step (dropped ones included).
        dropped_steps: steps recorded before ``timeline[0]`` and no longer kept; the
            timeline's first step is step number ``dropped_steps``.
        dropped_samples: background samples no longer kept.

    Returns:
        The report.

    Raises:
        ValueError: ``cpus`` < 1, or ``warmup_steps``, ``dropped_steps`` or
            ``dropped_samples`` < 0.

    Example:
        >>> steps = [StepRecord(i, i * 0.02, 0.015, 0.005, 32, None) for i in range(20)]
        >>> analyse(steps).verdict.kind
        'input-bound'
    """
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
    if dropped_steps < 0 or dropped_samples < 0:
        raise ValueError(
            f"dropped_steps and dropped_samples must be >= 0, got {dropped_steps!r} and "
            f"{dropped_samples!r}"
        )
    skip = max(0, warmup_steps - dropped_steps)  # warm-up steps still in the timeline
    first = dropped_steps + skip  # the number of the first measured step
    measured = list(timeline[skip:])
    t_start = measured[0].start if measured else 0.0
    # Background samples taken while the measured steps ran, plus the first one after (NVML's
    # utilisation covers the period before the sample); samples after that (a report made long
    # after the loop) would dilute the loop's figures. The steps "ran" until the GPU finished
    # them, which may be after the host's loop ended (the host queues ahead): the GPU could
    # not have finished before the first step's start plus the steps' spans.
    spans = [s.gpu_busy for s in measured]
    t_end = measured[-1].start + measured[-1].duration if measured else math.inf
    if measured and None not in spans:
        t_end = max(t_end, t_start + sum(x for x in spans if x is not None))
    during = [s for s in samples if t_start <= s.time <= t_end]
    after = [s for s in samples if s.time > t_end]
    window = during + after[:1]
    durations = [s.duration for s in measured]
    wall = sum(durations)
    wait = sum(s.wait for s in measured) / wall if wall > 0 else 0.0
    known = [s.samples for s in measured]
    samples_per_s = (
        sum(n for n in known if n is not None) / wall
        if wall > 0 and known and None not in known
        else None
    )
    busy = [s.gpu_busy for s in measured if s.gpu_busy is not None]
    # The CUDA-event span: an upper bound on the GPU's busy share, not the share itself.
    gpu_span = min(1.0, sum(busy) / wall) if busy and len(busy) == len(measured) else None
    utils = [s.gpu_utilization for s in window if s.gpu_utilization is not None]
    memory = [s.gpu_memory_used for s in window if s.gpu_memory_used is not None]
    process_cpu = _mean([s.process_cpu for s in window])
    host_cpu = _mean([s.host_cpu for s in window])
    period, stalled, stall_fraction = _find_stalls(durations, first)
    util_mean = _mean(utils)

    def report(verdict: Verdict, findings: Sequence[Verdict] = ()) -> WatchReport:
        return WatchReport(
            verdict=verdict,
            findings=tuple(findings),
            device=device,
            steps=dropped_steps + len(timeline),
            warmup_steps=min(warmup_steps, dropped_steps + len(timeline)),
            wall_s=wall,
            steps_per_s=len(measured) / wall if wall > 0 else 0.0,
            samples_per_s=samples_per_s,
            median_step_s=statistics.median(durations) if durations else 0.0,
            wait_fraction=wait,
            gpu_busy_fraction=gpu_span,
            gpu_utilization_mean=util_mean,
            gpu_utilization_max=max(utils) if utils else None,
            gpu_memory_max=max(memory) if memory else None,
            process_cpu_mean=process_cpu,
            host_cpu_mean=host_cpu,
            cpus=cpus,
            stall_period=period,
            stall_steps=tuple(stalled),
            stall_fraction=stall_fraction,
            timeline=tuple(timeline),
            samples=tuple(samples),
            dropped_steps=dropped_steps,
            dropped_samples=dropped_samples,
        )

    def verdict(kind: VerdictKind, summary: str, *reasons: str) -> Verdict:
        return Verdict(kind, summary, tuple(r for r in reasons if r), _FIXES[kind])

    if len(measured) < MIN_STEPS:
        return report(
            verdict(
                "inconclusive",
                f"{len(measured)} measured step(s) after {warmup_steps} warm-up; a verdict "
                f"needs at least {MIN_STEPS}",
            )
        )
    if gpu_present and not cuda_used:
        return report(
            verdict(
                "gpu-unused",
                "a GPU is visible but this process never initialised CUDA: the model and data "
                "stay on the CPU",
            )
        )
    # On an idle stream a step's two events complete as soon as they are recorded, so their
    # span is host time: ~100 % for a loop that launches nothing (or launches slowly). The
    # span only bounds the busy share from above; NVML's utilisation (the share of time a
    # kernel ran) is the smaller, truer figure where it exists.
    # NVML averages over a period of up to a second: over a shorter window, or with fewer
    # than three samples, its figure mostly describes what came before the loop.
    nvml_window = (t_end - t_start) if measured else 0.0
    nvml_ok = util_mean is not None and len(utils) >= 3 and nvml_window >= NVML_MIN_WINDOW_S
    utilisation = util_mean / 100 if nvml_ok and util_mean is not None else None
    nvml_note = (
        ""
        if nvml_ok or util_mean is None
        else f"NVML utilisation ({len(utils)} samples over {nvml_window:.2f} s) is not used: it "
        f"averages over up to {NVML_MIN_WINDOW_S:g} s, so watch at least that long"
    )
    shares = [x for x in (gpu_span, utilisation) if x is not None]
    gpu_share = min(shares) if shares else None
    gpu_figures = "; ".join(
        part
        for part in (
            "" if utilisation is None else f"NVML utilisation averages {util_mean:.0f}%",
            ""
            if gpu_span is None
            else f"the steps' CUDA events span {gpu_span:.0%} of step time (an upper bound)",
            nvml_note,
        )
        if part
    )
    if gpu_present and gpu_share is not None and gpu_share * 100 < GPU_IDLE_UTIL:
        return report(
            verdict(
                "gpu-unused",
                f"CUDA is initialised but the GPU is busy only {gpu_share:.0%} of the time: the "
                "model or the data is not on the GPU",
                gpu_figures,
            )
        )

    tree = None if process_cpu is None else process_cpu / (100 * cpus)
    saturated = tree is not None and (
        tree >= CPU_SATURATED
        or (host_cpu is not None and host_cpu >= HOST_SATURATED and tree >= CPU_SATURATED / 2)
    )
    cpu_reason = (
        f"this process and its workers use {tree:.0%} of the {cpus} usable CPUs"
        + ("" if host_cpu is None else f", the host is {host_cpu:.0f}% busy")
        if tree is not None
        else ""
    )
    swing = ""
    if nvml_ok and len(utils) >= 5 and util_mean is not None and util_mean < 60:
        low, high = min(utils), max(utils)
        if statistics.pstdev(utils) >= 20:
            swing = f"GPU utilisation swings between {low:.0f}% and {high:.0f}% (saw-tooth)"
    wait_reason = f"{wait:.0%} of step time is spent waiting for the next batch"
    candidates: list[tuple[float, Verdict]] = []
    if period is not None and stall_fraction >= STALL_SHARE / 2:
        slow_ms = statistics.median(durations[i - first] for i in stalled) * 1e3
        candidates.append(
            (
                stall_fraction if stall_fraction >= STALL_SHARE else 0.0,
                verdict(
                    "periodic-stalls",
                    f"every {period} steps one step takes {slow_ms:.0f} ms instead of "
                    f"{statistics.median(durations) * 1e3:.1f} ms, costing "
                    f"{stall_fraction:.0%} of the run",
                    f"stalled steps: {', '.join(str(i) for i in stalled[:8])}"
                    + (" ..." if len(stalled) > 8 else ""),
                ),
            )
        )
    # A saw-tooth (the GPU idles between batches) makes a smaller wait the limit as well.
    if wait >= INPUT_BOUND_WAIT or (swing and wait >= SAWTOOTH_WAIT):
        kind: VerdictKind = "host-bound" if saturated else "input-bound"
        summary = (
            "waiting for data while the CPUs are saturated"
            if saturated
            else "the training step waits for data"
        )
        candidates.append((wait, verdict(kind, summary, wait_reason, swing, cpu_reason)))
    elif gpu_share is not None and gpu_share < 0.5 and saturated:
        candidates.append(
            (
                1 - gpu_share,
                verdict(
                    "host-bound",
                    f"the GPU is busy only {gpu_share:.0%} of the time while the CPUs are "
                    "saturated",
                    cpu_reason,
                    gpu_figures,
                ),
            )
        )
    candidates.sort(key=lambda c: -c[0])
    if candidates and candidates[0][0] > 0:
        main = candidates[0][1]
        return report(main, [v for _, v in candidates[1:]])
    where = "the GPU" if cuda_used else "the CPU"
    if gpu_share is None:
        busy_reason = ""
    elif utilisation is None:  # the event span alone: only a bound
        busy_reason = f"the GPU is busy at most {gpu_share:.0%} of step time ({gpu_figures})"
    else:
        busy_reason = f"the GPU is busy {gpu_share:.0%} of step time ({gpu_figures})"
    main = verdict(
        "compute-bound",
        f"the training step on {where} is the limit; data arrives in time",
        f"only {wait:.0%} of step time is spent waiting for data",
        busy_reason,
    )
    return report(main, [v for _, v in candidates])
