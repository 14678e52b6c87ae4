"""What each fix is predicted to gain: pure functions of the measured :class:`Figures`.

Each function returns the :class:`Fix` for one trainperf call (or None where it does not
apply), with ``predicted_speedup`` (samples per second after over before) and a ``basis``
sentence naming the figures it came from. The verdict rules (``_rules``) attach them to
their verdicts; ``WatchReport.what_if()`` ranks them.

The models, all on the mean step ``T`` (wall time over steps), its data wait ``w`` and the
rest ``c = T - w``:

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
- **Without the stalls** (:func:`stall_fixes`): the run minus the stalls' excess over the
  median step, ``1 / (1 - stall_fraction)``; saving ten times less often keeps a tenth.
  Stalls every fewer than 5 steps, or costing over half the run, are not predicted (more
  likely the loop's own cadence, such as gradient accumulation, than a save).
- **Lower precision** (:func:`precision_fix`, ``MixedPrecision``): on a GPU the reference
  table's fp16/fp32 throughput ratio ``r`` for this GPU (or its tensor-core GPUs' median)
  on the share ``g`` of the step the GPU is busy: ``1 / ((1 - g) + g / r)``; on a CPU with
  native bf16, ``r`` is what a small MLP training step gained under bf16 autocast
  (``_cpu_bf16``) and ``g`` the share of the step not spent waiting for data.
- **A larger batch** (:func:`batch_fix`, ``tune_batch_size``): doubling it keeps the host's
  time per step and doubles the GPU's: ``min(2, 1 / g)``.
- **Fewer threads** (:func:`threads_fix`): with torch's threads cut to the cores the
  workers and other processes leave, the workers keep up and the step's own time shrinks
  by what the crowding probe measured (``_crowding``), ``s``:
  ``T / max(c / s + h, Lw / (n (1 - t)), (m + Lw) / (N - o))`` (``h``: the loop's own
  time getting its batches, which fewer threads do not shorten: receiving them from
  workers, or without workers the whole wait; ``Lw``: the workers' CPU per step, ``n``
  workers (unknown behind an iterable that is not a DataLoader: no such term), ``t`` the
  share of the time the hypervisor steals, ``m`` the loop's CPU with ``k`` threads,
  ``(1 - t) (k c / s + h')`` but no more than the loop's process uses now nor less than
  ``(1 - t) (c / s + h')``, ``h'`` the CPU of ``h``: ``h`` with workers, without them
  what the loop's thread demanded while it waited; ``N`` the usable CPUs' worth of time
  the hypervisor leaves, ``o`` the cores other processes keep busy: the CPUs must hold
  the step's threads and the workers); without the probe (a GPU step) ``s = 1``, a lower
  bound.
- **The host's CPUs back** (:func:`free_cpus_fix`): the step minus the time the loop's
  thread waited for a CPU.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from trainperf._utils.format import plural
from trainperf.loader._search import default_max_workers
from trainperf.monitor._figures import (
    Figures,
    capacity,
    compute_s,
    gpu_share,
    main_cores,
    mean_step_s,
    others_cores,
    oversubscribed,
    threads_that_fit,
    wait_s,
    waits_for_data,
    worker_cores,
)
from trainperf.monitor._report import NOT_PREDICTED, Fix, VerdictKind

__all__ = [
    "LESS_OFTEN",
    "LoadCost",
    "batch_fix",
    "batches_per_step",
    "free_cpus_fix",
    "gpu_decode_fix",
    "gpu_fix",
    "load_cost",
    "loader_fix",
    "precision_fix",
    "receive_s",
    "reference_ratio",
    "stall_fixes",
    "step_cores",
    "threads_fix",
    "tuner_workers",
]

LESS_OFTEN = 10  # "save less often" is predicted for saving this many times less often
MIN_SAVE_PERIOD = 5  # stalls more often than this are not predicted as saves
MAX_SAVE_SHARE = 0.5  # nor stalls that take more than this share of the run
CPU_HEAVY = 0.5  # share of the loading on a CPU above which GPU decoding is predicted
HIDDEN_WORKERS = 0.1  # child processes' cores that show workers behind a non-DataLoader

LOADER_CALL = "trainperf.autotune_loader(dataset, batch_size, step_fn=train_step)"
GPU_DECODE_CALL = 'trainperf.pipelines.image_loader(folder, batch_size, backend="nvjpeg")'
ASYNC_SAVE_CALL = "trainperf.Checkpointer(directory).save(state, step=step, blocking=False)"
PRECISION_CALL = "trainperf.MixedPrecision()"
BATCH_CALL = "trainperf.tune_batch_size(train_step, sample, model=model, optimizer=optimizer)"
GPU_CALL = "model.to(device); batch = trainperf.to_device(batch, device)"
FREE_CPUS_CALL = "stop or move the other jobs (`trainperf doctor` shows the host's load)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _cores(n: int) -> str:
    return f"{n} core" if n == 1 else f"{n} cores"


def _speedup(before: float, after: float) -> float:
    return before / after if after > 0 else 1.0


# --------------------------------------------------------------------------- the loader


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
        f"{n} workers deliver a step's batches every {_ms(step)}, so one takes {_ms(wall)} "
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
        f"{cost.how}; {k} workers (the tuner's pick for {_cores(w_cpus)} left to workers"
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


# --------------------------------------------------------------------------- stalls


def stall_fixes(f: Figures) -> tuple[Fix, ...]:
    """A non-blocking save (the stalls' excess gone) and saving ten times less often."""
    if f.stall_period is None or f.stall_fraction <= 0 or not f.stall_steps:
        return ()
    lost = f.stall_fraction
    if f.stall_period < MIN_SAVE_PERIOD or lost > MAX_SAVE_SHARE:
        basis = (
            f"not predicted: a stall every {f.stall_period} steps costing {lost:.0%} of the "
            "run is more likely the loop's own cadence (w.step() called per micro-batch of "
            "a gradient accumulation, or an optimizer step every few batches) than a save"
        )
        return (Fix("periodic-stalls", ASYNC_SAVE_CALL, 1.0, basis),)
    each = lost * f.wall_s / len(f.stall_steps)
    figures = (
        f"{len(f.stall_steps)} stalls every {f.stall_period} steps, each {_ms(each)} over the "
        f"median step, {lost:.0%} of {f.wall_s:.2f} s"
    )
    async_saved, async_basis = _async_save_gain(f, lost, each, figures)
    less = lost * (1 - 1 / LESS_OFTEN)
    less_basis = (
        f"the run with a tenth of the stalls' excess ({figures}): saving every "
        f"{LESS_OFTEN * f.stall_period} steps instead of every {f.stall_period}"
    )
    return (
        Fix("periodic-stalls", ASYNC_SAVE_CALL, 1 / (1 - async_saved), async_basis),
        Fix(
            "periodic-stalls",
            f"trainperf.save_checkpoint(...) every {LESS_OFTEN * f.stall_period} steps",
            1 / (1 - less),
            less_basis,
        ),
    )


def _async_save_gain(f: Figures, lost: float, each: float, figures: str) -> tuple[float, str]:
    """The share of the run a non-blocking save wins back, and its basis: on the CPU,
    the save's own blocking (its fork and bookkeeping) stays in each stalled step (measured:
    ``save_block_s``);
    on a GPU, the copy of the state to pinned host memory, not measured."""
    block = f.setup.save_block_s
    if block is None:
        return lost, (
            f"the run without the stalls' excess ({figures}); a non-blocking save leaves only "
            "the copy of the state to host memory in the step, not measured here"
        )
    kept = min(1.0, block / each) if each > 0 else 1.0
    return lost * (1 - kept), (
        f"the run with {_ms(min(block, each))} of each stall's excess left ({figures}): a "
        f"non-blocking save of a CPU state blocked this process for {_ms(block)} here "
        "(measured: the fork that takes its snapshot, and its bookkeeping)"
    )


# --------------------------------------------------------------------------- the step


def _geomean_ratio(row: dict[str, float]) -> tuple[float, float, float] | None:
    try:
        cnn = row["resnet50_fp16"] / row["resnet50_fp32"]
        vit = row["vit_base_patch16_224_fp16"] / row["vit_base_patch16_224_fp32"]
    except (KeyError, ZeroDivisionError):
        return None
    return math.sqrt(cnn * vit), cnn, vit


def reference_ratio(gpu_name: str | None) -> tuple[float, str]:
    """The fp16/fp32 throughput ratio the reference table gives a GPU, and whence.

    The geometric mean of the table's ResNet-50 and ViT-B/16 ratios for the GPU; for a GPU
    the table lacks, the median of that over its tensor-core GPUs (fp16 faster than fp32).

    Example:
        >>> ratio, where = reference_ratio("NVIDIA A100-SXM4-80GB")
        >>> round(ratio, 2), where.split(" (")[0].split()[-1]
        (1.3, 'A100')
        >>> reference_ratio("NVIDIA H200")[1].startswith("NVIDIA H200 is not in the reference")
        True
    """
    from trainperf.bench import find_reference_gpu, reference_throughput

    table = reference_throughput()
    row = find_reference_gpu(gpu_name) if gpu_name else None
    found = _geomean_ratio(table[row]) if row else None
    if row is not None and found is not None:
        mean, cnn, vit = found
        return mean, (
            f"the reference table's fp16/fp32 throughput for the {row} (ResNet-50 {cnn:.2f}x, "
            f"ViT-B/16 {vit:.2f}x: {mean:.2f}x, their geometric mean)"
        )
    tensor = [r[0] for v in table.values() if (r := _geomean_ratio(v)) and r[1] > 1]
    median = statistics.median(tensor)
    name = gpu_name or "this GPU"
    return median, (
        f"{name} is not in the reference table: the median of its {len(tensor)} tensor-core "
        f"GPUs' fp16/fp32 throughput ({median:.2f}x)"
    )


def precision_fix(f: Figures) -> Fix | None:
    """``MixedPrecision``: the reference ratio on the GPU's busy share (Amdahl's law).

    None when a lower precision is already in use; 1.0 where ``MixedPrecision`` keeps fp32
    (a CPU without native bf16, a GPU before tensor cores, or one already chose fp32).
    """
    if f.precision is not None and f.precision[0] != "fp32":
        return None
    if f.precision is not None:
        basis = f"MixedPrecision is in use and chose fp32 ({f.precision[1]}): no lower precision"
        return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
    if not f.cuda_used:
        gain = f.setup.cpu_bf16_speedup
        if f.setup.cpu_native_bf16 and gain is not None:
            if gain <= 1.0:
                basis = (
                    f"a small MLP training step ran no faster under bf16 autocast than in "
                    f"fp32 on this CPU ({gain:.2f}x, measured by a probe): no gain"
                )
                return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
            g = compute_s(f) / mean_step_s(f) if mean_step_s(f) > 0 else 1.0
            basis = (
                f"a small MLP training step ran {gain:.2f}x faster under bf16 autocast than "
                f"in fp32 on this CPU (measured by a probe), on the {g:.0%} of step time "
                "not spent waiting for data"
            )
            return Fix("compute-bound", PRECISION_CALL, 1 / ((1 - g) + g / gain), basis)
        if f.setup.cpu_native_bf16:
            basis = (
                f"{NOT_PREDICTED}: bf16 on this CPU is not in the reference table; "
                "`trainperf bench matmul --device cpu` measures it"
            )
        else:
            basis = "this CPU has no native bf16, so MixedPrecision keeps fp32: no gain"
        return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
    cap = f.setup.gpu_capability
    if cap is not None and cap < (7, 0):
        basis = f"compute capability {cap[0]}.{cap[1]} has no fast fp16: MixedPrecision keeps fp32"
        return Fix("compute-bound", PRECISION_CALL, 1.0, basis)
    ratio, where = reference_ratio(f.setup.gpu_name)
    busy = gpu_share(f)
    g = 1.0 if busy is None else busy
    speedup = 1 / ((1 - g) + g / ratio)
    share = "all (not measured)" if busy is None else f"{g:.0%}"
    basis = f"{where}, on the {share} of step time the GPU is busy"
    return Fix("compute-bound", PRECISION_CALL, speedup, basis)


def batch_fix(f: Figures) -> Fix | None:
    """``tune_batch_size``: a doubled batch on a GPU busy ``g`` of the step: ``min(2, 1/g)``."""
    busy = gpu_share(f)
    if not f.cuda_used or busy is None:
        return None
    speedup = 2.0 if busy <= 0.5 else 1 / busy
    basis = (
        f"twice the batch: the host's time per step stays and the GPU's, busy {busy:.0%} of "
        "the step, doubles, if memory allows (tune_batch_size finds the largest that fits)"
    )
    return Fix("compute-bound", BATCH_CALL, speedup, basis)


def gpu_fix(f: Figures) -> Fix:
    """Moving the loop to the GPU: not predicted (the step's speed there is not measured)."""
    basis = (
        f"{NOT_PREDICTED}: a loop on the CPU says nothing of its speed on the GPU; "
        "`trainperf bench model` shows what this GPU does"
    )
    return Fix("gpu-unused", GPU_CALL, 1.0, basis)


# --------------------------------------------------------------------------- the CPUs


def threads_fix(f: Figures) -> Fix | None:
    """``torch.set_num_threads(k)``: the step's threads cut to the cores left to them.

    The workers get the cores the surplus threads took, so the data wait goes where they
    can keep up, but for the loop's own time getting its batches (:func:`kept_loading_s`,
    ``h``): the loop runs at ``max(c' + h, what each worker delivers on its core)``, and as
    far as the CPUs other processes leave hold the loop's thread and the workers' CPU
    together. The step's own time ``c`` becomes ``c' = c / s``, ``s`` what the crowding
    probe measured (``_crowding``: a parallel torch workload with ``k`` threads against the
    loop's count, beside processes as busy as the workers); without that figure (a GPU
    step, or not measured) ``c`` is kept, and the prediction is a lower bound.
    """
    threads = f.setup.torch_threads
    if not oversubscribed(f) or threads is None:
        return None
    k = threads_that_fit(f)
    step, work = mean_step_s(f), compute_s(f)
    probed = f.setup.fewer_threads_speedup if f.setup.fewer_threads == k else None
    fewer = work if probed is None else work / max(probed, 1.0)  # never slower than now
    bounds = _thread_bounds(f, k, fewer)
    after = min(step, max(bounds.loop, bounds.worker, bounds.cpus))
    lead = (
        f"torch runs {threads} threads on {f.cpus} usable CPUs, {_cores(k)} left once the "
        f"workers ({worker_cores(f):.1f} cores) and other processes ({others_cores(f):.1f}) "
        f"have theirs; with {k} {_wait_words(f, bounds)}"
    )
    if probed is None:
        step_s = (
            f"the step's own {_ms(work)} kept (fewer threads stop crowding it too, not predicted)"
        )
    else:
        gain = (
            f"runs {probed:.2f}x faster, as a parallel torch workload did"
            if probed > 1.0
            else f"is kept, as a parallel torch workload ran no faster ({probed:.2f}x)"
        )
        step_s = (
            f"the step's own {_ms(work)} {gain} with {plural(k, 'thread')} instead of "
            f"{threads} beside processes as busy as the workers ({_ms(fewer)})"
        )
    at_least = "at least: " if probed is None else ""
    basis = (
        f"{at_least}{lead}, {step_s}{_binding_words(bounds, step)}: "
        f"{_ms(step)} -> {_ms(after)} per step"
    )
    return Fix("host-bound", f"torch.set_num_threads({k})", _speedup(step, after), basis)


@dataclass(frozen=True)
class _ThreadBounds:
    """What bounds a step with fewer threads, in seconds: ``loop``, the loop's own thread
    (its step and ``taking``, getting its batches); ``worker``, each worker delivering its
    share on a core; ``cpus``, the CPUs holding the loop's CPU (``own``) and the workers'
    (``fed``) together."""

    loop: float
    worker: float
    cpus: float
    taking: float
    own: float
    fed: float


def _thread_bounds(f: Figures, k: int, fewer: float) -> _ThreadBounds:
    """The three bounds of :func:`threads_fix` for ``k`` threads and a step of ``fewer``.

    The step's times are wall time, of which a thread runs the share the hypervisor leaves
    (``left``); the workers' figures are CPU time, which takes a worker ``1 / left`` as long
    on its core. The loop's CPU is its ``k`` threads' (no more than its process uses now,
    nor less than one thread's) and the CPU it spends getting its batches.
    """
    step = mean_step_s(f)
    left = capacity(f) / f.cpus
    taking = kept_loading_s(f)
    # Without workers the loop loads in its own thread, for as much CPU as it demanded
    # while it waited (reads that sleep demand little), or the whole wait when unmeasured.
    demand = f.wait_cpu_s
    loading_cpu = taking if has_workers(f) or demand is None else min(demand, taking)
    own = left * (k * fewer + loading_cpu)
    now = main_cores(f)
    if now is not None:
        own = min(own, max(left * (fewer + loading_cpu), now * step))
    fed = worker_cores(f) * step  # the workers' CPU per step
    # Workers behind an iterable that is not a DataLoader: their count, so each one's
    # share, is unknown, and only the CPUs bound them.
    count = f.setup.num_workers
    worker = fed / count / left if count else 0.0
    cpus = (own + fed) / max(left, capacity(f) - others_cores(f))
    return _ThreadBounds(fewer + taking, worker, cpus, taking, own, fed)


def _binding_words(b: _ThreadBounds, step: float) -> str:
    """The clause naming the bound that is not the loop's own thread, if one binds."""
    if b.worker > max(b.loop, b.cpus):
        return f", but each worker takes {_ms(b.worker)} a step to deliver its share"
    if b.cpus <= max(b.loop, b.worker):
        return ""
    held = f"the CPUs hold its {_ms(b.own)} of CPU and the workers' {_ms(b.fed)}"
    if b.cpus < step:
        return f", and {held} in {_ms(b.cpus)}"
    return f", but {held} in no less than the step takes now"


def _wait_words(f: Figures, b: _ThreadBounds) -> str:
    """What becomes of the data wait with fewer threads: the workers get their cores back
    (and keep up, unless one worker's share is the bound), and the loop keeps its own
    ``taking`` of the wait."""
    wait, taking = wait_s(f), b.taking
    if not has_workers(f):
        if wait <= 0:
            return "the loop, loading in its own thread, waits for no data"
        return f"the {_ms(taking)} the loop spends loading in its own thread stays"
    workers = (
        "the workers keep up" if b.worker <= max(b.loop, b.cpus) else "the workers get cores back"
    )
    if wait <= 0:
        return workers
    if taking <= 0:
        return f"{workers} and the {_ms(wait)} data wait goes"
    if _ms(taking) == _ms(wait):
        return f"{workers}; the {_ms(wait)} data wait, the loop receiving its batches, stays"
    return (
        f"{workers} and the {_ms(wait)} data wait goes but for the {_ms(taking)} the loop "
        "takes to receive its batches"
    )


def hidden_workers(f: Figures) -> bool:
    """Child processes busy behind an iterable that is not a DataLoader: workers whose
    settings the watch cannot see."""
    return f.setup.num_workers is None and worker_cores(f) >= HIDDEN_WORKERS


def has_workers(f: Figures) -> bool:
    """The loop takes its batches from worker processes: a DataLoader with workers, or
    hidden ones (:func:`hidden_workers`)."""
    return bool(f.setup.num_workers) or hidden_workers(f)


def kept_loading_s(f: Figures) -> float:
    """Seconds per step the loop's thread spends getting its batches whatever its torch
    threads: receiving them from workers (its CPU demand while it waited, at most the
    wait), or, without workers, the whole wait (it loads them itself)."""
    if not has_workers(f):
        return wait_s(f)
    return min(f.wait_cpu_s or 0.0, wait_s(f))


def free_cpus_fix(f: Figures) -> Fix:
    """The host's CPUs back: the step minus the time its thread waited for a CPU."""
    step = mean_step_s(f)
    if f.cpu_delay_s is None:
        basis = f"{NOT_PREDICTED}: the time the loop's thread waited for a CPU was not measured"
        return Fix("host-bound", FREE_CPUS_CALL, 1.0, basis)
    delay = f.cpu_delay_s
    if delay >= step:  # a thread cannot wait longer than the step it waits in
        basis = f"{NOT_PREDICTED}: the measured wait for a CPU is not shorter than the step"
        return Fix("host-bound", FREE_CPUS_CALL, 1.0, basis)
    after = step - delay
    basis = (
        f"the loop's thread waited {_ms(delay)} per step for a CPU other processes held: "
        f"{_ms(step)} -> {_ms(after)} per step without them"
    )
    return Fix("host-bound", FREE_CPUS_CALL, _speedup(step, after), basis)
