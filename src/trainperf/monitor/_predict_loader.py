"""What a faster loader is predicted to gain: ``autotune_loader`` and GPU decoding.

Pure functions of the measured :class:`Figures` (see ``_predict``), on the mean step ``T``
(wall time over steps), its data wait ``w`` and the rest ``c = T - w``:

- **A faster loader** (:func:`loader_fix`, ``autotune_loader``): loading a step's batches
  takes one worker ``L`` seconds, ``Lc`` of them on a CPU (measured in the loop's thread
  when it loads, ``L = w``; from the workers' delivered rate and CPU when they do,
  ``L = num_workers * T``). The tuner's pick (with ``step_fn``), ``k`` workers, is the
  count that fills the cores it leaves for workers, ``W`` (usable CPUs minus the step's
  cores, or what the tuner measured), at ``Lc / L`` of a core each, no more than keep up
  with the step (``1.1 L / c``), capped by its ``max_workers``; they deliver a step's
  batches every ``max(L / k, Lc / W')`` seconds (``W'``: ``W`` less the cores other
  processes keep busy, and with workers already less the share of the time the hypervisor
  steals, ``t``: at least ``1 - t``; never slower than the loader's current workers), and
  the loop then runs at ``max(c + h, that)``, ``h`` the loop's own cost of receiving a
  step's batches (measured when it has workers already; from the hand-over probe,
  ``_handover``, when it loads in its own thread, which also adds a worker's cost of
  handing the batches over to ``L`` and ``Lc``), never slower than now (the tuner measures
  the current setting, and ``num_workers=0``, too). Workers behind an iterable that is not
  a DataLoader are not predicted.
- **GPU decoding** (:func:`gpu_decode_fix`, ``image_loader``): the loading's CPU work
  moves to the GPU, leaving ``max(c, (L - Lc) / k)``; the GPU's own decode time is not
  measured, so this is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainperf._utils.format import plural
from trainperf.loader._search import default_max_workers
from trainperf.monitor._figures import (
    Figures,
    capacity,
    compute_s,
    main_cores,
    mean_step_s,
    others_cores,
    wait_s,
    waits_for_data,
    worker_cores,
)
from trainperf.monitor._predict import _cores, _ms, _speedup, hidden_workers
from trainperf.monitor._verdict import Fix, VerdictKind

__all__ = [
    "LoadCost",
    "batches_per_step",
    "gpu_decode_fix",
    "load_cost",
    "loader_fix",
    "receive_s",
    "step_cores",
    "tuner_workers",
]

CPU_HEAVY = 0.5  # share of the loading on a CPU above which GPU decoding is predicted

LOADER_CALL = "trainperf.autotune_loader(dataset, batch_size, step_fn=train_step)"
GPU_DECODE_CALL = 'trainperf.pipelines.image_loader(folder, batch_size, backend="nvjpeg")'


@dataclass(frozen=True)
class LoadCost:
    """What loading one step's batches costs one worker (or the loop's thread).

    Attributes:
        wall_s: seconds one worker takes (``L``).
        cpu_s: of which on a CPU (``Lc``), running or waiting for one.
        how: where the figures come from, in words.
    """

    wall_s: float
    cpu_s: float
    how: str

    @property
    def cores(self) -> float:
        """The share of a core one worker keeps busy while it loads."""
        return min(1.0, self.cpu_s / self.wall_s) if self.wall_s > 0 else 1.0


def load_cost(f: Figures) -> LoadCost:
    """The loading cost per step, from the loop's thread or from the workers' rate.

    Loading in the loop's thread (``num_workers=0``, or not a DataLoader) it is the wait
    itself and the CPU the thread demanded meanwhile; with ``n`` workers keeping the loop
    waiting, each takes ``n`` steps' time per step's batches, using the workers' sampled CPU.
    A CPU figure not measured counts the whole time as CPU (the cautious case).
    """
    n = f.setup.num_workers or 0
    step = mean_step_s(f)
    if n == 0:
        wall = wait_s(f)
        cpu = wall if f.wait_cpu_s is None else min(f.wait_cpu_s, wall)
        how = (
            f"the loop's thread waits {_ms(wall)} per step for its batches, {_ms(cpu)} of it "
            "running or waiting for a CPU"
        )
        extra = (f.setup.handover_produce_s or 0.0) * batches_per_step(f)
        if extra > 0:  # a worker also collates into shared memory and pickles
            how += f", and a worker {_ms(extra)} more to hand them over (measured)"
        return LoadCost(wall + extra, cpu + extra, how)
    wall = n * step
    # No worker CPU sampled (none, or only zeros: the sampler had not found the workers
    # yet, as at each epoch's start without persistent workers): the cautious case.
    cpu = wall if not f.workers_cpu else min(worker_cores(f) * step, wall)
    how = (
        f"{plural(n, 'worker')} {'delivers' if n == 1 else 'deliver'} a step's batches every "
        f"{_ms(step)}, so one takes {_ms(wall)} "
        f"({_ms(cpu)} of CPU per step)"
    )
    return LoadCost(wall, cpu, how)


def batches_per_step(f: Figures) -> float:
    """Batches the loop takes per step (1 when not known)."""
    return f.setup.batches_per_step or 1.0


def receive_s(f: Figures) -> float | None:
    """CPU seconds per step the loop's thread would spend taking its batches from workers,
    where the hand-over probe measured it (a loop loading in its own thread); else None."""
    one = f.setup.handover_receive_s
    return None if one is None else one * batches_per_step(f)


def step_cores(f: Figures, cost: LoadCost) -> float:
    """Cores the training step keeps busy while it runs (what ``step_fn`` measures for the
    tuner): this process's CPU per step, less the loading in its own thread, over the step's
    time; 1 where the CPU was not sampled (the core the tuner keeps without ``step_fn``)."""
    own, work = main_cores(f), compute_s(f)
    if own is None or work <= 0:
        return 1.0
    handing = (f.setup.handover_produce_s or 0.0) * batches_per_step(f)  # not in this thread
    loading = (f.wait_cpu_s or 0.0) if f.setup.num_workers else cost.cpu_s - handing
    return min(float(f.cpus), max(0.0, own * mean_step_s(f) - loading) / work)


def tuner_workers(f: Figures, cost: LoadCost) -> tuple[int, int]:
    """``(k, W)``: the workers ``autotune_loader(..., step_fn=...)`` would pick, and the
    cores it leaves them.

    ``W`` is the tuner's own figure when it ran, else the usable CPUs minus the cores the
    step keeps busy (:func:`step_cores`; at least 1). ``k`` fills ``W`` at ``cost.cores``
    each, no more than keep up with the step with 10 % to spare (the tuner's cap with a
    ``step_fn``), within its ``max_workers`` (the tuner's, or its default for these CPUs),
    and never below the loader's current count (the tuner keeps a faster setting of the
    caller's).
    """
    w_cpus = f.setup.tuned_worker_cpus or max(1, round(f.cpus - step_cores(f, cost)))
    top = f.setup.tuned_max_workers or default_max_workers(f.cpus)
    k = math.floor((w_cpus + 0.5) / max(0.01, cost.cores))
    work = compute_s(f)
    if work > 0:
        k = min(k, math.ceil(1.1 * cost.wall_s / work))
    return max(1, min(top, k), f.setup.num_workers or 0), w_cpus


def loader_fix(f: Figures, finding: VerdictKind) -> Fix | None:
    """``autotune_loader``: the step against what the tuner's workers would deliver.

    With workers already, the loop's thread keeps its cost of taking each batch from them
    (the CPU it demanded while waiting); from ``num_workers=0`` that cost is not measured
    and not counted.
    """
    if not waits_for_data(f):
        return None
    if hidden_workers(f):
        basis = (
            f"not predicted: child processes of this loop use {worker_cores(f):.1f} cores, "
            "so workers load behind an iterable that is not a DataLoader, whose settings "
            "the watch cannot see: pass the DataLoader itself to w.iter() for a prediction"
        )
        return Fix(finding, LOADER_CALL, 1.0, basis)
    cost = load_cost(f)
    k, w_cpus = tuner_workers(f, cost)
    step, work = mean_step_s(f), compute_s(f)
    n = f.setup.num_workers or 0
    # The cores the workers get: those the tuner leaves them, less what other processes
    # keep busy there (they keep their load; the tuner does not count it), at least one;
    # with workers already, whose sampled CPU is what ran, also less the share of the time
    # the hypervisor steals (the loop thread's demand, without workers, counts it already).
    left = capacity(f) / f.cpus if n else 1.0
    free = max(left, w_cpus * left - others_cores(f))
    loader = max(cost.wall_s / k, cost.cpu_s / free)
    taking = min(f.wait_cpu_s or 0.0, wait_s(f)) if n else receive_s(f)
    if n:  # the tuner measures the loader's own setting too
        loader = min(loader, cost.wall_s / n)
    # ... and num_workers=0 (or the current setting): it never picks a slower one.
    after = min(step, max(work + (taking or 0.0), loader))
    if n:
        step_part = f"the step's {_ms(work)} and the {_ms(taking or 0.0)} it takes to receive them"
    elif taking is None:
        step_part = f"the step's {_ms(work)} (receiving them from workers not counted)"
    else:
        step_part = (
            f"the step's {_ms(work)} and the {_ms(taking)} it would take to receive them "
            "(measured by a one-worker probe of these batches)"
        )
    held = others_cores(f)
    others = f", {held:.1f} of them busy with other processes" if held >= 0.05 else ""
    if left <= 0.95:
        others += f", {1 - left:.0%} of their time stolen by the hypervisor"
    basis = (
        f"{cost.how}; {plural(k, 'worker')} (the tuner's pick for {_cores(w_cpus)} left to workers"
        f"{others}, {cost.cores:.0%} of a core each) would deliver them every {_ms(loader)} "
        f"against {step_part}: {_ms(step)} -> {_ms(after)} per step"
    )
    return Fix(finding, LOADER_CALL, _speedup(step, after), basis)


def gpu_decode_fix(f: Figures, finding: VerdictKind) -> Fix | None:
    """GPU decoding (``image_loader``): the loading's CPU work moved off the CPUs.

    Only on a CUDA loop that waits for data whose loading is mostly CPU work.
    """
    if not f.cuda_used or not waits_for_data(f):
        return None
    cost = load_cost(f)
    if cost.cores < CPU_HEAVY:
        return None
    k, _ = tuner_workers(f, cost)
    step, work = mean_step_s(f), compute_s(f)
    rest = (cost.wall_s - cost.cpu_s) / k
    after = max(work, rest)
    basis = (
        f"at most: {cost.how}; decoding on the GPU moves the {_ms(cost.cpu_s)} of CPU off "
        f"the host, leaving the step's {_ms(work)} (the GPU's decode time, not measured "
        f"here, adds to it): {_ms(step)} -> {_ms(after)} per step"
    )
    return Fix(finding, GPU_DECODE_CALL, _speedup(step, after), basis)
