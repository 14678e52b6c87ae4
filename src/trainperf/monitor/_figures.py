"""What the verdict rules (``_rules``) and the predictions (``_predict``) judge:
:class:`Figures`, and the figures derived from it that both use.

Every function here is a pure function of one :class:`Figures`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from trainperf._utils.steal import undo_steal
from trainperf.monitor._setup import LoopSetup
from trainperf.monitor._shift import Shift

__all__ = [
    "CPU_SATURATED",
    "CROWDED_SATURATED",
    "CROWDED_THREADS",
    "HOST_SATURATED",
    "INPUT_BOUND_WAIT",
    "NVML_MIN_SAMPLES",
    "NVML_MIN_WINDOW_S",
    "SAWTOOTH_MAX_MEAN",
    "SAWTOOTH_MIN_SAMPLES",
    "SAWTOOTH_MIN_STDEV",
    "SAWTOOTH_WAIT",
    "Figures",
    "compute_s",
    "cpu_share",
    "cpus_saturated",
    "gpu_share",
    "main_cores",
    "mean_step_s",
    "nvml_share",
    "others_cores",
    "oversubscribed",
    "saw_tooth",
    "threads_that_fit",
    "wait_s",
    "waits_for_data",
    "worker_cores",
]

INPUT_BOUND_WAIT = 0.25  # share of step time spent waiting for data
SAWTOOTH_WAIT = 0.10  # with a saw-tooth GPU utilisation, this much waiting is input-bound
CPU_SATURATED = 0.8  # share of the usable CPUs this process and its workers use
HOST_SATURATED = 90.0  # host CPU percent, with the process using at least half its share
# torch threads this many times the usable CPUs or more wait for each other at every
# parallel region, and that waiting shows as idle CPU: such a tree counts as busy from
# this share of its CPUs (16 threads on 2 CPUs beside busy workers: 77-78 % under 13-16 %
# steal, the step 2.2-2.5x faster with one thread).
CROWDED_THREADS = 2
CROWDED_SATURATED = 0.6
NVML_MIN_WINDOW_S = 1.0  # NVML's utilisation averages over 1/6 s to 1 s, by product
NVML_MIN_SAMPLES = 3  # fewer NVML samples mostly describe what came before the loop
SAWTOOTH_MIN_SAMPLES = 5
SAWTOOTH_MAX_MEAN = 60.0  # percent: a busier GPU does not idle between batches
SAWTOOTH_MIN_STDEV = 20.0  # percentage points


@dataclass(frozen=True)
class Figures:
    """What the rules judge: figures of the measured steps (the warm-up left out; where the
    step time changed part-way, the steps since the change).

    Attributes:
        measured_steps: steps judged.
        warmup_steps: the warm-up steps that ran: those asked for, or fewer when the run
            ended first (the inconclusive verdict names it).
        gpu_present: a GPU is visible to this process.
        cuda_used: the process initialised CUDA during the watch.
        cpus: CPUs this process may use.
        wall_s: seconds of the judged steps.
        wait_fraction: share of step time spent waiting for data.
        median_step_s: the median step time.
        gpu_span: the steps' CUDA-event span as a share of step time, None unless every
            judged step has one. An upper bound on the GPU's busy share, not the share.
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
        wait_cpu_s: per step, the CPU the loop's thread demanded while it waited for data
            (seconds running plus seconds runnable, waiting for a CPU), None unless every
            judged step has it.
        cpu_delay_s: per step, the seconds the loop's thread was runnable but waited for a
            CPU, None unless every judged step has it.
        workers_cpu: mean CPU percent of this process's children (DataLoader workers) alone,
            None without samples.
        host_steal: mean percent of the host's CPU time the hypervisor withheld (steal),
            None where unknown. ``process_cpu``, ``workers_cpu`` and ``wait_cpu_s`` are as
            measured; :func:`capacity` is what the CPUs gave.
        setup: the loop's settings (:class:`LoopSetup`).
        shift: the change in step time the judged steps start at, None without one.
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
    wait_cpu_s: float | None = None
    cpu_delay_s: float | None = None
    workers_cpu: float | None = None
    setup: LoopSetup = field(default_factory=LoopSetup)
    shift: Shift | None = None
    host_steal: float | None = None

    @property
    def utilisation_mean(self) -> float | None:
        """The NVML samples' mean (percent), None without samples."""
        return statistics.fmean(self.utilisation) if self.utilisation else None


# --------------------------------------------------------------------------- time per step


def mean_step_s(f: Figures) -> float:
    """The mean step time (0 without steps): what throughput is the inverse of."""
    return f.wall_s / f.measured_steps if f.measured_steps else 0.0


