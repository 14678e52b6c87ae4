"""trainperf: make plain PyTorch training scripts fast, and say why a run is slow.

Import only what you need; nothing here initialises CUDA or imports NVML, torchvision,
DALI or matplotlib (those load inside the functions that use them).

Example:
    >>> import trainperf
    >>> trainperf.to_device({"x": [1, 2]}, "cpu")
    {'x': [1, 2]}
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from trainperf._utils.public import set_public_module
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

try:
    __version__ = version("trainperf")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

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

set_public_module(globals(), __all__, __name__)
