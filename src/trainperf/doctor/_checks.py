"""The checks behind ``trainperf doctor``: pure functions of their inputs.

Each takes what it checks as arguments (a :class:`~trainperf.limits.HostLimits`, a version,
an environment variable's value) and returns a :class:`Check`, so any environment can be
tested without touching the real one. This module holds :class:`Check` and the host's size
checks (CPUs, memory, ``/dev/shm``, start method); the CPU-contention checks (BLAS, threads,
load, steal) are in ``_cpu_checks``, ``CUDA_VISIBLE_DEVICES`` in ``_visible_checks``, the GPU
and PyTorch-build checks in ``_gpu``. :func:`trainperf.doctor.diagnose` gathers the real
inputs and runs them all; import everything from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from trainperf._utils.format import format_bytes, plural
from trainperf._utils.validate import non_negative_int, positive_int
from trainperf.limits import HostLimits

__all__ = [
    "Check",
    "CheckStatus",
    "check_cpus",
    "check_memory",
    "check_shm",
    "check_start_method",
]

# A check's status, held in Check.verdict ("skip": could not be checked). Not to be confused
# with trainperf.monitor.Verdict, the watch's finding.
CheckStatus = Literal["ok", "warn", "fail", "skip"]
_GiB = 2**30
_START_METHODS = ("fork", "spawn", "forkserver")  # multiprocessing's, on any platform

# 4-8 CPU cores per GPU is the usual advice for asynchronous data loading.
MIN_CPUS_PER_GPU = 4
# One ImageNet-style fp32 batch (128 x 3 x 224 x 224), what a DataLoader worker puts in /dev/shm.
DEFAULT_BATCH_BYTES = 128 * 3 * 224 * 224 * 4
DEFAULT_PREFETCH_FACTOR = 2


@dataclass(frozen=True)
class Check:
    """The outcome of one check.

    Attributes:
        name: short identifier, e.g. ``"shm"``.
        verdict: the check's status (a :data:`CheckStatus`): ``"ok"``, ``"warn"``,
            ``"fail"`` or ``"skip"`` (could not be checked).
        value: what was measured, in words.
        fix: what to do about a warn or fail (or how to make a skipped check run); empty
            when there is nothing to do.
    """

    name: str
    verdict: CheckStatus
    value: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        """A JSON-ready dict: ``{"name", "verdict" (the status), "value", "fix"}``.

        Example:
            >>> Check("shm", "warn", "64 MiB", "enlarge /dev/shm").to_dict()["verdict"]
            'warn'
        """
        return {"name": self.name, "verdict": self.verdict, "value": self.value, "fix": self.fix}


# --------------------------------------------------------------------------- host


def check_cpus(limits: HostLimits, gpu_count: int) -> Check:
    """CPU count vs affinity vs cgroup quota, and the share per GPU (4-8 is the usual advice).

    A cgroup quota under one CPU (``cpu.max`` of ``50000 100000``) is a warning with or
    without GPUs: ``limits.cpus`` rounds it up to 1, but every thread shares that fraction of
    one core's time, and the share per GPU is counted from it.

    Args:
        limits: the host limits (the CPU counts and the cgroup quota are used).
        gpu_count: GPUs on this host that the CPUs feed; 0 judges the CPUs alone.

    Raises:
        ValueError: ``gpu_count`` is not an int >= 0.

    Example:
        >>> from trainperf.limits import HostLimits
        >>> limits = HostLimits(64, 64, 4.0, 4, 2**36, None, 2**35, None, None)
        >>> check_cpus(limits, gpu_count=2).verdict
        'warn'
    """
    gpu_count = non_negative_int("gpu_count", gpu_count)
    parts = [f"{limits.cpus} usable"]
    if limits.cpus_affinity != limits.cpus_host:
        parts.append(f"affinity {limits.cpus_affinity} of {limits.cpus_host}")
    else:
        parts.append(f"host {limits.cpus_host}")
    if limits.cpu_quota is not None:
        parts.append(f"cgroup quota {limits.cpu_quota:g}")
    value = ", ".join(parts)
    hidden = limits.cpus < limits.cpus_host
    note = (
        f"os.cpu_count() says {limits.cpus_host} but only {limits.cpus} are usable: size "
        "num_workers and threads from trainperf.usable_cpus(), not os.cpu_count()"
        if hidden
        else ""
    )
    # A quota under one CPU is rounded up to 1 usable CPU so work can run, but that is
    # more than the process gets: every thread shares a fraction of one core's time.
    quota = limits.cpu_quota
    share: float = quota if quota is not None and quota < 1 else limits.cpus
    fraction = share < 1
    throttled = (
        f"the cgroup quota gives this process {share:g} of one CPU's time, so every thread "
        "(data loading included) is throttled: ask for at least 1 CPU per process (docker run "
        "--cpus, Kubernetes resources.limits.cpu, SLURM --cpus-per-task)"
    )
    if gpu_count:
        per_gpu = share / gpu_count
        value += f"; {per_gpu:g} per GPU ({gpu_count} GPU(s))"
        if per_gpu < MIN_CPUS_PER_GPU:
            few = (
                f"{per_gpu:g} CPU(s) per GPU is below the 4-8 recommended for asynchronous data "
                "loading: rent more cores per GPU, fewer GPUs, or decode on the GPU "
                "(trainperf.pipelines.image_loader)"
            )
            fix = "; ".join(filter(None, (throttled if fraction else "", few, note)))
            return Check("cpus", "warn", value, fix)
    if fraction:
        return Check("cpus", "warn", value, "; ".join(filter(None, (throttled, note))))
    return Check("cpus", "ok", value, note)


def check_memory(limits: HostLimits) -> Check:
    """Host memory, the cgroup limit and what is still available.

    Example:
        >>> from trainperf.limits import HostLimits
        >>> limits = HostLimits(8, 8, None, 8, 64 * 2**30, 16 * 2**30, 2**29, None, None)
        >>> check_memory(limits).verdict
        'warn'
    """
    ceiling = limits.memory_total
    if limits.memory_limit is not None and limits.memory_limit < limits.memory_total:
        ceiling = limits.memory_limit
        limit, host = format_bytes(limits.memory_limit), format_bytes(limits.memory_total)
        value = f"cgroup limit {limit} of host {host}"
    elif limits.memory_limit is not None:
        limit, host = format_bytes(limits.memory_limit), format_bytes(limits.memory_total)
        value = f"cgroup limit {limit}, above the host's {host} (the host's memory binds)"
    else:
        value = f"host {format_bytes(limits.memory_total)}, no cgroup limit"
    value += f", {format_bytes(limits.memory_available)} available"
    # Nothing left is a warning whatever the ceiling (a memory.max of 0 leaves 0 of 0).
    if limits.memory_available <= 0 or (
        limits.memory_available < min(2 * _GiB, 0.1 * ceiling)
        or limits.memory_available < 0.05 * ceiling
    ):
        fix = (
            "little memory left, and a process that goes over the limit is killed at once (no "
            "swap): use fewer DataLoader workers or a smaller prefetch_factor, and do not cache "
            "the dataset in RAM"
        )
        return Check("memory", "warn", value, fix)
    fix = (
        "size caches and DataLoader workers from the cgroup limit, not the host's memory"
        if ceiling != limits.memory_total
        else ""
    )
    return Check("memory", "ok", value, fix)


def check_shm(
    limits: HostLimits,
    workers: int,
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    prefetch_factor: int = DEFAULT_PREFETCH_FACTOR,
    platform: str = sys.platform,
) -> Check:
    """``/dev/shm`` vs what DataLoader workers need to hand batches to the main process.

    Each worker keeps up to ``prefetch_factor`` batches in shared memory. Docker's default
    64 MB ``/dev/shm`` is smaller than one ImageNet batch, and workers then die with "bus
    error" or "No space left on device".

    Args:
        limits: the host limits (``shm_total``/``shm_free``/``shm_error`` are used): a
            ``/dev/shm`` that could not be read (``shm_error``) is a warning, since it is
            there but its size is unknown.
        workers: DataLoader workers expected on the whole host: one per usable CPU is
            typical, and every rank's workers share the one ``/dev/shm``. 0 (DataLoader's
            ``num_workers=0``: the main process loads every batch) needs no shared memory,
            whatever ``/dev/shm`` holds or whether there is one.
        batch_bytes: bytes of one batch (default: 128 x 3 x 224 x 224 fp32, 77 MB).
        prefetch_factor: batches each worker keeps ready (DataLoader's default is 2).
        platform: ``sys.platform``: on Linux, where torch's shared memory is ``shm_open``'s
            files in ``/dev/shm``, a missing ``/dev/shm`` fails; elsewhere it is not used.

    Raises:
        ValueError: ``workers`` or ``batch_bytes`` is not an int >= 0, or
            ``prefetch_factor`` not an int >= 1.

    Example:
        >>> from trainperf.limits import HostLimits
        >>> tiny = HostLimits(8, 8, None, 8, 2**34, None, 2**33, 64 * 2**20, 64 * 2**20)
        >>> check_shm(tiny, workers=8).verdict
        'fail'
        >>> check_shm(tiny, workers=0).verdict
        'ok'
    """
    workers = non_negative_int("workers", workers)
    batch_bytes = non_negative_int("batch_bytes", batch_bytes)
    prefetch_factor = positive_int("prefetch_factor", prefetch_factor)
    if workers == 0:
        value = (
            f"{_shm_words(limits)}; 0 workers: the main process loads every batch and needs no "
            "shared memory for them"
        )
        return Check("shm", "ok", value)
    fix = (
        "enlarge /dev/shm: docker run --shm-size=16g (or --ipc=host); on Kubernetes mount an "
        "emptyDir with medium: Memory at /dev/shm"
    )
    if limits.shm_total is None and limits.shm_error is not None:
        return Check(
            "shm",
            "warn",
            f"could not read /dev/shm ({limits.shm_error}), so its size is unknown",
            f"run `df -h /dev/shm` as this user to see its size; if it is small, {fix}",
        )
    if limits.shm_total is None and platform.startswith("linux"):
        # torch's tensors from workers are shm_open() files, which glibc puts in /dev/shm.
        fix = fix.replace("enlarge /dev/shm", "mount a tmpfs at /dev/shm", 1)
        return Check(
            "shm",
            "fail",
            "no /dev/shm here: DataLoader workers pass batches through it",
            f"DataLoader workers will crash (unable to open shared memory object): {fix}; "
            "or use num_workers=0",
        )
    if limits.shm_total is None:
        return Check(
            "shm", "skip", "no /dev/shm here", "DataLoader workers share memory another way"
        )
    need = workers * prefetch_factor * batch_bytes
    free = limits.shm_free if limits.shm_free is not None else limits.shm_total
    value = (
        f"{_shm_words(limits)}; {plural(workers, 'worker')} x "
        f"{plural(prefetch_factor, 'batch', 'batches')} of "
        f"{format_bytes(batch_bytes)} need ~{format_bytes(need)}"
    )
    if free < batch_bytes:
        return Check("shm", "fail", value, "DataLoader workers will crash: " + fix)
    if free < need:
        return Check("shm", "warn", value, fix + "; or use fewer workers / a smaller batch")
    return Check("shm", "ok", value)


def _shm_words(limits: HostLimits) -> str:
    """``/dev/shm`` in words: its size and free space, that there is none, or why it could not
    be read."""
    if limits.shm_total is None and limits.shm_error is not None:
        return f"could not read /dev/shm ({limits.shm_error})"
    if limits.shm_total is None:
        return "no /dev/shm here"
    free = limits.shm_free if limits.shm_free is not None else limits.shm_total
    return f"{format_bytes(limits.shm_total)} ({format_bytes(free)} free)"


def check_start_method(method: str, platform: str = sys.platform) -> Check:
    """The multiprocessing start method DataLoader workers will use.

    With ``spawn`` (the default on macOS and Windows) or ``forkserver`` (Linux's default from
    Python 3.14), each worker re-imports the main script: without an
    ``if __name__ == "__main__":`` guard the script re-runs in every worker, or hangs.

    Raises:
        ValueError: ``method`` is not ``"fork"``, ``"spawn"`` or ``"forkserver"``.

    Example:
        >>> check_start_method("fork", "linux").verdict
        'ok'
        >>> check_start_method("spawn", "darwin").verdict
        'warn'
    """
    if method not in _START_METHODS:
        raise ValueError(
            f"method must be one of {', '.join(map(repr, _START_METHODS))}, got {method!r}; "
            "pass the start method DataLoader workers use, e.g. "
            "multiprocessing.get_start_method()"
        )
    value = f"{method} on {platform}"
    if method == "fork":
        return Check("start_method", "ok", value)
    fix = (
        "DataLoader workers re-import the main script: put the training code under "
        "`if __name__ == '__main__':` and keep the Dataset picklable (no lambdas, open "
        "files or CUDA tensors); num_workers=0 avoids workers altogether"
    )
    return Check("start_method", "warn", value, fix)
