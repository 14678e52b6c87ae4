"""Shared by the monitor tests: loaders that sleep, steps that burn CPU, synthetic timelines
and figures."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import torch

from trainperf.monitor import Sample, StepRecord
from trainperf.monitor._figures import Figures


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


def cpu_work(seconds: float) -> None:
    """Busy-waits on this thread's CPU time: ``seconds`` of CPU demand however crowded the
    host, or however much of its time the hypervisor steals (a wall-clock busy-wait on a VM
    whose CPUs other tenants share demands less: stolen time is neither run nor wait)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
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


def figures(**changes: object) -> Figures:
    """20 measured steps on a used GPU, 8 CPUs idle, no waiting, no samples, no stalls."""
    base = Figures(
        measured_steps=20, warmup_steps=2, gpu_present=True, cuda_used=True, cpus=8,
        wall_s=0.2, wait_fraction=0.0, median_step_s=0.01, gpu_span=None, utilisation=(),
        nvml_window_s=2.0, process_cpu=None, host_cpu=None, stall_period=None,
        stall_steps=(), stall_fraction=0.0, stall_median_s=None,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def cpu_loop(**changes: object) -> Figures:
    """A CPU loop of 100 steps of 20 ms on 2 CPUs (``figures`` with no GPU)."""
    loop: dict[str, object] = {
        "gpu_present": False, "cuda_used": False, "cpus": 2, "measured_steps": 100,
        "wall_s": 2.0, "median_step_s": 0.02,
    }  # fmt: skip
    return figures(**{**loop, **changes})


def doubling_timeline() -> list[StepRecord]:
    """Two workers keep up with a 5 ms step, until the per-sample cost doubles at step 60:
    then each step waits 3 ms for its batch (8 ms a step)."""
    out, start = [], 0.0
    for i in range(120):
        wait, compute = (0.0002, 0.005) if i < 60 else (0.003, 0.005)
        out.append(StepRecord(i, start, wait, compute, 8, None, 0.0001, 0.0))
        start += wait + compute
    return out
