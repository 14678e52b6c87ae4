"""Exceptions that trainperf callers may want to catch.

Everything else is a built-in exception (``ValueError`` for a bad argument,
``ModuleNotFoundError`` for a missing extra) whose message names the value and
the fix. The tree::

    TrainperfError
    ├── DeviceError                  (also RuntimeError)
    │   └── DeviceMismatchError      tensors/parameters on different devices
    ├── CheckpointError
    │   ├── CheckpointNotFoundError  (also FileNotFoundError)
    │   ├── CheckpointCorruptError   empty, truncated or damaged file
    │   ├── NotACheckpointError      a file that is not a checkpoint at all
    │   ├── UnsafeCheckpointError    weights_only=True refused the file
    │   └── StateDictMismatchError   keys or shapes differ from the model
    └── LaunchError                  a multi-process launch failed
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DeviceError",
    "DeviceMismatchError",
    "LaunchError",
    "NotACheckpointError",
    "StateDictMismatchError",
    "TrainperfError",
    "UnsafeCheckpointError",
]


class TrainperfError(Exception):
    """Base class of every exception trainperf defines."""


class DeviceError(TrainperfError, RuntimeError):
    """A device could not be selected or used as asked (no CUDA, too few GPUs, CUDA already
    initialised)."""


class DeviceMismatchError(DeviceError):
    """A module and its inputs live on more than one device."""


class CheckpointError(TrainperfError):
    """A checkpoint could not be saved or loaded. ``path`` names the file."""

    def __init__(self, message: str, path: object = None) -> None:
        super().__init__(message)
        self.path = path


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""

    def __str__(self) -> str:
        # FileNotFoundError's own __str__ would print "[Errno None]" for a one-argument error.
        return str(self.args[0]) if self.args else ""


class CheckpointCorruptError(CheckpointError):
    """The file is empty, truncated or damaged (an interrupted copy or write)."""


class NotACheckpointError(CheckpointError):
    """The file exists and is readable, but is not a PyTorch or safetensors checkpoint."""


class UnsafeCheckpointError(CheckpointError):
    """``weights_only=True`` refused an object in the file; loading it needs explicit trust."""


class StateDictMismatchError(CheckpointError):
    """A state dict does not fit a model: missing, unexpected or shape-mismatched keys."""

    def __init__(
        self,
        message: str,
        *,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched


class LaunchError(TrainperfError, RuntimeError):
    """A worker of a multi-process launch failed; the message names the rank and cause."""
