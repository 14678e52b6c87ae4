"""The verdict side of ``trainperf.watch()``: :func:`analyse` (report types: ``_report``).

:class:`~trainperf.monitor.Watch` records a timeline (one :class:`StepRecord` per step) and
background :class:`Sample` s; :func:`analyse` measures them into the figures the verdict
rules (``_rules``, pure functions) judge, applies the rules in order, and returns a
:class:`WatchReport` whose :class:`Verdict` names what limits the loop, the numbers behind
it, the trainperf tool that fixes it, and what each fix is predicted to gain (``_predict``).
Where the step time changed lastingly part-way (``_shift``), the figures the rules judge
are those of the steps since the change: the loop as it runs now. Import these from
:mod:`trainperf.monitor`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainperf._utils.steal import undo_steal
from trainperf._utils.validate import non_negative_int, positive_int
from trainperf.monitor._figures import Figures
from trainperf.monitor._record_checks import check_rates, check_records
from trainperf.monitor._records import Sample, StepRecord
from trainperf.monitor._report import WatchReport
from trainperf.monitor._rules import (
    MIN_STEPS,
    cuda_never_initialised,
    gpu_idle,
    host_bound,
    input_bound,
    periodic_stalls,
    rank,
    too_few_steps,
)
from trainperf.monitor._setup import LoopSetup
from trainperf.monitor._shift import Shift, find_shift
from trainperf.monitor._verdict import Verdict, VerdictKind

__all__ = ["Sample", "StepRecord", "Verdict", "VerdictKind", "WatchReport", "analyse"]

STALL_FACTOR = 2.5  # a stall is a step this many times the median (and far outside the noise)

# The first of these that applies is the verdict on its own.
_DECISIVE: tuple[Callable[[Figures], Verdict | None], ...] = (
    too_few_steps,
    cuda_never_initialised,
    gpu_idle,
)
# Otherwise these are ranked by how much of the run each explains (stalls first on a tie).
_CANDIDATES: tuple[Callable[[Figures], Verdict | None], ...] = (
    periodic_stalls,
    input_bound,
    host_bound,
)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _longest_period(steps: int, slow: int) -> int:
    """The longest period worth trying: it must fit three stalls (p, p + N, p + 2N), and its
    phase must have room for the 60 % of the ``slow`` steps a period has to explain
    (``ceil(steps / N)`` slots), which keeps the search linear in ``steps``.

    Example:
        >>> _longest_period(100, 3), _longest_period(100_000, 5_000)
        (49, 34)
    """
    need = max(3, math.ceil(0.6 * slow))
    return min((steps - 1) // 2, steps // (need - 1) + 1)


def _find_stalls(
    durations: Sequence[float], first: int, wall: float | None = None
) -> tuple[int | None, list[int], float]:
    """Steps far slower than the median, their period if they recur every N steps, and the
    share of ``wall`` (default: the durations' sum) the periodic ones lose."""
    if len(durations) < MIN_STEPS:
        return None, [], 0.0
    median = statistics.median(durations)
    mad = statistics.median(abs(d - median) for d in durations)
    threshold = max(STALL_FACTOR * median, median + 6 * 1.4826 * mad)
    slow = [first + i for i, d in enumerate(durations) if d > threshold]
    total = sum(durations) if wall is None else wall
    last = first + len(durations) - 1
    if len(slow) >= 3:
        for period in range(2, _longest_period(len(durations), len(slow)) + 1):
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


def _window(
    measured: Sequence[StepRecord], samples: Sequence[Sample]
) -> tuple[list[Sample], float]:
    """The background samples that describe the measured steps, and the seconds they cover.

    Samples taken while the steps ran count, plus the first one after (NVML's utilisation
    covers the period before the sample); later ones (a report made long after the loop)
    would dilute the loop's figures. The steps "ran" until the GPU finished them, which may
    be after the host's loop ended (the host queues ahead): the GPU could not have finished
    before the first step's start plus the steps' spans.
    """
    t_start = measured[0].start if measured else 0.0
    spans = [s.gpu_busy for s in measured]
    t_end = measured[-1].start + measured[-1].duration if measured else math.inf
    if measured and None not in spans:
        t_end = max(t_end, t_start + sum(x for x in spans if x is not None))
    during = [s for s in samples if t_start <= s.time <= t_end]
    after = [s for s in samples if s.time > t_end]
    return during + after[:1], (t_end - t_start) if measured else 0.0


def _event_span(measured: Sequence[StepRecord], wall: float) -> float | None:
    """The CUDA-event span as a share of step time: an upper bound on the GPU's busy share."""
    busy = [s.gpu_busy for s in measured if s.gpu_busy is not None]
    # Steps of no time at all (a made-up or re-analysed timeline) have no share to give.
    if wall <= 0 or not busy or len(busy) != len(measured):
        return None
    return min(1.0, sum(busy) / wall)


def _per_step(values: Sequence[float | None]) -> float | None:
    """The mean of a per-step figure, None unless every step has it."""
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(v for v in values if v is not None)


def _samples_per_s(measured: Sequence[StepRecord], wall: float) -> float | None:
    known = [s.samples for s in measured]
    if wall <= 0 or not known or None in known:
        return None
    return sum(n for n in known if n is not None) / wall


@dataclass(frozen=True)
class _Context:
    """What ``analyse`` was told about the run, besides its steps and samples."""

    warmup_steps: int
    gpu_present: bool
    cuda_used: bool
    cpus: int
    wait_measured: bool
    precision: tuple[str, str] | None
    setup: LoopSetup


def _figures(
    measured: Sequence[StepRecord],
    window: Sequence[Sample],
    window_s: float,
    first: int,
    ctx: _Context,
    shift: Shift | None = None,
) -> Figures:
    """Measure the steps (numbered from ``first``) and their samples for the rules."""
    durations = [s.duration for s in measured]
    workers = [s.workers_cpu for s in window if s.workers_cpu is not None]
    steal = _mean([s.host_steal for s in window if s.host_steal is not None])
    wall = sum(durations)
    # Stalls are the loop's own time (a synchronous save): with the wait for data measured,
    # a batch that comes late (workers delivering in bursts) is the input-bound finding's.
    own = [s.compute for s in measured] if ctx.wait_measured else durations
    period, stalled, stall_fraction = _find_stalls(own, first, wall)
    # The whole step, as the median step it is compared with: a stall is found in the
    # loop's own time, but the step that stalls also waited for its batch.
    stall_median = statistics.median(durations[i - first] for i in stalled) if stalled else None
    return Figures(
        measured_steps=len(measured),
        warmup_steps=ctx.warmup_steps,
        gpu_present=ctx.gpu_present,
        cuda_used=ctx.cuda_used,
        cpus=ctx.cpus,
        wall_s=wall,
        wait_fraction=sum(s.wait for s in measured) / wall if wall > 0 else 0.0,
        median_step_s=statistics.median(durations) if durations else 0.0,
        gpu_span=_event_span(measured, wall),
        utilisation=tuple(s.gpu_utilization for s in window if s.gpu_utilization is not None),
        nvml_window_s=window_s,
        process_cpu=_mean([s.process_cpu for s in window]),
        host_cpu=_mean([s.host_cpu for s in window]),
        stall_period=period,
        stall_steps=tuple(stalled),
        stall_fraction=stall_fraction,
        stall_median_s=stall_median,
        wait_measured=ctx.wait_measured,
        precision=ctx.precision,
        wait_cpu_s=_wait_cpu(measured, steal) if ctx.wait_measured else None,
        cpu_delay_s=_per_step([s.cpu_delay for s in measured]),
        workers_cpu=_mean(workers),
        setup=ctx.setup,
        shift=shift,
        host_steal=steal,
    )


def _wait_cpu(measured: Sequence[StepRecord], steal: float | None) -> float | None:
    """The loop thread's CPU demand while waiting, per step, as it would be without the
    hypervisor's steal (stolen time is in neither its run time nor its wait for a CPU)."""
    demand = _per_step([s.wait_cpu for s in measured])
    if demand is None or steal is None:
        return demand
    return undo_steal(demand, steal / 100)


def _decide(figures: Figures) -> tuple[Verdict, tuple[Verdict, ...]]:
    """Apply the rules in order: the verdict and the "also" findings."""
    for rule in _DECISIVE:
        verdict = rule(figures)
        if verdict is not None:
            return verdict, ()
    candidates = [v for v in (rule(figures) for rule in _CANDIDATES) if v is not None]
    return rank(figures, candidates)


def _shift_reason(shift: Shift, steps: int) -> str:
    change = "rose" if shift.ratio > 1 else "fell"
    return (
        f"the step time {change} lastingly at step {shift.step}, from a median of "
        f"{shift.before_s * 1e3:.1f} ms to {shift.after_s * 1e3:.1f} ms ({shift.ratio:.2f}x): "
        f"these figures and predictions cover the {steps} steps since, the loop as it runs now"
    )


Measure = Callable[[Figures], LoopSetup | None]
"""Measures more for the predictions, on the judged figures: their setup with the new
figures in it, or None (nothing to add)."""


def _judge(
    measured: Sequence[StepRecord],
    samples: Sequence[Sample],
    first: int,
    ctx: _Context,
    measure: Measure | None = None,
) -> tuple[Verdict, tuple[Verdict, ...], Shift | None, LoopSetup]:
    """The verdict and findings on the loop as it runs now: the steps since a lasting change
    in step time (``_shift``), or all of them; and the setup they were judged with."""
    shift = find_shift([s.duration for s in measured], first)
    judged = measured
    if shift is not None:
        judged = measured[shift.step - first :]
        check_rates(judged)  # the rates the predictions multiply (analyse checked measured's)
    window, window_s = _window(judged, samples)
    figures = _figures(judged, window, window_s, shift.step if shift else first, ctx, shift)
    setup = measure(figures) if measure is not None else None
    if setup is not None:
        figures = dataclasses.replace(figures, setup=setup)
    verdict, findings = _decide(figures)
    if shift is not None:
        reasons = (_shift_reason(shift, len(judged)), *verdict.reasons)
        verdict = dataclasses.replace(verdict, reasons=reasons)
    return verdict, findings, shift, figures.setup


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
    wait_measured: bool = True,
    precision: tuple[str, str] | None = None,
    setup: LoopSetup | None = None,
    measure: Measure | None = None,
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
        wait_measured: the timeline's ``wait`` is the measured data wait (the loop used
            ``w.iter()``). False when it was not: the time spent fetching batches is then in
            ``compute``, nothing is called input-bound, the report's ``wait_fraction`` is
            None, and a compute-bound verdict says the wait was not measured.
        precision: ``(name, reason)`` of the :class:`trainperf.amp.MixedPrecision` in use,
            e.g. ``("fp32", "auto: the CPU has no native bf16 ... -> fp32")``; a
            compute-bound verdict then does not advise mixed precision. None: none in use.
        setup: what the loop ran with (:class:`LoopSetup`: DataLoader settings, torch
            threads, the GPU), for the predictions; None: nothing known.
        measure: called with the judged figures before the rules, to measure more for
            the predictions (the watch's crowding probe); returns their setup with the
            new figures, or None.

    Returns:
        The report: a verdict and "also" findings, each with its fixes and their predicted
        gains (``report.what_if()`` ranks them). Where the step time changed lastingly
        part-way, the verdict covers the steps since (``regime_start``); the report's own
        figures cover every measured step.

    Raises:
        ValueError: ``cpus`` is not an int >= 1; ``warmup_steps``, ``dropped_steps`` or
            ``dropped_samples`` is not an int >= 0; a step or sample has a figure that is
            no Python number (a NumPy scalar, a tensor, a bool; ``samples`` and
            ``gpu_memory_used`` must be ints), a NaN or infinite figure (or a count past
            float range), or a negative one other than a step's ``start`` or a sample's
            ``time``; a figure's total over the steps or samples is past float range; or
            steps so short that their steps/s or samples/s is.

    Example:
        >>> steps = [StepRecord(i, i * 0.02, 0.015, 0.005, 32, None) for i in range(20)]
        >>> analyse(steps).verdict.kind
        'input-bound'
    """
    cpus = positive_int("cpus", cpus)
    check_records(timeline, samples)
    warmup_steps = non_negative_int("warmup_steps", warmup_steps)
    dropped_steps = non_negative_int("dropped_steps", dropped_steps)
    dropped_samples = non_negative_int("dropped_samples", dropped_samples)
    skip = max(0, warmup_steps - dropped_steps)  # warm-up steps still in the timeline
    first = dropped_steps + skip  # the number of the first measured step
    measured = list(timeline[skip:])
    check_rates(measured)
    kept = dropped_steps + len(timeline)
    ran = min(warmup_steps, kept)  # fewer than asked for when the run ended in its warm-up
    ctx = _Context(
        ran, gpu_present, cuda_used, cpus, wait_measured, precision, setup or LoopSetup()
    )
    window, window_s = _window(measured, samples)
    figures = _figures(measured, window, window_s, first, ctx)  # the whole run, for the report
    verdict, findings, shift, judged_setup = _judge(measured, samples, first, ctx, measure)
    memory = [s.gpu_memory_used for s in window if s.gpu_memory_used is not None]
    return WatchReport(
        verdict=verdict,
        findings=findings,
        device=device,
        steps=kept,
        warmup_steps=ran,
        wall_s=figures.wall_s,
        steps_per_s=len(measured) / figures.wall_s if figures.wall_s > 0 else 0.0,
        samples_per_s=_samples_per_s(measured, figures.wall_s),
        median_step_s=figures.median_step_s,
        wait_fraction=figures.wait_fraction if wait_measured else None,
        gpu_busy_fraction=figures.gpu_span,
        gpu_utilization_mean=figures.utilisation_mean,
        gpu_utilization_max=max(figures.utilisation) if figures.utilisation else None,
        gpu_memory_max=max(memory) if memory else None,
        process_cpu_mean=figures.process_cpu,
        host_cpu_mean=figures.host_cpu,
        host_steal_mean=figures.host_steal,
        cpus=cpus,
        stall_period=figures.stall_period,
        stall_steps=figures.stall_steps,
        stall_fraction=figures.stall_fraction,
        timeline=tuple(timeline),
        samples=tuple(samples),
        dropped_steps=dropped_steps,
        dropped_samples=dropped_samples,
        setup=judged_setup,
        regime_start=None if shift is None else shift.step,
    )
