"""The verdict rules of ``trainperf.watch()``: pure functions of the measured figures.

:func:`~trainperf.monitor.analyse` (in ``_analysis``) measures a timeline into one
:class:`Figures` and applies the rules in order. The first three settle the verdict alone:
:func:`too_few_steps` (inconclusive), :func:`cuda_never_initialised` and :func:`gpu_idle`
(gpu-unused). The candidates :func:`periodic_stalls`, :func:`input_bound` and
:func:`host_bound` are then ranked by :func:`rank` on how much of the run each explains
(:func:`weight`): the first leads and the others become the report's "also" findings;
when none explains any of the run, :func:`cpus_held_by_others` (other processes keep the
host busy) leads if it applies and the GPU is not shown busy, else :func:`compute_bound`.
Each rule returns its :class:`Verdict`, or None where it does not apply, so each can be
tested on figures alone.

Two inputs change what the rules may say. Without ``w.iter()``, or with ``w.iter()`` in a
prefetch thread (``LoopSetup.prefetch_thread``), the time spent fetching a batch is step
time (``Figures.wait_measured`` is False): nothing is input-bound then, and compute-bound
says that the data wait was not measured, and why, instead of "data arrives in time".
A :class:`trainperf.amp.MixedPrecision` in use (``Figures.precision``) is not advised again.

Every verdict carries the fixes that apply to it, each with the gain predicted for it by
a pure function of the same figures (``_predict``): ``Verdict.predicted_speedup`` and
``Verdict.basis`` are the best fix's. :class:`Figures` and the figures derived from it
that the predictions share live in ``_figures`` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainperf._utils.steal import steal_words
from trainperf.monitor._figures import (
    CPU_SATURATED,
    HOST_SATURATED,
    INPUT_BOUND_WAIT,
    NVML_MIN_SAMPLES,
    NVML_MIN_WINDOW_S,
    SAWTOOTH_MAX_MEAN,
    SAWTOOTH_MIN_SAMPLES,
    SAWTOOTH_MIN_STDEV,
    SAWTOOTH_WAIT,
    Figures,
    cpu_share,
    cpus_saturated,
    gpu_share,
    nvml_share,
    others_cores,
    oversubscribed,
    saw_tooth,
    threads_that_fit,
    waits_for_data,
    worker_cores,
)
from trainperf.monitor._predict_cpus import free_cpus_fix, threads_fix
from trainperf.monitor._predict_loader import gpu_decode_fix, loader_fix
from trainperf.monitor._predict_stalls import epochs_per_stall, stall_fixes
from trainperf.monitor._predict_step import batch_fix, gpu_fix, precision_fix
from trainperf.monitor._verdict import NOT_PREDICTED, Fix, Verdict, VerdictKind, with_fixes

__all__ = [
    "CPU_SATURATED",
    "GPU_IDLE_UTIL",
    "GPU_STARVED",
    "HOST_SATURATED",
    "INPUT_BOUND_WAIT",
    "MIN_STEPS",
    "NVML_MIN_SAMPLES",
    "NVML_MIN_WINDOW_S",
    "SAWTOOTH_MAX_MEAN",
    "SAWTOOTH_MIN_SAMPLES",
    "SAWTOOTH_MIN_STDEV",
    "SAWTOOTH_WAIT",
    "STALL_SHARE",
    "UNMEASURED",
    "Figures",
    "compute_bound",
    "cpu_share",
    "cpus_held_by_others",
    "cpus_saturated",
    "cuda_never_initialised",
    "gpu_figures",
    "gpu_idle",
    "gpu_share",
    "host_bound",
    "input_bound",
    "nvml_share",
    "periodic_stalls",
    "rank",
    "saw_tooth",
    "too_few_steps",
    "waits_for_data",
    "weight",
]

MIN_STEPS = 5  # measured steps needed for a verdict
GPU_IDLE_UTIL = 5.0  # percent
GPU_STARVED = 0.5  # busy share under which saturated CPUs make the loop host-bound
STALL_SHARE = 0.1  # share of run time lost to periodic stalls that makes them the verdict
# How a reason that explains an unmeasured data wait begins (the watch adds none then).
UNMEASURED = "data waiting was not measured"

_FIXES: dict[str, str] = {
    "input-bound": (
        "feed the loop faster: trainperf.autotune_loader(dataset, batch_size, "
        "step_fn=train_step) picks num_workers, prefetch_factor and pin_memory for this "
        "machine and this step; trainperf.pipelines.image_loader decodes images on the GPU"
    ),
    "host-bound": (
        "the CPUs are saturated: move decoding and augmentation to the GPU "
        "(trainperf.pipelines.image_loader), rent 4-8 cores per GPU, and check "
        "`trainperf doctor` for thread oversubscription"
    ),
    "compute-bound": (
        "the training step itself is the limit: use bf16/fp16 autocast "
        "(trainperf.amp.MixedPrecision), channels_last for convolutional models, and a larger "
        "batch if memory allows"
    ),
    "gpu-unused": (
        "move the model and each batch to the GPU: model.to(device) and "
        "batch = trainperf.to_device(batch, device), with device = trainperf.best_device()"
    ),
    "periodic-stalls": (
        "something expensive runs every few steps inside the loop: save checkpoints without "
        "blocking the loop (trainperf.Checkpointer(...).save(..., blocking=False)) or less "
        "often (trainperf.save_checkpoint every few hundred steps or per epoch), and move "
        "image saving and logging out of the loop"
    ),
    "inconclusive": "watch more steps: call w.step() once at the end of each training step",
}
# Stalls between epochs (``epochs_per_stall``): a validation pass as likely as a save.
_BETWEEN_EPOCHS_FIX = (
    "something expensive runs between epochs: if it is a validation pass, validate every few "
    "epochs or on a subset of the validation set; if it is a save, save without blocking the "
    "loop (trainperf.Checkpointer(...).save(..., blocking=False)) or every few epochs"
)
_HELD_CPUS_FIX = (
    "other processes are using this host's CPUs, so every figure here is slowed by them: "
    "stop or move the other jobs (`trainperf doctor` shows the host's load) or run where "
    "these cores are yours, then watch again"
)
_STEP_FIXES = "use channels_last for convolutional models, and a larger batch if memory allows"


def _verdict(
    kind: VerdictKind, summary: str, *reasons: str, fixes: Sequence[Fix | None] = ()
) -> Verdict:
    verdict = Verdict(kind, summary, tuple(r for r in reasons if r), _FIXES[kind])
    return with_fixes(verdict, [x for x in fixes if x is not None])


# --------------------------------------------------------------------------- derived figures


def _nvml_note(f: Figures) -> str:
    if nvml_share(f) is not None or f.utilisation_mean is None:
        return ""
    return (
        f"NVML utilisation ({len(f.utilisation)} samples over {f.nvml_window_s:.2f} s) is not "
        f"used: it averages over up to {NVML_MIN_WINDOW_S:g} s, so watch at least that long"
    )


def gpu_figures(f: Figures) -> str:
    """The GPU figures behind a verdict, in words ("" without any)."""
    parts = (
        "" if nvml_share(f) is None else f"NVML utilisation averages {f.utilisation_mean:.0f}%",
        ""
        if f.gpu_span is None
        else f"the steps' CUDA events span {f.gpu_span:.0%} of step time (an upper bound)",
        _nvml_note(f),
    )
    return "; ".join(part for part in parts if part)


def _cpu_reason(f: Figures) -> str:
    tree = cpu_share(f)
    if tree is None:
        return ""
    host = "" if f.host_cpu is None else f", the host is {f.host_cpu:.0f}% busy"
    stolen = steal_words(f.host_steal)
    left = " (of the time the hypervisor left them)" if stolen else ""
    return (
        f"this process and its workers use {tree:.0%} of the {f.cpus} usable CPUs{left}"
        + host
        + stolen
    )


def _wait_reason(f: Figures) -> str:
    return f"{f.wait_fraction:.0%} of step time is spent waiting for the next batch"


def _unmeasured_reason(f: Figures) -> str:
    """Why the data wait was not measured: no ``w.iter()``, or one a prefetch thread ran."""
    thread = f.setup.prefetch_thread
    if thread is None:
        return (
            f"{UNMEASURED}: w.step() was called but w.iter() never was, so the time spent "
            "fetching each batch counts as step time"
        )
    return (
        f"{UNMEASURED}: w.iter() ran in thread {thread!r} (a prefetch "
        "thread), not in the loop's, so the loop's own wait for each batch counts as step time"
    )


def _wrap(f: Figures) -> str:
    """The loop that measures the data wait: over the loader, or, where a prefetch thread
    iterated ``w.iter()``, over what the loop itself iterates (its own wait is for the
    prefetcher)."""
    if f.setup.prefetch_thread is None:
        return "for batch in w.iter(loader)"
    return "wrap what the loop itself iterates, for batch in w.iter(prefetcher)"


def _how(f: Figures) -> str:
    """How to measure the data wait, naming the prefetch thread where one iterated it."""
    if f.setup.prefetch_thread is None:
        return f"wrap the loader, {_wrap(f)}"
    return f"w.iter() ran in prefetch thread {f.setup.prefetch_thread!r}; {_wrap(f)}"


def _measure_wait(f: Figures) -> str:
    """The first step of a fix where the data wait was not measured."""
    return f"measure the data wait first: {_wrap(f)}: ... w.step(), and watch again; "


# --------------------------------------------------------------------------- decisive rules


def too_few_steps(f: Figures) -> Verdict | None:
    """inconclusive: fewer than ``MIN_STEPS`` measured steps, or steps that took no
    measurable time: a clock that did not advance (every share of step time is 0/0), or
    one too coarse for the steps (most took none, a few every tick: not periodic stalls)."""
    if f.measured_steps < MIN_STEPS:
        verdict = _verdict(
            "inconclusive",
            f"{f.measured_steps} measured step(s) after {f.warmup_steps} warm-up; a verdict "
            f"needs at least {MIN_STEPS}",
        )
        return replace(verdict, basis=f"{NOT_PREDICTED}: {f.measured_steps} step(s) say too little")
    if f.wall_s > 0 and f.median_step_s > 0:  # NaN too is no time to judge
        return None
    if f.wall_s > 0:
        summary = (
            f"most of the {f.measured_steps} measured steps took no measurable time (the "
            f"median is 0 of {f.wall_s:.3g} s in all): the clock (time.perf_counter) "
            "advanced in ticks longer than a step, so the time fell on a few steps; watch "
            "the loop with a finer clock"
        )
    else:
        summary = (
            f"the {f.measured_steps} measured steps took no measurable time: the clock "
            "(time.perf_counter) did not advance between w.step() calls, as under a test "
            "library that freezes time; watch the loop with a running clock"
        )
    verdict = _verdict("inconclusive", summary)
    return replace(verdict, basis=f"{NOT_PREDICTED}: steps of no time say nothing")


def cuda_never_initialised(f: Figures) -> Verdict | None:
    """gpu-unused: a GPU is visible but the process never initialised CUDA."""
    if not f.gpu_present or f.cuda_used:
        return None
    return _verdict(
        "gpu-unused",
        "a GPU is visible but this process never initialised CUDA: the model and data stay "
        "on the CPU",
        fixes=(gpu_fix(f),),
    )


def gpu_idle(f: Figures) -> Verdict | None:
    """gpu-unused: a GPU is visible and busy under ``GPU_IDLE_UTIL`` percent of the time."""
    share = gpu_share(f)
    if not f.gpu_present or share is None or share * 100 >= GPU_IDLE_UTIL:
        return None
    return _verdict(
        "gpu-unused",
        f"CUDA is initialised but the GPU is busy only {share:.0%} of the time: the model or "
        "the data is not on the GPU",
        gpu_figures(f),
        fixes=(gpu_fix(f),),
    )


# --------------------------------------------------------------------------- candidates


def periodic_stalls(f: Figures) -> Verdict | None:
    """periodic-stalls: every N-th step stalls, costing at least half of ``STALL_SHARE``.

    Under ``STALL_SHARE`` the stalls rank with weight 0 (:func:`weight`): an "also"
    finding, never the main verdict.
    """
    if f.stall_period is None or f.stall_median_s is None:
        return None
    if f.stall_fraction < STALL_SHARE / 2:
        return None
    listed = ", ".join(str(i) for i in f.stall_steps[:8])
    epochs = epochs_per_stall(f)
    verdict = _verdict(
        "periodic-stalls",
        f"every {f.stall_period} steps{'' if epochs is None else ' (between epochs)'} one step "
        f"takes {f.stall_median_s * 1e3:.0f} ms instead of {f.median_step_s * 1e3:.1f} ms, "
        f"costing {f.stall_fraction:.0%} of the run",
        f"stalled steps: {listed}" + (" ..." if len(f.stall_steps) > 8 else ""),
        fixes=stall_fixes(f),
    )
    return verdict if epochs is None else replace(verdict, fix=_BETWEEN_EPOCHS_FIX)


def input_bound(f: Figures) -> Verdict | None:
    """input-bound: the loop waits for data (:func:`waits_for_data`) with CPUs to spare."""
    if not waits_for_data(f) or cpus_saturated(f):
        return None
    return _verdict(
        "input-bound",
        "the training step waits for data",
        _wait_reason(f),
        saw_tooth(f),
        _cpu_reason(f),
        fixes=(loader_fix(f, "input-bound"), gpu_decode_fix(f, "input-bound")),
    )


def _threads_reason(f: Figures) -> str:
    if not oversubscribed(f):
        return ""
    return (
        f"torch runs {f.setup.torch_threads} threads on {f.cpus} usable CPUs while the "
        f"DataLoader workers keep {worker_cores(f):.1f} cores busy and other processes "
        f"{others_cores(f):.1f}: {threads_that_fit(f)} would fit (torch.set_num_threads)"
    )


def host_bound(f: Figures) -> Verdict | None:
    """host-bound: saturated CPUs, and the loop waits for data or the GPU starves; or torch
    oversubscribes busy CPUs with threads (:func:`~trainperf.monitor._figures.oversubscribed`).

    The GPU starves when it is busy under ``GPU_STARVED`` of the time.
    """
    threads = _threads_reason(f)
    if not cpus_saturated(f) and not threads:
        return None
    fixes = (threads_fix(f), gpu_decode_fix(f, "host-bound"), loader_fix(f, "host-bound"))
    if waits_for_data(f):
        summary = (
            "waiting for data while the CPUs are saturated"
            if cpus_saturated(f)
            else f"waiting for data while torch's {f.setup.torch_threads} threads "
            "oversubscribe the busy CPUs"
        )
        return _verdict(
            "host-bound", summary, _wait_reason(f), saw_tooth(f), _cpu_reason(f), threads,
            fixes=fixes,
        )  # fmt: skip
    if threads:
        summary = f"torch's {f.setup.torch_threads} threads oversubscribe the {f.cpus} usable CPUs"
        return _verdict("host-bound", summary, threads, _cpu_reason(f), fixes=fixes)
    share = gpu_share(f)
    if share is None or share >= GPU_STARVED:
        return None
    return _verdict(
        "host-bound",
        f"the GPU is busy only {share:.0%} of the time while the CPUs are saturated",
        _cpu_reason(f),
        gpu_figures(f),
        fixes=fixes,
    )


def _compute_fix(f: Figures) -> str:
    """The compute-bound fix; a MixedPrecision already in use is not advised again."""
    if f.precision is None:
        return _FIXES["compute-bound"]
    name, why = f.precision
    if name == "fp32":
        return (
            f"the training step itself is the limit; trainperf.amp.MixedPrecision is in use "
            f"and chose fp32 ({why}), so lower precision is not advised: {_STEP_FIXES}"
        )
    return (
        f"the training step itself is the limit and already runs in {name} "
        f"(trainperf.amp.MixedPrecision: {why}): {_STEP_FIXES}"
    )


def compute_bound(f: Figures) -> Verdict:
    """compute-bound: what is left when no candidate explains the run; it always applies.

    It says "data arrives in time" only when the wait was measured; without ``w.iter()``
    the step time includes fetching the batch, and the verdict says so and how to measure
    it. The fix leaves out mixed precision when ``f.precision`` says it is in use.
    """
    where = "the GPU" if f.cuda_used else "the CPU"
    share = gpu_share(f)
    if share is None:
        busy_reason = ""
    elif nvml_share(f) is None:  # the event span alone: only a bound
        busy_reason = f"the GPU is busy at most {share:.0%} of step time ({gpu_figures(f)})"
    else:
        busy_reason = f"the GPU is busy {share:.0%} of step time ({gpu_figures(f)})"
    if f.wait_measured:
        summary = f"the training step on {where} is the limit; data arrives in time"
        wait_reason = f"only {f.wait_fraction:.0%} of step time is spent waiting for data"
        fix = _compute_fix(f)
    else:
        summary = (
            f"the training step on {where}, or the data loading inside it, is the limit: "
            "data waiting was not measured"
        )
        wait_reason = _unmeasured_reason(f)
        fix = _measure_wait(f) + "if the step is still the limit, " + _compute_fix(f)
    reasons = tuple(r for r in (wait_reason, busy_reason) if r)
    fixes = [x for x in (precision_fix(f), batch_fix(f)) if x is not None]
    return with_fixes(Verdict("compute-bound", summary, reasons, fix), fixes)


def cpus_held_by_others(f: Figures) -> Verdict | None:
    """host-bound: the host is >= 90 % busy while this process tree uses < 40 % of its CPUs.

    Other processes then hold the CPUs this loop could use, and a step slowed by them
    cannot be told from a compute-bound one (nor, from these figures, from a loop that is
    idle for another reason): :func:`rank` puts this in compute-bound's place, and lists it
    under any other verdict. ``host_cpu`` is the whole host's figure, so on a host split
    into CPU sets another set's load counts too.
    """
    tree = cpu_share(f)
    if tree is None or f.host_cpu is None:
        return None
    if f.host_cpu < HOST_SATURATED or tree >= CPU_SATURATED / 2:
        return None
    verdict = Verdict(
        "host-bound",
        f"other processes hold the host's CPUs: the host is {f.host_cpu:.0f}% busy while "
        f"this process and its workers use {tree:.0%} of the {f.cpus} usable CPUs",
        (
            _wait_reason(f) if f.wait_measured else f"{UNMEASURED}: {_how(f)}",
            "on a saturated host a step slowed by other processes cannot be told from a "
            "compute-bound one",
        ),
        _HELD_CPUS_FIX,
    )
    return with_fixes(verdict, [free_cpus_fix(f)])


# --------------------------------------------------------------------------- ranking


def weight(f: Figures, verdict: Verdict) -> float:
    """How much of the run a candidate explains, for :func:`rank`.

    Periodic stalls weigh their share of the run (0 under ``STALL_SHARE``), waiting for data
    its share of step time, and a starving GPU the share of time it idles; oversubscribed
    CPUs weigh at least the share of torch's threads that do not fit
    (``1 - threads_that_fit / torch_threads``).

    Raises:
        ValueError: ``verdict`` is not a candidate (periodic-stalls, input-bound, host-bound).
    """
    if verdict.kind == "periodic-stalls":
        return f.stall_fraction if f.stall_fraction >= STALL_SHARE else 0.0
    if verdict.kind == "input-bound":
        return f.wait_fraction
    if verdict.kind == "host-bound":
        share = gpu_share(f)
        base = f.wait_fraction if waits_for_data(f) or share is None else 1 - share
        threads = f.setup.torch_threads
        if oversubscribed(f) and threads is not None:
            return max(base, 1 - threads_that_fit(f) / threads)
        return base
    raise ValueError(
        "only periodic-stalls, input-bound and host-bound verdicts are ranked, got "
        f"{verdict.kind!r}: pass the candidates' verdicts"
    )


def rank(f: Figures, candidates: Sequence[Verdict]) -> tuple[Verdict, tuple[Verdict, ...]]:
    """The main verdict and the "also" findings.

    The candidate that explains most of the run leads (on a tie, the earlier one) and the
    others follow it as findings; when none explains any of it, every candidate is a
    finding and :func:`cpus_held_by_others` leads where it applies, unless NVML shows the
    GPU busy at least ``GPU_STARVED`` of the time (then the GPU is the limit:
    :func:`compute_bound` leads). Held CPUs that do not lead are the last finding.
    """
    ranked = sorted(candidates, key=lambda v: -weight(f, v))
    held = cpus_held_by_others(f)
    if ranked and weight(f, ranked[0]) > 0:
        main, others = ranked[0], ranked[1:]
    elif held is not None and not _gpu_shown_busy(f):
        return held, tuple(ranked)
    else:
        main, others = compute_bound(f), ranked
    return main, (*others, *(() if held is None else (held,)))


def _gpu_shown_busy(f: Figures) -> bool:
    """NVML (not the event span alone, an upper bound) shows the GPU busy half the time."""
    share = gpu_share(f)
    return nvml_share(f) is not None and share is not None and share >= GPU_STARVED
