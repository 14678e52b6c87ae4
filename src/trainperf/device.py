"""Devices: which GPUs exist and are free, moving batches to a device, same-device checks, seeds.

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

import copy
import dataclasses
import functools
import operator
import os
import random
import re
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from trainperf.errors import DeviceError, DeviceMismatchError

__all__ = [
    "GpuInfo",
    "best_device",
    "check_same_device",
    "gpus",
    "seed_everything",
    "select_gpus",
    "to_device",
    "worker_init_fn",
]

T = TypeVar("T")
_GiB = 1 << 30


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
        stacklevel=3,
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


_ORDINAL = re.compile(r"\+?(\d+)")


def _visible(cards: list[GpuInfo], migs: Callable[[], list[GpuInfo]]) -> list[GpuInfo]:
    """Apply CUDA_DEVICE_ORDER and CUDA_VISIBLE_DEVICES the way the CUDA runtime does."""
    if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        ordered = sorted(cards, key=lambda c: (c.pci_bus_id.lower(), c.nvml_index))
    else:  # FASTEST_FIRST, CUDA's default; any other value is ignored by CUDA too
        ordered = sorted(
            cards,
            key=lambda c: (tuple(-v for v in c.compute_capability or (0, 0)), c.pci_bus_id),
        )
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return ordered
    # The first entry sets the notation (ordinals, GPU- or MIG- UUIDs); an entry in another
    # notation ends the list, as it does for CUDA (seen on an H200: "0,GPU-<uuid of 0>" shows
    # one card, while naming a card twice in one notation, even as prefix + full UUID, or
    # "0,0", shows none).
    entries = [raw.strip() for raw in spec.split(",")]
    prefix = entries[0][:4] if entries[0].startswith(("GPU-", "MIG-")) else ""
    pool = migs() if prefix == "MIG-" else cards
    chosen: list[GpuInfo] = []
    for entry in entries:
        candidates: list[GpuInfo] = []
        if prefix and entry.startswith(prefix) and len(entry) > len(prefix):
            # CUDA accepts the hex digits in either case (seen on an H200).
            candidates = [c for c in pool if c.uuid.lower().startswith(entry.lower())]
        elif not prefix and (match := _ORDINAL.match(entry)):
            # Read like C's strtoul, as CUDA does: "1gpu" is 1.
            candidates = ordered[int(match.group(1)) :][:1]
        if len(candidates) != 1:  # unknown, out of range or an ambiguous prefix: stop here
            break
        if candidates[0] in chosen:
            return []
        chosen.append(candidates[0])
    return chosen


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


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


def gpus() -> list[GpuInfo]:
    """List the GPUs this process can see, numbered as CUDA numbers them, without touching CUDA.

    Honours ``CUDA_VISIBLE_DEVICES`` as CUDA does: ordinals, ``GPU-`` UUIDs or unique UUID
    prefixes, or ``MIG-`` ids; the list ends at the first entry that is unknown or in
    another notation than the first; a card named twice, or an empty string, hides every
    GPU; unset shows all. Ordinals count in ``CUDA_DEVICE_ORDER`` (see the module docstring
    for how ``FASTEST_FIRST`` is approximated).

    Returns:
        One :class:`GpuInfo` per visible device, ordered by CUDA index; ``[]`` without an
        NVIDIA driver or NVML library (with one ``RuntimeWarning`` per process).

    Raises:
        DeviceError: NVML is there but refuses access (permissions) or fails otherwise.

    Example:
        >>> all(g.index == i for i, g in enumerate(gpus()))
        True
    """
    try:
        import pynvml as nvml
    except ImportError as e:
        _warn_no_nvml(f"cannot import pynvml: {e}")
        return []
    try:
        nvml.nvmlInit()
    except (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded) as e:
        _warn_no_nvml(str(e))
        return []
    except nvml.NVMLError as e:
        raise _nvml_error(nvml, e) from e
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        cards = [_describe(nvml, h, i) for i, h in enumerate(handles)]
        mig_cache: list[list[GpuInfo]] = []

        def migs() -> list[GpuInfo]:
            if not mig_cache:
                mig_cache.append(_mig_instances(nvml, handles, cards))
            return mig_cache[0]

        visible = _torch_order(lambda: cards + migs()) or _visible(cards, migs)
    except nvml.NVMLError as e:
        raise _nvml_error(nvml, e) from e
    finally:
        nvml.nvmlShutdown()
    return [dataclasses.replace(c, index=i) for i, c in enumerate(visible)]


def _nvml_error(nvml: Any, e: Exception) -> DeviceError:
    if isinstance(e, nvml.NVMLError_NoPermission):
        return DeviceError(
            f"NVML refused access to the GPUs ({e}). Fix: give this user read/write access to "
            "/dev/nvidiactl and /dev/nvidia* (add it to the group that owns them, often "
            "'video'), or start the container with the NVIDIA runtime (docker run --gpus all)."
        )
    return DeviceError(f"NVML failed while listing GPUs: {e!r}. Check `nvidia-smi` works.")


def _free(card: GpuInfo) -> int:
    return -1 if card.memory_free is None else card.memory_free


def _fmt_free(card: GpuInfo) -> str:
    if card.memory_free is None:
        return "free memory unknown"
    return f"{card.memory_free / _GiB:.1f} GiB free"


def select_gpus(n: int = 1, *, min_free_memory: int | None = None) -> list[int]:
    """Pick the ``n`` visible GPUs with the most free memory and make them ``cuda:0..n-1``.

    Sets ``CUDA_VISIBLE_DEVICES`` to the chosen cards' UUIDs, emptiest first. UUIDs mean
    the same card whatever ``CUDA_DEVICE_ORDER`` says (plain integers would not). Call it
    before anything initialises CUDA: the variable is read once, at CUDA's start.

    Args:
        n: how many GPUs to take (>= 1).
        min_free_memory: bytes a card must have free to qualify; None takes any card.

    Returns:
        The chosen cards' NVML (``nvidia-smi``) indices, in their new CUDA order.

    Raises:
        ValueError: ``n`` < 1 or ``min_free_memory`` < 0.
        DeviceError: CUDA is already initialised, or fewer than ``n`` cards qualify.

    Example:
        >>> try:
        ...     chosen = select_gpus(1)  # the emptiest visible GPU becomes cuda:0
        ... except DeviceError:  # no GPU here, or CUDA already initialised
        ...     chosen = []
        >>> len(chosen) <= 1
        True
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if min_free_memory is not None and min_free_memory < 0:
        raise ValueError(f"min_free_memory must be >= 0 bytes or None, got {min_free_memory!r}")
    if _cuda_initialized():
        raise DeviceError(
            "select_gpus() must run before CUDA is initialised in this process: "
            "CUDA_VISIBLE_DEVICES is read only once, when CUDA starts, so setting it now "
            "has no effect. Call select_gpus() first thing in your script, before any "
            "tensor or model is moved to 'cuda'."
        )
    cards = gpus()
    qualified = [c for c in cards if min_free_memory is None or _free(c) >= min_free_memory]
    ranked = sorted(qualified, key=lambda c: (-_free(c), c.index))
    if len(ranked) < n:
        found = (
            ", ".join(
                f"cuda:{c.index} {c.name} (nvidia-smi {c.nvml_index}) {_fmt_free(c)}" for c in cards
            )
            or "no GPUs (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them all)"
        )
        need = "" if min_free_memory is None else f" with >= {min_free_memory / _GiB:.1f} GiB free"
        raise DeviceError(f"select_gpus(n={n}) needs {n} GPU(s){need}; found: {found}")
    chosen = ranked[:n]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(c.uuid for c in chosen)
    return [c.nvml_index for c in chosen]


