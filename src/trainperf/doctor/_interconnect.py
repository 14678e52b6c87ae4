"""What the link between ranks should carry, for ``trainperf doctor --dist``.

A bus bandwidth means little without the figure the link should give. For GPUs that is
NVLink (active links x per-link speed, both from NVML) or, without NVLink, PCIe (generation
and width from NVML, per lane after line encoding). For gloo ranks on one host it is the
loopback socket, measured here with both directions running at once as in a ring, next to a
plain memory copy. :func:`link_estimate` and :func:`loopback_estimate` are pure functions of
those figures; :func:`read_gpu_links`, :func:`read_p2p_blocked` and
:func:`measure_loopback` gather them. Nothing here initialises CUDA.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainperf._utils.serialize import result_dict
from trainperf._utils.validate import positive_int
from trainperf.device import GpuInfo
from trainperf.device._inventory import nvml_session
from trainperf.errors import DeviceError

__all__ = [
    "GpuLink",
    "LinkEstimate",
    "LoopbackBaseline",
    "link_estimate",
    "loopback_estimate",
    "measure_loopback",
    "pcie_gb_per_s",
    "read_gpu_links",
    "read_p2p_blocked",
]

_MiB = 2**20
# GB/s per lane and direction after line encoding (8b/10b up to Gen2, 128b/130b from Gen3,
# FLIT from Gen6): the PCI-SIG transfer rates 2.5, 5, 8, 16, 32 and 64 GT/s.
PCIE_LANE_GB_PER_S: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# Link widths the PCIe specification defines. NVML gives 0 on some virtualised GPUs, and an
# "N/A" sentinel (0xFFFFFFFF) elsewhere: neither is a lane count.
PCIE_WIDTHS = frozenset({1, 2, 4, 8, 12, 16, 32})
# NVML field ids (nvml.h): per-link NVLink speed in MB/s common to the active links.
_FI_NVLINK_SPEED_MBPS_COMMON = 90
_FIELD_ATTRS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}

LinkKind = Literal["nvlink", "pcie", "loopback", "unknown"]


@dataclass(frozen=True)
class GpuLink:
    """One GPU's links as NVML reports them.

    Attributes:
        index: the CUDA index (``cuda:<index>``).
        nvlink_links: active NVLink links (0 without NVLink).
        nvlink_gb_per_s: GB/s per link and direction, None when NVML does not say.
        pcie_generation: the PCIe generation the GPU and the slot both support.
        pcie_width: lanes the GPU and the slot both support.
    """

    index: int
    nvlink_links: int
    nvlink_gb_per_s: float | None
    pcie_generation: int | None
    pcie_width: int | None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict."""
        return result_dict(self)


@dataclass(frozen=True)
class LinkEstimate:
    """What one rank's link should carry in each direction: the all_reduce's reference.

    Attributes:
        kind: ``"nvlink"``, ``"pcie"``, ``"loopback"`` (gloo on one host), or ``"unknown"``.
        gb_per_s: GB/s per direction (10**9 bytes), None when unknown.
        detail: how the figure was found, in words.
    """

    kind: LinkKind
    gb_per_s: float | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict."""
        return result_dict(self)


@dataclass(frozen=True)
class LoopbackBaseline:
    """This host's loopback socket and memory copy, measured.

    Attributes:
        socket_gb_per_s: GB/s each way over a TCP loopback connection with both directions
            running at once (what each rank of a gloo ring does); None if it failed.
        memcpy_gb_per_s: GB/s of one large tensor copy in memory.
    """

    socket_gb_per_s: float | None
    memcpy_gb_per_s: float

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict."""
        return result_dict(self)


def pcie_gb_per_s(generation: int | None, width: int | None) -> float | None:
    """GB/s per direction of a PCIe link, after line encoding; None when unknown: a
    generation past Gen6, or a width that is no PCIe lane count (0, as NVML reports on some
    virtualised GPUs, or its 0xFFFFFFFF "not available").

    Example:
        >>> pcie_gb_per_s(4, 16), pcie_gb_per_s(3, 8), pcie_gb_per_s(None, 16)
        (31.504, 7.88, None)
        >>> pcie_gb_per_s(4, 0), pcie_gb_per_s(4, 0xFFFFFFFF)
        (None, None)
    """
    lane = PCIE_LANE_GB_PER_S.get(generation or 0)
    if lane is None or width not in PCIE_WIDTHS:
        return None
    return round(lane * width, 3)


def _pcie_unknown(link: GpuLink) -> str:
    """Why ``link``'s PCIe bandwidth is unknown, in words ('' where it is known)."""
    gpu = f"cuda:{link.index}"
    if link.pcie_generation is None:
        return f"{gpu}'s PCIe generation not reported by NVML"
    if link.pcie_generation not in PCIE_LANE_GB_PER_S:
        return f"{gpu}'s PCIe generation {link.pcie_generation} is not one trainperf knows"
    if link.pcie_width is None:
        return f"{gpu}'s PCIe width not reported by NVML"
    if link.pcie_width not in PCIE_WIDTHS:
        return (
            f"{gpu}'s PCIe width reported as {link.pcie_width}, no lane count (NVML gives "
            "this on some virtualised GPUs)"
        )
    return ""


