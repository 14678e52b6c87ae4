"""What every benchmark shares: choosing the device, synchronising it, the run-time limit, the
result protocol.

Every result (:class:`~trainperf.bench.BenchResult`, :class:`~trainperf.bench.MatmulResult`,
:class:`~trainperf.bench.H2DResult`, :class:`~trainperf.bench.ReferenceComparison`,
:class:`Skipped`) is a frozen dataclass whose ``str()`` is the report a person reads and whose
``to_dict()`` (``_utils.serialize.result_dict``) is what ``trainperf bench ... --json``
prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from trainperf._utils.format import format_bytes
from trainperf._utils.serialize import result_dict
from trainperf._utils.validate import positive_number
from trainperf.device import resolve_device as _resolve
from trainperf.limits import host_limits

__all__ = [
    "DEFAULT_MAX_SECONDS",
    "RunTimeLimitExceeded",
    "Skipped",
    "check_host_memory",
    "check_max_seconds",
    "check_tensor_bytes",
    "fewer_iterations",
    "format_duration",
    "gpu_name",
    "iterations_within",
    "limit_passed",
    "power_of_two_at_most",
    "resolve_device",
    "result_dict",
    "run_time_fix",
    "seconds_to_fit",
    "suggested_max_seconds",
    "synchronize",
]

# A benchmark is a check that takes seconds to minutes: a run estimated past this is refused.
DEFAULT_MAX_SECONDS = 300.0

# What a refusal suggests leaves room to spare, so that a rerun a little slower than the run
# it was estimated from (a busier host, a warmer card) is not refused again: a smaller setting
# is sized to fit this share of the limit, and a larger limit is this factor of the estimate.
_FIT_SHARE = 0.8
_LIMIT_HEADROOM = 1.2


class RunTimeLimitExceeded(ValueError):
    """A benchmark's refusal of a run estimated to take longer than its ``max_seconds``
    (which ran nothing more): "... more than max_seconds=<s>: <fix>". A ``ValueError`` to
    callers, as for the other arguments; ``trainperf bench model --precision all`` catches
    it to skip that precision and run the others.
    """


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


# ------------------------------------------------------------------ the run-time limit


def check_max_seconds(max_seconds: object) -> float | None:
    """``max_seconds`` as a float, or None (no limit).

    Raises:
        ValueError: it is neither None nor a finite number > 0.

    Example:
        >>> check_max_seconds(300), check_max_seconds(None)
        (300.0, None)
    """
    if max_seconds is None:
        return None
    return positive_number("max_seconds", max_seconds, unit="seconds (or None)")


def limit_passed(estimate: float, max_seconds: float | None) -> float | None:
    """The decision rule every benchmark's limit shares: ``max_seconds`` where a run
    estimated to take ``estimate`` seconds would take longer; None where it fits (or there
    is no limit).

    Example:
        >>> limit_passed(300.1, 300.0), limit_passed(300.0, 300.0), limit_passed(1e9, None)
        (300.0, None, None)
    """
    return None if max_seconds is None or estimate <= max_seconds else max_seconds


def run_time_fix(estimate: float, fixes: Sequence[str], *, after: Sequence[str] = ()) -> str:
    """What to do instead of a run estimated at ``estimate`` seconds that does not
    :func:`limit_passed`: ``fixes`` (what that benchmark can shrink, each sized by
    :func:`seconds_to_fit`), then the ``max_seconds`` that would let it run
    (:func:`suggested_max_seconds`), then ``after`` (fixes less sure to help).

    Example:
        >>> run_time_fix(400.2, ["fewer iterations (e.g. iterations=7)"])
        'use fewer iterations (e.g. iterations=7) or a larger max_seconds (e.g. max_seconds=490)'
    """
    # iterations=<n> and max_seconds=<s> are what trainperf.cli rewrites as its options.
    larger = f"a larger max_seconds (e.g. max_seconds={suggested_max_seconds(estimate)})"
    every = [*fixes, larger, *after]
    return f"use {', '.join(every[:-1])} or {every[-1]}" if len(every) > 1 else f"use {every[0]}"


def seconds_to_fit(max_seconds: float) -> float:
    """The seconds a suggested smaller setting is sized to take: 0.8 x ``max_seconds``, so
    that a rerun a little slower than the estimate still fits.

    Example:
        >>> seconds_to_fit(300.0)
        240.0
    """
    return _FIT_SHARE * max_seconds


def suggested_max_seconds(estimate: float) -> int:
    """The ``max_seconds`` suggested for a run estimated at ``estimate`` seconds: 1.2 x the
    estimate, rounded up to two significant digits (a rerun a little slower still fits).

    Example:
        >>> suggested_max_seconds(1020.0), suggested_max_seconds(14293.6)
        (1300, 18000)
    """
    wanted = _LIMIT_HEADROOM * estimate
    step = int(10 ** max(0, math.floor(math.log10(wanted)) - 1))
    return math.ceil(wanted / step) * step


def iterations_within(max_seconds: float, fixed_seconds: float, per_iteration: float) -> int:
    """How many iterations of ``per_iteration`` seconds fit beside ``fixed_seconds`` (the
    warm-up) in :func:`seconds_to_fit` of ``max_seconds``: 0 or less where none does.

    Example:
        >>> iterations_within(300.0, 20.0, 10.0)
        22
    """
    return math.floor((seconds_to_fit(max_seconds) - fixed_seconds) / per_iteration)


def fewer_iterations(max_seconds: float, fixed_seconds: float, per_iteration: float) -> list[str]:
    """The fix "fewer iterations (e.g. iterations=<n>)", ``n`` from :func:`iterations_within`;
    none where not even one iteration fits.

    Example:
        >>> fewer_iterations(300.0, 20.0, 10.0), fewer_iterations(300.0, 20.0, 500.0)
        (['fewer iterations (e.g. iterations=22)'], [])
    """
    # iterations=<n> is what trainperf.cli rewrites as --iterations <n>.
    fewer = iterations_within(max_seconds, fixed_seconds, per_iteration)
    return [f"fewer iterations (e.g. iterations={fewer})"] if fewer >= 1 else []


def power_of_two_at_most(n: int) -> int:
    """The largest power of two ``<= n``: the round size a refusal suggests; 0 for ``n < 1``.

    Example:
        >>> power_of_two_at_most(1000), power_of_two_at_most(1), power_of_two_at_most(0)
        (512, 1, 0)
    """
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def format_duration(seconds: float) -> str:
    """``seconds`` in the unit a person reads them in: s, min, h or days.

    Example:
        >>> format_duration(14294), format_duration(0.05)
        ('4.0 h', '0.05 s')
    """
    if seconds < 1:
        return f"{seconds:.2g} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
