"""The checks behind ``trainperf doctor``: pure functions of their inputs.

Each takes what it checks as arguments (a :class:`~trainperf.limits.HostLimits`, a version,
an environment variable's value) and returns a :class:`Check`, so any environment can be
tested without touching the real one. The GPU and PyTorch-build checks are in
``_gpu``. :func:`trainperf.doctor.diagnose` gathers the real
inputs and runs them all; import everything from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trainperf._utils.format import format_bytes
from trainperf.device import VisibleDevices, parse_visible_devices
from trainperf.limits import HostLimits

__all__ = [
    "Check",
    "CheckStatus",
    "check_blas",
    "check_cpus",
    "check_load",
    "check_memory",
    "check_shm",
    "check_start_method",
    "check_threads",
    "check_visible_devices",
]

# A check's status, held in Check.verdict ("skip": could not be checked). Not to be confused
# with trainperf.monitor.Verdict, the watch's finding.
CheckStatus = Literal["ok", "warn", "fail", "skip"]
_GiB = 2**30

# 4-8 CPU cores per GPU is the usual advice for asynchronous data loading.
MIN_CPUS_PER_GPU = 4
# One ImageNet-style fp32 batch (128 x 3 x 224 x 224), what a DataLoader worker puts in /dev/shm.
DEFAULT_BATCH_BYTES = 128 * 3 * 224 * 224 * 4
DEFAULT_PREFETCH_FACTOR = 2
# A 1-minute load average above this many times the usable CPUs is oversubscription.
OVERLOAD_FACTOR = 1.5
# The share of the CPU time the CPUs wanted that the hypervisor may steal before it matters.
STEAL_WARN = 0.1


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

    Example:
        >>> from trainperf.limits import HostLimits
        >>> limits = HostLimits(64, 64, 4.0, 4, 2**36, None, 2**35, None, None)
        >>> check_cpus(limits, gpu_count=2).verdict
        'warn'
    """
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
    if gpu_count:
        per_gpu = limits.cpus / gpu_count
        value += f"; {per_gpu:g} per GPU ({gpu_count} GPU(s))"
        if per_gpu < MIN_CPUS_PER_GPU:
            fix = (
                f"{per_gpu:g} CPU(s) per GPU is below the 4-8 recommended for asynchronous data "
                "loading: rent more cores per GPU, fewer GPUs, or decode on the GPU "
                "(trainperf.pipelines.image_loader)" + (f"; {note}" if note else "")
            )
            return Check("cpus", "warn", value, fix)
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
    else:
        value = f"host {format_bytes(limits.memory_total)}, no cgroup limit"
    value += f", {format_bytes(limits.memory_available)} available"
    if limits.memory_available < min(2 * _GiB, 0.1 * ceiling) or (
        limits.memory_available < 0.05 * ceiling
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
) -> Check:
    """``/dev/shm`` vs what DataLoader workers need to hand batches to the main process.

    Each worker keeps up to ``prefetch_factor`` batches in shared memory. Docker's default
    64 MB ``/dev/shm`` is smaller than one ImageNet batch, and workers then die with "bus
    error" or "No space left on device".

    Args:
        limits: the host limits (``shm_total``/``shm_free`` are used).
        workers: DataLoader workers expected on the whole host: one per usable CPU is
            typical, and every rank's workers share the one ``/dev/shm``.
        batch_bytes: bytes of one batch (default: 128 x 3 x 224 x 224 fp32, 77 MB).
        prefetch_factor: batches each worker keeps ready.

    Example:
        >>> from trainperf.limits import HostLimits
        >>> tiny = HostLimits(8, 8, None, 8, 2**34, None, 2**33, 64 * 2**20, 64 * 2**20)
        >>> check_shm(tiny, workers=8).verdict
        'fail'
    """
    if limits.shm_total is None:
        return Check(
            "shm", "skip", "no /dev/shm here", "DataLoader workers share memory another way"
        )
    need = max(1, workers) * prefetch_factor * batch_bytes
    free = limits.shm_free if limits.shm_free is not None else limits.shm_total
    value = (
        f"{format_bytes(limits.shm_total)} ({format_bytes(free)} free); {workers} workers x "
        f"{prefetch_factor} batches of {format_bytes(batch_bytes)} need ~{format_bytes(need)}"
    )
    fix = (
        "enlarge /dev/shm: docker run --shm-size=16g (or --ipc=host); on Kubernetes mount an "
        "emptyDir with medium: Memory at /dev/shm"
    )
    if free < batch_bytes:
        return Check("shm", "fail", value, "DataLoader workers will crash: " + fix)
    if free < need:
        return Check("shm", "warn", value, fix + "; or use fewer workers / a smaller batch")
    return Check("shm", "ok", value)


