"""Shared by the monitor tests: loaders that sleep, steps that burn CPU, synthetic timelines."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from trainperf.monitor import Sample, StepRecord


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trainperf-watch-sampler"]


def sleepy_loader(n: int, seconds: float, batch: int = 16) -> Iterator[torch.Tensor]:
    for _ in range(n):
        time.sleep(seconds)
        yield torch.zeros(batch, 4)


def burn(seconds: float) -> None:
    # Busy-waits on the wall clock, so a step lasts `seconds` even on a contended CPU.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def steps(n: int, wait: float, compute: float, **extra: object) -> list[StepRecord]:
    out = []
    for i in range(n):
        busy = extra.get("gpu_busy")
        out.append(StepRecord(i, i * (wait + compute), wait, compute, 32, busy))  # type: ignore[arg-type]
    return out


def samples(n: int, util: float | None, process_cpu: float, host_cpu: float) -> list[Sample]:
    return [Sample(i * 0.1, util, 2**30 if util is not None else None, process_cpu, host_cpu)
            for i in range(n)]  # fmt: skip
