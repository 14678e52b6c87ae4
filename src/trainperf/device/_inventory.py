"""GPU inventory: :class:`GpuInfo`, :func:`gpus`, :func:`select_gpus`, :func:`best_device`.

GPU discovery goes through NVML (``pynvml``), never through CUDA, so listing or choosing
GPUs does not create a CUDA context and ``CUDA_VISIBLE_DEVICES`` can still be set
afterwards. :func:`gpus` maps NVML's view onto CUDA's numbering the way the CUDA runtime
does, from ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``.

``CUDA_DEVICE_ORDER=FASTEST_FIRST`` (CUDA's default) orders cards by a speed estimate NVML
cannot see; it is approximated as *descending compute capability, then PCI bus id*, which is
exact when all cards are of one model. Once ``torch.cuda`` is initialised, the UUIDs torch
reports are used instead, which is exact.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from trainperf._utils.format import format_bytes
from trainperf._utils.serialize import result_dict
from trainperf._utils.validate import non_negative_number, positive_int
from trainperf.errors import DeviceError

T = TypeVar("T")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU (or MIG instance) visible to this process, as NVML reports it.

    Attributes:
        index: the CUDA index this process sees it under (``cuda:<index>``).
        nvml_index: NVML's (``nvidia-smi``'s) index of the physical card.
        uuid: ``GPU-…`` (or ``MIG-…`` for a MIG instance); stable across reboots.
        name: the product name, e.g. ``"NVIDIA A100-SXM4-80GB"``.
        memory_total: bytes of device memory (None where NVML cannot report it, e.g. on
            unified-memory systems).
        memory_used: bytes in use, by every process on the card.
        memory_free: bytes free.
        utilization: percent of the last sample period a kernel ran (None where not
            supported, e.g. on MIG instances).
        compute_capability: ``(major, minor)``, e.g. ``(8, 0)``; None where not reported.
        pci_bus_id: e.g. ``"00000000:3B:00.0"``.
    """

    index: int
    nvml_index: int
    uuid: str
    name: str
    memory_total: int | None
    memory_used: int | None
    memory_free: int | None
    utilization: int | None
    compute_capability: tuple[int, int] | None
    pci_bus_id: str

    def __str__(self) -> str:
        cc = "?" if self.compute_capability is None else ".".join(map(str, self.compute_capability))
        util = "?" if self.utilization is None else f"{self.utilization}%"
        return (
            f"cuda:{self.index} {self.name} (compute {cc}): {format_bytes(self.memory_free)} free "
            f"of {format_bytes(self.memory_total)}, {util} busy, NVML {self.nvml_index} {self.uuid}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (``compute_capability`` as a list)."""
        return result_dict(self)


# --------------------------------------------------------------------------- NVML discovery

_nvml_warned = False


def _warn_no_nvml(reason: str) -> None:
    global _nvml_warned
    if _nvml_warned:
        return
    _nvml_warned = True
    warnings.warn(
        f"trainperf.gpus() found no NVIDIA driver/NVML ({reason}); reporting no GPUs. "
        "This warning is shown once per process.",
        RuntimeWarning,
        stacklevel=5,  # past nvml_session and contextlib, to the caller of gpus()
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _query(nvml: Any, fn: Callable[..., T], *args: Any) -> T | None:
    # A query the device does not support (utilisation on MIG, memory on unified-memory
    # systems) is an absent value, not a failure of the whole listing.
    try:
        return fn(*args)
    except nvml.NVMLError_NotSupported:
        return None


def _describe(nvml: Any, handle: Any, nvml_index: int, pci_bus_id: str | None = None) -> GpuInfo:
    mem = _query(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    util = _query(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    cc = _query(nvml, nvml.nvmlDeviceGetCudaComputeCapability, handle)
    if pci_bus_id is None:
        pci_bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    return GpuInfo(
        index=-1,
        nvml_index=nvml_index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_total=None if mem is None else int(mem.total),
        memory_used=None if mem is None else int(mem.used),
        memory_free=None if mem is None else int(mem.free),
        utilization=None if util is None else int(util.gpu),
        compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
        pci_bus_id=pci_bus_id,
    )


def _mig_instances(nvml: Any, handles: list[Any], cards: list[GpuInfo]) -> list[GpuInfo]:
    found: list[GpuInfo] = []
    for handle, card in zip(handles, cards, strict=True):
        mode = _query(nvml, nvml.nvmlDeviceGetMigMode, handle)
        if mode is None or mode[0] != 1:  # current mode; 1 is NVML_DEVICE_MIG_ENABLE
            continue
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:  # an empty slot
                continue
            info = _describe(nvml, mig, card.nvml_index, card.pci_bus_id)
            if info.compute_capability is None:
                info = dataclasses.replace(info, compute_capability=card.compute_capability)
            found.append(info)
    return found


# [0-9], not \d: strtoul reads ASCII digits only, where \d also matches "\u0661" and the like.
_ORDINAL = re.compile(r"\+?([0-9]+)")

Notation = Literal["index", "GPU-", "MIG-"]


@dataclass(frozen=True)
class VisibleDevices:
    """``CUDA_VISIBLE_DEVICES`` read the way the CUDA runtime reads it.

    Attributes:
        notation: ``"index"`` (ordinals), ``"GPU-"`` (UUIDs or unique UUID prefixes) or
            ``"MIG-"``; the first entry sets it.
        entries: the entries CUDA takes, in order, up to the first it cannot read; ordinals
            as plain decimal digits (``"+1"`` and ``"1gpu"`` read as ``"1"``, like C's
            ``strtoul``), UUIDs as written.
        first_invalid: the entry CUDA stops at (junk, empty, another notation than the
            first entry's, or a bare prefix), None when it reads every entry.
    """

    notation: Notation
    entries: tuple[str, ...]
    first_invalid: str | None

    @property
    def duplicates(self) -> tuple[str, ...]:
        """Entries named more than once (textually): CUDA then makes no GPU visible."""
        seen: set[str] = set()
        repeated: list[str] = []
        for entry in self.entries:
            key = entry.lower()
            if key in seen and entry not in repeated:
                repeated.append(entry)
            seen.add(key)
        return tuple(repeated)


def parse_visible_devices(value: str) -> VisibleDevices:
    """Parse ``CUDA_VISIBLE_DEVICES`` as CUDA does, without looking at any GPU.

    The first entry sets the notation (ordinals, ``GPU-`` or ``MIG-`` UUIDs); an entry in
    another notation ends the list, as does any entry CUDA cannot read. Whether an ordinal or
    UUID exists, and duplicates of one card under two spellings, need the GPUs: see
    :func:`gpus`.

    Args:
        value: the variable's value (an empty string hides every GPU).

    Returns:
        A :class:`VisibleDevices`.

    Example:
        >>> parse_visible_devices("1, 3,x,2")
        VisibleDevices(notation='index', entries=('1', '3'), first_invalid='x')
        >>> parse_visible_devices("GPU-8d3b,0").entries, parse_visible_devices("").entries
        (('GPU-8d3b',), ())
    """
    raw = [entry.strip() for entry in value.split(",")]
    prefix = raw[0][:4] if raw[0].startswith(("GPU-", "MIG-")) else ""
    notation: Notation = "GPU-" if prefix == "GPU-" else "MIG-" if prefix == "MIG-" else "index"
    entries: list[str] = []
    for entry in raw:
        if prefix and entry.startswith(prefix) and len(entry) > len(prefix):
            entries.append(entry)
        elif not prefix and (match := _ORDINAL.match(entry)):
            entries.append(str(int(match.group(1))))
        else:
            return VisibleDevices(notation, tuple(entries), entry)
    return VisibleDevices(notation, tuple(entries), None)


def _visible(
    cards: list[GpuInfo], migs: Callable[[], list[GpuInfo]], env: Mapping[str, str]
) -> list[GpuInfo]:
    """Apply CUDA_DEVICE_ORDER and CUDA_VISIBLE_DEVICES the way the CUDA runtime does."""
    if env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        ordered = sorted(cards, key=lambda c: (c.pci_bus_id.lower(), c.nvml_index))
    else:  # FASTEST_FIRST, CUDA's default; any other value is ignored by CUDA too
        ordered = sorted(
            cards,
            key=lambda c: (tuple(-v for v in c.compute_capability or (0, 0)), c.pci_bus_id),
        )
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return ordered
    # Seen on an H200: "0,GPU-<uuid of 0>" shows one card, while naming a card twice in one
    # notation, even as prefix + full UUID, or "0,0", shows none.
    parsed = parse_visible_devices(spec)
    pool = migs() if parsed.notation == "MIG-" else cards
    chosen: list[GpuInfo] = []
    for entry in parsed.entries:
        if parsed.notation == "index":
            candidates = ordered[int(entry) :][:1]
        else:
            # CUDA accepts the hex digits in either case (seen on an H200).
            candidates = [c for c in pool if c.uuid.lower().startswith(entry.lower())]
        if len(candidates) != 1:  # unknown, out of range or an ambiguous prefix: stop here
            break
        if candidates[0] in chosen:
            return []
        chosen.append(candidates[0])
    return chosen


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


_CUDA_SUCCESS = 0


def _cuda_driver_started() -> bool:
    """Whether this process's CUDA driver has started (``cuInit`` ran), torch's CUDA aside.

    The driver reads ``CUDA_VISIBLE_DEVICES`` in ``cuInit``, which
    ``torch.cuda.is_available()`` runs while ``torch.cuda.is_initialized()`` stays False
    (pytorch#40618). libcuda is asked only if something loaded it already (``RTLD_NOLOAD``),
    and ``cuDeviceGetCount`` answers ``CUDA_ERROR_NOT_INITIALIZED`` until ``cuInit`` ran, so
    asking starts nothing.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_LAZY | os.RTLD_NOLOAD)
        count = ctypes.c_int(0)
        return int(libcuda.cuDeviceGetCount(ctypes.byref(count))) == _CUDA_SUCCESS
    except (OSError, AttributeError):  # not loaded: nothing in this process started CUDA
        return False


def _torch_order(found: Callable[[], list[GpuInfo]]) -> list[GpuInfo] | None:
    # Only when CUDA is already initialised: asking torch otherwise would initialise it.
    cuda = torch.cuda
    if not _cuda_initialized():
        return None
    by_uuid = {c.uuid.split("-", 1)[1]: c for c in found()}
    try:
        uuids = [str(cuda.get_device_properties(i).uuid) for i in range(cuda.device_count())]
    except (RuntimeError, AttributeError, AssertionError):
        return None
    mapped = [by_uuid.get(u) for u in uuids]
    return None if None in mapped else [c for c in mapped if c is not None]


@contextlib.contextmanager
def nvml_session(
    purpose: str = "listing GPUs", on_missing: Callable[[str], None] | None = None
) -> Iterator[Any]:
    """Initialise NVML for the block, shut it down after, and turn its errors into ours.

    The one place trainperf opens NVML (:func:`gpus`, ``trainperf doctor`` and
    ``trainperf.watch`` all go through it). NVML counts its initialisations, so nested
    sessions are fine.

    Args:
        purpose: what the caller does, for the error message (``"NVML failed while ..."``).
        on_missing: called with the reason when there is no NVML to open (pynvml not
            installed, no NVIDIA driver); the block then gets None.

    Yields:
        The ``pynvml`` module, initialised; None without a driver or pynvml.

    Raises:
        DeviceError: NVML refuses access (permissions) or fails otherwise, on start-up or
            inside the block.

    Example:
        >>> with nvml_session(on_missing=lambda reason: None) as nvml:
        ...     count = 0 if nvml is None else nvml.nvmlDeviceGetCount()
        >>> count >= 0
        True
    """
    # A plain import, not _imports.is_available: tests (and users) may put a stand-in
    # module under the name, which find_spec rejects.
    try:
        import pynvml as nvml
    except ImportError as e:
        if on_missing is not None:
            on_missing(f"cannot import pynvml: {e}")
        yield None
        return
    try:
        nvml.nvmlInit()
    except (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded) as e:
        if on_missing is not None:
            on_missing(str(e))
        yield None
        return
    except nvml.NVMLError as e:
        raise _nvml_error(nvml, e, purpose) from e
    try:
        yield nvml
    except nvml.NVMLError as e:
        raise _nvml_error(nvml, e, purpose) from e
    finally:
        nvml.nvmlShutdown()


def gpus(*, env: Mapping[str, str] | None = None) -> list[GpuInfo]:
    """List the GPUs this process can see, numbered as CUDA numbers them, without touching CUDA.

    Honours ``CUDA_VISIBLE_DEVICES`` as CUDA does: ordinals, ``GPU-`` UUIDs or unique UUID
    prefixes, or ``MIG-`` ids; the list ends at the first entry that is unknown or in
    another notation than the first; a card named twice, or an empty string, hides every
    GPU; unset shows all. Ordinals count in ``CUDA_DEVICE_ORDER`` (see the module docstring
    for how ``FASTEST_FIRST`` is approximated).

    Args:
        env: where to read ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` from; None
            means ``os.environ``, and then, once CUDA is initialised, the UUIDs torch reports
            (CUDA read the variables at its start, maybe before they changed).

    Returns:
        One :class:`GpuInfo` per visible device, ordered by CUDA index; ``[]`` without an
        NVIDIA driver or NVML library (with one ``RuntimeWarning`` per process).

    Raises:
        DeviceError: NVML is there but refuses access (permissions) or fails otherwise.

    Example:
        >>> all(g.index == i for i, g in enumerate(gpus()))
        True
        >>> gpus(env={"CUDA_VISIBLE_DEVICES": ""})  # an empty list hides every GPU
        []
    """
    with nvml_session(on_missing=_warn_no_nvml) as nvml:
        if nvml is None:
            return []
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        cards = [_describe(nvml, h, i) for i, h in enumerate(handles)]
        mig_cache: list[list[GpuInfo]] = []

        def migs() -> list[GpuInfo]:
            if not mig_cache:
                mig_cache.append(_mig_instances(nvml, handles, cards))
            return mig_cache[0]

        by_torch = _torch_order(lambda: cards + migs()) if env is None else None
        visible = by_torch or _visible(cards, migs, os.environ if env is None else env)
    return [dataclasses.replace(c, index=i) for i, c in enumerate(visible)]


def _nvml_error(nvml: Any, e: Exception, purpose: str = "listing GPUs") -> DeviceError:
    if isinstance(e, nvml.NVMLError_NoPermission):
        return DeviceError(
            f"NVML refused access to the GPUs ({e}). Fix: give this user read/write access to "
            "/dev/nvidiactl and /dev/nvidia* (add it to the group that owns them, often "
            "'video'), or start the container with the NVIDIA runtime (docker run --gpus all)."
        )
    return DeviceError(f"NVML failed while {purpose}: {e!r}. Check `nvidia-smi` works.")


def _free(card: GpuInfo) -> int:
    return -1 if card.memory_free is None else card.memory_free


def _fmt_free(card: GpuInfo) -> str:
    if card.memory_free is None:
        return "free memory unknown"
    return f"{format_bytes(card.memory_free)} free"


def select_gpus(n: int = 1, *, min_free_memory: int | None = None) -> list[int]:
    """Pick the ``n`` visible GPUs with the most free memory and make them ``cuda:0..n-1``.

    Sets ``CUDA_VISIBLE_DEVICES`` to the chosen cards' UUIDs, emptiest first. UUIDs mean
    the same card whatever ``CUDA_DEVICE_ORDER`` says (plain integers would not). Call it
    before anything initialises CUDA: the variable is read once, at CUDA's start.

    Args:
        n: how many GPUs to take (>= 1).
        min_free_memory: bytes a card must have free to qualify; None or 0 takes any card
            (a card whose free memory NVML cannot report, unified memory, meets no other).

    Returns:
        The chosen cards' NVML (``nvidia-smi``) indices, in their new CUDA order.

    Raises:
        ValueError: ``n`` is not an int >= 1, or ``min_free_memory`` is neither None nor
            a finite number >= 0 (a string, NaN).
        DeviceError: CUDA is already initialised, or its driver started (by
            ``torch.cuda.is_available()``, :func:`best_device` or another CUDA library),
            either of which read ``CUDA_VISIBLE_DEVICES`` already; or fewer than ``n``
            cards qualify.

    Example:
        >>> try:
        ...     chosen = select_gpus(1)  # the emptiest visible GPU becomes cuda:0
        ... except DeviceError:  # no GPU here, or CUDA already initialised
        ...     chosen = []
        >>> len(chosen) <= 1
        True
    """
    n = positive_int("n", n)
    threshold = 0.0
    if min_free_memory is not None:
        threshold = non_negative_number(
            "min_free_memory", min_free_memory, unit="bytes", zero="any card"
        )
    if _cuda_initialized() or _cuda_driver_started():
        raise DeviceError(
            "select_gpus() must run before CUDA is initialised in this process: "
            "CUDA_VISIBLE_DEVICES is read only once, when CUDA's driver starts, so setting it "
            "now has no effect. Call select_gpus() first thing in your script, before any "
            "tensor or model is moved to 'cuda' and before torch.cuda.is_available() or "
            "best_device(), which start the driver."
        )
    cards = gpus()
    # A card whose free memory NVML cannot tell (unified memory) meets a threshold of 0 only.
    qualified = [c for c in cards if not threshold or _free(c) >= threshold]
    ranked = sorted(qualified, key=lambda c: (-_free(c), c.index))
    if len(ranked) < n:
        found = (
            ", ".join(
                f"cuda:{c.index} {c.name} (nvidia-smi {c.nvml_index}) {_fmt_free(c)}" for c in cards
            )
            or "no GPUs (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them all)"
        )
        need = "" if not threshold else f" with >= {format_bytes(threshold)} free"
        raise DeviceError(f"select_gpus(n={n}) needs {n} GPU(s){need}; found: {found}")
    chosen = ranked[:n]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(c.uuid for c in chosen)
    return [c.nvml_index for c in chosen]


def best_device() -> torch.device:
    """The device to train on: the visible GPU with most free memory, else MPS, else CPU.

    Does not initialise CUDA (``torch.cuda.is_available()`` creates no context, and the
    free memory comes from NVML); but ``torch.cuda.is_available()`` starts CUDA's driver,
    which reads ``CUDA_VISIBLE_DEVICES`` then, so call :func:`select_gpus` before this.

    Returns:
        ``cuda:<i>``; ``cuda:0`` when CUDA works but NVML is absent, or refuses or fails
        (with a warning); ``mps``; or ``cpu``.

    Example:
        >>> best_device().type in {"cuda", "mps", "cpu"}
        True
    """
    if torch.cuda.is_available():
        try:
            cards = gpus()
        except DeviceError as e:  # NVML refuses or fails, while CUDA works
            warnings.warn(
                f"{e}; best_device() cannot compare the GPUs' free memory and picks cuda:0 "
                "(pass a device, e.g. device='cuda:1', to choose another)",
                RuntimeWarning,
                stacklevel=2,
            )
            return torch.device("cuda", 0)
        count = torch.cuda.device_count()
        if cards:
            best = max(cards, key=lambda c: (_free(c), -c.index))
            if best.index < count:
                return torch.device("cuda", best.index)
        return torch.device("cuda", 0)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