def best_device() -> torch.device:
    """The device to train on: the visible GPU with most free memory, else MPS, else CPU.

    Does not initialise CUDA (``torch.cuda.is_available()`` creates no context, and the
    free memory comes from NVML).

    Returns:
        ``cuda:<i>``; ``cuda:0`` when CUDA works but NVML is absent; ``mps``; or ``cpu``.

    Example:
        >>> best_device().type in {"cuda", "mps", "cpu"}
        True
    """
    if torch.cuda.is_available():
        cards = gpus()
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


# --------------------------------------------------------------------------- moving batches

# How a type is traversed; decided once per type, then looked up.
_LEAF, _TENSOR, _HAS_TO, _NAMEDTUPLE, _MAPPING, _SEQUENCE, _SET, _DATACLASS = range(8)
_ATOMS: frozenset[type] = frozenset(
    (str, bytes, int, float, bool, complex, type(None), torch.Size, torch.dtype)
)
_kinds: dict[type, int] = dict.fromkeys(_ATOMS, _LEAF)
_kinds.update({torch.Tensor: _TENSOR, torch.nn.Parameter: _TENSOR})
_FLOAT_DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point},
    key=str,
)


def _kind(cls: type) -> int:
    kind = _kinds.get(cls)
    if kind is not None:
        return kind
    if issubclass(cls, torch.Tensor):
        kind = _TENSOR
    elif issubclass(cls, (str, bytes, int, float, torch.Size)):
        kind = _LEAF
    elif callable(getattr(cls, "to", None)):
        # Before the container checks: a mapping with its own .to (Hugging Face's
        # BatchEncoding) knows best how to move itself.
        kind = _HAS_TO
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        kind = _NAMEDTUPLE
    elif issubclass(cls, Mapping):
        kind = _MAPPING
    elif issubclass(cls, (list, tuple)):
        kind = _SEQUENCE
    elif issubclass(cls, (set, frozenset)):
        kind = _SET
    elif dataclasses.is_dataclass(cls):
        kind = _DATACLASS
    else:
        kind = _LEAF
    if len(_kinds) < 4096:  # types made on the fly (namedtuple factories) must not leak
        _kinds[cls] = kind
    return kind


