"""Shared by the doctor tests: fake GPUs, host limits, files and BLAS pools."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from trainperf.device import GpuInfo
from trainperf.limits import HostLimits

GiB = 2**30
MiB = 2**20


def gpu(index: int = 0, cc: tuple[int, int] | None = (8, 0), **changes: object) -> GpuInfo:
    info = GpuInfo(
        index=index, nvml_index=index, uuid=f"GPU-{index:08d}", name="NVIDIA A100-SXM4-80GB",
        memory_total=80 * GiB, memory_used=GiB // 2, memory_free=80 * GiB - GiB // 2,
        utilization=0, compute_capability=cc, pci_bus_id=f"00000000:{index + 1:02X}:00.0",
    )  # fmt: skip
    return dataclasses.replace(info, **changes)  # type: ignore[arg-type]


def limits(**changes: object) -> HostLimits:
    base = HostLimits(
        cpus_host=32, cpus_affinity=32, cpu_quota=None, cpus=32, memory_total=256 * GiB,
        memory_limit=None, memory_available=200 * GiB, shm_total=64 * GiB, shm_free=64 * GiB,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _pool(api: str, threads: int = 4) -> dict[str, object]:
    return {"user_api": "blas", "internal_api": api, "num_threads": threads, "version": "1.0"}


def link_nvml(
    cards: list[dict[str, object]], p2p: dict[tuple[int, int], int] | None = None
) -> types.ModuleType:
    """A stand-in pynvml serving NVLink/PCIe links and P2P status for ``cards``.

    Each card: ``links`` (NVLink states, 1 = active), ``speed`` (MB/s per link, None: the
    field is not supported), ``gen`` and ``width`` (PCIe; None: not supported).
    """
    nvml: Any = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    for name in ("LibraryNotFound", "DriverNotLoaded", "NoPermission", "NotSupported",
                 "InvalidArgument", "Unknown"):  # fmt: skip
        setattr(nvml, f"NVMLError_{name}", type(name, (nvml.NVMLError,), {}))
    nvml.NVML_FEATURE_ENABLED = 1
    nvml.NVML_NVLINK_MAX_LINKS = 18
    nvml.NVML_P2P_STATUS_OK = 0
    nvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED = 3
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i

    def state(handle: int, link: int) -> int:
        links = cast("list[int]", cards[handle]["links"])
        if not links:
            raise nvml.NVMLError_NotSupported("Not Supported")
        if link >= len(links):
            raise nvml.NVMLError_InvalidArgument("Invalid Argument")
        return links[link]

    def fields(handle: int, ids: list[int]) -> list[Any]:
        speed = cards[handle].get("speed")
        value = types.SimpleNamespace(uiVal=speed or 0)
        return [types.SimpleNamespace(nvmlReturn=0 if speed else 3, valueType=1, value=value)]

    def pcie(key: str) -> Callable[[int], int]:
        def read(handle: int) -> int:
            found = cards[handle].get(key)
            if found is None:
                raise nvml.NVMLError_NotSupported("Not Supported")
            return cast("int", found)

        return read

    nvml.nvmlDeviceGetNvLinkState = state
    nvml.nvmlDeviceGetFieldValues = fields
    nvml.nvmlDeviceGetMaxPcieLinkGeneration = pcie("gen")
    nvml.nvmlDeviceGetMaxPcieLinkWidth = pcie("width")
    nvml.nvmlDeviceGetP2PStatus = lambda a, b, index: (p2p or {}).get((a, b), 0)
    return cast("types.ModuleType", nvml)
