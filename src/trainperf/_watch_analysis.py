"""The verdict side of ``trainperf.watch``: report types and :func:`analyse`.

:class:`~trainperf.watch.Watch` records a timeline (one :class:`StepRecord` per step) and
background :class:`Sample` s; :func:`analyse` turns them into a :class:`WatchReport` whose
:class:`Verdict` names what limits the loop in the seed guide's terms, the numbers behind
it, and the trainperf tool that fixes it. Import these from :mod:`trainperf.watch`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from trainperf._imports import require

__all__ = ["Sample", "StepRecord", "Verdict", "VerdictKind", "WatchReport", "analyse"]

VerdictKind = Literal[
    "input-bound", "compute-bound", "host-bound", "gpu-unused", "periodic-stalls", "inconclusive"
]

MIN_STEPS = 5  # measured steps needed for a verdict
INPUT_BOUND_WAIT = 0.25  # share of step time spent waiting for data
CPU_SATURATED = 0.8  # share of the usable CPUs this process and its workers use
HOST_SATURATED = 90.0  # host CPU percent, with the process using at least half its share
GPU_IDLE_UTIL = 5.0  # percent
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


@dataclass(frozen=True)
class StepRecord:
    """One training step.

    Attributes:
        index: the step's number, from 0.
        start: seconds from the start of the watch to the step's start.
        wait: seconds spent waiting for batches (in ``w.iter``).
        compute: the rest of the step.
        samples: samples in the step's batches, None when unknown.
        gpu_busy: seconds the GPU took for the step's work (CUDA events), None without CUDA.
    """

    index: int
    start: float
    wait: float
    compute: float
    samples: int | None
    gpu_busy: float | None

    @property
    def duration(self) -> float:
        """``wait + compute``."""
        return self.wait + self.compute


@dataclass(frozen=True)
class Sample:
    """One background sample.

    Attributes:
        time: seconds from the start of the watch.
        gpu_utilization: percent of the sample period a kernel ran (NVML), None without one.
        gpu_memory_used: bytes used on the GPU (all processes), None without one.
        process_cpu: CPU percent of this process and its children (100 = one core).
        host_cpu: CPU percent of the whole host (100 = every core busy).
    """

    time: float
    gpu_utilization: float | None
    gpu_memory_used: int | None
    process_cpu: float
    host_cpu: float


@dataclass(frozen=True)
class Verdict:
    """What limits the loop, why, and what fixes it.

    Attributes:
        kind: ``"input-bound"``, ``"compute-bound"``, ``"host-bound"``, ``"gpu-unused"``,
            ``"periodic-stalls"`` or ``"inconclusive"``.
        summary: one sentence.
        reasons: the numbers behind it.
        fix: what to do, naming the trainperf tool that does it.
    """

    kind: VerdictKind
    summary: str
    reasons: tuple[str, ...]
    fix: str


@dataclass(frozen=True)
class WatchReport:
    """The verdict on a watched loop and the measurements behind it.

    Steps before ``warmup_steps`` (loader start-up, cuDNN autotuning) are kept in
    ``timeline`` but left out of every figure.

    Attributes:
        verdict: the main finding.
        findings: further findings worth acting on.
        device: ``"cpu"``, ``"cuda:<i>"`` or ``"auto"`` (CUDA never used).
        steps: steps recorded.
        warmup_steps: leading steps left out of the figures.
        wall_s: seconds of the measured steps.
        steps_per_s: measured steps per second.
        samples_per_s: samples per second, None when batch sizes are unknown.
        median_step_s: the median step time.
        wait_fraction: share of step time spent waiting for data.
        gpu_busy_fraction: share of step time the GPU worked on the steps (CUDA events).
        gpu_utilization_mean: mean NVML utilisation (percent) over the measured steps.
        gpu_utilization_max: its maximum.
        gpu_memory_max: the most GPU memory seen in use, bytes.
        process_cpu_mean: mean CPU percent of this process and its children.
        host_cpu_mean: mean host CPU percent.
        cpus: CPUs this process may use.
        stall_period: N when every N-th step stalls, else None.
        stall_steps: indices of the stalled steps.
        stall_fraction: share of the measured time lost to those stalls.
        timeline: every step.
        samples: every background sample.
    """

    verdict: Verdict
    findings: tuple[Verdict, ...]
    device: str
    steps: int
    warmup_steps: int
    wall_s: float
    steps_per_s: float
    samples_per_s: float | None
    median_step_s: float
    wait_fraction: float
    gpu_busy_fraction: float | None
    gpu_utilization_mean: float | None
    gpu_utilization_max: float | None
    gpu_memory_max: int | None
    process_cpu_mean: float | None
    host_cpu_mean: float | None
    cpus: int
    stall_period: int | None
    stall_steps: tuple[int, ...]
    stall_fraction: float
    timeline: tuple[StepRecord, ...]
    samples: tuple[Sample, ...]

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; the per-step timeline and samples only when asked for."""
        data = asdict(self)
        if not timeline:
            del data["timeline"], data["samples"]
        return data

    def __str__(self) -> str:
        v = self.verdict
        lines = [f"trainperf.watch: {v.kind}: {v.summary}"]
        if self.steps - self.warmup_steps >= 1 and self.wall_s > 0:
            rate = f", {self.samples_per_s:.1f} samples/s" if self.samples_per_s else ""
            lines.append(
                f"  {self.steps} steps ({self.warmup_steps} warm-up left out), "
                f"{self.steps_per_s:.2f} steps/s{rate}; median step {self.median_step_s * 1e3:.1f}"
                f" ms, {self.wait_fraction:.0%} of it waiting for data"
            )
        gpu = []
        if self.gpu_busy_fraction is not None:
            gpu.append(f"busy {self.gpu_busy_fraction:.0%} of step time")
        if self.gpu_utilization_mean is not None:
            gpu.append(f"utilisation mean {self.gpu_utilization_mean:.0f}%")
        if self.gpu_memory_max is not None:
            gpu.append(f"memory up to {self.gpu_memory_max / 2**30:.1f} GiB")
        if gpu:
            lines.append("  GPU: " + ", ".join(gpu))
        if self.process_cpu_mean is not None and self.host_cpu_mean is not None:
            lines.append(
                f"  CPU: this process and its workers {self.process_cpu_mean:.0f}% "
                f"(of {self.cpus * 100}% usable), host {self.host_cpu_mean:.0f}%"
            )
        lines.extend(f"  - {r}" for r in v.reasons)
        lines.append(f"  fix: {v.fix}")
        for f in self.findings:
            lines.append(f"  also {f.kind}: {f.summary}")
            lines.append(f"    fix: {f.fix}")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """Save a timeline PNG: step time split into wait and compute, GPU and CPU use.

        Args:
            path: the PNG to write.

        Returns:
            ``path`` as a :class:`~pathlib.Path`.

        Raises:
            ModuleNotFoundError: matplotlib is not installed (``pip install 'trainperf[plot]'``).
        """
        require("matplotlib", "WatchReport.plot()")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 6))
        FigureCanvasAgg(fig)  # a canvas of our own: pyplot's global state is left alone
        top, bottom = fig.subplots(2, 1, sharex=True)
        starts, widths, waits, computes = _binned(self.timeline)
        top.bar(starts, waits, width=widths, align="edge", color="tab:orange", label="data wait")
        top.bar(
            starts, computes, width=widths, bottom=waits, align="edge", color="tab:blue",
            label="compute",
        )  # fmt: skip
        top.set_ylabel("step time (ms)")
        top.set_title(f"trainperf.watch: {self.verdict.kind}")
        top.legend(loc="upper right")
        times = [s.time for s in self.samples]
        gpu = [(s.time, s.gpu_utilization) for s in self.samples if s.gpu_utilization is not None]
        if gpu:
            bottom.plot([t for t, _ in gpu], [u for _, u in gpu], label="GPU utilisation %")
        cpu = [s.process_cpu / self.cpus for s in self.samples]
        bottom.plot(times, cpu, label="process CPU % of usable")
        bottom.plot(times, [s.host_cpu for s in self.samples], label="host CPU %", alpha=0.6)
        bottom.set_ylim(0, 105)
        bottom.set_xlabel("seconds")
        bottom.legend(loc="upper right")
        out = Path(path)
        fig.savefig(out, dpi=100)
        return out


