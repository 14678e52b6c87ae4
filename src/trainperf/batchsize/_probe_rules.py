"""How one batch size is measured and judged, each rule a pure function of what the probe
(:mod:`trainperf.batchsize._probe`) saw: the shape of the measurement (:class:`ProbePolicy`),
when the warm-up has settled (:func:`warmed_up`), how many steps make a timed window
(:func:`steps_per_window`), which errors are out-of-memory ones (:func:`is_out_of_memory`,
:func:`oom_text`) and what a size's peak makes of it (:func:`status_of`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainperf._utils.oom import oom_kind
from trainperf._utils.windows import WindowPolicy
from trainperf.batchsize._report import CandidateStatus

__all__ = [
    "DEFAULT_PROBE",
    "OTHER_RANK",
    "ProbePolicy",
    "is_out_of_memory",
    "oom_text",
    "status_of",
    "steps_per_window",
    "warmed_up",
]


@dataclass(frozen=True)
class ProbePolicy:
    """How one batch size is measured (:mod:`trainperf.batchsize._probe` says why).

    Attributes:
        min_warmup: warm-up steps at least.
        max_warmup: warm-up steps at most.
        warmup_tolerance: warm-up ends when two steps in a row differ by at most this.
        windows: the timed windows (``min_window_s``, ``min_windows``, ``max_windows``,
            ``target_spread``; ``min_window_batches`` is the fewest steps per window).
    """

    min_warmup: int = 2
    max_warmup: int = 8
    warmup_tolerance: float = 0.25
    windows: WindowPolicy = field(
        default_factory=lambda: WindowPolicy(
            min_window_batches=1, min_window_s=0.25, min_windows=2, max_windows=5
        )
    )


DEFAULT_PROBE = ProbePolicy()


def is_out_of_memory(e: BaseException) -> bool:
    """True for an out-of-memory error: ``torch.OutOfMemoryError`` (CUDA and other
    accelerators), or a ``RuntimeError`` saying so: the CPU allocator's (it raises no such
    class), cuBLAS/cuDNN failing to allocate a workspace, or any that says "out of memory"
    (``CUDA driver error: out of memory`` from a driver API call, ROCm's ``HIP error: out of
    memory``, an out-of-tree backend's ``NPU out of memory``).

    Example:
        >>> import torch
        >>> is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
        True
        >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
        True
        >>> is_out_of_memory(RuntimeError("CUDA driver error: out of memory"))
        True
        >>> is_out_of_memory(RuntimeError("shape mismatch"))
        False
    """
    if oom_kind(e) is not None:
        return True
    # A size that does not fit raises more texts than oom_kind reads (which say whether
    # device or host memory ran out); for the search only "it did not fit" matters.
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def warmed_up(times: Sequence[float], policy: ProbePolicy = DEFAULT_PROBE) -> bool:
    """True once the warm-up steps (their seconds, in order) have settled.

    Example:
        >>> warmed_up([3.0, 0.1]), warmed_up([3.0, 0.1, 0.11]), warmed_up([0.1] * 8)
        (False, True, True)
    """
    if len(times) >= policy.max_warmup:
        return True
    if len(times) < max(2, policy.min_warmup):
        return False
    prev, last = times[-2], times[-1]
    return abs(last - prev) <= policy.warmup_tolerance * max(prev, last, 1e-9)


def steps_per_window(step_s: float, policy: ProbePolicy = DEFAULT_PROBE) -> int:
    """Steps in one timed window: enough for ``min_window_s`` at ``step_s`` per step.

    Example:
        >>> steps_per_window(0.01), steps_per_window(2.0)
        (25, 1)
    """
    w = policy.windows
    want = math.ceil(w.min_window_s / max(step_s, 1e-6) - 1e-9)
    return int(min(100_000, max(w.min_window_batches, want)))


def status_of(oom: bool, peak: int | None, usable: float | None) -> CandidateStatus:
    """``oom``, ``over-headroom`` (the peak is past ``usable``) or ``ok``.

    Example:
        >>> status_of(False, 9 * 2**30, 8 * 2**30), status_of(False, None, 1.0)
        ('over-headroom', 'ok')
    """
    if oom:
        return "oom"
    if peak is not None and usable is not None and peak > usable:
        return "over-headroom"
    return "ok"


OTHER_RANK = "out of memory on another rank"


def oom_text(e: BaseException) -> str:
    """The first line of an out-of-memory error (200 characters at most), or its class.

    Example:
        >>> oom_text(RuntimeError("DefaultCPUAllocator: can't allocate memory\\nmore"))
        "DefaultCPUAllocator: can't allocate memory"
    """
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
