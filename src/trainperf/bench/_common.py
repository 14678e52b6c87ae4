"""What every benchmark shares: choosing the device, synchronising it, the result protocol.

Every result (:class:`~trainperf.bench.BenchResult`, :class:`~trainperf.bench.MatmulResult`,
:class:`~trainperf.bench.H2DResult`, :class:`~trainperf.bench.ReferenceComparison`,
:class:`Skipped`) is a frozen dataclass whose ``str()`` is the report a person reads and whose
``to_dict()`` (``_utils.serialize.result_dict``) is what ``trainperf bench ... --json``
prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from trainperf._utils.format import format_bytes
from trainperf._utils.serialize import result_dict
from trainperf.device import resolve_device as _resolve
from trainperf.limits import host_limits

__all__ = [
    "Skipped",
    "check_host_memory",
    "check_tensor_bytes",
    "gpu_name",
    "resolve_device",
    "result_dict",
    "synchronize",
]


@dataclass(frozen=True)
class Skipped:
    """A measurement that was not run, and why (a CPU-only host, an unsupported dtype).

    Attributes:
        benchmark: ``"model"``, ``"matmul"`` or ``"h2d"``.
        setting: what was skipped, e.g. ``"fp16"`` or ``"tf32"``.
        reason: why, and what would make it run.

    Example:
        >>> print(Skipped("matmul", "tf32", "needs a CUDA GPU"))
        bench matmul tf32 skipped: needs a CUDA GPU
    """

    benchmark: str
    setting: str
    reason: str

    def __str__(self) -> str:
        return f"bench {self.benchmark} {self.setting} skipped: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """``{"benchmark", "setting", "reason"}``, JSON-safe."""
        return result_dict(self)


# PyTorch counts a tensor's bytes in a signed 64-bit integer: past it, it raises "Storage size
# calculation overflowed" (or a TypeError for a dimension past int64) instead of running out
# of memory.
_MAX_TENSOR_BYTES = 2**63 - 1


def check_tensor_bytes(call: str, what: str, numel: int, dtype: torch.dtype, fix: str) -> None:
    """Raise ``ValueError`` where ``numel`` elements of ``dtype`` are more bytes than a tensor
    can address, before PyTorch fails on it with an error that names no argument.

    Args:
        call: the call and the value at fault, e.g. ``"bench_matmul(size=3000000000)"``.
        what: the tensor, e.g. ``"a 3000000000x3000000000 fp32 matrix"``.
        numel: its element count.
        dtype: its dtype.
        fix: what to do instead.

    Raises:
        ValueError: the tensor would need more than ``2**63 - 1`` bytes.

    Example:
        >>> check_tensor_bytes("f(n=4)", "a tensor", 4, torch.float32, "use a smaller n")
    """
    nbytes = numel * dtype.itemsize
    if nbytes > _MAX_TENSOR_BYTES:
        raise ValueError(
            f"{call}: {what} is {nbytes:.2g} bytes, more than a tensor can address "
            f"(2**63 - 1): {fix}"
        )


def check_host_memory(call: str, what: str, nbytes: int, fix: str | Callable[[int], str]) -> None:
    """Raise ``MemoryError`` where ``nbytes`` of host memory are more than this process can
    still allocate (``host_limits().memory_available``, a cgroup limit included), before
    filling them swaps the host or gets the process killed by the kernel, without a message.

    Args:
        call: the call and the value at fault, e.g. ``"bench_matmul(size=100000)"``.
        what: the buffers, e.g. ``"three 100000x100000 fp32 matrices"``.
        nbytes: their bytes.
        fix: what to do instead, or a function of the bytes available that says it (a
            size that fits).

    Raises:
        MemoryError: ``nbytes`` is more than the memory available.

    Example:
        >>> check_host_memory("f(n=1)", "one byte", 1, "use a smaller n")
    """
    available = host_limits().memory_available
    if nbytes > available:
        fix = fix(available) if callable(fix) else fix
        raise MemoryError(
            f"{call}: {what} need {format_bytes(nbytes)} of host memory, and "
            f"{format_bytes(available)} is available (it would swap, or the kernel would kill "
            f"the process): {fix}"
        )


def resolve_device(
    device: str | torch.device | None, allowed: tuple[str, ...] = ("cpu", "cuda")
) -> torch.device:
    """The device to benchmark: ``device`` checked, or the best one available for None/"auto".

    Parsed by :func:`trainperf.device.resolve_device` with CPU and CUDA allowed (None on a
    Mac picks the CPU, not MPS: the benchmarks and their reference figures are CPU or CUDA),
    or only ``allowed``; a bare ``"cuda"`` becomes the current CUDA device, so records name
    the card.
    """
    dev = _resolve(device, allowed=allowed)
    # torch's stubs type .index as int, but a bare "cuda" has none.
    if dev.type == "cuda" and cast("int | None", dev.index) is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` to finish its queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_name(device: torch.device) -> str | None:
    """The name of the GPU behind ``device``, or None for the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
