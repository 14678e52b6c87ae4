"""``bench_h2d``: host-to-device copy bandwidth from pageable and from pinned memory.

A copy from ordinary (pageable) host memory is staged by the driver through a pinned
buffer; from pinned memory the GPU's copy engine reads it directly. The difference is what
``DataLoader(pin_memory=True)`` buys: on one H200, 7.2 GB/s pageable against 54.5 GB/s
pinned (7.6x).

Each copy is synchronised on its own (a copy is what is timed). The first timed copy of each
kind comes before the others, so that a run they say would take longer than
``max_seconds`` is refused before the rest of it runs (with one timed copy of each, nothing
is left to spare, so nothing is refused).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from trainperf._utils.format import format_bytes
from trainperf._utils.validate import positive_int
from trainperf.bench._common import (
    DEFAULT_MAX_SECONDS,
    RunTimeLimitExceeded,
    check_host_memory,
    check_max_seconds,
    check_tensor_bytes,
    fewer_iterations,
    format_duration,
    gpu_name,
    limit_passed,
    power_of_two_at_most,
    resolve_device,
    result_dict,
    run_time_fix,
    seconds_to_fit,
    synchronize,
)
from trainperf.errors import DeviceError

__all__ = ["H2DResult", "bench_h2d"]

_MiB = 2**20
DEFAULT_SIZE_BYTES = 512 * _MiB


@dataclass(frozen=True)
class H2DResult:
    """Host-to-device bandwidth, pageable vs pinned.

    Attributes:
        device: e.g. ``"cuda:0"``.
        gpu_name: the GPU's name.
        size_bytes: bytes per copy.
        iterations: timed copies of each kind.
        pageable_gb_per_s: median bandwidth from pageable memory, in GB/s (10^9 bytes).
        pinned_gb_per_s: median bandwidth from pinned memory, in GB/s.
        pinned_speedup: ``pinned_gb_per_s / pageable_gb_per_s``.
    """

    device: str
    gpu_name: str | None
    size_bytes: int
    iterations: int
    pageable_gb_per_s: float
    pinned_gb_per_s: float
    pinned_speedup: float

    def summary(self) -> str:
        """Two lines: pageable and pinned GB/s, and what pinning is worth.

        Example:
            >>> r = H2DResult("cuda:0", "NVIDIA H200", 2**28, 10, 12.3, 50.1, 50.1 / 12.3)
            >>> print(r.summary())
            pageable:   12.3 GB/s
            pinned:     50.1 GB/s (4.1x; use DataLoader(pin_memory=True))
        """
        return (
            f"pageable: {self.pageable_gb_per_s:6.1f} GB/s\n"
            f"pinned:   {self.pinned_gb_per_s:6.1f} GB/s "
            f"({self.pinned_speedup:.1f}x; use DataLoader(pin_memory=True))"
        )

    def __str__(self) -> str:
        """A line naming the GPU and the copy size, then :meth:`summary`.

        Example:
            >>> print(H2DResult("cuda:0", "NVIDIA H200", 2**28, 10, 12.3, 50.1, 50.1 / 12.3))
            host -> NVIDIA H200, 256 MiB per copy:
            pageable:   12.3 GB/s
            pinned:     50.1 GB/s (4.1x; use DataLoader(pin_memory=True))
        """
        size = self.size_bytes
        per_copy = f"{size // _MiB} MiB" if size % _MiB == 0 else f"{size} bytes"
        where = self.gpu_name or self.device
        return f"host -> {where}, {per_copy} per copy:\n{self.summary()}"

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-safe.

        Example:
            >>> H2DResult("cuda:0", None, 2**20, 1, 1.0, 4.0, 4.0).to_dict()["pinned_speedup"]
            4.0
        """
        return result_dict(self)


