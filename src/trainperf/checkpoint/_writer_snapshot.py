"""What a background save's payload holds, for choosing its writer: the bytes of its
tensors, each storage once (:func:`tensor_bytes`), and whether a fork's copy-on-write
snapshot holds them as they are now (:func:`snapshot_safe`), which it does not for memory
the fork shares with the training process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["snapshot_safe", "tensor_bytes"]


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    return _leaves(obj, torch.Tensor, out)


def _leaves(obj: Any, kind: Any, out: list[Any]) -> list[Any]:
    """The leaves of type ``kind`` in ``obj``'s mappings, lists and tuples, in order."""
    if isinstance(obj, kind):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _leaves(v, kind, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, kind, out)
    return out


def _shared_ranges() -> list[tuple[int, int]] | None:
    """The address ranges of this process's shared mappings (``MAP_SHARED``: shared
    memory, a file mapped for writing), which a fork shares instead of copying on write;
    None where ``/proc/self/maps`` cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split(None, 2)
        if len(fields) >= 2 and len(fields[1]) >= 4 and fields[1][3] == "s":
            start, _, end = fields[0].partition("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _in_shared(ptr: int, ranges: list[tuple[int, int]] | None) -> bool:
    """``ptr`` lies in a shared mapping (True where the mappings are unknown)."""
    return ranges is None or any(start <= ptr < end for start, end in ranges)


def _numpy_owned(a: np.ndarray[Any, Any]) -> bool:
    """NumPy allocated this array's memory itself, or it views such an array: private to
    this process (malloc'd or an anonymous private mapping)."""
    base: Any = a
    while isinstance(base, np.ndarray) and not base.flags.owndata:
        base = base.base
    return isinstance(base, np.ndarray)


def _foreign(t: torch.Tensor) -> bool:
    """The tensor's memory is not torch's own (``torch.from_numpy``, DLPack, a file): its
    storage cannot be resized."""
    try:
        return not t.untyped_storage().resizable()
    except (RuntimeError, NotImplementedError):
        return True


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        ptr = id(t)
    return (str(t.device), ptr)


def tensor_bytes(payload: Any) -> tuple[int, bool]:
    """``(bytes, all on the CPU)`` of the tensors in ``payload``, each storage counted once.

    Example:
        >>> w = torch.zeros(256)
        >>> tensor_bytes({"a": w, "b": [w, torch.zeros(2, dtype=torch.int8)]})
        (1026, True)
    """
    seen: dict[tuple[Any, ...], int] = {}
    cpu = True
    for t in _tensors(payload, []):
        cpu = cpu and t.device.type == "cpu"
        key = _storage_key(t)
        nbytes = t.untyped_storage().nbytes() if key[1] != id(t) else t.numel() * t.element_size()
        seen[key] = max(seen.get(key, 0), nbytes)
    return sum(seen.values()), cpu


def snapshot_safe(payload: Any) -> bool:
    """Whether a fork's copy-on-write snapshot holds ``payload``'s tensors and arrays as
    they are now.

    Not for memory the fork shares, so that the training process's next writes would reach
    the writer: a tensor in shared memory (``share_memory_()``), a tensor or NumPy array
    over a shared mapping (``multiprocessing.shared_memory``, ``np.memmap`` in ``r+``
    mode, ``torch.from_numpy`` of either), nor, once CUDA is initialised, a pinned tensor:
    those go through staging, which copies them.

    Example:
        >>> shared = torch.zeros(2).share_memory_()
        >>> snapshot_safe({"w": torch.zeros(2)}), snapshot_safe({"w": shared})
        (True, False)
        >>> snapshot_safe({"rng": np.zeros(3), "w": torch.from_numpy(np.zeros(3))})
        True
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    pointers: list[int] = []  # memory torch or NumPy did not allocate: is it shared?
    for t in _tensors(payload, []):
        if t.layout != torch.strided:
            continue
        if t.is_shared() or (cuda and t.is_pinned()):  # type: ignore[no-untyped-call]
            return False
        if _foreign(t):
            pointers.append(t.data_ptr())
    arrays = _leaves(payload, np.ndarray, [])
    pointers += [a.__array_interface__["data"][0] for a in arrays if not _numpy_owned(a)]
    if not pointers:
        return True
    ranges = _shared_ranges()
    return not any(_in_shared(ptr, ranges) for ptr in pointers)
