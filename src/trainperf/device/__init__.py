"""Devices: which GPUs exist and are free, moving batches to a device, same-device checks, seeds.

GPU discovery goes through NVML, never through CUDA, so listing or choosing GPUs creates no
CUDA context; how NVML's view is mapped onto CUDA's numbering (``CUDA_VISIBLE_DEVICES``,
``CUDA_DEVICE_ORDER``) is described in :mod:`._inventory`.

- :mod:`._inventory`: :class:`GpuInfo`, :func:`gpus`, :func:`select_gpus`, :func:`best_device`,
  :func:`parse_visible_devices` (NVML discovery, through one NVML session helper, and the
  ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` rules);
- :mod:`._move`: :func:`to_device` (moving nested batches);
- :mod:`._containers`: how each type of container is walked and rebuilt, shared by
  :mod:`._move` and :mod:`._same_device`;
- :mod:`._same_device`: :func:`check_same_device`;
- :mod:`._resolve`: :func:`resolve_device`, the one parser of every ``device`` argument;
- :mod:`._seed`: :func:`seed_everything` and :func:`worker_init_fn`;
- :class:`DieWithParent` (from ``trainperf._utils.lifetime``): a ``worker_init_fn`` wrapper that
  makes DataLoader workers die with the process that started them.
"""

from __future__ import annotations

from trainperf._utils.lifetime import DieWithParent
from trainperf._utils.public import set_public_module
from trainperf.device._inventory import (
    GpuInfo,
    VisibleDevices,
    best_device,
    gpus,
    parse_visible_devices,
    select_gpus,
)
from trainperf.device._move import to_device
from trainperf.device._resolve import resolve_device
from trainperf.device._same_device import check_same_device
from trainperf.device._seed import seed_everything, worker_init_fn

__all__ = [
    "DieWithParent",
    "GpuInfo",
    "VisibleDevices",
    "best_device",
    "check_same_device",
    "gpus",
    "parse_visible_devices",
    "resolve_device",
    "seed_everything",
    "select_gpus",
    "to_device",
    "worker_init_fn",
]

set_public_module(globals(), __all__, __name__)
