"""The host buffers the ``"thread"`` background writer stages a payload into
(:class:`Staging`, reused from save to save, pinned for GPU tensors), and the rule that
says whether one more copy of the state fits the host's memory (:func:`staging_fits`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import Any

import torch

from trainperf.checkpoint._keys import _same_type
from trainperf.checkpoint._writer_snapshot import _tensors

__all__ = ["Staging", "staging_fits"]

# Headroom kept free when deciding whether staging fits: the larger of these.
_MARGIN_MIN = 512 << 20
_MARGIN_FRACTION = 0.05


def staging_fits(needed: int, available: int, total: int) -> bool:
    """Whether ``needed`` more bytes of host memory fit while keeping a margin free.

    The margin is the larger of 512 MiB and 5 % of ``total``: page cache, the writer's own
    buffers and the training loop's allocations need room too.

    Example:
        >>> staging_fits(1 << 30, 8 << 30, 16 << 30)
        True
        >>> staging_fits(1 << 30, (1 << 30) + (100 << 20), 16 << 30)
        False
    """
    margin = max(_MARGIN_MIN, int(total * _MARGIN_FRACTION))
    return needed + margin <= available


class Staging:
    """Host buffers that background saves copy tensors into, reused from save to save."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        # Whether each buffer is pinned, kept here: is_pinned() on a CPU tensor can start
        # CUDA where it was never used.
        self._pinned: list[bool] = []

    def _fits(self, i: int, t: torch.Tensor) -> bool:
        if i >= len(self._buffers):
            return False
        buf = self._buffers[i]
        pinned = t.device.type == "cuda"
        return buf.shape == t.shape and buf.dtype == t.dtype and self._pinned[i] == pinned

    def needed_bytes(self, payload: Any) -> int:
        """Bytes of new buffers that staging ``payload`` would allocate."""
        return sum(
            t.numel() * t.element_size()
            for i, t in enumerate(_staged_tensors(payload))
            if not self._fits(i, t)
        )

    def _buffer(self, i: int, t: torch.Tensor) -> torch.Tensor:
        if self._fits(i, t):
            return self._buffers[i]
        pin = t.device.type == "cuda"
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if i < len(self._buffers):
            self._buffers[i], self._pinned[i] = buf, pin
        else:
            self._buffers.append(buf)
            self._pinned.append(pin)
        return buf

    def stage(self, payload: Any) -> Any:
        """``payload`` with every tensor copied into a host buffer and every other leaf
        (NumPy arrays, user objects) deep-copied (containers rebuilt; a leaf that cannot be
        copied is shared), once every copy has landed."""
        counter = [0]
        done: dict[tuple[Any, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()

        def copy(t: torch.Tensor) -> torch.Tensor:
            if t.layout != torch.strided:  # sparse and such: a plain copy, no buffer
                return t.detach().to("cpu", copy=True)
            key = _view_key(t)
            if key not in done:  # the same tensor twice (tied weights): one buffer
                out = self._buffer(counter[0], t)
                out.copy_(t.detach(), non_blocking=t.device.type == "cuda")
                if t.device.type == "cuda":
                    devices.add(t.device)
                counter[0] += 1
                done[key] = out
            return done[key]

        staged = _rebuild(payload, copy)
        for device in devices:  # every non-blocking copy has landed, on each device
            torch.cuda.synchronize(device)
        return staged


def _copy_leaf(obj: Any) -> Any:
    """A deep copy of a non-tensor leaf, so the training loop's next change misses it;
    immutable scalars and anything that cannot be copied are shared."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return obj
    try:
        return deepcopy(obj)
    except Exception:  # a lock, a generator, a socket: written as it is at write time
        return obj


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _staged_tensors(payload: Any) -> list[torch.Tensor]:
    """The tensors :meth:`Staging.stage` gives a buffer each, in its order."""
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    for t in _tensors(payload, []):
        if t.layout == torch.strided:
            seen.setdefault(_view_key(t), t)
    return list(seen.values())


def _rebuild(obj: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return copy(obj)
    if isinstance(obj, Mapping):
        out = _same_type(obj, ((k, _rebuild(v, copy)) for k, v in obj.items()))
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            with contextlib.suppress(AttributeError, TypeError):
                out._metadata = meta
        return out
    if isinstance(obj, list):
        return [_rebuild(v, copy) for v in obj]
    if isinstance(obj, tuple):
        values = [_rebuild(v, copy) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    return _copy_leaf(obj)
