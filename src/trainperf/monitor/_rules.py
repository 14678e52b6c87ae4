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

Two inputs change what the rules may say. Without ``w.iter()`` the time spent fetching a
batch is step time (``Figures.wait_measured`` is False): nothing is input-bound then, and
compute-bound says that the data wait was not measured instead of "data arrives in time".
A :class:`trainperf.amp.MixedPrecision` in use (``Figures.precision``) is not advised again.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from trainperf.monitor._report import Verdict, VerdictKind

__all__ = [
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
INPUT_BOUND_WAIT = 0.25  # share of step time spent waiting for data
SAWTOOTH_WAIT = 0.10  # with a saw-tooth GPU utilisation, this much waiting is input-bound
CPU_SATURATED = 0.8  # share of the usable CPUs this process and its workers use
HOST_SATURATED = 90.0  # host CPU percent, with the process using at least half its share
# (the same 90 % with the process tree under half its share: other processes hold the CPUs)
GPU_IDLE_UTIL = 5.0  # percent
GPU_STARVED = 0.5  # busy share under which saturated CPUs make the loop host-bound
NVML_MIN_WINDOW_S = 1.0  # NVML's utilisation averages over 1/6 s to 1 s, by product
NVML_MIN_SAMPLES = 3  # fewer NVML samples mostly describe what came before the loop
SAWTOOTH_MIN_SAMPLES = 5
SAWTOOTH_MAX_MEAN = 60.0  # percent: a busier GPU does not idle between batches
SAWTOOTH_MIN_STDEV = 20.0  # percentage points
STALL_SHARE = 0.1  # share of run time lost to periodic stalls that makes them the verdict

_FIXES: dict[str, str] = {
    "input-bound": (
        "feed the loop faster: trainperf.autotune_loader() picks num_workers, prefetch_factor "
        "and pin_memory for this machine; trainperf.pipelines.image_loader decodes images on "
        "the GPU"
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
        "something expensive runs every few steps inside the loop: save checkpoints less often "
        "(trainperf.save_checkpoint every few hundred steps or per epoch), and move image "
        "saving and logging out of the loop"
    ),
    "inconclusive": "watch more steps: call w.step() once at the end of each training step",
}
_HELD_CPUS_FIX = (
    "other processes are using this host's CPUs, so every figure here is slowed by them: "
    "stop or move the other jobs (`trainperf doctor` shows the host's load) or run where "
    "these cores are yours, then watch again"
)
_STEP_FIXES = "use channels_last for convolutional models, and a larger batch if memory allows"
_MEASURE_WAIT = (
    "measure the data wait first: for batch in w.iter(loader): ... w.step(), and watch again; "
)


@dataclass(frozen=True)
class Figures:
    """What the rules judge: figures of the measured steps (the warm-up left out).

    Attributes:
        measured_steps: steps after the warm-up.
        warmup_steps: the warm-up asked for (the inconclusive verdict names it).
        gpu_present: a GPU is visible to this process.
        cuda_used: the process initialised CUDA during the watch.
        cpus: CPUs this process may use.
        wall_s: seconds of the measured steps.
        wait_fraction: share of step time spent waiting for data.
        median_step_s: the median step time.
        gpu_span: the steps' CUDA-event span as a share of step time, None unless every
            measured step has one. An upper bound on the GPU's busy share, not the share.
        utilisation: NVML utilisation samples (percent) taken while the steps ran.
        nvml_window_s: seconds those samples cover (the steps, up to the GPU's end).
        process_cpu: mean CPU percent of this process and its children, None without samples.
        host_cpu: mean host CPU percent, None without samples.
        stall_period: N when every N-th step stalls, else None.
        stall_steps: the stalled steps' numbers.
        stall_fraction: share of the run lost to the periodic stalls.
        stall_median_s: the median stalled step's duration, None without stalls.
        wait_measured: the data wait was measured (the loop used ``w.iter()``); when False
            the time spent fetching batches is in the step time and ``wait_fraction`` is 0.
        precision: ``(name, reason)`` of the :class:`trainperf.amp.MixedPrecision` in use
            (``"fp32"``, ``"bf16"`` or ``"fp16"``, and why it chose that), None without one.
    """

    measured_steps: int
    warmup_steps: int
    gpu_present: bool
    cuda_used: bool
    cpus: int
    wall_s: float
    wait_fraction: float
    median_step_s: float
    gpu_span: float | None
    utilisation: tuple[float, ...]
    nvml_window_s: float
    process_cpu: float | None
    host_cpu: float | None
    stall_period: int | None
    stall_steps: tuple[int, ...]
    stall_fraction: float
    stall_median_s: float | None
    wait_measured: bool = True
    precision: tuple[str, str] | None = None

    @property
    def utilisation_mean(self) -> float | None:
        """The NVML samples' mean (percent), None without samples."""
        return statistics.fmean(self.utilisation) if self.utilisation else None


def _verdict(kind: VerdictKind, summary: str, *reasons: str) -> Verdict:
    return Verdict(kind, summary, tuple(r for r in reasons if r), _FIXES[kind])


# --------------------------------------------------------------------------- derived figures


def nvml_share(f: Figures) -> float | None:
    """NVML's mean utilisation as a share, where it can be trusted, else None.

    NVML averages over a period of up to a second: over a shorter window, or with fewer
    than three samples, its figure mostly describes what came before the loop.
    """
    mean = f.utilisation_mean
    trusted = len(f.utilisation) >= NVML_MIN_SAMPLES and f.nvml_window_s >= NVML_MIN_WINDOW_S
    return mean / 100 if mean is not None and trusted else None


def gpu_share(f: Figures) -> float | None:
    """How busy the GPU was: the smaller of the event span and NVML's trusted share.

    On an idle stream a step's two events complete as soon as they are recorded, so their
    span is host time: ~100 % for a loop that launches nothing (or launches slowly). The
    span only bounds the busy share from above; NVML's utilisation (the share of time a
    kernel ran) is the smaller, truer figure where it exists.
    """
    shares = [x for x in (f.gpu_span, nvml_share(f)) if x is not None]
    return min(shares) if shares else None


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


def cpu_share(f: Figures) -> float | None:
    """The share of the usable CPUs this process and its workers use, None without samples."""
    return None if f.process_cpu is None else f.process_cpu / (100 * f.cpus)


def cpus_saturated(f: Figures) -> bool:
    """The process tree uses 80 % of its CPUs, or 40 % on a host that is 90 % busy."""
    tree = cpu_share(f)
    if tree is None:
        return False
    busy_host = f.host_cpu is not None and f.host_cpu >= HOST_SATURATED
    return tree >= CPU_SATURATED or (busy_host and tree >= CPU_SATURATED / 2)


def _cpu_reason(f: Figures) -> str:
    tree = cpu_share(f)
    if tree is None:
        return ""
    host = "" if f.host_cpu is None else f", the host is {f.host_cpu:.0f}% busy"
    return f"this process and its workers use {tree:.0%} of the {f.cpus} usable CPUs" + host


def saw_tooth(f: Figures) -> str:
    """The saw-tooth in words when a trusted NVML utilisation swings widely, else ""."""
    mean = f.utilisation_mean
    if nvml_share(f) is None or len(f.utilisation) < SAWTOOTH_MIN_SAMPLES or mean is None:
        return ""
    if mean >= SAWTOOTH_MAX_MEAN or statistics.pstdev(f.utilisation) < SAWTOOTH_MIN_STDEV:
        return ""
    low, high = min(f.utilisation), max(f.utilisation)
    return f"GPU utilisation swings between {low:.0f}% and {high:.0f}% (saw-tooth)"


def waits_for_data(f: Figures) -> bool:
    """Waiting for data limits the loop: 25 % of step time, or 10 % with a saw-tooth.

    A saw-tooth (the GPU idles between batches) makes the smaller wait the limit as well.
    Never when the wait was not measured (no ``w.iter()``).
    """
    if not f.wait_measured:
        return False
    return f.wait_fraction >= INPUT_BOUND_WAIT or (
        bool(saw_tooth(f)) and f.wait_fraction >= SAWTOOTH_WAIT
    )


def _wait_reason(f: Figures) -> str:
    return f"{f.wait_fraction:.0%} of step time is spent waiting for the next batch"


# --------------------------------------------------------------------------- decisive rules


def too_few_steps(f: Figures) -> Verdict | None:
    """inconclusive: fewer than ``MIN_STEPS`` measured steps."""
    if f.measured_steps >= MIN_STEPS:
        return None
    return _verdict(
        "inconclusive",
        f"{f.measured_steps} measured step(s) after {f.warmup_steps} warm-up; a verdict "
        f"needs at least {MIN_STEPS}",
    )


def cuda_never_initialised(f: Figures) -> Verdict | None:
    """gpu-unused: a GPU is visible but the process never initialised CUDA."""
    if not f.gpu_present or f.cuda_used:
        return None
    return _verdict(
        "gpu-unused",
        "a GPU is visible but this process never initialised CUDA: the model and data stay "
        "on the CPU",
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
    return _verdict(
        "periodic-stalls",
        f"every {f.stall_period} steps one step takes {f.stall_median_s * 1e3:.0f} ms instead "
        f"of {f.median_step_s * 1e3:.1f} ms, costing {f.stall_fraction:.0%} of the run",
        f"stalled steps: {listed}" + (" ..." if len(f.stall_steps) > 8 else ""),
    )


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
    )


def host_bound(f: Figures) -> Verdict | None:
    """host-bound: saturated CPUs, and the loop waits for data or the GPU starves.

    The GPU starves when it is busy under ``GPU_STARVED`` of the time.
    """
    if not cpus_saturated(f):
        return None
    if waits_for_data(f):
        return _verdict(
            "host-bound",
            "waiting for data while the CPUs are saturated",
            _wait_reason(f),
            saw_tooth(f),
            _cpu_reason(f),
        )
    share = gpu_share(f)
    if share is None or share >= GPU_STARVED:
        return None
    return _verdict(
        "host-bound",
        f"the GPU is busy only {share:.0%} of the time while the CPUs are saturated",
        _cpu_reason(f),
        gpu_figures(f),
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
        wait_reason = (
            "data waiting was not measured: w.step() was called but w.iter() never was, so "
            "the time spent fetching each batch counts as step time"
        )
        fix = _MEASURE_WAIT + "if the step is still the limit, " + _compute_fix(f)
    reasons = tuple(r for r in (wait_reason, busy_reason) if r)
    return Verdict("compute-bound", summary, reasons, fix)


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
    return Verdict(
        "host-bound",
        f"other processes hold the host's CPUs: the host is {f.host_cpu:.0f}% busy while "
        f"this process and its workers use {tree:.0%} of the {f.cpus} usable CPUs",
        (
            _wait_reason(f)
            if f.wait_measured
            else "data waiting was not measured: wrap the loader, for batch in w.iter(loader)",
            "on a saturated host a step slowed by other processes cannot be told from a "
            "compute-bound one",
        ),
        _HELD_CPUS_FIX,
    )


# --------------------------------------------------------------------------- ranking


def weight(f: Figures, verdict: Verdict) -> float:
    """How much of the run a candidate explains, for :func:`rank`.

    Periodic stalls weigh their share of the run (0 under ``STALL_SHARE``), waiting for data
    its share of step time, and a starving GPU the share of time it idles.

    Raises:
        ValueError: ``verdict`` is not a candidate (periodic-stalls, input-bound, host-bound).
    """
    if verdict.kind == "periodic-stalls":
        return f.stall_fraction if f.stall_fraction >= STALL_SHARE else 0.0
    if verdict.kind == "input-bound":
        return f.wait_fraction
    if verdict.kind == "host-bound":
        share = gpu_share(f)
        return f.wait_fraction if waits_for_data(f) or share is None else 1 - share
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
