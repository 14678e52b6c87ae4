"""``data_parallel``: ``nn.DataParallel`` with the model moved to its first GPU first, and
``device_ids`` taken as ``nn.DataParallel`` takes them (numbers, ``torch.device``, ``"cuda:1"``),
and as numbers written in digits (``"1"``).
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Sequence
from typing import SupportsIndex

import torch
from torch import nn

__all__ = ["data_parallel"]

_dp_warned = False

GpuId = int | str | torch.device


def data_parallel(model: nn.Module, device_ids: Sequence[GpuId] | None = None) -> nn.Module:
    """Wrap ``model`` in ``nn.DataParallel``, first moving it to ``device_ids[0]``.

    DataParallel gathers on ``device_ids[0]`` and insists that the module already lives
    there ("module must have its parameters and buffers on device cuda:1 ... but found one
    of them on device: cuda:0"); this moves it. Says once that DistributedDataParallel
    (:func:`launch` + :func:`wrap_model`) is faster: one process per GPU, no per-step
    scatter/gather and no GIL contention. Without CUDA the model is returned unwrapped.

    Args:
        model: a plain module.
        device_ids: GPUs to use, as ``nn.DataParallel`` takes them: numbers (``1``, or
            digits: ``"1"``), ``torch.device("cuda", 1)`` or ``"cuda:1"`` (``"cuda"``: the
            current GPU); None means all visible.

    Returns:
        The DataParallel-wrapped model (or ``model`` itself without CUDA).

    Raises:
        ValueError: ``device_ids`` is empty, names a device that is not a CUDA GPU, or a
            GPU that is not visible.
        TypeError: ``device_ids`` is one value (``"0,1"``, ``1``), not a sequence of them,
            or an entry of it is neither a number nor a device.

    Example:
        >>> net = data_parallel(torch.nn.Linear(2, 1))  # no GPU here: returned as is
        >>> type(net).__name__
        'Linear'
    """
    global _dp_warned
    _refuse_one_value(device_ids)
    if device_ids is not None and len(device_ids) == 0:
        raise ValueError(
            "device_ids must name at least one GPU, got []; pass None to use every visible GPU"
        )
    devices = None if device_ids is None else [_as_gpu(entry) for entry in device_ids]
    if not torch.cuda.is_available():
        if device_ids:
            raise ValueError(f"device_ids={list(device_ids)!r} given, but no CUDA GPU is visible")
        return model
    ids = _visible_indices(devices)
    if not _dp_warned:
        _dp_warned = True
        warnings.warn(
            "nn.DataParallel runs every GPU from one process; DistributedDataParallel is "
            "faster (trainperf.ddp.launch(main) with wrap_model(model) inside main)",
            stacklevel=2,
        )
    model.to(torch.device("cuda", ids[0]))
    return nn.DataParallel(model, device_ids=ids)


def _refuse_one_value(device_ids: object) -> None:
    """A string would be read one character per GPU (``"01"`` as GPUs 0 and 1), and a
    number or a device has no length: refused with the list to pass."""
    if not isinstance(device_ids, str | int | torch.device):
        return
    shown = f"[{device_ids!r}]"
    if isinstance(device_ids, bool):  # [True] is refused too: no GPU number
        shown = "a list of GPU numbers such as [0, 1]"
    elif isinstance(device_ids, str):
        parts = [part.strip() for part in device_ids.split(",")]
        if all(part.isascii() and part.isdigit() for part in parts):
            shown = f"[{', '.join(str(int(part)) for part in parts)}]"
    raise TypeError(
        f"device_ids must be a sequence of GPUs, got {device_ids!r} "
        f"({type(device_ids).__name__}): pass {shown}"
    )


def _as_gpu(entry: object) -> int | torch.device:
    """One ``device_ids`` entry, checked: a GPU number (digits too: ``"1"``, as from
    ``os.environ[...].split(",")``), or a CUDA device (maybe no index)."""
    if isinstance(entry, str) and entry.strip().isascii() and entry.strip().isdigit():
        return int(entry)
    if isinstance(entry, str | torch.device):
        try:
            device = torch.device(entry)
        except RuntimeError as e:
            raise ValueError(
                f"device_ids entry {entry!r} is not a device name: pass a GPU number (1), "
                "torch.device('cuda', 1) or 'cuda:1'"
            ) from e
        if device.type != "cuda":
            raise ValueError(
                f"device_ids must name CUDA GPUs, got {entry!r} (a {device.type} device); "
                "pass GPU numbers (0, 1) or 'cuda:N', or call the model directly to run "
                f"it on {device.type}"
            )
        return device
    if isinstance(entry, bool) or not isinstance(entry, SupportsIndex):
        # int() took 1.5 as GPU 1, and True as GPU 1.
        raise TypeError(
            "device_ids entries must be GPU numbers, torch.device('cuda', N) or 'cuda:N': "
            f"got {entry!r} ({type(entry).__name__})"
        )
    return operator.index(entry)


def _visible_indices(devices: list[int | torch.device] | None) -> list[int]:
    """The GPU numbers to use, each checked against the visible count."""
    count = torch.cuda.device_count()
    if devices is None:
        return list(range(count))
    ids = [_index(d) for d in devices]
    bad = [i for i in ids if not 0 <= i < count]
    if bad:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        numbering = (
            "CUDA_VISIBLE_DEVICES is unset: all of the machine's GPUs"
            if shown is None
            else f"CUDA_VISIBLE_DEVICES={shown!r} renumbers the cards it shows from cuda:0"
        )
        raise ValueError(
            f"device_ids {bad} are not visible GPUs: {count} visible, numbered "
            f"0..{count - 1} ({numbering}); pass numbers in 0..{count - 1}, or None for "
            "every visible GPU"
        )
    return ids


def _index(device: int | torch.device) -> int:
    """``"cuda"`` without an index is the current GPU, as nn.DataParallel reads it."""
    if isinstance(device, int):
        return device
    return torch.cuda.current_device() if device.index is None else device.index
