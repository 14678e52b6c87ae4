"""The precision policy behind :class:`trainperf.amp.MixedPrecision`: what a device supports.

The small functions that ask the device (:func:`cuda_capability`, :func:`cpu_has_bf16_kernels`,
:func:`autocast_supports`) are the seams tests replace to fake a P40, V100, T4, A100 or H200;
:func:`auto_precision` and :func:`resolve` turn their answers into a dtype and a reason, and
:func:`choose_precision` is the public face of the "auto" policy.
"""

from __future__ import annotations

import platform
import warnings

import torch

from trainperf.device import resolve_device
from trainperf.errors import DeviceError

__all__ = [
    "DTYPES",
    "NAMES",
    "auto_precision",
    "autocast_supports",
    "check_precision",
    "choose_precision",
    "cpu_has_bf16_kernels",
    "cuda_capability",
    "resolve",
]

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


# torch's dtypes and other names for the precisions: only to name the one to pass instead.
_OTHER_NAMES: dict[object, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}


def check_precision(precision: object, choices: tuple[str, ...]) -> None:
    """Refuse a precision not among ``choices``, naming the one to pass where it is another
    name for one (``torch.bfloat16``, ``"float16"``, ``"BF16"``).

    Raises:
        ValueError: ``precision`` is not one of ``choices``.

    Example:
        >>> try:
        ...     check_precision(torch.bfloat16, ("auto", "bf16", "fp16", "fp32"))
        ... except ValueError as e:
        ...     print(str(e).split(", got ")[1])
        torch.bfloat16; pass precision='bf16'
    """
    if isinstance(precision, str) and precision in choices:
        return
    name = None
    if isinstance(precision, str):
        lower = precision.lower()
        name = lower if lower in choices else _OTHER_NAMES.get(lower)
    elif isinstance(precision, torch.dtype):
        name = _OTHER_NAMES.get(precision)
    hint = f"; pass precision={name!r}" if name in choices else ""
    raise ValueError(f"precision must be one of {choices}, got {precision!r}{hint}")


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device (initialises CUDA)."""
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {str(device)!r} was asked for, but CUDA is not available here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "use device='cpu', or device=None to pick the best available device"
        )
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


# platform.machine() of an x86-64 CPU: Linux and macOS say x86_64, Windows AMD64.
_X86_64 = ("x86_64", "amd64")


def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU computes bf16 natively; where it is emulated, bf16 is slower than fp32.

    On x86-64 that takes AVX512-BF16 or AMX (Cooper Lake, Sapphire Rapids, Zen 4 and later).
    oneDNN's own check is not enough there: it also says yes on any AVX-512BW/VL/DQ CPU
    (Skylake-SP, Cascade Lake), where bf16 is emulated. Elsewhere (aarch64) oneDNN's check is
    used. On x86-64 a torch without torch.cpu's checks gets False: fp32 may leave speed
    unused there, but is never slower than emulated bf16.
    """
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if platform.machine().lower() in _X86_64:
        return _x86_has_native_bf16()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an op missing from this torch build
        return False


def _x86_has_native_bf16() -> bool:
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, name, None)
        if check is None:  # private helpers, missing from some torch releases
            continue
        try:
            if check():
                return True
        except (AttributeError, RuntimeError):
            continue
    return False