def _as_device(device: str | int | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"device must be a str, int or torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"a device index must be >= 0, got {device!r}")
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"invalid device {device!r}: expected e.g. 'cpu', 'cuda', 'cuda:1', 'mps' or 'meta' "
            f"({e})"
        ) from e


def _rebuild(obj: Any, kind: int, move: Callable[[Any], Any], device: torch.device) -> Any:
    """Everything but exact tensors, dicts, lists and tuples (the hot path handles those)."""
    cls = type(obj)
    if kind == _HAS_TO:
        return obj.to(device)
    if kind == _NAMEDTUPLE:
        return cls(*[move(v) for v in obj])
    if kind == _MAPPING:
        if isinstance(obj, MutableMapping):
            # A shallow copy keeps the subclass and its state (defaultdict's factory).
            new = copy.copy(obj)
            for key, value in obj.items():
                new[key] = move(value)
            return new
        return _construct(cls, {k: move(v) for k, v in obj.items()})
    if kind == _SEQUENCE:
        if isinstance(obj, list):
            new_list = copy.copy(obj)
            new_list[:] = [move(v) for v in obj]
            return new_list
        return _construct(cls, [move(v) for v in obj])
    if kind == _SET:
        return cls(move(v) for v in obj)
    if kind == _DATACLASS:
        changed = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            moved = move(value)
            if moved is not value:
                changed[field.name] = moved
        if not changed:
            return obj
        # Copy and set rather than call __init__: works for frozen classes, init=False
        # fields and InitVars alike, and does not re-run __post_init__.
        new_obj = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(new_obj, name, value)
        return new_obj
    return obj


def _construct(cls: type, contents: Any) -> Any:
    try:
        return cls(contents)
    except TypeError as e:
        raise TypeError(
            f"to_device cannot rebuild a {cls.__qualname__} from its moved contents ({e}); "
            "give the class a .to(device) method"
        ) from e


@functools.lru_cache(maxsize=64)
def _mover(dev: torch.device, nb: bool, dtype: torch.dtype | None) -> Callable[[Any], Any]:
    # Exact-type tests come first, so plain batches (dicts of lists of tensors) never reach
    # the kind table, and tensors inside containers move inline, without a Python call each:
    # such a call costs about as much as the rest of the traversal. Hence two variants.
    tensor = torch.Tensor
    kinds = _kinds

    def other(x: Any, cls: type) -> Any:
        kind = kinds.get(cls)
        if kind is None:
            kind = _kind(cls)
        if kind == _LEAF:
            return x
        if kind == _TENSOR:
            return x.to(dev, target(x.dtype), non_blocking=nb)
        return _rebuild(x, kind, move, dev)

    if dtype is None:
        target: Callable[[torch.dtype], torch.dtype | None] = lambda _: None  # noqa: E731

        def move(x: Any) -> Any:
            cls = type(x)
            if cls is tensor:
                return x.to(dev, non_blocking=nb)
            if cls is list:
                return [v.to(dev, non_blocking=nb) if type(v) is tensor else move(v) for v in x]
            if cls is dict:
                return {
                    k: v.to(dev, non_blocking=nb) if type(v) is tensor else move(v)
                    for k, v in x.items()
                }
            if cls is tuple:
                return tuple(
                    [v.to(dev, non_blocking=nb) if type(v) is tensor else move(v) for v in x]
                )
            return x if cls in _ATOMS else other(x, cls)

        return move

    # source dtype -> new dtype; None (keep it) for ints, bools, complex
    target = dict.fromkeys(_FLOAT_DTYPES, dtype).get

    def move_cast(x: Any) -> Any:
        cls = type(x)
        if cls is tensor:
            return x.to(dev, target(x.dtype), non_blocking=nb)
        if cls is list:
            return [
                v.to(dev, target(v.dtype), non_blocking=nb) if type(v) is tensor else move(v)
                for v in x
            ]
        if cls is dict:
            return {
                k: v.to(dev, target(v.dtype), non_blocking=nb) if type(v) is tensor else move(v)
                for k, v in x.items()
            }
        if cls is tuple:
            return tuple(
                [
                    v.to(dev, target(v.dtype), non_blocking=nb) if type(v) is tensor else move(v)
                    for v in x
                ]
            )
        return x if cls in _ATOMS else other(x, cls)

    move = move_cast
    return move


