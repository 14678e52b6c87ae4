"""The training step's share of the CPUs: ``step_fn`` timed alone, and the cores left.

Without ``step_fn`` the main process keeps one core (the training step is unknown). With
it, the step is timed on a few batches in this process, and the main process keeps the CPU
it was measured to use at the rate it will be fed; the workers get the rest
(:func:`cores_for_workers`). A call of ``step_fn`` cannot be cut short, so none is started
that would end after the deadline by the last one's time (:func:`time_step`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainperf.loader._report import CandidateResult

__all__ = [
    "Shares",
    "StepTiming",
    "cores_for_workers",
    "loader_ceiling",
    "main_process_cores",
    "split_cores",
    "time_step",
]


def _moved(batch: Any, device: torch.device) -> Any:
    from trainperf.device import to_device

    try:
        batch = to_device(batch, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:
        raise RuntimeError(
            f"moving a batch to {device} for step_fn failed: {e!r}; step_fn gets the batch "
            f"on the tuning device, so its tensors (or objects with a .to method) must move "
            f"there"
        ) from e
    return batch


def _timed_call(
    step_fn: Callable[[Any], Any], batch: Any, device: torch.device
) -> tuple[float, float]:
    """Wall and CPU seconds of one ``step_fn(batch)``."""
    name = getattr(step_fn, "__qualname__", None) or repr(step_fn)
    t, c = time.perf_counter(), time.process_time()
    try:
        step_fn(batch)
        # CPU time stops before the tuner's own synchronize: waiting on it may spin, and
        # a training loop does not synchronise after every step.
        c_end = time.process_time()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:
        raise RuntimeError(
            f"step_fn {name} raised on a batch of the dataset (moved to {device}): {e!r}; "
            f"tune_loader calls step_fn(batch) like one training step"
        ) from e
    return time.perf_counter() - t, c_end - c


@dataclass(frozen=True)
class StepTiming:
    """What :func:`time_step` measured.

    Attributes:
        samples_per_s: the step's own throughput.
        cpu_per_sample: this process's CPU seconds per sample until ``step_fn`` returns.
        calls: timed calls; 0 when the budget allowed only the warm-up call, whose figures
            are then used (they include one-off start-up costs: a partial measurement).
        longest_s: the longest call, with its batch (loaded in this process) and the move to
            the device: how far past the deadline one call can run.
    """

    samples_per_s: float
    cpu_per_sample: float
    calls: int
    longest_s: float

    @property
    def partial(self) -> bool:
        """Only the warm-up call was timed."""
        return self.calls == 0


def time_step(
    dataset: Any,
    batch_size: int,
    loader_kwargs: Mapping[str, Any],
    step_fn: Callable[[Any], Any],
    device: torch.device,
    deadline: float,
) -> StepTiming:
    """``step_fn`` alone: one warm-up call, then up to 5 timed calls (1 s).

    Returns its samples/s and the CPU seconds it costs per sample (this process's CPU time
    until ``step_fn`` returns, all threads counted, not the synchronisation the tuner adds
    after it), from which the main process's share of the cores follows. Each batch is
    moved to ``device`` first (outside the timed region), as the training loop would do; on
    CUDA the device is synchronised before and after each call so the time is the step's
    and not a queue's.

    Nothing interrupts a call (it runs the caller's code in this process), so the deadline
    is kept by not starting one that the last one says would end after it: only the first
    call, or one slower than the one before, runs past the deadline. When no time is left
    after the warm-up call, its figures are returned (``calls == 0``).

    Raises:
        RuntimeError: a batch cannot be moved to ``device``, or ``step_fn`` raises.
    """
    kwargs = {k: v for k, v in loader_kwargs.items() if k in ("shuffle", "sampler", "collate_fn")}
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=batch_size, **kwargs)
    it = iter(loader)
    spent, cpu, calls, samples = 0.0, 0.0, 0, 0
    warm_up = (math.inf, 0.0)  # wall and CPU seconds of the first call
    longest = 0.0
    for i in range(6):
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        wall_s, cpu_s = _timed_call(step_fn, _moved(batch, device), device)
        now = time.perf_counter()
        longest = max(longest, now - start)
        if i == 0:  # the first call pays for lazy initialisation
            warm_up = (wall_s, cpu_s)
        else:
            spent += wall_s
            cpu += cpu_s
            calls += 1
            samples += batch_size
        if (calls and spent > 1.0) or now + (now - start) > deadline:
            break
    if not calls:
        wall_s, cpu_s = warm_up
        return StepTiming(batch_size / max(wall_s, 1e-9), cpu_s / batch_size, 0, longest)
    return StepTiming(samples / max(spent, 1e-9), cpu / samples, calls, longest)


def main_process_cores(
    cpus: int,
    step_cpu_per_sample: float | None = None,
    samples_per_s: float = 0.0,
) -> float:
    """Cores kept for the main process: one when the training step is unknown (no
    ``step_fn``), else the step's CPU seconds per sample times the samples per second it
    will process (at most ``cpus``).

    Example:
        >>> main_process_cores(16), main_process_cores(16, 0.0005, 2000.0)
        (1.0, 1.0)
        >>> main_process_cores(16, 2e-6, 5000.0), main_process_cores(2, 0.01, 500.0)
        (0.01, 2.0)
    """
    if step_cpu_per_sample is None:
        return 1.0
    return round(min(float(cpus), max(0.0, step_cpu_per_sample * samples_per_s)), 2)


def loader_ceiling(baseline: CandidateResult, cpus: int) -> float:
    """Samples/s the loading could reach with every usable core, from ``num_workers=0``
    (an upper bound: the main process's demand is judged at the fastest the step could be
    fed).

    Example:
        >>> loader_ceiling(CandidateResult(0, None, False, "ok", samples_per_s=100.0,
        ...                                main_cpu=0.5), 4)
        800.0
    """
    rate = baseline.samples_per_s or 0.0
    return cpus * rate / min(1.0, max(0.01, baseline.main_cpu or 1.0))


def cores_for_workers(cpus: int, main_cores: float) -> int:
    """Whole cores the workers may keep busy: the rest after ``main_cores``, at least 1.

    Example:
        >>> cores_for_workers(16, 1.0), cores_for_workers(2, 0.02), cores_for_workers(2, 2.0)
        (15, 2, 1)
    """
    return max(1, math.floor(cpus - main_cores + 0.5))


@dataclass(frozen=True)
class Shares:
    """How the usable cores are split, and the step's timing when ``step_fn`` was timed."""

    main_cores: float
    worker_cpus: int
    step: StepTiming | None = None

    @property
    def step_samples_per_s(self) -> float | None:
        """The step's own throughput, when it was timed."""
        return None if self.step is None else self.step.samples_per_s


def split_cores(
    dataset: Any,
    batch_size: int,
    loader_kwargs: Mapping[str, Any],
    step_fn: Callable[[Any], Any] | None,
    *,
    device: torch.device,
    cpus: int,
    baseline: CandidateResult,
    batch_s: float,
    deadline: float,
    notes: list[str],
) -> Shares:
    """One core for the main process, or what ``step_fn`` was measured to use.

    ``step_fn`` is not timed when its first batch (``batch_s``, loaded in this process)
    would already end after the deadline; a note says so, or that only its warm-up call
    was timed.
    """
    main_cores = main_process_cores(cpus)
    if step_fn is None:
        return Shares(main_cores, cores_for_workers(cpus, main_cores))
    if time.perf_counter() + batch_s >= deadline:
        notes.append(
            "step_fn was not timed: the time budget ran out first, so one core is kept for "
            "the main process; fix: a larger budget_s"
        )
        return Shares(main_cores, cores_for_workers(cpus, main_cores))
    step = time_step(dataset, batch_size, loader_kwargs, step_fn, device, deadline)
    if step.partial:
        notes.append(
            "step_fn was timed on its warm-up call only (the time budget ran out), which may "
            "include one-off start-up costs; fix: a larger budget_s"
        )
    # The main process steps as fast as batches arrive, up to the step's own speed.
    fed = min(step.samples_per_s, loader_ceiling(baseline, cpus))
    main_cores = main_process_cores(cpus, step.cpu_per_sample, fed)
    return Shares(main_cores, cores_for_workers(cpus, main_cores), step)