def wait_s(f: Figures) -> float:
    """Seconds per step spent waiting for data (0 when the wait was not measured)."""
    return f.wait_fraction * mean_step_s(f) if f.wait_measured else 0.0


def compute_s(f: Figures) -> float:
    """Seconds per step not spent waiting for data: the step itself."""
    return mean_step_s(f) - wait_s(f)


# --------------------------------------------------------------------------- the GPU


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


def saw_tooth(f: Figures) -> str:
    """The saw-tooth in words when a trusted NVML utilisation swings widely, else ""."""
    mean = f.utilisation_mean
    if nvml_share(f) is None or len(f.utilisation) < SAWTOOTH_MIN_SAMPLES or mean is None:
        return ""
    if mean >= SAWTOOTH_MAX_MEAN or statistics.pstdev(f.utilisation) < SAWTOOTH_MIN_STDEV:
        return ""
    low, high = min(f.utilisation), max(f.utilisation)
    return f"GPU utilisation swings between {low:.0f}% and {high:.0f}% (saw-tooth)"


# --------------------------------------------------------------------------- the CPUs


def capacity(f: Figures) -> float:
    """The usable CPUs' worth of time the hypervisor left this machine: ``cpus`` less the
    stolen share (``host_steal``, capped at ``MAX_STEAL``); ``cpus`` where nothing is stolen."""
    return f.cpus / undo_steal(1.0, None if f.host_steal is None else f.host_steal / 100)


def cpu_share(f: Figures) -> float | None:
    """The share of the usable CPUs' time (:func:`capacity`: what the hypervisor did not
    steal) this process and its workers use, None without samples."""
    return None if f.process_cpu is None else f.process_cpu / (100 * capacity(f))


def cpus_saturated(f: Figures) -> bool:
    """The process tree uses 80 % of its CPUs, or 40 % on a host that is 90 % busy."""
    tree = cpu_share(f)
    if tree is None:
        return False
    busy_host = f.host_cpu is not None and f.host_cpu >= HOST_SATURATED
    return tree >= CPU_SATURATED or (busy_host and tree >= CPU_SATURATED / 2)


def worker_cores(f: Figures) -> float:
    """Cores the DataLoader workers keep busy (0 without samples or workers)."""
    return (f.workers_cpu or 0.0) / 100


def main_cores(f: Figures) -> float | None:
    """Cores the loop's own process keeps busy, its workers left out; None without samples."""
    if f.process_cpu is None:
        return None
    return max(0.0, f.process_cpu - (f.workers_cpu or 0.0)) / 100


def others_cores(f: Figures) -> float:
    """Cores of this process's CPUs that other processes keep busy (0 without samples).

    The host's busy cores (``host_cpu`` of ``setup.host_cpus``, or of ``cpus`` when the
    host's count is unknown) minus this process tree's, taken to be spread evenly over the
    host: the share that falls on this process's ``cpus``. The host's figure counts the
    time the hypervisor stole as busy (``/proc/stat``'s steal is not idle); that share
    (``host_steal``) is no process's and is left out.
    """
    if f.host_cpu is None or f.process_cpu is None:
        return 0.0
    host = max(f.setup.host_cpus or f.cpus, f.cpus)
    ran = max(0.0, f.host_cpu - (f.host_steal or 0.0))
    others = ran / 100 * host - f.process_cpu / 100
    return min(float(f.cpus), max(0.0, others * f.cpus / host))


def threads_that_fit(f: Figures, *, others: bool = True) -> int:
    """The torch threads the usable CPUs hold once the workers, and (``others``) other
    processes, have their cores: at least 1."""
    taken = worker_cores(f) + (others_cores(f) if others else 0.0)
    return max(1, math.floor(f.cpus - taken + 0.5))


def oversubscribed(f: Figures) -> bool:
    """torch runs more threads than the usable CPUs hold beside this process's workers
    (other processes aside: a host they keep busy is
    :func:`~trainperf.monitor._rules.cpus_held_by_others`'s case),
    while the CPUs are busy: this process tree's (:func:`cpus_saturated`, or
    ``CROWDED_SATURATED`` of them for ``CROWDED_THREADS`` times the CPUs' threads or more)
    or the host's (``HOST_SATURATED``)."""
    threads = f.setup.torch_threads
    if threads is None or threads <= threads_that_fit(f, others=False):
        return False
    busy_host = f.host_cpu is not None and f.host_cpu >= HOST_SATURATED
    tree = cpu_share(f)
    crowded = threads >= CROWDED_THREADS * f.cpus and tree is not None and tree >= CROWDED_SATURATED
    return cpus_saturated(f) or busy_host or crowded


# --------------------------------------------------------------------------- the data


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
