"""trainperf: make plain PyTorch training scripts fast, and say why a run is slow.

Import only what you need: ``import trainperf`` imports nothing but this file (not even
torch), and each name below loads its subpackage the first time it is used
(``trainperf.MixedPrecision`` imports ``trainperf.amp``), so ``trainperf --help`` and every
rank ``trainperf.ddp`` starts pay only for what they use. Nothing initialises CUDA or
imports NVML, torchvision, DALI or matplotlib (those load inside the functions that use
them).

Example:
    >>> import trainperf
    >>> trainperf.to_device({"x": [1, 2]}, "cpu")
    {'x': [1, 2]}
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from trainperf._utils import exiting as _exiting  # noqa: F401  (imports threading: see there)
from trainperf._utils.public import set_public_module

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs; loaded by __getattr__
    from trainperf.amp import MixedPrecision, choose_precision
    from trainperf.batchsize import BatchSizeReport, batches_from, tune_batch_size
    from trainperf.checkpoint import (
        Checkpointer,
        LoadResult,
        load_checkpoint,
        load_state_dict,
        save_checkpoint,
        strip_prefix,
        unwrap_model,
    )
    from trainperf.device import (
        DieWithParent,
        GpuInfo,
        best_device,
        check_same_device,
        gpus,
        seed_everything,
        select_gpus,
        to_device,
        worker_init_fn,
    )
    from trainperf.doctor import DoctorReport, diagnose
    from trainperf.errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointNotFoundError,
        DeviceError,
        DeviceMismatchError,
        HangError,
        LaunchError,
        NotACheckpointError,
        StateDictMismatchError,
        TrainperfError,
        UnsafeCheckpointError,
    )
    from trainperf.limits import HostLimits, host_limits, usable_cpus
    from trainperf.loader import CandidateResult, TuningReport, autotune_loader, tune_loader
    from trainperf.monitor import Watch, WatchReport, watch

    __version__: str

# The module each name above is loaded from: the imports above, as data.
_SOURCES: dict[str, tuple[str, ...]] = {
    "trainperf.amp": ("MixedPrecision", "choose_precision"),
    "trainperf.batchsize": ("BatchSizeReport", "batches_from", "tune_batch_size"),
    "trainperf.checkpoint": (
        "Checkpointer",
        "LoadResult",
        "load_checkpoint",
        "load_state_dict",
        "save_checkpoint",
        "strip_prefix",
        "unwrap_model",
    ),
    "trainperf.device": (
        "DieWithParent",
        "GpuInfo",
        "best_device",
        "check_same_device",
        "gpus",
        "seed_everything",
        "select_gpus",
        "to_device",
        "worker_init_fn",
    ),
    "trainperf.doctor": ("DoctorReport", "diagnose"),
    "trainperf.errors": (
        "CheckpointCorruptError",
        "CheckpointError",
        "CheckpointNotFoundError",
        "DeviceError",
        "DeviceMismatchError",
        "HangError",
        "LaunchError",
        "NotACheckpointError",
        "StateDictMismatchError",
        "TrainperfError",
        "UnsafeCheckpointError",
    ),
    "trainperf.limits": ("HostLimits", "host_limits", "usable_cpus"),
    "trainperf.loader": ("CandidateResult", "TuningReport", "autotune_loader", "tune_loader"),
    "trainperf.monitor": ("Watch", "WatchReport", "watch"),
}
_EXPORTS = {name: module for module, names in _SOURCES.items() for name in names}
# The public modules `trainperf.<name>` gives without an import (as it did when this file
# imported them all).
_SUBMODULES = (
    "amp",
    "batchsize",
    "bench",
    "checkpoint",
    "cli",
    "ddp",
    "device",
    "doctor",
    "errors",
    "limits",
    "loader",
    "monitor",
    "pipelines",
)

__all__ = [
    "BatchSizeReport",
    "CandidateResult",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "DeviceError",
    "DeviceMismatchError",
    "DieWithParent",
    "DoctorReport",
    "GpuInfo",
    "HangError",
    "HostLimits",
    "LaunchError",
    "LoadResult",
    "MixedPrecision",
    "NotACheckpointError",
    "StateDictMismatchError",
    "TrainperfError",
    "TuningReport",
    "UnsafeCheckpointError",
    "Watch",
    "WatchReport",
    "__version__",
    "autotune_loader",
    "batches_from",
    "best_device",
    "check_same_device",
    "choose_precision",
    "diagnose",
    "gpus",
    "host_limits",
    "load_checkpoint",
    "load_state_dict",
    "save_checkpoint",
    "seed_everything",
    "select_gpus",
    "strip_prefix",
    "to_device",
    "tune_batch_size",
    "tune_loader",
    "unwrap_model",
    "usable_cpus",
    "watch",
    "worker_init_fn",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainperf")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


if not TYPE_CHECKING:  # so that mypy still refuses a name trainperf does not have

    def __getattr__(name: str) -> Any:
        """``trainperf.<name>``, loaded on first use and kept (PEP 562)."""
        if name == "__version__":
            value: Any = _version()
        elif name in _EXPORTS:
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        elif name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")  # binds itself here
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


class _Package(types.ModuleType):
    """The type of this module: Python binds ``trainperf.<sub>`` once a subpackage has been
    imported, by whatever path, and that is when the names it gives :data:`__all__` get
    ``__module__ = "trainperf"`` (their public path, in reprs, tracebacks and the API
    reference), whichever of ``trainperf.X`` or ``trainperf.<sub>.X`` is used first."""

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        names = _SOURCES.get(f"{__name__}.{name}", ())
        if isinstance(value, types.ModuleType) and names:
            set_public_module(vars(value), names, __name__)


sys.modules[__name__].__class__ = _Package