def to_device(
    obj: T,
    device: str | int | torch.device,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
) -> T:
    """Move every tensor inside ``obj`` to ``device``, keeping the containers as they are.

    Walks dicts (``OrderedDict``, ``defaultdict`` and other mappings keep their type),
    lists, tuples, namedtuples, sets and dataclasses (frozen ones too); calls
    ``x.to(device)`` on objects that have a ``.to`` method (modules, custom batch classes);
    leaves everything else (str, int, None, NumPy arrays…) untouched. A tensor already on
    ``device`` with the right dtype is returned as is, not copied.

    ``non_blocking=True`` only overlaps the copy with other work for a *pinned* CPU tensor
    going to CUDA (``pin_memory=True`` in the DataLoader); every other copy is synchronous
    anyway. A CUDA-to-CPU non-blocking copy returns before the data is there: call
    ``torch.cuda.synchronize()`` before reading it.

    Args:
        obj: a tensor or any nesting of the containers above.
        device: ``"cuda:1"``, ``1`` (meaning ``cuda:1``) or a ``torch.device``.
        non_blocking: allow asynchronous host-to-device copies (see above).
        dtype: cast floating-point tensors to this floating dtype on the way; integer and
            bool tensors (labels, indices, masks) keep theirs. Not passed to ``.to`` objects.

    Returns:
        A structure like ``obj`` with its tensors on ``device``.

    Raises:
        ValueError: ``device`` is not a valid device, or ``dtype`` is not floating-point.
        TypeError: ``device`` has the wrong type, or a container cannot be rebuilt.

    Example:
        >>> batch = {"x": torch.ones(2), "y": [torch.tensor([1]), "id-7"]}
        >>> out = to_device(batch, "meta", dtype=torch.float16)
        >>> out["x"].device, out["x"].dtype, out["y"][0].dtype, out["y"][1]
        (device(type='meta'), torch.float16, torch.int64, 'id-7')
    """
    dev = _as_device(device)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"dtype casts floating-point tensors only, so it must be a floating dtype such as "
            f"torch.bfloat16, got {dtype!r}"
        )
    move = _mover(dev, non_blocking, dtype)
    result: T = move(obj)
    return result


# --------------------------------------------------------------------------- same-device check


def _named_tensors(obj: Any, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    kind = _kind(type(obj))
    if kind == _TENSOR:
        out.append((path, obj))
    elif isinstance(obj, torch.nn.Module):
        out += [(f"{path}.{name}", p) for name, p in obj.named_parameters()]
        out += [(f"{path}.{name}", b) for name, b in obj.named_buffers()]
    elif kind == _MAPPING:
        for key, value in obj.items():
            _named_tensors(value, f"{path}[{key!r}]", out)
    elif kind in (_NAMEDTUPLE, _DATACLASS):
        names = obj._fields if kind == _NAMEDTUPLE else [f.name for f in dataclasses.fields(obj)]
        for name in names:
            _named_tensors(getattr(obj, name), f"{path}.{name}", out)
    elif kind in (_SEQUENCE, _SET):
        for i, value in enumerate(obj):
            _named_tensors(value, f"{path}[{i}]", out)


def check_same_device(
    module: torch.nn.Module | None, *tensors: Any, **named_tensors: Any
) -> torch.device:
    """Check a module's parameters and buffers and the inputs share one device.

    Call it before the forward pass to get an error naming the culprits instead of
    PyTorch's "Expected all tensors to be on the same device".

    Args:
        module: the model (or None to check the inputs alone).
        *tensors: inputs, possibly nested in containers (named ``arg0``, ``arg1``…).
        **named_tensors: inputs by name, possibly nested.

    Returns:
        The one device they all live on.

    Raises:
        DeviceMismatchError: more than one device; the message lists, per device, a few of
            the parameters, buffers and inputs found there.
        ValueError: there is no tensor at all to check.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> check_same_device(model, torch.ones(3, 2), batch={"x": torch.ones(3, 2)})
        device(type='cpu')
    """
    found: list[tuple[str, torch.Tensor]] = []
    if module is not None:
        found += [(f"parameter {n}", p) for n, p in module.named_parameters()]
        found += [(f"buffer {n}", b) for n, b in module.named_buffers()]
    inputs: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(tensors):
        _named_tensors(value, f"arg{i}", inputs)
    for name, value in named_tensors.items():
        _named_tensors(value, name, inputs)
    found += [(f"input {n}", t) for n, t in inputs]
    if not found:
        raise ValueError(
            "check_same_device found no tensors: pass a module with parameters "
            "or at least one tensor input"
        )
    by_device: dict[torch.device, list[str]] = {}
    for name, t in found:
        by_device.setdefault(t.device, []).append(name)
    if len(by_device) == 1:
        return next(iter(by_device))
    lines = []
    for dev, names in by_device.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"  {dev}: {shown}")
    first = next(iter(by_device))
    raise DeviceMismatchError(
        f"tensors are on {len(by_device)} devices, but one forward pass needs them on one:\n"
        + "\n".join(lines)
        + f"\nFix: move both to one device, e.g. model.to({str(first)!r}) and "
        f"batch = trainperf.to_device(batch, {str(first)!r})."
    )


