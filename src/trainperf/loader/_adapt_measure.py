"""What the adaptive loader reads besides its own clocks: the usable CPUs' busy time (every
process counted) and its workers' CPU (psutil on their pids, at most twice a second)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import psutil

__all__ = ["CpuMark", "Workers", "cpu_mark", "host_busy"]

_SAMPLE_EVERY_S = 0.5  # how often the workers' CPU is read


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


CpuMark = dict[int, tuple[float, float]]
"""``{cpu: (busy seconds, total seconds)}`` for this process's CPUs."""


def cpu_mark() -> CpuMark | None:
    """The busy and total time of each CPU this process may run on, so far (read with its
    own mark, not psutil's shared one that ``cpu_percent`` moves)."""
    try:
        per = psutil.cpu_times(percpu=True)
        mine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    out = {}
    for i in mine:
        if i < len(per):
            t = per[i]
            total = float(sum(t))
            out[i] = (total - t.idle - getattr(t, "iowait", 0.0), total)
    return out


def host_busy(before: CpuMark | None, after: CpuMark | None) -> float | None:
    """Share of the CPUs' time busy between two marks (every process counted), or None.

    Example:
        >>> host_busy({0: (1.0, 2.0), 1: (0.0, 2.0)}, {0: (3.0, 4.0), 1: (1.0, 4.0)})
        0.75
    """
    if not before or not after:
        return None
    busy = total = 0.0
    for cpu, (b1, t1) in after.items():
        if cpu in before:
            b0, t0 = before[cpu]
            busy, total = busy + b1 - b0, total + t1 - t0
    return min(1.0, max(0.0, busy / total)) if total > 0 else None


class Workers:
    """The workers' CPU, read at most every half second while batches arrive."""

    def __init__(self) -> None:
        self.procs: list[psutil.Process] = []
        self.first: tuple[float, float] | None = None  # (wall, cpu seconds)
        self.last: tuple[float, float] | None = None

    def read(self, it: Any, now: float) -> None:
        if self.last is not None and now - self.last[0] < _SAMPLE_EVERY_S:
            return
        if not self.procs:
            with contextlib.suppress(psutil.Error, AttributeError):
                self.procs = [psutil.Process(w.pid) for w in getattr(it, "_workers", [])]
            if not self.procs:
                return
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                total += _cpu_s(p)
        self.last = (now, total)
        if self.first is None:
            self.first = self.last

    def cores(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