def check_blas(
    pools: Sequence[Mapping[str, Any]] | None, cpu_vendor: str | None, cpus: int
) -> Check:
    """NumPy's BLAS (via threadpoolctl): OpenBLAS on an Intel CPU, or too many threads.

    OpenBLAS on an Intel CPU is a warning only while it runs more than one thread and more
    than a quarter of the usable CPUs: capped below that, it cannot peg the cores.

    Args:
        pools: ``threadpoolctl.threadpool_info()``; None when threadpoolctl is missing.
        cpu_vendor: ``vendor_id`` from ``/proc/cpuinfo``, e.g. ``"GenuineIntel"``.
        cpus: usable CPUs.

    Example:
        >>> pools = [{"user_api": "blas", "internal_api": "openblas", "num_threads": 4,
        ...           "version": "0.3.27"}]
        >>> check_blas(pools, "GenuineIntel", cpus=4).verdict
        'warn'
        >>> pools[0]["num_threads"] = 1  # OPENBLAS_NUM_THREADS=1: already capped
        >>> check_blas(pools, "GenuineIntel", cpus=4).verdict
        'ok'
        >>> check_blas(None, "GenuineIntel", cpus=4).verdict
        'skip'
    """
    if pools is None:
        fix = "pip install threadpoolctl"
        return Check(
            "blas",
            "skip",
            "threadpoolctl is not installed, so NumPy's BLAS cannot be inspected",
            fix,
        )
    blas = [p for p in pools if p.get("user_api") == "blas"]
    if not blas:
        return Check("blas", "skip", "NumPy loaded no BLAS that threadpoolctl recognises", "")
    libs = [
        f"{p.get('internal_api')} {p.get('version') or ''}".strip()
        + f" ({p.get('num_threads')} threads)"
        for p in blas
    ]
    value = ", ".join(libs) + (f"; CPU {cpu_vendor}" if cpu_vendor else "")
    apis = {str(p.get("internal_api")) for p in blas}
    openblas_threads = max(
        (int(p.get("num_threads") or 0) for p in blas if p.get("internal_api") == "openblas"),
        default=0,
    )
    # Capped to 1 thread (OPENBLAS_NUM_THREADS=1), or to a quarter of the CPUs or fewer, it
    # cannot peg the cores: the cap this warning asks for is already in place.
    capped = openblas_threads <= max(1, cpus // 4)
    if "openblas" in apis and "mkl" not in apis and cpu_vendor == "GenuineIntel" and not capped:
        fix = (
            "on Intel CPUs an OpenBLAS NumPy can peg every core and starve the GPU's data "
            "loading: use an MKL build (conda install numpy 'libblas=*=*mkl'), or cap its threads "
            "(OPENBLAS_NUM_THREADS=1, or threadpoolctl.threadpool_limits(1, 'blas'))"
        )
        return Check("blas", "warn", value, fix)
    threads = max(int(p.get("num_threads") or 0) for p in blas)
    if threads > cpus:
        fix = (
            f"{threads} BLAS threads for {cpus} usable CPUs oversubscribes them: set "
            f"OMP_NUM_THREADS={cpus} (or threadpoolctl.threadpool_limits({cpus}))"
        )
        return Check("blas", "warn", value, fix)
    return Check("blas", "ok", value)


def _omp_threads(text: str | None) -> int | None:
    """The outermost thread count of ``OMP_NUM_THREADS``: an integer >= 1, or a list of them
    (``"4,2"``, one per nesting level, as OpenMP accepts); None when unset or unreadable."""
    if text is None:
        return None
    levels = []
    for part in text.split(","):
        try:
            levels.append(int(part))
        except ValueError:
            return None
    return levels[0] if all(n >= 1 for n in levels) else None


def check_threads(
    torch_threads: int, omp_num_threads: str | None, cpus: int, processes: int = 1
) -> Check:
    """torch's intra-op threads, ``OMP_NUM_THREADS`` and oversubscription of the CPUs.

    Every PyTorch process starts one thread per core it sees; several training processes on
    one host (several experiments, or DDP ranks) then thrash. The fix is
    ``torch.set_num_threads(cpus // processes)`` in each.

    Args:
        torch_threads: ``torch.get_num_threads()``.
        omp_num_threads: the ``OMP_NUM_THREADS`` variable, None when unset.
        cpus: usable CPUs.
        processes: training processes sharing the host (``LOCAL_WORLD_SIZE`` under torchrun).

    Example:
        >>> check_threads(16, None, cpus=16, processes=4).verdict
        'warn'
        >>> check_threads(4, "4", cpus=16, processes=4).verdict
        'ok'
        >>> check_threads(4, "0", cpus=16).verdict
        'warn'
    """
    value = (
        f"torch {torch_threads} threads, OMP_NUM_THREADS={omp_num_threads or 'unset'}, "
        f"{cpus} usable CPUs, {processes} process(es)"
    )
    share = max(1, cpus // max(1, processes))
    omp = _omp_threads(omp_num_threads)
    if omp_num_threads is not None and omp is None:
        # OpenMP ignores 0 or junk and starts one thread per core, the oversubscription the
        # variable was meant to prevent.
        fix = (
            f"OMP_NUM_THREADS must be an integer >= 1 (or a comma-separated list of them, one "
            f"per nesting level), got {omp_num_threads!r} (OpenMP then ignores it): set "
            f"OMP_NUM_THREADS={share}"
        )
        return Check("threads", "warn", value, fix)
    if omp is not None and omp * processes > cpus:
        fix = (
            f"OMP_NUM_THREADS={omp} x {processes} process(es) oversubscribes "
            f"{cpus} usable CPUs: set OMP_NUM_THREADS={share}"
        )
        return Check("threads", "warn", value, fix)
    if torch_threads * processes > cpus:
        fix = (
            f"{processes} x {torch_threads} threads oversubscribe {cpus} CPUs: call "
            f"torch.set_num_threads({share}) in each process (or OMP_NUM_THREADS={share})"
        )
        return Check("threads", "warn", value, fix)
    return Check("threads", "ok", value)


def load_average() -> float | None:
    """The host's 1-minute load average, None where the platform has none (Windows).

    Example:
        >>> value = load_average()
        >>> value is None or value >= 0
        True
    """
    getloadavg = getattr(os, "getloadavg", None)
    if getloadavg is None:
        return None
    try:
        return float(getloadavg()[0])
    except OSError:  # the platform could not tell
        return None


def check_load(load_average: float | None, cpus: int) -> Check:
    """The 1-minute load average against the usable CPUs: other jobs competing for them.

    ``check_threads`` sees only this process's own settings; the load average counts every
    runnable (or I/O-waiting) thread on the host, so several jobs, or a neighbour's, that
    together want more cores than there are show up here. Data loading and kernel launches
    then wait for a core.

    Args:
        load_average: ``os.getloadavg()[0]``; None where the platform has none (Windows).
        cpus: usable CPUs.

    Example:
        >>> check_load(24.0, cpus=8).verdict
        'warn'
        >>> check_load(6.5, cpus=8).verdict, check_load(None, cpus=8).verdict
        ('ok', 'skip')
    """
    if load_average is None:
        return Check("load", "skip", "no load average on this platform", "")
    value = f"1-minute load average {load_average:.1f} for {cpus} usable CPUs"
    if load_average > OVERLOAD_FACTOR * cpus:
        fix = (
            f"a load of {load_average:.1f} is {load_average / cpus:.1f}x the {cpus} usable "
            "CPUs, so threads wait for a core: run fewer jobs at once, lower each job's "
            "threads so that together they fit (OMP_NUM_THREADS, torch.set_num_threads(), "
            "DataLoader num_workers), or pin each job to cores of its own "
            "(taskset -c <first>-<last> python train.py)"
        )
        return Check("load", "warn", value, fix)
    return Check("load", "ok", value)


def check_steal(share: float | None) -> Check:
    """The CPU time the hypervisor withheld from this VM since boot (*steal*): a VM whose
    physical CPUs other tenants share, or a burstable instance out of CPU credits.

    Stolen time is in no process's CPU time: data loading, kernel launches and every CPU
    figure measured here (tuning, ``trainperf.watch``) get that much less of a core.

    Args:
        share: the stolen share of the CPU time the CPUs wanted since boot (busy or
            stolen, idle left out), ``trainperf._utils.steal.boot_steal_share()``; None
            where the platform reports no steal (only Linux does).

    Example:
        >>> check_steal(0.25).verdict, check_steal(0.02).verdict, check_steal(None).verdict
        ('warn', 'ok', 'skip')
    """
    if share is None:
        return Check("steal", "skip", "no steal figure on this platform (Linux VMs report it)")
    value = (
        f"the hypervisor withheld {share:.1%} of the CPU time this machine's CPUs wanted "
        "since boot (steal)"
    )
    if share >= STEAL_WARN:
        fix = (
            "other tenants share this VM's physical CPUs, or a burstable instance ran out of "
            "CPU credits: data loading and every CPU figure lose that share. Rent an instance "
            "type with dedicated cores (not shared-core or burstable), or move the job to "
            "another host; trainperf.watch reports the steal during your own loop "
            "(report.host_steal_mean)"
        )
        return Check("steal", "warn", value, fix)
    return Check("steal", "ok", value)


def check_start_method(method: str, platform: str = sys.platform) -> Check:
    """The multiprocessing start method DataLoader workers will use.

    With ``spawn`` (the default on macOS and Windows) or ``forkserver`` (Linux's default from
    Python 3.14), each worker re-imports the main script: without an
    ``if __name__ == "__main__":`` guard the script re-runs in every worker, or hangs.

    Example:
        >>> check_start_method("fork", "linux").verdict
        'ok'
        >>> check_start_method("spawn", "darwin").verdict
        'warn'
    """
    value = f"{method} on {platform}"
    if method == "fork":
        return Check("start_method", "ok", value)
    fix = (
        "DataLoader workers re-import the main script: put the training code under "
        "`if __name__ == '__main__':` and keep the Dataset picklable (no lambdas, open "
        "files or CUDA tensors); num_workers=0 avoids workers altogether"
    )
    return Check("start_method", "warn", value, fix)


_CUDA_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")


def _hides_all(first: str) -> bool:
    """A first entry set to hide every GPU: empty, negative, or SLURM's ``NoDevFiles`` (a job
    given no GPU)."""
    return first == "" or first.startswith("-") or first == "NoDevFiles"


def _unreadable_entry(bad: str, parsed: VisibleDevices) -> str:
    """Why CUDA cannot read ``bad``: junk, or an entry in another notation than the first's."""
    if not parsed.entries:  # the first entry itself
        return f"{bad!r} is neither an index nor a GPU- or MIG- UUID"
    kind = "an index" if parsed.notation == "index" else f"a {parsed.notation} UUID"
    other = bad.startswith(("GPU-", "MIG-")) or bad.lstrip("+").isdigit()
    mixing = " (entries cannot mix indices, GPU- and MIG- UUIDs)" if other else ""
    return f"{bad!r} is not {kind}, as the first entry sets{mixing}"


def _setting(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def _list_end(visible: str, parsed: VisibleDevices) -> str | None:
    """A note when the list stops at a negative index after readable entries: CUDA's
    documented way to end it early (``0,2,-1,1`` shows 0 and 2), so meant, not a typo; None
    when it stops anywhere else, or nowhere."""
    bad = parsed.first_invalid
    if bad is None or not parsed.entries or re.fullmatch(r"-[0-9]+", bad) is None:
        return None
    ignored = [e.strip() for e in visible.split(",")][len(parsed.entries) + 1 :]
    after = [e for e in ignored if e]
    tail = f"; CUDA ignores {', '.join(map(repr, after))} after it" if after else ""
    return f" (the list ends at {bad!r}{tail})"


def check_visible_devices(
    visible: str | None, order: str | None, gpu_count: int, *, shown: int | None = None
) -> Check:
    """``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` sanity.

    The list is read with :func:`trainperf.device.parse_visible_devices`, the rules
    :func:`trainperf.gpus` applies. CUDA reads it once, at start-up; the first entry sets the
    notation (indices or UUIDs); it stops at the first entry it cannot parse, in another
    notation, or that does not exist, shows nothing when an entry repeats, and numbers the
    GPUs fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so on a multi-GPU host an
    integer index need not be the GPU ``nvidia-smi`` shows under it. A negative index after
    readable entries ends the list on purpose (CUDA's docs: ``0,2,-1,1`` shows 0 and 2). On a
    host without GPUs the list changes nothing, and is not judged.

    Args:
        visible: ``CUDA_VISIBLE_DEVICES``, None when unset.
        order: ``CUDA_DEVICE_ORDER``, None when unset.
        gpu_count: physical GPUs (NVML's count, which ignores ``CUDA_VISIBLE_DEVICES``).
        shown: the GPUs :func:`trainperf.gpus` finds visible under it (None: not known):
            UUIDs are checked against the cards only through it.

    Example:
        >>> check_visible_devices("1,3", None, gpu_count=4).verdict
        'warn'
        >>> check_visible_devices("1,3", "PCI_BUS_ID", gpu_count=4).verdict
        'ok'
    """
    value = f"CUDA_VISIBLE_DEVICES={_setting(visible)}, CUDA_DEVICE_ORDER={_setting(order)}"
    if order is not None and order not in _CUDA_ORDERS:
        fix = f"CUDA ignores CUDA_DEVICE_ORDER={order!r}: use one of {list(_CUDA_ORDERS)}"
        return Check("visible_devices", "warn", value, fix)
    if visible is None:
        return Check("visible_devices", "ok", value + f" (all {gpu_count} GPU(s) visible)")
    parsed = parse_visible_devices(visible)
    entries = parsed.entries
    bad = parsed.first_invalid
    if not entries and bad is not None and (_hides_all(bad) or not gpu_count):
        return Check(
            "visible_devices",
            "warn" if gpu_count else "ok",
            value + " (hides every GPU)",
            "unset CUDA_VISIBLE_DEVICES to use the GPUs" if gpu_count else "",
        )
    if not gpu_count:
        return Check("visible_devices", "ok", value + " (no GPU here: CUDA shows none either way)")
    end = _list_end(visible, parsed)
    if end is not None:
        value += end
    elif bad is not None:
        visible_part = f"only {', '.join(entries)} are visible" if entries else "no GPU is visible"
        why = _unreadable_entry(bad, parsed)
        fix = f"{why}: CUDA stops reading the list there, so {visible_part}"
        return Check("visible_devices", "fail", value, fix)
    return _check_entries(value, parsed, order, gpu_count, shown)


def _check_entries(
    value: str, parsed: VisibleDevices, order: str | None, gpu_count: int, shown: int | None
) -> Check:
    """The readable entries of a list on a host with GPUs: indices that exist, no repeats,
    UUIDs that match, and the numbering they are read in."""
    entries = parsed.entries
    if parsed.notation == "index":
        missing = next((e for e in entries if int(e) >= gpu_count), None)
        if missing is not None:
            fix = (
                f"index {missing} does not exist ({gpu_count} GPU(s)): CUDA stops reading the "
                "list there; `nvidia-smi -L` lists the GPUs"
            )
            return Check("visible_devices", "fail", value, fix)
    if parsed.duplicates:
        fix = "a GPU is listed twice, and CUDA then makes no GPU visible: list each once"
        return Check("visible_devices", "fail", value, fix)
    if parsed.notation != "index" and shown is not None and shown < len(entries):
        fix = (
            f"only {shown} of its {len(entries)} UUID(s) make a GPU visible: CUDA stops at a "
            "UUID that matches no card here or several (too short a prefix), and shows none "
            "when one card is named twice (a prefix and a longer one); `nvidia-smi -L` lists "
            "the UUIDs"
        )
        return Check("visible_devices", "fail", value, fix)
    if parsed.notation == "index" and gpu_count > 1 and order != "PCI_BUS_ID":
        fix = (
            "CUDA numbers GPUs fastest-first, nvidia-smi by PCI bus: index "
            f"{entries[0]} here need not be nvidia-smi's GPU {entries[0]}. Set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID, or list UUIDs (trainperf.select_gpus() does)"
        )
        return Check("visible_devices", "warn", value, fix)
    return Check("visible_devices", "ok", value)
