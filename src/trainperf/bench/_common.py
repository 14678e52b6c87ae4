"""What every benchmark shares: choosing the device, synchronising it, skipped records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from trainperf.device import resolve_device as _resolve

__all__ = ["Skipped", "check_positive", "gpu_name", "resolve_device", "synchronize"]


@dataclass(frozen=True)
class Skipped:
    """A measurement that was not run, and why (a CPU-only host, an unsupported dtype).

    Attributes:
        benchmark: ``"model"``, ``"matmul"`` or ``"h2d"``.
        setting: what was skipped, e.g. ``"fp16"`` or ``"tf32"``.
        reason: why, and what would make it run.
    """

    benchmark: str
    setting: str
    reason: str


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to benchmark: ``device`` checked, or the best one available when None.

    Parsed by :func:`trainperf.device.resolve_device` with CPU and CUDA allowed (None on a
    Mac picks the CPU); a bare ``"cuda"`` becomes the current CUDA device, so records
    name the card.
    """
    dev = _resolve(device, allowed=("cpu", "cuda"))
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


def check_positive(name: str, value: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
