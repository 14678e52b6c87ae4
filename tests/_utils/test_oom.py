"""``oom_kind``: device memory, host memory, or another error."""

from __future__ import annotations

import pytest
import torch

from trainperf._utils.oom import oom_kind


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "device"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "device"),  # re-raised
        (RuntimeError("HIP out of memory. Tried to allocate 20.00 MiB"), "device"),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), "device"),
        (
            RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
            "device",
        ),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), "device"),
        # A CUDA call outside the caching allocator (pinned host memory in bench h2d)
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be"), "device"),
        (RuntimeError("CUDA driver error: out of memory"), "device"),  # a driver API call
        (RuntimeError("HIP error: out of memory"), "device"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to"), "host"),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] Cannot allocate memory"), "host"),
        (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate"), "host"),
        (MemoryError(), "host"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)"), None),
        (RuntimeError("PytorchStreamReader failed reading zip archive"), None),
        (ValueError("can't allocate memory"), None),  # only the allocator's RuntimeError
        (OSError(12, "Cannot allocate memory"), None),  # fork() failing: the caller says so
    ],
)
def test_each_error_reads_as_what_ran_out(error: BaseException, kind: str | None) -> None:
    assert oom_kind(error) == kind


def test_a_real_cpu_allocation_failure_is_host_memory() -> None:
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as e:
        assert oom_kind(e) == "host"
    else:  # pragma: no cover - a host with four exbibytes
        pytest.skip("the allocation succeeded")