def autocast_supports(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype=dtype)`` would really autocast.

    torch disables autocast with a warning (rather than failing) for a dtype a device does
    not support, e.g. fp16 on the CPU in older releases; this asks without autocasting.
    """
    if not torch.amp.is_autocast_available(device_type):
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ctx = torch.autocast(device_type, dtype=dtype)
        except RuntimeError:
            return False
    return bool(getattr(ctx, "_enabled", False)) and not caught


# --------------------------------------------------------------------------- choosing a precision


def auto_precision(device: torch.device) -> tuple[torch.dtype, str]:
    """The "auto" choice for ``device`` and the reason for it."""
    if device.type == "cuda":
        major, minor = cuda_capability(device)
        cc = f"compute capability {major}.{minor}"
        if major >= 8:
            return torch.bfloat16, f"auto: {device} has {cc} (>= 8.0) -> bf16, no loss scaling"
        if major == 7:
            return torch.float16, (
                f"auto: {device} has {cc} (Volta/Turing: fp16 tensor cores, no native bf16) "
                "-> fp16 with loss scaling"
            )
        return torch.float32, (
            f"auto: {device} has {cc} (< 7.0: no tensor cores, fp16 is slower than fp32) -> fp32"
        )
    if device.type == "cpu":
        if cpu_has_bf16_kernels() and autocast_supports("cpu", torch.bfloat16):
            return torch.bfloat16, "auto: the CPU has native bf16 and bf16 autocast -> bf16"
        return torch.float32, "auto: the CPU has no native bf16 (emulated bf16 is slower) -> fp32"
    if device.type == "mps":
        return torch.float16, "auto: mps -> fp16 with loss scaling"
    return torch.float32, f"auto: no policy for device type {device.type!r} -> fp32"


def resolve(device: torch.device, precision: str) -> tuple[torch.dtype, str]:
    """The dtype for an explicit or "auto" ``precision`` on ``device``, and why.

    Raises:
        DeviceError: bf16 on a GPU without native bf16 (compute capability < 8.0), or a
            CUDA device without CUDA.
        ValueError: fp16 or bf16 on a device whose autocast this torch does not support.
    """
    if precision == "auto":
        return auto_precision(device)
    dtype = DTYPES[precision]
    if dtype == torch.float32:
        return dtype, "requested fp32"
    if device.type == "cuda":
        major, minor = cuda_capability(device)
        if dtype == torch.bfloat16 and major < 8:
            raise DeviceError(
                f"precision='bf16' needs compute capability >= 8.0 (Ampere or newer) for native "
                f"bf16, but {device} has {major}.{minor}; use precision='fp16' (with loss "
                "scaling) or precision='auto'"
            )
        if dtype == torch.float16 and major < 7:
            warnings.warn(
                f"precision='fp16' on {device} (compute capability {major}.{minor}, no tensor "
                "cores) is usually slower than fp32; precision='auto' picks fp32 there",
                UserWarning,
                stacklevel=3,
            )
        scaled = " with loss scaling" if dtype == torch.float16 else ""
        return dtype, f"requested {precision}{scaled} on {device} ({major}.{minor})"
    if not autocast_supports(device.type, dtype):
        raise ValueError(
            f"precision={precision!r} needs {precision} autocast on {device.type!r}, which "
            f"torch {torch.__version__} does not support there; use precision='auto', 'fp32' "
            "or the other half precision"
        )
    scaled = " with loss scaling" if dtype == torch.float16 else ""
    return dtype, f"requested {precision}{scaled} on {device}"


def choose_precision(device: str | torch.device | None = None) -> torch.dtype:
    """The precision the "auto" policy picks for ``device`` (the table in :mod:`trainperf.amp`).

    CUDA compute capability >= 8.0 -> bf16; 7.x -> fp16 (with a loss scaler); < 7.0 -> fp32;
    a CPU with native bf16 -> bf16, else fp32; MPS -> fp16. Override it with
    ``MixedPrecision(precision=...)``.

    Args:
        device: the device to decide for; None or ``"auto"`` means
            :func:`trainperf.best_device` (parsed by :func:`trainperf.device.resolve_device`).

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

    Raises:
        DeviceError: CUDA or MPS asked for but not available, or a CUDA index beyond the
            visible GPUs.
        ValueError: ``device`` is not a valid device string.
        TypeError: ``device`` has the wrong type.

    Example:
        >>> choose_precision("cpu") in (torch.bfloat16, torch.float32)
        True
    """
    return auto_precision(resolve_device(device, allowed=None))[0]
