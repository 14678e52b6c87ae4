"""What every benchmark shares: choosing the device, synchronising it, skipped records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from trainperf.errors import DeviceError

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
    """The device to benchmark: ``device`` checked, or the best one available when None."""
    if device is None:
        from trainperf.device import best_device

        dev = best_device()
        return dev if dev.type in ("cuda", "cpu") else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r} ({e})"
        ) from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {device!r} asked for, but CUDA is not available here: "
                "no NVIDIA GPU or driver, or a CPU-only PyTorch build"
            )
        # torch's stubs type .index as int, but a bare "cuda" has none.
        index = cast("int | None", dev.index)
        if index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) "
                "are visible"
            )
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
