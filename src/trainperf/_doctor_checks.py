"""The checks behind ``trainperf doctor``: pure functions of their inputs.

Each takes what it checks as arguments (a :class:`~trainperf.limits.HostLimits`, a version,
an environment variable's value) and returns a :class:`Check`, so any environment can be
tested without touching the real one. :func:`trainperf.doctor.diagnose` gathers the real
inputs and runs them all; import everything from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trainperf.device import GpuInfo
from trainperf.limits import HostLimits

__all__ = [
    "Check",
    "Verdict",
    "check_blas",
    "check_cpus",
    "check_cuda_arch",
    "check_gpus",
    "check_memory",
    "check_shm",
    "check_start_method",
    "check_threads",
    "check_torch_build",
    "check_visible_devices",
]

Verdict = Literal["ok", "warn", "fail", "skip"]
_GiB = 2**30
_MiB = 2**20

# The seed recommends 4-8 CPU cores per GPU for asynchronous data loading.
MIN_CPUS_PER_GPU = 4
# One ImageNet-style fp32 batch (128 x 3 x 224 x 224), what a DataLoader worker puts in /dev/shm.
DEFAULT_BATCH_BYTES = 128 * 3 * 224 * 224 * 4
DEFAULT_PREFETCH_FACTOR = 2
# A GPU already this busy (percent) or this full when doctor runs is shared with someone.
BUSY_UTILIZATION = 50
BUSY_MEMORY_FRACTION = 0.1


@dataclass(frozen=True)
class Check:
    """The outcome of one check.

    Attributes:
        name: short identifier, e.g. ``"shm"``.
        verdict: ``"ok"``, ``"warn"``, ``"fail"`` or ``"skip"`` (could not be checked).
        value: what was measured, in words.
        fix: what to do about a warn or fail (or how to make a skipped check run); empty
            when there is nothing to do.
    """

    name: str
    verdict: Verdict
    value: str
    fix: str = ""


def _gib(n: float) -> str:
    return f"{n / _GiB:.1f} GiB"


# --------------------------------------------------------------------------- GPUs and torch


def check_gpus(
    gpus: Sequence[GpuInfo], driver: str | None = None, error: str | None = None
) -> Check:
    """GPUs and driver as NVML sees them, and whether another process already uses one.

    Args:
        gpus: the visible GPUs (:func:`trainperf.gpus`).
        driver: the driver version, None when unknown.
        error: why the GPUs could not be listed, if they could not.

    Example:
        >>> check_gpus([]).verdict
        'skip'
    """
    if error is not None:
        return Check("gpus", "fail", f"NVML failed: {error}", "check that `nvidia-smi` works")
    if not gpus:
        fix = "nothing to do on a CPU-only machine"
        return Check(
            "gpus",
            "skip",
            "no NVIDIA GPU visible (no driver, or CUDA_VISIBLE_DEVICES hides them)",
            fix,
        )
    parts = []
    busy = []
    for g in gpus:
        memory = "" if g.memory_total is None else f", {_gib(g.memory_total)}"
        parts.append(f"cuda:{g.index} {g.name}{memory}")
        used_fraction = (
            g.memory_used / g.memory_total if g.memory_used is not None and g.memory_total else 0.0
        )
        if (g.utilization or 0) >= BUSY_UTILIZATION or used_fraction >= BUSY_MEMORY_FRACTION:
            busy.append(f"cuda:{g.index} is {g.utilization or 0}% busy, {used_fraction:.0%} full")
    value = "; ".join(parts) + (f"; driver {driver}" if driver else "")
    if busy:
        fix = (
            "another process is using the GPU (nvidia-smi shows which): stop it, or pick a free "
            "card with trainperf.select_gpus()"
        )
        return Check("gpus", "warn", value + " -- " + "; ".join(busy), fix)
    return Check("gpus", "ok", value)


def _version_tuple(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_torch_build(
    *,
    torch_version: str,
    cuda: str | None,
    cudnn: int | None,
    nccl: tuple[int, ...] | None,
    gpu_count: int,
    driver_cuda: int | None = None,
) -> Check:
    """PyTorch, CUDA, cuDNN and NCCL versions; a CPU-only build or a too-old driver fails.

    Args:
        torch_version: ``torch.__version__``.
        cuda: ``torch.version.cuda`` (None for a CPU-only build).
        cudnn: ``torch.backends.cudnn.version()``, e.g. 92400.
        nccl: ``torch.cuda.nccl.version()``, e.g. ``(2, 21, 5)``.
        gpu_count: NVIDIA GPUs on this machine.
        driver_cuda: the newest CUDA the driver supports, as NVML encodes it (12040 = 12.4).

    Example:
        >>> check_torch_build(torch_version="2.4.0+cpu", cuda=None, cudnn=None, nccl=None,
        ...                   gpu_count=1).verdict
        'fail'
    """
    parts = [f"torch {torch_version}", f"CUDA {cuda or 'none (CPU-only build)'}"]
    if cudnn:
        # cuDNN 9 encodes 9.1.0 as 90100; cuDNN 8 encoded 8.9.2 as 8902.
        major, rest = (cudnn // 10000, cudnn % 10000) if cudnn >= 10000 else divmod(cudnn, 1000)
        parts.append(f"cuDNN {major}.{rest // 100}.{rest % 100}")
    if nccl:
        parts.append("NCCL " + ".".join(str(v) for v in nccl))
    if driver_cuda:
        parts.append(f"driver supports CUDA {driver_cuda // 1000}.{driver_cuda % 1000 // 10}")
    value = ", ".join(parts)
    if gpu_count and cuda is None:
        fix = (
            f"this machine has {gpu_count} GPU(s) but PyTorch is a CPU-only build: install a "
            "CUDA build (pip install torch --index-url https://download.pytorch.org/whl/cu124, "
            "picking the CUDA version your driver supports)"
        )
        return Check("torch", "fail", value, fix)
    built = _version_tuple(cuda)
    if built and driver_cuda:
        supported = (driver_cuda // 1000, driver_cuda % 1000 // 10)
        if supported[0] < built[0]:
            fix = (
                f"the driver supports CUDA up to {supported[0]}.{supported[1]} but PyTorch was "
                f"built for {cuda}: update the NVIDIA driver, or install a PyTorch built for "
                f"CUDA {supported[0]}.x"
            )
            return Check("torch", "fail", value, fix)
        if supported < built:
            fix = (
                f"the driver is older than PyTorch's CUDA {cuda}: minor-version compatibility "
                "usually works, but kernels compiled at run time (PTX) can fail; update the "
                "driver"
            )
            return Check("torch", "warn", value, fix)
    return Check("torch", "ok", value)


_ARCH = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


def _arch_capability(digits: str) -> tuple[int, int]:
    return int(digits[:-1]), int(digits[-1])


def check_cuda_arch(
    arch_list: Sequence[str], capabilities: Sequence[tuple[str, tuple[int, int] | None]]
) -> Check:
    """Whether this PyTorch build has kernels for each GPU's architecture.

    A GPU runs machine code (``sm_XY``) built for its own major version and an equal or
    lower minor (``sm_80`` runs on 8.6), code built for exactly its architecture
    (``sm_90a``), or compiles PTX (``compute_XY``) for an equal or older architecture at
    start-up, which is slow the first time.

    Args:
        arch_list: ``torch.cuda.get_arch_list()``, e.g. ``["sm_80", "sm_90"]``.
        capabilities: ``(gpu name, (major, minor))`` for each GPU.

    Example:
        >>> check_cuda_arch(["sm_70", "sm_80"], [("NVIDIA H100", (9, 0))]).verdict
        'fail'
        >>> check_cuda_arch(["sm_80", "sm_90"], [("NVIDIA A10", (8, 6))]).verdict
        'ok'
    """
    if not capabilities:
        return Check("cuda_arch", "skip", "no GPU to check", "")
    if not arch_list:
        return Check(
            "cuda_arch",
            "skip",
            "this PyTorch build reports no CUDA architectures (CPU-only build, or CUDA not "
            "usable here)",
            "see the torch check",
        )
    parsed = [m for m in (_ARCH.match(a) for a in arch_list) if m]
    bad: list[str] = []
    jit: list[str] = []
    for name, cc in capabilities:
        if cc is None:
            continue
        sass = False
        ptx = False
        for m in parsed:
            kind, digits, suffix = m.groups()
            built = _arch_capability(digits)
            if kind == "sm" and suffix == "a":
                sass |= built == cc
            elif kind == "sm":
                sass |= built[0] == cc[0] and built[1] <= cc[1]
            else:
                ptx |= built <= cc
        label = f"{name} (sm_{cc[0]}{cc[1]})"
        if not sass and ptx:
            jit.append(label)
        elif not sass:
            bad.append(label)
    value = "built for " + " ".join(arch_list)
    if bad:
        fix = (
            "install a PyTorch build whose CUDA version supports this GPU (a newer one for a "
            "new GPU: Ampere needs CUDA 11+, Hopper 11.8+, Blackwell 12.8+; old GPUs need an "
            "older build); see https://pytorch.org/get-started/locally/"
        )
        return Check("cuda_arch", "fail", value + "; no kernels for " + ", ".join(bad), fix)
    if jit:
        fix = (
            "kernels are compiled at start-up (slow first run, cached in ~/.nv/ComputeCache); "
            "a build with native kernels for this GPU avoids it"
        )
        return Check("cuda_arch", "warn", value + "; only PTX for " + ", ".join(jit), fix)
    return Check("cuda_arch", "ok", value + "; every GPU has native kernels")


# --------------------------------------------------------------------------- host


def check_cpus(limits: HostLimits, gpu_count: int) -> Check:
    """CPU count vs affinity vs cgroup quota, and the share per GPU (the seed says 4-8).

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
        value = f"cgroup limit {_gib(limits.memory_limit)} of host {_gib(limits.memory_total)}"
    else:
        value = f"host {_gib(limits.memory_total)}, no cgroup limit"
    value += f", {_gib(limits.memory_available)} available"
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
        workers: DataLoader workers expected (one per usable CPU is typical).
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
        f"{limits.shm_total / _MiB:.0f} MiB ({free / _MiB:.0f} MiB free); {workers} workers x "
        f"{prefetch_factor} batches of {batch_bytes / _MiB:.0f} MiB need ~{need / _MiB:.0f} MiB"
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

    Args:
        pools: ``threadpoolctl.threadpool_info()``; None when threadpoolctl is missing.
        cpu_vendor: ``vendor_id`` from ``/proc/cpuinfo``, e.g. ``"GenuineIntel"``.
        cpus: usable CPUs.

    Example:
        >>> pools = [{"user_api": "blas", "internal_api": "openblas", "num_threads": 4,
        ...           "version": "0.3.27"}]
        >>> check_blas(pools, "GenuineIntel", cpus=4).verdict
        'warn'
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
    if "openblas" in apis and "mkl" not in apis and cpu_vendor == "GenuineIntel":
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
    """
    value = (
        f"torch {torch_threads} threads, OMP_NUM_THREADS={omp_num_threads or 'unset'}, "
        f"{cpus} usable CPUs, {processes} process(es)"
    )
    if omp_num_threads is not None and not omp_num_threads.strip().isdigit():
        fix = f"OMP_NUM_THREADS must be a positive integer, got {omp_num_threads!r}"
        return Check("threads", "warn", value, fix)
    share = max(1, cpus // max(1, processes))
    if omp_num_threads is not None and int(omp_num_threads) * processes > cpus:
        fix = (
            f"OMP_NUM_THREADS={omp_num_threads.strip()} x {processes} process(es) oversubscribes "
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


def check_visible_devices(visible: str | None, order: str | None, gpu_count: int) -> Check:
    """``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` sanity.

    CUDA reads the list once, at start-up; it stops at the first entry it cannot parse or
    that does not exist, shows nothing when an entry repeats, and numbers the GPUs fastest
    first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so on a multi-GPU host an integer index
    need not be the GPU ``nvidia-smi`` shows under it.

    Args:
        visible: ``CUDA_VISIBLE_DEVICES``, None when unset.
        order: ``CUDA_DEVICE_ORDER``, None when unset.
        gpu_count: physical GPUs (NVML's count, which ignores ``CUDA_VISIBLE_DEVICES``).

    Example:
        >>> check_visible_devices("1,3", None, gpu_count=4).verdict
        'warn'
        >>> check_visible_devices("1,3", "PCI_BUS_ID", gpu_count=4).verdict
        'ok'
    """
    value = f"CUDA_VISIBLE_DEVICES={visible!r}, CUDA_DEVICE_ORDER={order!r}"
    if order is not None and order not in _CUDA_ORDERS:
        fix = f"CUDA ignores CUDA_DEVICE_ORDER={order!r}: use one of {list(_CUDA_ORDERS)}"
        return Check("visible_devices", "warn", value, fix)
    if visible is None:
        return Check("visible_devices", "ok", value + f" (all {gpu_count} GPU(s) visible)")
    entries = [e.strip() for e in visible.split(",")]
    if visible.strip() == "" or entries[0].startswith("-"):
        return Check(
            "visible_devices",
            "warn" if gpu_count else "ok",
            value + " (hides every GPU)",
            "unset CUDA_VISIBLE_DEVICES to use the GPUs" if gpu_count else "",
        )
    for entry in entries:
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            fix = (
                f"{entry!r} is neither an index nor a GPU-/MIG- UUID: CUDA stops reading the "
                "list there, so only the entries before it are visible"
            )
            return Check("visible_devices", "fail", value, fix)
        if entry.isdigit() and gpu_count and int(entry) >= gpu_count:
            fix = (
                f"index {entry} does not exist ({gpu_count} GPU(s)): CUDA stops reading the list "
                "there; `nvidia-smi -L` lists the GPUs"
            )
            return Check("visible_devices", "fail", value, fix)
    if len(set(entries)) != len(entries):
        fix = "a GPU is listed twice, and CUDA then makes no GPU visible: list each once"
        return Check("visible_devices", "fail", value, fix)
    if any(e.isdigit() for e in entries) and gpu_count > 1 and order != "PCI_BUS_ID":
        fix = (
            "CUDA numbers GPUs fastest-first, nvidia-smi by PCI bus: index "
            f"{entries[0]} here need not be nvidia-smi's GPU {entries[0]}. Set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID, or list UUIDs (trainperf.select_gpus() does)"
        )
        return Check("visible_devices", "warn", value, fix)
    return Check("visible_devices", "ok", value)
