"""The timeline's records in a ``trainperf.watch()`` report: :class:`StepRecord` (one
training step), :class:`Sample` (one background sample) and :class:`LoaderChange` (one
change an adaptive loader made while watched).

:func:`~trainperf.monitor.analyse` (in ``_analysis``) judges them; import them from
:mod:`trainperf.monitor`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["LoaderChange", "Sample", "StepRecord"]


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


def _fields_dict(obj: Any) -> dict[str, Any]:
    """A dataclass's fields, shallow, in their order (``asdict`` would copy tuples as tuples)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}