def link_estimate(links: Sequence[GpuLink]) -> LinkEstimate:
    """The link an all_reduce across these GPUs should reach, per rank and direction.

    With NVLink on every GPU, the slowest GPU's active links x per-link speed (a ring or
    NVSwitch all_reduce's bus bandwidth approaches it); otherwise the slowest GPU's PCIe
    link, which peer-to-peer traffic crosses in each direction at once.

    Example:
        >>> h100 = [GpuLink(i, 18, 26.562, 5, 16) for i in range(2)]
        >>> link_estimate(h100).gb_per_s
        478.116
        >>> link_estimate([GpuLink(0, 0, None, 4, 16), GpuLink(1, 0, None, 4, 8)]).detail
        'PCIe Gen4 x8 = 15.8 GB/s (the slowest of 2 GPUs), no NVLink'
    """
    if not links:
        return LinkEstimate("unknown", None, "no GPU links to read")
    n = len(links)
    if all(link.nvlink_links for link in links):
        slowest = min(links, key=lambda link: link.nvlink_links * (link.nvlink_gb_per_s or 0.0))
        if slowest.nvlink_gb_per_s is None:
            detail = f"NVLink x{slowest.nvlink_links}, per-link speed not reported by NVML"
            return LinkEstimate("nvlink", None, detail)
        total = round(slowest.nvlink_links * slowest.nvlink_gb_per_s, 3)
        detail = (
            f"NVLink {slowest.nvlink_links} links x {slowest.nvlink_gb_per_s:g} GB/s = "
            f"{total:.1f} GB/s" + f" (the slowest of {n} GPUs)" * (n > 1)
        )
        return LinkEstimate("nvlink", total, detail)
    unknown = [reason for reason in map(_pcie_unknown, links) if reason]
    if unknown:
        return LinkEstimate(
            "pcie", None, f"no NVLink; PCIe bandwidth unknown: {'; '.join(unknown)}"
        )
    rates = [(pcie_gb_per_s(link.pcie_generation, link.pcie_width) or 0.0, link) for link in links]
    rate, slowest = min(rates, key=lambda pair: pair[0])
    detail = f"PCIe Gen{slowest.pcie_generation} x{slowest.pcie_width} = {rate:.1f} GB/s"
    detail += f" (the slowest of {n} GPUs)" * (n > 1)
    partial = [link.index for link in links if link.nvlink_links]
    detail += f", NVLink only on {partial}" if partial else ", no NVLink"
    return LinkEstimate("pcie", rate, detail)


def loopback_estimate(baseline: LoopbackBaseline) -> LinkEstimate:
    """The reference for gloo ranks on one host: the loopback socket measured both ways.

    Example:
        >>> loopback_estimate(LoopbackBaseline(0.64, 2.4)).gb_per_s
        0.64
    """
    if baseline.socket_gb_per_s is None:
        memcpy = baseline.memcpy_gb_per_s
        detail = f"loopback socket could not be measured (memcpy {memcpy:.2f} GB/s)"
        return LinkEstimate("loopback", None, detail)
    detail = (
        f"loopback TCP {baseline.socket_gb_per_s:.2f} GB/s each way with both directions at "
        f"once, measured (memcpy {baseline.memcpy_gb_per_s:.2f} GB/s)"
    )
    return LinkEstimate("loopback", baseline.socket_gb_per_s, detail)


# --------------------------------------------------------------------------- NVML


def _field(nvml: Any, handle: Any, field_id: int) -> float | None:
    try:
        (value,) = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
    except (nvml.NVMLError, ValueError, TypeError):
        return None
    if value.nvmlReturn != 0:
        return None
    attr = _FIELD_ATTRS.get(int(value.valueType))
    return None if attr is None else float(getattr(value.value, attr))


def _call(nvml: Any, fn: Callable[..., Any], *args: Any) -> Any:
    # A query this GPU does not support is an absent value, not a failed reading.
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _nvlink_links(nvml: Any, handle: Any) -> int:
    active = 0
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError:  # no NVLink, a link this GPU lacks, or past its last one
            continue
        active += state == getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    return active