_MAX_BARS = 2000


def _binned(
    timeline: Sequence[StepRecord],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Bar positions, widths and mean wait/compute (ms) per bar, at most ``_MAX_BARS`` bars."""
    size = max(1, -(-len(timeline) // _MAX_BARS))  # long runs: average runs of steps per bar
    starts, widths, waits, computes = [], [], [], []
    for i in range(0, len(timeline), size):
        group = timeline[i : i + size]
        starts.append(group[0].start)
        widths.append(max(sum(s.duration for s in group), 1e-6))
        waits.append(sum(s.wait for s in group) / len(group) * 1e3)
        computes.append(sum(s.compute for s in group) / len(group) * 1e3)
    return starts, widths, waits, computes


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
        for period in range(2, len(durations) // 3 + 1):
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
) -> WatchReport:
    """Turn a step timeline and background samples into a :class:`WatchReport`.

    :class:`Watch` calls this; it is public so recorded timelines can be re-analysed.

    Args:
        timeline: the steps, in order.
        samples: background samples (GPU utilisation, CPU).
        device: what the loop ran on, for the report.
        gpu_present: a GPU is visible to this process.
        cuda_used: the process initialised CUDA during the watch.
        cpus: CPUs this process may use.
        warmup_steps: leading steps to leave out of the figures.

    Returns:
        The report.

    Raises:
        ValueError: ``cpus`` < 1 or ``warmup_steps`` < 0.

    Example:
        >>> steps = [StepRecord(i, i * 0.02, 0.015, 0.005, 32, None) for i in range(20)]
        >>> analyse(steps).verdict.kind
        'input-bound'
    """
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
    measured = list(timeline[warmup_steps:])
    t_start = measured[0].start if measured else 0.0
    window = [s for s in samples if s.time >= t_start]
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
    gpu_busy = min(1.0, sum(busy) / wall) if busy and len(busy) == len(measured) else None
    utils = [s.gpu_utilization for s in window if s.gpu_utilization is not None]
    memory = [s.gpu_memory_used for s in window if s.gpu_memory_used is not None]
    process_cpu = _mean([s.process_cpu for s in window])
    host_cpu = _mean([s.host_cpu for s in window])
    period, stalled, stall_fraction = _find_stalls(durations, warmup_steps)
    util_mean = _mean(utils)

    def report(verdict: Verdict, findings: Sequence[Verdict] = ()) -> WatchReport:
        return WatchReport(
            verdict=verdict,
            findings=tuple(findings),
            device=device,
            steps=len(timeline),
            warmup_steps=min(warmup_steps, len(timeline)),
            wall_s=wall,
            steps_per_s=len(measured) / wall if wall > 0 else 0.0,
            samples_per_s=samples_per_s,
            median_step_s=statistics.median(durations) if durations else 0.0,
            wait_fraction=wait,
            gpu_busy_fraction=gpu_busy,
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
    gpu_share = (
        gpu_busy if gpu_busy is not None else (None if util_mean is None else util_mean / 100)
    )
    if gpu_present and gpu_share is not None and gpu_share * 100 < GPU_IDLE_UTIL:
        return report(
            verdict(
                "gpu-unused",
                f"CUDA is initialised but the GPU is busy only {gpu_share:.0%} of the time: the "
                "model or the data is not on the GPU",
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
    if len(utils) >= 5 and util_mean is not None and util_mean < 60:
        low, high = min(utils), max(utils)
        if statistics.pstdev(utils) >= 20:
            swing = f"GPU utilisation swings between {low:.0f}% and {high:.0f}% (saw-tooth)"
    wait_reason = f"{wait:.0%} of step time is spent waiting for the next batch"
    candidates: list[tuple[float, Verdict]] = []
    if period is not None and stall_fraction >= STALL_SHARE / 2:
        slow_ms = statistics.median(durations[i - warmup_steps] for i in stalled) * 1e3
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
    if wait >= INPUT_BOUND_WAIT:
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
                ),
            )
        )
    candidates.sort(key=lambda c: -c[0])
    if candidates and candidates[0][0] > 0:
        main = candidates[0][1]
        return report(main, [v for _, v in candidates[1:]])
    where = "the GPU" if cuda_used else "the CPU"
    busy_reason = "" if gpu_share is None else f"the GPU is busy {gpu_share:.0%} of step time"
    main = verdict(
        "compute-bound",
        f"the training step on {where} is the limit; data arrives in time",
        f"only {wait:.0%} of step time is spent waiting for data",
        busy_reason,
    )
    return report(main, [v for _, v in candidates])
