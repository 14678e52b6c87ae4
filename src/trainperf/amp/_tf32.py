"""TF32 for fp32 matmuls and cuDNN convolutions: read, switch and restore it safely.

torch keeps TF32 as process-wide state behind two APIs: the legacy one
(``torch.set_float32_matmul_precision``, ``torch.backends.cudnn.allow_tf32``) and, from torch
2.9, a per-backend ``fp32_precision`` attribute. Once the new API has been used, reading a
legacy getter can raise ``RuntimeError`` ("you have used mix of the legacy and new APIs").
Everything here reads through whichever API answers and restores both, so a caller never
trips over what another library (or the user) set before it. The flags exist without CUDA,
so all of this works, and is tested, on a CPU-only build.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TF32State", "enable_tf32", "tf32", "tf32_state"]


@dataclass(frozen=True)
class TF32State:
    """Whether TF32 is allowed, as torch would apply it now.

    Attributes:
        matmul: fp32 matmuls (cuBLAS) may use TF32 tensor cores.
        cudnn: cuDNN convolutions may use TF32 tensor cores.
    """

    matmul: bool
    cudnn: bool


def _backend(*path: str) -> Any:
    """``torch.backends.<path>``, or None where this torch build lacks it."""
    obj: Any = torch.backends
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


# The new-API attributes a TF32 switch can change (set_float32_matmul_precision also sets
# oneDNN's matmul precision), in the order they are restored.
_NEW_API = (("cuda", "matmul"), ("mkldnn", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn"))


def tf32_state() -> TF32State:
    """Whether TF32 is on for fp32 matmuls and cuDNN convolutions, never raising.

    Returns:
        A :class:`TF32State`.

    Example:
        >>> with tf32(False):
        ...     tf32_state()
        TF32State(matmul=False, cudnn=False)
    """
    try:
        matmul = torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the new API was used: ask it instead
        matmul = getattr(_backend("cuda", "matmul"), "fp32_precision", "ieee") == "tf32"
    try:
        cudnn = bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        cudnn = getattr(_backend("cudnn", "conv"), "fp32_precision", "ieee") == "tf32"
    return TF32State(matmul=matmul, cudnn=cudnn)


def _set(enabled: bool) -> None:
    # The legacy matmul setter works whatever API was used before, and leaves both readable.
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        torch.backends.cudnn.allow_tf32  # noqa: B018  (raises when the APIs were mixed)
    except RuntimeError:
        conv = _backend("cudnn", "conv")
        if conv is not None:
            conv.fp32_precision = "tf32" if enabled else "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = enabled


def _snapshot() -> tuple[str | None, bool | None, list[tuple[Any, str]]]:
    try:
        matmul: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        matmul = None
    try:
        cudnn: bool | None = bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        cudnn = None
    raw = []
    for path in _NEW_API:
        backend = _backend(*path)
        value = getattr(backend, "fp32_precision", None)
        if value is not None:
            raw.append((backend, str(value)))
    return matmul, cudnn, raw


def _restore(saved: tuple[str | None, bool | None, list[tuple[Any, str]]]) -> None:
    matmul, cudnn, raw = saved
    # The legacy values first (their setters also write the new attributes), then the new
    # attributes exactly as they were.
    if matmul is not None:
        torch.set_float32_matmul_precision(matmul)
    if cudnn is not None:
        torch.backends.cudnn.allow_tf32 = cudnn
    for backend, value in raw:
        backend.fp32_precision = value


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[TF32State]:
    """Switch TF32 on or off for fp32 matmuls and cuDNN convolutions, then restore it.

    Whatever was set before, through either API, is put back on exit, also after an error.

    Args:
        enabled: allow TF32 (True) or force full fp32 (False) inside the block.

    Yields:
        The :class:`TF32State` in effect inside the block.

    Raises:
        TypeError: ``enabled`` is not a bool.

    Example:
        >>> before = tf32_state()
        >>> with tf32(True) as state:
        ...     state.matmul, tf32_state().cudnn
        (True, True)
        >>> tf32_state() == before
        True
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    saved = _snapshot()
    try:
        _set(enabled)
        yield tf32_state()
    finally:
        _restore(saved)


def enable_tf32() -> None:
    """Allow TF32 for fp32 matmuls and cuDNN convolutions, process-wide (not restored).

    What :class:`trainperf.amp.MixedPrecision` does on compute capability >= 8.0. Safe after
    either TF32 API was used: it never reads a legacy flag that would raise.

    Example:
        >>> with tf32(False):  # only to leave this process's settings as they were
        ...     enable_tf32()
        ...     tf32_state()
        TF32State(matmul=True, cudnn=True)
    """
    _set(True)