# --------------------------------------------------------------------------- seeds


def seed_everything(seed: int, *, deterministic: bool = False) -> int:
    """Seed Python's ``random``, NumPy, torch and every CUDA device, for reproducible runs.

    Also sets ``PYTHONHASHSEED`` for child processes (this process's string hashing was
    fixed when it started). For DataLoader workers, pass :func:`worker_init_fn` and a seeded
    generator: ``DataLoader(ds, worker_init_fn=worker_init_fn,
    generator=torch.Generator().manual_seed(seed))``.

    Args:
        seed: an int in ``[0, 2**32 - 1]``.
        deterministic: also make torch pick deterministic algorithms (erroring on ops that
            have none), turn cuDNN's autotuner off and set ``CUBLAS_WORKSPACE_CONFIG``.
            Slower; ``False`` leaves those settings as they are.

    Returns:
        The seed, for logging.

    Raises:
        TypeError: ``seed`` is not an integer.
        ValueError: ``seed`` is outside ``[0, 2**32 - 1]``.

    Example:
        >>> seed_everything(7)
        7
        >>> a = torch.rand(1); _ = seed_everything(7); bool(torch.equal(a, torch.rand(1)))
        True
    """
    if isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    try:
        seed = operator.index(seed)
    except TypeError as e:
        raise TypeError(f"seed must be an int, got {seed!r}") from e
    if not 0 <= seed <= 2**32 - 1:
        raise ValueError(f"seed must be in [0, 2**32 - 1] (NumPy's range), got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # lazy: queued until CUDA starts, never starts it
    os.environ["PYTHONHASHSEED"] = str(seed)
    if deterministic:
        # cuBLAS reads this when it creates its handle, i.e. at the first matmul on a device.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return seed


def _worker_seed_state(seed: int) -> np.ndarray[Any, Any]:
    # SeedSequence spreads nearby seeds (base_seed + 0, base_seed + 1...) over unrelated
    # NumPy states, which a plain `seed % 2**32` would not.
    return np.random.SeedSequence(seed).generate_state(4)


def worker_init_fn(worker_id: int) -> None:
    """Give each DataLoader worker its own reproducible ``random`` and NumPy seed.

    Inside a worker the seed comes from ``torch.initial_seed()``, which the DataLoader sets
    to ``base_seed + worker_id`` (``base_seed`` drawn from the loader's generator), so
    seeding that generator makes every worker's stream reproducible. Recent PyTorch seeds
    NumPy in workers itself; this function makes the scheme explicit and version-proof.
    Called outside a worker, it seeds from ``torch.initial_seed() + worker_id``.

    Args:
        worker_id: the worker's number, as the DataLoader passes it.

    Raises:
        ValueError: ``worker_id`` < 0.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(4), num_workers=0, worker_init_fn=worker_init_fn,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> worker_init_fn(0)
    """
    if worker_id < 0:
        raise ValueError(f"worker_id must be >= 0, got {worker_id!r}")
    info = torch.utils.data.get_worker_info()
    seed = info.seed if info is not None else torch.initial_seed() + worker_id
    random.seed(seed)
    np.random.seed(_worker_seed_state(seed))
