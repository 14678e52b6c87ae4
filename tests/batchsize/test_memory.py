"""Peak memory: the host's resident growth (with the kernel's high-water mark) and CUDA's."""

from __future__ import annotations

import pytest
import torch

from trainperf.batchsize._memory import (
    CudaMemory,
    HostMemory,
    UnmeasuredMemory,
    _reset_high_water_mark,
    reader_for,
)

MiB = 2**20


def _touch(nbytes: int) -> None:
    """Allocate and write ``nbytes`` (so the pages are resident), then free them."""
    x = torch.ones(nbytes // 4)
    x.mul_(2.0)
    del x


def test_host_peak_counts_memory_freed_before_the_probe_ends() -> None:
    m = HostMemory()
    assert m.kind == "rss" and m.limit is not None and m.limit > 0
    m.start_probe()
    _touch(96 * MiB)
    m.after_step()  # where the high-water mark cannot be reset, this samples: still freed
    peak = m.peak().memory
    assert peak is not None
    if m.samples_steps:
        pytest.skip("VmHWM cannot be reset here: the peak inside a step is not seen")
    assert peak >= 80 * MiB


def test_host_peak_starts_again_at_each_probe() -> None:
    m = HostMemory()
    m.start_probe()
    _touch(96 * MiB)
    first = m.peak().memory
    m.free()
    m.start_probe()
    second = m.peak().memory
    assert first is not None and second is not None
    if not _reset_high_water_mark():
        pytest.skip("VmHWM cannot be reset here")
    assert second < first - 48 * MiB


def test_each_device_gets_its_reader() -> None:
    assert isinstance(reader_for(torch.device("cpu")), HostMemory)
    unmeasured = reader_for(torch.device("mps"))  # built without touching MPS
    assert isinstance(unmeasured, UnmeasuredMemory)
    assert unmeasured.kind == "unmeasured" and unmeasured.peak().memory is None


@pytest.mark.requires_cuda
def test_cuda_peak_is_the_allocators_reserved_memory_within_the_free_memory() -> None:
    dev = torch.device("cuda", 0)
    m = CudaMemory(dev)
    assert m.limit is not None and m.limit > 0
    m.start_probe()
    x = torch.ones(64 * MiB // 4, device=dev)
    del x
    peak = m.peak()
    assert peak.memory is not None and peak.allocated is not None
    assert peak.memory >= peak.allocated >= 64 * MiB
    m.free()
    m.start_probe()
    assert (m.peak().allocated or 0) < 64 * MiB
