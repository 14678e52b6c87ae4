""":func:`resolve_device`: the one parser of every ``device`` argument trainperf takes."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import NoReturn, cast

import torch

from trainperf._utils.validate import as_real_number
from trainperf.errors import DeviceError

__all__ = ["resolve_device"]

_DEFAULT_ALLOWED = ("cpu", "cuda", "mps", "meta")

# torch keeps a device index in 8 bits (c10::DeviceIndex): torch.device("cuda", 256) is cuda:0
# and 128 is cuda:-128, without a word, and past 64 bits it fails with an overflow error that
# names no argument.
MAX_DEVICE_INDEX = 127
# An index as torch's device-string parser takes it: ASCII digits, no sign, no leading zero.
_INDEX = re.compile(r"0|[1-9][0-9]*")


def _choices(allowed: Collection[str] | None, auto: bool) -> str:
    forms = ["'auto'"] if auto else []
    for kind in _DEFAULT_ALLOWED if allowed is None else allowed:
        forms += ["'cuda'", "'cuda:<i>' (e.g. 'cuda:1')"] if kind == "cuda" else [repr(kind)]
    more = ", or a torch.device" if allowed is None else ""
    return ", ".join(forms[:-1]) + f" or {forms[-1]}{more}" if len(forms) > 1 else forms[0]


def _instead(allowed: Collection[str] | None, auto: bool, where: str) -> str:
    """What to do about a missing device: the CPU where the caller takes it, else ``where``."""
    if allowed is not None and "cpu" not in allowed:
        return f"this has no CPU fallback: run it {where}"
    return "use device='cpu' or device='auto' instead" if auto else "use device='cpu' instead"


def resolve_device(
    device: str | int | torch.device | None,
    *,
    allowed: Collection[str] | None = _DEFAULT_ALLOWED,
    auto: bool = True,
) -> torch.device:
    """Turn a user's ``device`` argument into a checked :class:`torch.device`.

    Every trainperf function that takes ``device`` parses it here, so the spellings, the
    checks and the error messages are the same everywhere. Only the availability of the
    device is checked (``torch.cuda.is_available()``, ``torch.cuda.device_count()``): CUDA
    is not initialised.

    Args:
        device: ``None`` or ``"auto"`` for :func:`trainperf.device.best_device` (when
            ``auto`` is True); a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``,
            ``"mps"`` or ``"meta"``; an int ``i`` (a NumPy integer too), meaning ``cuda:<i>``; or a
            :class:`torch.device`.
        allowed: the device types the caller accepts; None accepts every type
            :class:`torch.device` knows. When ``"auto"`` picks a type outside it (MPS for
            a CPU-or-CUDA caller), the CPU is used instead if it is allowed; if not, that
            is a :class:`DeviceError` (``allowed=("cuda",)`` on a host without CUDA).
        auto: whether None and ``"auto"`` mean the best device; if False, None is a
            :class:`TypeError` and ``"auto"`` a :class:`ValueError`.

    Returns:
        The device.

    Raises:
        TypeError: ``device`` is not a str, int, torch.device (or None with ``auto``).
        ValueError: ``device`` is not a valid device, has an index below 0 or above 127
            (the most torch can hold: it wraps larger ones onto other devices), is a CPU
            with an index other than 0 (``"cpu:1"``: torch has one CPU device; ``"cpu:0"``
            comes back as ``"cpu"``), or is of a type not in ``allowed``; the message lists
            the choices.
        DeviceError: the device's backend is not available here: CUDA (no GPU or driver),
            MPS, or another type (``"xpu"``, ``"hpu"``, ``"xla"``...: no such device, or a
            PyTorch build or plugin without it); an index beyond the visible devices
            (``torch.cuda.device_count()`` for CUDA); or, for None and ``"auto"``, no
            device of an ``allowed`` type when the CPU is not one of them.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device(torch.device("meta"), allowed=None)
        device(type='meta')
        >>> resolve_device(None, allowed=("cpu", "cuda")).type in {"cpu", "cuda"}
        True
    """
    if auto and (device is None or (isinstance(device, str) and device == "auto")):
        # Looked up on the package at call time, so one monkeypatch of
        # trainperf.device.best_device reaches every caller.
        from trainperf import device as package

        best = package.best_device()
        if allowed is not None and best.type not in allowed:
            if "cpu" not in allowed:
                raise _no_allowed_device(device, best, allowed)
            return torch.device("cpu")
        return best
    number = as_real_number(device)
    if isinstance(number, int):
        device = number  # NumPy's integers too (an index read from a config or an array)
    if isinstance(device, torch.device):
        dev = _unwrapped(device)
    elif isinstance(device, bool) or not isinstance(device, (str, int)):
        kinds = "a str, int, torch.device or None" if auto else "a str, int or torch.device"
        raise TypeError(f"device must be {kinds}, got {device!r}")
    elif isinstance(device, int):
        dev = _indexed("cuda", device, device)
    else:
        dev = _parse(device, allowed, auto)
    if allowed is not None and dev.type not in allowed:
        raise ValueError(
            f"device {str(dev)!r} is not supported here: expected {_choices(allowed, auto)}"
        )
    kind = dev.type
    if kind == "cpu":
        dev = _one_cpu(dev)
    elif kind == "cuda":
        _check_cuda(dev, allowed, auto)
    elif kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise DeviceError(
                f"device {str(dev)!r} needs Apple's Metal (MPS), but MPS is not available here "
                "(not a Mac with Apple silicon, or a PyTorch build without MPS); "
                + _instead(allowed, auto, "on a Mac with Apple silicon")
            )
    elif kind not in ("cpu", "meta"):
        _check_backend(dev, allowed, auto)
    return dev


def _parse(device: str, allowed: Collection[str] | None, auto: bool) -> torch.device:
    """A device string, its index checked before torch would wrap it (``"cuda:256"``)."""
    kind, colon, number = device.partition(":")
    try:
        dev = torch.device(kind)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}: expected {_choices(allowed, auto)}") from e
    if not colon:
        return dev
    if _INDEX.fullmatch(number) is None:
        raise ValueError(f"invalid device {device!r}: expected {_choices(allowed, auto)}")
    return _indexed(dev.type, int(number), device)


def _indexed(kind: str, index: int, device: str | int) -> torch.device:
    """``torch.device(kind, index)``, with an index torch cannot hold refused, not wrapped."""
    if index < 0:
        raise ValueError(f"a device index must be >= 0, got {device!r}")
    if index > MAX_DEVICE_INDEX:
        where = "" if isinstance(device, int) else f" in {device!r}"
        raise ValueError(
            f"a device index must be <= {MAX_DEVICE_INDEX} (PyTorch keeps it in 8 bits and "
            f"wraps larger ones onto other devices), got {index}{where}: use the index of a "
            f"visible device, 0 to torch.{kind}.device_count() - 1"
        )
    return torch.device(kind, index)


def _unwrapped(dev: torch.device) -> torch.device:
    """``dev``, unless torch wrapped its index below 0 (``torch.device("cuda", 128)``)."""
    # torch's stubs type .index as int, but a bare "cuda" has none.
    index = cast("int | None", dev.index)
    if index is not None and index < 0:
        raise ValueError(
            f"device {str(dev)!r} has a negative index: torch.device() wraps an index past "
            f"{MAX_DEVICE_INDEX} (torch.device('cuda', 128) is cuda:-128): use the index of a "
            f"visible device, 0 to torch.{dev.type}.device_count() - 1"
        )
    return dev


def _one_cpu(dev: torch.device) -> torch.device:
    """The CPU as plain ``"cpu"``: ``"cpu:0"`` names it too, and torch.load maps onto exactly
    ``"cpu"``; any other index names no device (a tensor made on ``"cpu:1"`` is on ``"cpu"``),
    though a report would repeat it."""
    if dev.index not in (None, 0):
        raise ValueError(
            f"device {str(dev)!r} does not exist: PyTorch has one CPU device, whatever the "
            "cores; use device='cpu' (to pin cores, set the process's affinity: taskset)"
        )
    return torch.device("cpu")


def _no_allowed_device(
    device: str | None, best: torch.device, allowed: Collection[str]
) -> DeviceError:
    """``"auto"`` found no device the caller takes, and the CPU is not one of them."""
    kinds = " or ".join(repr(kind) for kind in allowed) or "allowed"
    where = "on a host with an NVIDIA GPU" if "cuda" in allowed else f"where {kinds} is available"
    return DeviceError(
        f"device={device!r} picks the best device available, but no {kinds} device is "
        f"available here (the best is {str(best)!r}); " + _instead(allowed, True, where)
    )


def _check_cuda(dev: torch.device, allowed: Collection[str] | None, auto: bool) -> None:
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {str(dev)!r} needs CUDA, but CUDA is not available here (no NVIDIA GPU "
            f"or driver, or a CPU-only PyTorch build); "
            + _instead(allowed, auto, "on a host with an NVIDIA GPU")
        )
    count = torch.cuda.device_count()
    # torch's stubs type .index as int, but a bare "cuda" has none.
    index: int | None = dev.index
    if index is not None and index >= count:
        raise DeviceError(
            f"device {str(dev)!r} does not exist: only {count} GPU(s) are visible "
            f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them from 0)"
        )


# Devices without a torch.<type> module that made a tensor once: not asked again.
_working: set[torch.device] = set()


def _check_backend(dev: torch.device, allowed: Collection[str] | None, auto: bool) -> None:
    """Any other device type (XPU, MTIA, HPU, XLA, a PrivateUse1 plugin such as ``npu``).

    Where PyTorch or a plugin provides ``torch.<type>`` with ``is_available()``, that module
    says (and ``device_count()`` bounds the index); where there is none (XLA, whose plugin
    registers no module), an empty tensor made there does.
    """
    module = getattr(torch, dev.type, None)
    is_available = getattr(module, "is_available", None)
    if callable(is_available):
        if not is_available():
            _unavailable(dev, allowed, auto, f"torch.{dev.type}.is_available() is False")
        count = getattr(module, "device_count", None)
        index: int | None = dev.index
        if index is not None and callable(count) and index >= count():
            raise DeviceError(
                f"device {str(dev)!r} does not exist: only {count()} {dev.type} device(s) "
                f"are visible ({dev.type}:0 to {dev.type}:{count() - 1})"
            )
        return
    if dev in _working:
        return
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, NotImplementedError, AssertionError, ImportError) as e:
        _unavailable(dev, allowed, auto, f"{type(e).__name__}: {str(e).splitlines()[0]}", e)
    _working.add(dev)


def _unavailable(
    dev: torch.device,
    allowed: Collection[str] | None,
    auto: bool,
    why: str,
    cause: BaseException | None = None,
) -> NoReturn:
    raise DeviceError(
        f"device {str(dev)!r} needs PyTorch's {dev.type!r} backend, but it is not available "
        f"here ({why}); install and import the PyTorch build or plugin that provides it "
        f"(for 'xla', torch_xla), or "
        + _instead(allowed, auto, f"on a host with a {dev.type} device")
    ) from cause
