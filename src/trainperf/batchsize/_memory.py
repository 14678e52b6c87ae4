"""Peak memory of one probe and the limit it is held to, on CUDA and on the host.

CUDA (:class:`CudaMemory`): the limit is what this process could hold when tuning began,
``torch.cuda.mem_get_info``'s free memory plus what PyTorch's caching allocator already
reserved (other processes' memory is not ours to count on), lowered after each probe if the
driver's free memory shrank for reasons outside the allocator (a cuDNN or NCCL workspace, the
context growing). A probe's peak is ``max_memory_reserved``: what the allocator held at its
highest, fragmentation included, which is what runs out, not ``max_memory_allocated``
(recorded alongside). Both peaks are reset before each probe, after the previous probe's
memory is handed back (``empty_cache``).

Host (:class:`HostMemory`, for ``device="cpu"``): the limit is
:func:`trainperf.host_limits`'s available memory when tuning began (cgroup-aware: past it
the kernel's OOM killer ends the process, no exception), and a probe's peak is the growth of
this process's resident memory over its size when tuning began. On Linux the kernel's
high-water mark (``VmHWM``) is reset before each probe (``/proc/self/clear_refs``), so the
peak inside a step counts; elsewhere the resident size is read after each step. Freed memory
is handed back to the system between probes (``malloc_trim``) so one probe's peak does not
start from the previous one's.

Other devices (MPS): no peak is measured; only an out-of-memory error stops the search.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from trainperf.limits import host_limits

__all__ = ["CudaMemory", "HostMemory", "MemoryReader", "Peak", "UnmeasuredMemory", "reader_for"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class Peak:
    """One probe's peak memory in bytes (``allocated``: CUDA's live tensors, else None)."""

    memory: int | None
    allocated: int | None = None


class MemoryReader:
    """What the tuner asks of a device's memory (this base measures nothing)."""

    kind = "unmeasured"
    """How ``peak`` is measured, for the report: ``"cuda"``, ``"rss"`` or ``"unmeasured"``."""
    limit: int | None = None
    """Bytes a probe's peak is held to (before the headroom), None when unknown."""
    start_level: int = 0
    """What a peak would read with nothing probed (CUDA: reserved at the start; the host's
    peaks are growth, so 0), for the memory prediction."""

    def start_probe(self) -> None:
        """Reset the peak (the previous probe's memory was handed back by :meth:`free`)."""

    def after_step(self) -> None:
        """Called after each step (a reader that samples reads here)."""

    def peak(self) -> Peak:
        """The peak since :meth:`start_probe`."""
        return Peak(None)

    def free(self, collect: bool = False) -> None:
        """Hand freed memory back; ``collect``: first run a full garbage collection (after
        an out-of-memory error, whose traceback's reference cycles may hold the probe's
        tensors). Not otherwise: with torch loaded a full collection takes 0.15 s in a bare
        interpreter and seconds in a large one (a test session, a notebook)."""
        if collect:
            gc.collect()


class UnmeasuredMemory(MemoryReader):
    """A device whose peak memory trainperf cannot read (MPS)."""


class CudaMemory(MemoryReader):
    """The caching allocator's peak against what this process could hold on the GPU."""

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free()
        free, _ = torch.cuda.mem_get_info(device)
        self.start_level = int(torch.cuda.memory_reserved(device))
        self.limit = int(free) + self.start_level

    def free(self, collect: bool = False) -> None:
        if collect:
            gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def start_probe(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> Peak:
        torch.cuda.synchronize(self.device)
        reserved = int(torch.cuda.max_memory_reserved(self.device))
        allocated = int(torch.cuda.max_memory_allocated(self.device))
        free, _ = torch.cuda.mem_get_info(self.device)
        # Memory outside the allocator (cuDNN/cuBLAS workspaces, NCCL) shrinks what we have.
        room = int(free) + int(torch.cuda.memory_reserved(self.device))
        self.limit = room if self.limit is None else min(self.limit, room)
        return Peak(max(reserved, allocated), allocated)


def _vm_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _malloc_trim() -> None:
    """Hand freed heap memory back to the system (glibc only; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def _reset_high_water_mark() -> bool:
    """Reset the kernel's peak resident size (``VmHWM``) to the current one (Linux >= 4.0)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _vm_kib("VmHWM") is not None


class HostMemory(MemoryReader):
    """Growth of this process's resident memory against the host's available memory."""

    kind = "rss"

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.free()
        self._rss0 = self._rss()
        self.limit = host_limits().memory_available
        self._hwm = False
        self._sampled = 0

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def free(self, collect: bool = False) -> None:
        if collect:
            gc.collect()
        _malloc_trim()

    def start_probe(self) -> None:
        self._hwm = _reset_high_water_mark()
        self._sampled = self._rss()

    def after_step(self) -> None:
        if not self._hwm:
            self._sampled = max(self._sampled, self._rss())

    def peak(self) -> Peak:
        high = _vm_kib("VmHWM") if self._hwm else None
        top = max(self._sampled, self._rss(), high or 0)
        return Peak(max(0, top - self._rss0))

    @property
    def samples_steps(self) -> bool:
        """True when the peak is sampled after each step (``VmHWM`` could not be reset)."""
        return not self._hwm


def reader_for(device: torch.device) -> MemoryReader:
    """The memory reader for ``device``.

    Example:
        >>> reader_for(torch.device("cpu")).kind
        'rss'
    """
    if device.type == "cuda":
        return CudaMemory(device)
    if device.type == "cpu":
        return HostMemory()
    return UnmeasuredMemory()
