"""The report types of ``trainperf.watch()``: :class:`StepRecord`, :class:`Sample`,
:class:`Verdict` and :class:`WatchReport` (printing, ``to_dict`` and ``plot``).

:func:`~trainperf.monitor.analyse` (in ``_analysis``) builds them; import everything
from :mod:`trainperf.monitor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from trainperf._utils.format import format_bytes
from trainperf._utils.imports import require

__all__ = ["Sample", "StepRecord", "Verdict", "VerdictKind", "WatchReport"]

VerdictKind = Literal[
    "input-bound", "compute-bound", "host-bound", "gpu-unused", "periodic-stalls", "inconclusive"
]


@dataclass(frozen=True)
class StepRecord:
    """One training step.

    Attributes:
        index: the step's number, from 0.
        start: seconds from the start of the watch to the step's start.
        wait: seconds spent waiting for batches (in ``w.iter``).
        compute: the rest of the step.
        samples: samples in the step's batches, None when unknown.
        gpu_busy: seconds between the step's two CUDA events (one recorded when its first
            batch arrives, one at ``w.step()``) as the GPU reached them, None without CUDA.
            An upper bound on the GPU's busy time: on an idle stream an event completes as
            soon as it is recorded, so a step that launches nothing spans its host time.
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

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``duration`` is left out: it is their sum)."""
        return _fields_dict(self)


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

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return _fields_dict(self)


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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"kind", "summary", "reasons" (a list), "fix"}``.

        Example:
            >>> Verdict("input-bound", "waits", ("30% waiting",), "tune").to_dict()["reasons"]
            ['30% waiting']
        """
        return {
            "kind": self.kind,
            "summary": self.summary,
            "reasons": list(self.reasons),
            "fix": self.fix,
        }


@dataclass(frozen=True)
class WatchReport:
    """The verdict on a watched loop and the measurements behind it.

    Steps before ``warmup_steps`` (loader start-up, cuDNN autotuning) are kept in
    ``timeline`` but left out of every figure. A long run keeps only its most recent steps
    and samples (``max_records`` of :func:`trainperf.watch`); the figures then cover those,
    and ``dropped_steps`` / ``dropped_samples`` count the older ones.

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
        wait_fraction: share of step time spent waiting for data; None when it was not
            measured (the loop called ``w.step()`` but never ``w.iter()``, so the time spent
            fetching batches is in the step time).
        gpu_busy_fraction: the steps' CUDA-event span as a share of step time (the sum of
            ``StepRecord.gpu_busy`` over the step time), None without CUDA. An upper bound
            on how busy the GPU was, not the busy share itself: a loop that launches kernels
            slowly, or none at all, still spans ~100 %. The verdict uses the smaller of this
            and ``gpu_utilization_mean`` / 100.
        gpu_utilization_mean: mean NVML utilisation (percent) over the measured steps.
        gpu_utilization_max: its maximum.
        gpu_memory_max: the most GPU memory seen in use, bytes.
        process_cpu_mean: mean CPU percent of this process and its children.
        host_cpu_mean: mean host CPU percent.
        cpus: CPUs this process may use.
        stall_period: N when every N-th step stalls, else None.
        stall_steps: indices of the stalled steps.
        stall_fraction: share of the measured time lost to those stalls.
        timeline: every step kept (the most recent ``max_records``).
        samples: every background sample kept.
        dropped_steps: older steps no longer kept (0 unless the run outgrew ``max_records``).
        dropped_samples: older background samples no longer kept.
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
    wait_fraction: float | None
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
    dropped_steps: int = 0
    dropped_samples: int = 0

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; the per-step timeline and samples only when asked for.

        Args:
            timeline: include ``timeline`` and ``samples`` (large for a long run).

        Returns:
            The report's fields as plain dicts, lists, strings and numbers (``json.dumps``
            takes it as it is); the verdict and findings as :meth:`Verdict.to_dict` gives them.

        Example:
            >>> import json
            >>> from trainperf.monitor import analyse
            >>> steps = [StepRecord(i, i * 0.02, 0.015, 0.005, 32, None) for i in range(8)]
            >>> data = analyse(steps).to_dict()
            >>> data["verdict"]["kind"], data["steps"], "timeline" in data
            ('input-bound', 8, False)
            >>> len(json.loads(json.dumps(analyse(steps).to_dict(timeline=True)))["timeline"])
            8
        """
        data = _fields_dict(self)  # in field order; the non-JSON values are replaced below
        data["verdict"] = self.verdict.to_dict()
        data["findings"] = [f.to_dict() for f in self.findings]
        data["stall_steps"] = list(self.stall_steps)
        if timeline:
            data["timeline"] = [s.to_dict() for s in self.timeline]
            data["samples"] = [s.to_dict() for s in self.samples]
        else:
            del data["timeline"], data["samples"]
        return data

    def __str__(self) -> str:
        v = self.verdict
        lines = [f"trainperf.watch: {v.kind}: {v.summary}"]
        if self.steps - self.warmup_steps >= 1 and self.wall_s > 0:
            rate = f", {self.samples_per_s:.1f} samples/s" if self.samples_per_s else ""
            kept = f", figures over the last {len(self.timeline)}" if self.dropped_steps else ""
            wait = (
                "data wait not measured (wrap the loader: w.iter(loader))"
                if self.wait_fraction is None
                else f"{self.wait_fraction:.0%} of it waiting for data"
            )
            lines.append(
                f"  {self.steps} steps ({self.warmup_steps} warm-up left out{kept}), "
                f"{self.steps_per_s:.2f} steps/s{rate}; median step {self.median_step_s * 1e3:.1f}"
                f" ms, {wait}"
            )
        gpu = []
        if self.gpu_busy_fraction is not None:
            gpu.append(f"CUDA events span {self.gpu_busy_fraction:.0%} of step time")
        if self.gpu_utilization_mean is not None:
            gpu.append(f"utilisation mean {self.gpu_utilization_mean:.0f}%")
        if self.gpu_memory_max is not None:
            gpu.append(f"memory up to {format_bytes(self.gpu_memory_max)}")
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

        Example:
            >>> from trainperf.monitor import analyse
            >>> steps = [StepRecord(i, i * 0.02, 0.015, 0.005, 32, None) for i in range(8)]
            >>> analyse(steps).plot("timeline.png")  # doctest: +SKIP
            PosixPath('timeline.png')
        """
        require("matplotlib", "WatchReport.plot()")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 6))
        FigureCanvasAgg(fig)  # a canvas of our own: pyplot's global state is left alone
        top, bottom = fig.subplots(2, 1, sharex=True)
        starts, widths, waits, computes = _binned(self.timeline)
        waited = "data wait" if self.wait_fraction is not None else "data wait (not measured)"
        top.bar(starts, waits, width=widths, align="edge", color="tab:orange", label=waited)
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


def _fields_dict(obj: Any) -> dict[str, Any]:
    """A dataclass's fields, shallow, in their order (``asdict`` would copy tuples as tuples)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


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
