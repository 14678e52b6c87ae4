"""The report of ``trainperf.watch()``: :class:`WatchReport`, the verdict on a watched
loop with the figures behind it (printing, ``to_dict``; the plot is drawn by ``_plot``).
Its parts are the timeline's records (``_records``) and the findings (``_verdict``).

:func:`~trainperf.monitor.analyse` (in ``_analysis``) builds it; import everything
from :mod:`trainperf.monitor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainperf._utils.format import format_bytes
from trainperf._utils.steal import steal_words
from trainperf.monitor._records import LoaderChange, Sample, StepRecord, _fields_dict
from trainperf.monitor._setup import LoopSetup
from trainperf.monitor._verdict import NOT_PREDICTED, Verdict, WhatIf, rank_fixes

__all__ = ["WatchReport"]


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
            measured (the loop called ``w.step()`` but never ``w.iter()``, or a prefetch
            thread iterated it: ``setup.prefetch_thread``), so the time spent fetching
            batches is in the step time.
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
        host_steal_mean: mean percent of the host's CPU time the hypervisor withheld
            (steal: a VM whose physical CPUs other tenants share), None where unknown. The
            CPU shares the verdict judges are of the time that was left.
        cpus: CPUs this process may use.
        stall_period: N when every N-th step stalls, else None.
        stall_steps: indices of the stalled steps.
        stall_fraction: share of the measured time lost to those stalls.
        timeline: every step kept (the most recent ``max_records``).
        samples: every background sample kept.
        dropped_steps: older steps no longer kept (0 unless the run outgrew ``max_records``).
        dropped_samples: older background samples no longer kept.
        setup: what the loop ran with (DataLoader settings, torch threads, the GPU), as
            the predictions used it.
        regime_start: where the step time changed lastingly part-way (an epoch's
            augmentation got heavier, other jobs arrived), the first step after the change:
            the verdict, the findings and their predictions describe the steps since then;
            None without such a change.
        loader_changes: the changes an adaptive loader given to ``w.iter()`` made while
            watched, oldest first (the timeline plot marks each).
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
    setup: LoopSetup = field(default_factory=LoopSetup)
    regime_start: int | None = None
    loader_changes: tuple[LoaderChange, ...] = ()
    host_steal_mean: float | None = None

    def what_if(self) -> WhatIf:
        """The fixes of the verdict and the "also" findings, ranked by predicted gain.

        ``print(report.what_if())`` gives the table: each fix's predicted speed-up, the
        trainperf call that applies it, the finding it addresses, and the basis of the
        prediction.

        Example:
            >>> from trainperf.monitor import analyse
            >>> steps = [StepRecord(i, i * 0.02, 0.015, 0.005, 32, 0.0, 0.0) for i in range(20)]
            >>> best = analyse(steps, cpus=4).what_if().fixes[0]
            >>> best.call, round(best.predicted_speedup, 1)
            ('trainperf.autotune_loader(dataset, batch_size, step_fn=train_step)', 4.0)
        """
        samples_per_s, steps_per_s = self._judged_rates()
        return WhatIf(rank_fixes((self.verdict, *self.findings)), samples_per_s, steps_per_s)

    def _judged_rates(self) -> tuple[float | None, float]:
        """``(samples/s, steps/s)`` of the steps the verdict judges: the run's, or since
        the change in step time (``regime_start``), what the predictions multiply."""
        if self.regime_start is None:
            return self.samples_per_s, self.steps_per_s
        since = [s for s in self.timeline if s.index >= self.regime_start]
        wall = sum(s.duration for s in since)
        if not since or wall <= 0:
            return self.samples_per_s, self.steps_per_s
        counts = [s.samples for s in since]
        samples = None if None in counts else sum(n or 0 for n in counts) / wall
        return samples, len(since) / wall

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
        data["setup"] = self.setup.to_dict()
        data["what_if"] = [f.to_dict() for f in self.what_if().fixes]
        data["loader_changes"] = [c.to_dict() for c in self.loader_changes]
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
            lines.append(self._rate_line())
        lines.extend(self._use_lines())
        if self.regime_start is not None:
            lines.append(
                f"  the step time changed at step {self.regime_start}: the verdict, findings "
                "and predictions cover the steps since then"
            )
        for c in self.loader_changes:
            lines.append(f"  the loader retuned at step {c.step}: {c.label} ({c.reason})")
        lines.extend(f"  - {r}" for r in v.reasons)
        lines.append(f"  fix: {v.fix}")
        lines.append(f"  predicted: {_predicted(v)}")
        for f in self.findings:
            lines.append(f"  also {f.kind}: {f.summary}")
            lines.append(f"    fix: {f.fix}")
            lines.append(f"    predicted: {_predicted(f)}")
        lines.append(str(self.what_if()))
        return "\n".join(lines)

    def _rate_line(self) -> str:
        rate = f", {self.samples_per_s:.1f} samples/s" if self.samples_per_s else ""
        kept = f", figures over the last {len(self.timeline)}" if self.dropped_steps else ""
        thread = self.setup.prefetch_thread
        if self.wait_fraction is not None:
            wait = f"{self.wait_fraction:.0%} of it waiting for data"
        elif thread is None:
            wait = "data wait not measured (wrap the loader: w.iter(loader))"
        else:
            wait = f"data wait not measured (w.iter() ran in prefetch thread {thread!r})"
        return (
            f"  {self.steps} steps ({self.warmup_steps} warm-up left out{kept}), "
            f"{self.steps_per_s:.2f} steps/s{rate}; median step {self.median_step_s * 1e3:.1f}"
            f" ms, {wait}"
        )

    def _use_lines(self) -> list[str]:
        lines = []
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
                + steal_words(self.host_steal_mean)
            )
        return lines

    def plot(self, path: str | Path) -> Path:
        """Save a timeline PNG: step time split into wait and compute, GPU and CPU use.

        Args:
            path: the PNG to write (another suffix matplotlib knows, ``.svg`` or ``.pdf``,
                picks that format; none writes a PNG at ``path`` as given).

        Returns:
            ``path`` as a :class:`~pathlib.Path`.

        Raises:
            FileNotFoundError: the folder ``path`` is in does not exist.
            IsADirectoryError: ``path`` is a folder.
            ModuleNotFoundError: matplotlib is not installed (``pip install 'trainperf[plot]'``).

        Example:
            >>> from trainperf.monitor import analyse
            >>> steps = [StepRecord(i, i * 0.02, 0.015, 0.005, 32, None) for i in range(8)]
            >>> analyse(steps).plot("timeline.png")  # doctest: +SKIP
            PosixPath('timeline.png')
        """
        from trainperf.monitor._plot import plot_report

        return plot_report(self, path)


def _predicted(v: Verdict) -> str:
    """The verdict's prediction in a few words: ``"2.50x with trainperf.autotune_loader(...)"``,
    a bound as its basis says (``"at most 1.52x with ..."``), and a placeholder 1.0 (a basis
    that begins "not predicted") as no forecast: ``"not predicted for ..."``, not ``"1.00x"``."""
    if not v.fixes:
        return v.basis
    best = v.fixes[0]
    if best.basis.startswith(NOT_PREDICTED):
        return f"{NOT_PREDICTED} for {best.call}"
    bound = next((b for b in ("at most", "at least") if best.basis.startswith(b + ":")), "")
    return f"{bound + ' ' if bound else ''}{v.predicted_speedup:.2f}x with {best.call}"
