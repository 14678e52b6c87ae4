"""The report types of ``trainperf.watch()``: :class:`StepRecord`, :class:`Sample`,
:class:`Fix`, :class:`Verdict`, :class:`WhatIf` and :class:`WatchReport` (printing,
``to_dict``; the plot is drawn by ``_plot``).

:func:`~trainperf.monitor.analyse` (in ``_analysis``) builds them; import everything
from :mod:`trainperf.monitor`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from trainperf._utils.format import format_bytes
from trainperf._utils.steal import steal_words
from trainperf.monitor._setup import LoopSetup

__all__ = [
    "NOT_PREDICTED",
    "Fix",
    "LoaderChange",
    "Sample",
    "StepRecord",
    "Verdict",
    "VerdictKind",
    "WatchReport",
    "WhatIf",
    "rank_fixes",
    "with_fixes",
]

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
        wait_cpu: CPU seconds the loop's thread demanded while it waited for the step's
            batches (running, plus runnable but waiting for a CPU: Linux ``schedstat``;
            CPU time elsewhere); loading in the loop's thread shows here, a worker's does
            not. None when not measured.
        cpu_delay: seconds of the step the loop's thread was runnable but waited for a CPU
            (other threads or processes held them); None when not measured.
    """

    index: int
    start: float
    wait: float
    compute: float
    samples: int | None
    gpu_busy: float | None
    wait_cpu: float | None = None
    cpu_delay: float | None = None

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
        workers_cpu: CPU percent of the children alone (DataLoader workers), part of
            ``process_cpu``; None when not measured.
        host_steal: percent of the host's CPU time the hypervisor withheld since the
            previous sample (a VM's "steal"), None where the platform does not report it.
    """

    time: float
    gpu_utilization: float | None
    gpu_memory_used: int | None
    process_cpu: float
    host_cpu: float
    workers_cpu: float | None = None
    host_steal: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return _fields_dict(self)


@dataclass(frozen=True)
class LoaderChange:
    """A change an adaptive loader (``autotune_loader(..., adapt=True)``) made while watched.

    Attributes:
        step: the step (from 0) that took the first batch with the new settings.
        time: seconds from the start of the watch to the change.
        old: ``(num_workers, prefetch_factor)`` before.
        new: ``(num_workers, prefetch_factor)`` after.
        reason: the rule that made it (``"input-bound"``, ``"cpus"``, ...).
        why: the loader's sentence for it, with the figures behind it.
    """

    step: int
    time: float
    old: tuple[int, int | None]
    new: tuple[int, int | None]
    reason: str
    why: str

    @property
    def label(self) -> str:
        """What changed, for the timeline's marker.

        Example:
            >>> LoaderChange(12, 3.5, (0, None), (4, 2), "input-bound", "...").label
            'num_workers 0→4'
            >>> LoaderChange(12, 3.5, (4, 2), (4, 4), "input-bound", "...").label
            'prefetch_factor 2→4'
        """
        if self.old[0] != self.new[0]:
            return f"num_workers {self.old[0]}→{self.new[0]}"
        return f"prefetch_factor {self.old[1]}→{self.new[1]}"

    def __str__(self) -> str:
        return f"step {self.step} ({self.time:.1f} s): {self.label} ({self.reason}): {self.why}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``old`` and ``new`` as lists)."""
        data = _fields_dict(self)
        data["old"], data["new"] = list(self.old), list(self.new)
        return data


NOT_PREDICTED = "not predicted"
"""How a ``basis`` begins when the figures say nothing about the gain (the speed-up is 1.0)."""


@dataclass(frozen=True)
class Fix:
    """One fix for a finding, and the gain predicted for it from the measured figures.

    Attributes:
        finding: the verdict kind it addresses.
        call: the trainperf call (or setting) that applies it.
        predicted_speedup: samples per second after the fix over samples per second now
            (1.8: 80 % more; 1.0: no gain predicted, or none can be, see ``basis``).
        basis: one sentence: how the prediction was computed, from which measured figures.
    """

    finding: VerdictKind
    call: str
    predicted_speedup: float
    basis: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict.

        Example:
            >>> Fix("input-bound", "trainperf.autotune_loader(dataset, 32)", 2.5, "...").to_dict()
            ... # doctest: +NORMALIZE_WHITESPACE
            {'finding': 'input-bound', 'call': 'trainperf.autotune_loader(dataset, 32)',
             'predicted_speedup': 2.5, 'basis': '...'}
        """
        return _fields_dict(self)


@dataclass(frozen=True)
class Verdict:
    """What limits the loop, why, what fixes it, and how much the fix is predicted to gain.

    Attributes:
        kind: ``"input-bound"``, ``"compute-bound"``, ``"host-bound"``, ``"gpu-unused"``,
            ``"periodic-stalls"`` or ``"inconclusive"``.
        summary: one sentence.
        reasons: the numbers behind it.
        fix: what to do, naming the trainperf tool that does it.
        predicted_speedup: the best of ``fixes``' predicted speed-ups (1.0 without fixes).
        basis: how that prediction was computed (the best fix's ``basis``).
        fixes: the fixes with a predicted gain, best first.
    """

    kind: VerdictKind
    summary: str
    reasons: tuple[str, ...]
    fix: str
    predicted_speedup: float = 1.0
    basis: str = f"{NOT_PREDICTED}: no fix was predicted"
    fixes: tuple[Fix, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"kind", "summary", "reasons" (a list), "fix",
        "predicted_speedup", "basis", "fixes" (a list of dicts)}``.

        Example:
            >>> Verdict("input-bound", "waits", ("30% waiting",), "tune").to_dict()["reasons"]
            ['30% waiting']
        """
        return {
            "kind": self.kind,
            "summary": self.summary,
            "reasons": list(self.reasons),
            "fix": self.fix,
            "predicted_speedup": self.predicted_speedup,
            "basis": self.basis,
            "fixes": [f.to_dict() for f in self.fixes],
        }


def with_fixes(verdict: Verdict, fixes: tuple[Fix, ...] | list[Fix]) -> Verdict:
    """``verdict`` carrying ``fixes``, ranked best first, and the best one's prediction.

    Example:
        >>> fixes = [Fix("input-bound", "a()", 1.5, "x"), Fix("input-bound", "b()", 3.0, "y")]
        >>> v = with_fixes(Verdict("input-bound", "waits", (), "tune"), fixes)
        >>> v.predicted_speedup, v.basis, [f.call for f in v.fixes]
        (3.0, 'y', ['b()', 'a()'])
    """
    ranked = tuple(sorted(fixes, key=lambda f: -f.predicted_speedup))
    if not ranked:
        return dataclasses.replace(verdict, fixes=())
    best = ranked[0]
    return dataclasses.replace(
        verdict, predicted_speedup=best.predicted_speedup, basis=best.basis, fixes=ranked
    )


@dataclass(frozen=True)
class WhatIf:
    """The fixes of a :class:`WatchReport`, ranked by predicted gain (``report.what_if()``).

    Attributes:
        fixes: every fix of the verdict and the "also" findings, best first; a call named
            by two findings is listed once, with the larger prediction.
        samples_per_s: the measured samples per second (None when batch sizes are
            unknown) of the steps the predictions judge, what each speed-up multiplies:
            the whole run's, or the steps' since the step time changed (the report's
            ``regime_start``).
        steps_per_s: their steps per second.
    """

    fixes: tuple[Fix, ...]
    samples_per_s: float | None
    steps_per_s: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"fixes": [Fix.to_dict(), ...], "samples_per_s",
        "steps_per_s"}``."""
        return {
            "fixes": [f.to_dict() for f in self.fixes],
            "samples_per_s": self.samples_per_s,
            "steps_per_s": self.steps_per_s,
        }

    def __str__(self) -> str:
        if not self.fixes:
            return "what if: no fix to predict"
        rate = (
            f"{self.samples_per_s:,.1f} samples/s"
            if self.samples_per_s
            else f"{self.steps_per_s:.2f} steps/s"
        )
        lines = [f"what if (ranked by predicted gain; now {rate}):"]
        for i, f in enumerate(self.fixes, start=1):
            lines.append(f"  {i}. {f.predicted_speedup:5.2f}x  {f.call}  [{f.finding}]")
            lines.append(f"            {f.basis}")
        return "\n".join(lines)


def rank_fixes(verdicts: tuple[Verdict, ...] | list[Verdict]) -> tuple[Fix, ...]:
    """Every fix of ``verdicts``, one per call (the larger prediction), best first."""
    best: dict[str, Fix] = {}
    for v in verdicts:
        for f in v.fixes:
            if f.call not in best or f.predicted_speedup > best[f.call].predicted_speedup:
                best[f.call] = f
    return tuple(sorted(best.values(), key=lambda f: -f.predicted_speedup))


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
        wait = (
            "data wait not measured (wrap the loader: w.iter(loader))"
            if self.wait_fraction is None
            else f"{self.wait_fraction:.0%} of it waiting for data"
        )
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
        from trainperf.monitor._plot import plot_report

        return plot_report(self, path)


def _predicted(v: Verdict) -> str:
    """The verdict's prediction in a few words: ``"2.50x with trainperf.autotune_loader(...)"``."""
    if not v.fixes:
        return v.basis
    return f"{v.predicted_speedup:.2f}x with {v.fixes[0].call}"


def _fields_dict(obj: Any) -> dict[str, Any]:
    """A dataclass's fields, shallow, in their order (``asdict`` would copy tuples as tuples)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}