def _gpu_link(nvml: Any, gpu: GpuInfo) -> GpuLink:
    handle = nvml.nvmlDeviceGetHandleByIndex(gpu.nvml_index)
    links = _nvlink_links(nvml, handle)
    speed = _field(nvml, handle, _FI_NVLINK_SPEED_MBPS_COMMON) if links else None
    generation = _call(nvml, nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    width = _call(nvml, nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
    return GpuLink(
        index=gpu.index,
        nvlink_links=links,
        nvlink_gb_per_s=None if not speed else speed / 1000,
        pcie_generation=None if generation is None else int(generation),
        pcie_width=None if width is None else int(width),
    )


def read_gpu_links(gpus: Sequence[GpuInfo]) -> list[GpuLink]:
    """NVLink and PCIe links of each GPU, from NVML (empty without NVML or GPUs).

    Raises:
        DeviceError: NVML fails while reading (the caller reports it as a check).

    Example:
        >>> read_gpu_links([])
        []
    """
    if not gpus:
        return []
    with nvml_session("reading NVLink and PCIe links", on_missing=lambda reason: None) as nvml:
        if nvml is None:
            return []
        return [_gpu_link(nvml, gpu) for gpu in gpus]


def read_p2p_blocked(gpus: Sequence[GpuInfo]) -> list[str]:
    """GPU pairs NVML says cannot read each other's memory peer-to-peer, with the reason.

    Example:
        >>> read_p2p_blocked([])
        []
    """
    if len(gpus) < 2:
        return []
    blocked: list[str] = []
    try:
        with nvml_session("reading peer-to-peer status", on_missing=lambda r: None) as nvml:
            if nvml is None or not hasattr(nvml, "nvmlDeviceGetP2PStatus"):
                return []
            handles = [nvml.nvmlDeviceGetHandleByIndex(g.nvml_index) for g in gpus]
            names = {v: k for k, v in vars(nvml).items() if k.startswith("NVML_P2P_STATUS_")}
            for i, first in enumerate(handles):
                for j in range(i + 1, len(handles)):
                    status = _call(nvml, nvml.nvmlDeviceGetP2PStatus, first, handles[j], 0)
                    if status not in (None, 0):  # 0: NVML_P2P_STATUS_OK; index 0: read
                        reason = names.get(status, str(status)).removeprefix("NVML_P2P_STATUS_")
                        blocked.append(f"cuda:{gpus[i].index}-cuda:{gpus[j].index} {reason}")
    except DeviceError:
        return []
    return blocked


# --------------------------------------------------------------------------- loopback


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        first = socket.create_connection(server.getsockname(), timeout=10)
        second, _ = server.accept()
    second.settimeout(10)
    return first, second


def _duplex_seconds(total: int, chunk: int) -> float:
    """Seconds to move ``total`` bytes each way over one loopback connection, both at once."""
    rounds = max(1, total // chunk)
    total = rounds * chunk
    first, second = _socket_pair()
    payload = memoryview(bytearray(chunk))
    errors: list[BaseException] = []

    def send(sock: socket.socket) -> None:
        try:
            for _ in range(rounds):
                sock.sendall(payload)
        except OSError as e:
            errors.append(e)

    def receive(sock: socket.socket) -> None:
        view, got = memoryview(bytearray(chunk)), 0
        try:
            while got < total:
                n = sock.recv_into(view)
                if n == 0:
                    errors.append(OSError("the loopback peer closed the connection early"))
                    return
                got += n
        except OSError as e:
            errors.append(e)

    jobs = [(send, first), (receive, second), (send, second), (receive, first)]
    threads = [threading.Thread(target=fn, args=(s,), daemon=True) for fn, s in jobs]
    start = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.perf_counter() - start
    finally:
        first.close()
        second.close()
    if errors or any(t.is_alive() for t in threads):
        raise OSError(f"loopback measurement failed: {errors[0] if errors else 'timed out'}")
    return elapsed


def _memcpy_gb_per_s(size: int, repeats: int) -> float:
    source = torch.ones(size // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up: first touch of the pages
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    return size * repeats / (time.perf_counter() - start) / 1e9


def measure_loopback(total_bytes: int = 128 * _MiB, *, repeats: int = 2) -> LoopbackBaseline:
    """Measure the loopback socket (both directions at once) and a memory copy; best of runs.

    Args:
        total_bytes: bytes sent each way per run (the memory copy takes up to 64 MiB of it).
        repeats: runs of each measurement; the best counts.

    Raises:
        ValueError: ``total_bytes`` or ``repeats`` is not an int >= 1.

    Example:
        >>> baseline = measure_loopback(8 * 2**20, repeats=1)
        >>> baseline.memcpy_gb_per_s > 0
        True
    """
    total_bytes = positive_int("total_bytes", total_bytes)
    repeats = positive_int("repeats", repeats)
    chunk = min(4 * _MiB, total_bytes)
    total = max(1, total_bytes // chunk) * chunk
    best: float | None = None
    try:
        for _ in range(repeats):
            rate = total / _duplex_seconds(total, chunk) / 1e9
            best = rate if best is None else max(best, rate)
    except OSError:
        best = None
    memcpy = max(_memcpy_gb_per_s(min(total_bytes, 64 * _MiB), 5) for _ in range(repeats))
    return LoopbackBaseline(None if best is None else round(best, 3), round(memcpy, 3))
