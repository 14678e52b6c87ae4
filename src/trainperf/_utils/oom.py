"""What ran out of memory: :func:`oom_kind`, one reading of allocator errors.

torch raises ``torch.OutOfMemoryError`` only for CUDA (and other accelerators) through its
caching allocator. The CPU allocator, cuBLAS/cuDNN failing to allocate a workspace, MPS,
and code that catches and re-raises give a plain ``RuntimeError`` whose text says so, which
would otherwise read as a damaged checkpoint or a bug in the user's step. Used by
``checkpoint`` (device or host memory: each names its own fix), ``tune_batch_size`` (a size
that does not fit) and the ``trainperf bench`` command (a setting skipped).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["oom_kind"]

_DEVICE_TEXTS = (
    "cuda out of memory",
    "cuda error: out of memory",  # a CUDA call outside the caching allocator (pinned memory)
    "cuda driver error: out of memory",  # a driver API call
    "hip out of memory",
    "hip error: out of memory",
    "mps backend out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
)
_HOST_TEXTS = ("can't allocate memory", "cannot allocate memory", "not enough memory")


def oom_kind(e: BaseException) -> Literal["device", "host"] | None:
    """``"device"`` when a GPU's memory ran out, ``"host"`` when host memory did, None for
    any other error.

    Example:
        >>> oom_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        'device'
        >>> oom_kind(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling"))
        'device'
        >>> oom_kind(RuntimeError("CUDA error: out of memory (pinned memory)"))
        'device'
        >>> oom_kind(RuntimeError("CUDA driver error: out of memory"))
        'device'
        >>> oom_kind(RuntimeError("DefaultCPUAllocator: can't allocate memory")), oom_kind(
        ...     MemoryError())
        ('host', 'host')
        >>> oom_kind(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
        True
    """
    if isinstance(e, torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError since 2.5
        return "device"
    if isinstance(e, MemoryError):
        return "host"
    if not isinstance(e, RuntimeError):
        return None
    text = str(e).lower()
    if any(t in text for t in _DEVICE_TEXTS):
        return "device"
    if any(t in text for t in _HOST_TEXTS):
        return "host"
    return None
