"""Shared by the doctor tests: fake GPUs, host limits, files and BLAS pools."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
