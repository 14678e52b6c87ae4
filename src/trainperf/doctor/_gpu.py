"""The GPU and PyTorch-build checks behind ``trainperf doctor``: pure functions of their inputs.

Like the host checks in ``_checks``, each takes what it checks as arguments and
returns a :class:`~trainperf.doctor.Check`; import them from :mod:`trainperf.doctor`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from trainperf._utils.format import format_bytes
from trainperf.device import GpuInfo
from trainperf.doctor._checks import Check

__all__ = ["check_cuda_arch", "check_gpus", "check_torch_build"]

# A GPU already this busy (percent) or this full when doctor runs is shared with someone.
BUSY_UTILIZATION = 50
BUSY_MEMORY_FRACTION = 0.1


def check_gpus(
    gpus: Sequence[GpuInfo],
    driver: str | None = None,
    error: str | None = None,
    *,
    physical: int = 0,
) -> Check:
    """GPUs and driver as NVML sees them, and whether another process already uses one.

    Args:
        gpus: the visible GPUs (:func:`trainperf.gpus`).
        driver: the driver version, None when unknown.
        error: why the GPUs could not be listed, if they could not.
        physical: the host's GPUs (NVML's count, which ignores ``CUDA_VISIBLE_DEVICES``);
            0 when none or unknown.

    Example:
        >>> check_gpus([]).verdict
        'skip'
        >>> check_gpus([], physical=2).value
        'no GPU visible: CUDA_VISIBLE_DEVICES hides all 2 GPU(s) of this host'
    """
    if error is not None:
        return Check("gpus", "fail", f"NVML failed: {error}", "check that `nvidia-smi` works")
    if not gpus and physical:
        return Check(
            "gpus",
            "skip",
            f"no GPU visible: CUDA_VISIBLE_DEVICES hides all {physical} GPU(s) of this host",
            "to use them, unset CUDA_VISIBLE_DEVICES or list them in it (`nvidia-smi -L`); "
            "the visible_devices check says why",
        )
    if not gpus:
        fix = (
            "nothing to do on a CPU-only machine; on a GPU host, check the driver "
            "(`nvidia-smi`) and CUDA_VISIBLE_DEVICES"
        )
        return Check(
            "gpus",
            "skip",
            "no NVIDIA GPU visible (no driver, or CUDA_VISIBLE_DEVICES hides them)",
            fix,
        )
    parts = []
    busy = []
    for g in gpus:
        memory = "" if g.memory_total is None else f", {format_bytes(g.memory_total)}"
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
    unknown = [name for name, cc in capabilities if cc is None]
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
    if len(unknown) == len(capabilities):
        return Check(
            "cuda_arch", "skip", value + "; no GPU's compute capability is known", "see gpus"
        )
    if unknown:
        return Check(
            "cuda_arch",
            "ok",
            value + "; native kernels for every GPU but " + ", ".join(unknown) + " (compute "
            "capability unknown)",
            "",
        )
    return Check("cuda_arch", "ok", value + "; every GPU has native kernels")