def _buffers(size_bytes: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The pageable and the pinned source, each filled, and the target on ``device``."""
    pageable = torch.empty(size_bytes, dtype=torch.uint8)
    pageable.fill_(1)  # touch every page, so first-touch faults are not timed
    pinned = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    target = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    return pageable, pinned, target


def _seconds_per_copy(src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> float:
    """One copy's wall time, synchronised."""
    start = time.perf_counter()
    dst.copy_(src, non_blocking=src.is_pinned())
    synchronize(device)
    return time.perf_counter() - start


def _check_run_time(
    size_bytes: int,
    iterations: int,
    firsts: tuple[float, float],
    device: torch.device,
    max_seconds: float | None,
) -> None:
    """Refuse a run whose copies, at the seconds of the first timed pageable and pinned
    copy (``firsts``), would take longer than ``max_seconds``.

    Raises:
        RunTimeLimitExceeded: they would (a ValueError); the message names the estimate, the
            rates and the fix.
    """
    per_round = sum(firsts)  # one copy of each kind
    estimate = (1 + iterations) * per_round
    limit = limit_passed(estimate, max_seconds)
    if limit is None:
        return
    # iterations=<n> and size_bytes=<n> are what trainperf.cli rewrites as --iterations <n>
    # and --size-mb <n / 2**20>.
    fixes = fewer_iterations(limit, per_round, per_round)
    # A copy's time taken as in proportion to its bytes; a power of two from 1 MiB, so whole
    # MiB (what --size-mb says; a smaller copy measures its latency more than the bandwidth).
    fitting = int(size_bytes * seconds_to_fit(limit) / estimate)
    smaller = max(_MiB, power_of_two_at_most(fitting))
    if not fixes and fitting >= 1 and smaller < size_bytes:
        fixes.append(f"a smaller size_bytes (e.g. size_bytes={smaller})")
    pageable, pinned = (size_bytes / seconds / 1e9 for seconds in firsts)
    raise RunTimeLimitExceeded(
        f"bench_h2d(iterations={iterations}): {2 * (1 + iterations)} copies of "
        f"{format_bytes(size_bytes)} (1 warm-up and {iterations} timed, pageable and pinned) "
        f"would take about {format_duration(estimate)} on {device} ({pageable:.3g} GB/s "
        f"pageable, {pinned:.3g} GB/s pinned, from the first timed copy of each), more than "
        f"max_seconds={limit:g}: {run_time_fix(estimate, fixes)}"
    )


def _copy_seconds(
    sources: tuple[torch.Tensor, torch.Tensor],
    target: torch.Tensor,
    device: torch.device,
    size_bytes: int,
    iterations: int,
    max_seconds: float | None,
) -> tuple[list[float], list[float]]:
    """The seconds of each timed copy of ``size_bytes`` from each source, after an untimed
    one; the first timed copy of each is checked against ``max_seconds``
    (:func:`_check_run_time`) before the rest run (where any remain: a check after the last
    copy could only refuse a run that is over)."""
    firsts = []
    for src in sources:
        _seconds_per_copy(src, target, device)  # warm-up: first-touch and driver setup
        firsts.append(_seconds_per_copy(src, target, device))
    if iterations > 1:
        _check_run_time(size_bytes, iterations, (firsts[0], firsts[1]), device, max_seconds)
    pageable, pinned = (
        [first] + [_seconds_per_copy(src, target, device) for _ in range(iterations - 1)]
        for first, src in zip(firsts, sources, strict=True)
    )
    return pageable, pinned


def bench_h2d(
    *,
    size_bytes: int = DEFAULT_SIZE_BYTES,
    iterations: int = 5,
    device: str | torch.device | None = None,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
) -> H2DResult:
    """Measure host-to-device copy bandwidth from pageable and from pinned memory.

    Args:
        size_bytes: bytes per copy (512 MiB by default).
        iterations: timed copies of each kind (after one untimed copy).
        device: ``"cuda"`` or ``"cuda:<i>"``; None or ``"auto"`` is the best available
            device (:func:`trainperf.best_device`: the GPU with the most free memory). Unlike
            the other benchmarks there is no CPU fallback: without CUDA there is nothing to
            copy to, and a :class:`~trainperf.errors.DeviceError` says so.
        max_seconds: refuse a run that would take longer than this (every copy, estimated
            from the first timed copy of each kind, which run before the others; with
            ``iterations=1`` those are the last, and nothing is refused); None for no limit.

    Returns:
        An :class:`H2DResult`.

    Raises:
        ValueError: a count below 1, a ``size_bytes`` past what a tensor can address
            (``2**63 - 1``), a non-CUDA ``device``, a ``max_seconds`` that is not a positive
            number or None, or copies estimated to take longer than ``max_seconds`` (the
            message names the estimate and the fix).
        DeviceError: no CUDA GPU is available (host-to-device copies need one), or the CUDA
            device asked for does not exist.
        MemoryError: the pageable and the pinned buffer need more host memory than is
            available (checked before they are filled).

    Example:
        >>> from trainperf.errors import DeviceError
        >>> try:
        ...     r = bench_h2d(size_bytes=2**20, iterations=1)
        ... except DeviceError as e:  # a CPU-only machine
        ...     print("needs CUDA" in str(e))
        ... else:
        ...     print(r.pinned_gb_per_s > 0)
        True
    """
    size_bytes = positive_int("size_bytes", size_bytes)
    iterations = positive_int("iterations", iterations)
    max_seconds = check_max_seconds(max_seconds)
    check_tensor_bytes(
        f"bench_h2d(size_bytes={size_bytes})",
        "one copy",
        size_bytes,
        torch.uint8,
        f"use a smaller size_bytes (e.g. size_bytes={DEFAULT_SIZE_BYTES}, the default: "
        f"{DEFAULT_SIZE_BYTES // 2**20} MiB)",
    )
    if device in (None, "auto") and not torch.cuda.is_available():
        raise DeviceError(
            "bench_h2d needs CUDA: it measures host-to-device copies, and no CUDA GPU is "
            "available here (no NVIDIA GPU or driver, or a CPU-only PyTorch build)"
        )
    try:
        dev = resolve_device(device, allowed=("cuda",))
    except ValueError as e:
        raise ValueError(
            f"bench_h2d needs a CUDA device ('cuda' or 'cuda:<i>'), got {device!r}"
        ) from e
    what = "a pageable and a pinned copy"
    fix = "use a smaller size_bytes"
    check_host_memory(f"bench_h2d(size_bytes={size_bytes})", what, 2 * size_bytes, fix)
    pageable, pinned, target = _buffers(size_bytes, dev)
    seconds = _copy_seconds((pageable, pinned), target, dev, size_bytes, iterations, max_seconds)
    pageable_rate, pinned_rate = (
        statistics.median(size_bytes / s / 1e9 for s in kind) for kind in seconds
    )
    return H2DResult(
        device=str(dev),
        gpu_name=gpu_name(dev),
        size_bytes=size_bytes,
        iterations=iterations,
        pageable_gb_per_s=pageable_rate,
        pinned_gb_per_s=pinned_rate,
        pinned_speedup=pinned_rate / pageable_rate,
    )
