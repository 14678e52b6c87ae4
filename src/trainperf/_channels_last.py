"""channels_last for :class:`trainperf.amp.MixedPrecision`: when to convert, and converting batches.

channels_last (NHWC) lets convolutions run on tensor cores without layout transposes; it helps
convolutional models only, so "auto" looks at where a model's parameters are.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal, TypeVar

import torch
from torch import nn

__all__ = [
    "CONV_SHARE_FOR_CHANNELS_LAST",
    "channels_last_decision",
    "conv_share",
    "to_channels_last",
]

T = TypeVar("T")

# channels_last="auto" converts a model only when at least this share of its parameters sits
# in 2-D convolutions and their batch norms: ResNets are ~95 %, a ViT-B/16 (whose only
# convolution is the patch embedding) ~0.7 %, and channels_last does not help a ViT.
CONV_SHARE_FOR_CHANNELS_LAST = 0.5


def conv_share(model: nn.Module) -> float:
    """The share of ``model``'s parameters held by 2-D convolutions and 2-D batch norms."""
    seen: set[int] = set()
    total = conv = 0
    for module in model.modules():
        is_conv = isinstance(module, (nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d))
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if is_conv:
                conv += p.numel()
    return conv / total if total else 0.0


def channels_last_decision(
    model: nn.Module,
    setting: bool | Literal["auto"],
    *,
    device: torch.device,
    tensor_cores: bool,
) -> tuple[bool, str]:
    """Whether to convert ``model`` to channels_last, and why (pure: touches no device)."""
    if setting is True:
        return True, "channels_last: requested"
    if setting is False:
        return False, "channels_last: off (requested)"
    if device.type != "cuda":
        return False, f"channels_last: not on {device.type} ('auto' converts on CUDA only)"
    share = conv_share(model)
    if share < CONV_SHARE_FOR_CHANNELS_LAST:
        return False, (
            f"channels_last: no, {share:.0%} of parameters in Conv2d/BatchNorm2d "
            f"(< {CONV_SHARE_FOR_CHANNELS_LAST:.0%}: not a convolutional model)"
        )
    if not tensor_cores:
        return False, "channels_last: no, no tensor cores in use (fp32 without TF32, or < 7.0)"
    return True, f"channels_last: yes, {share:.0%} of parameters in Conv2d/BatchNorm2d"


def to_channels_last(obj: T) -> T:
    """4-D floating tensors inside dicts, lists, tuples and namedtuples -> channels_last."""
    out: Any
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 4 and obj.is_floating_point():
            out = obj.contiguous(memory_format=torch.channels_last)
            return out  # type: ignore[no-any-return]
        return obj
    if isinstance(obj, tuple):
        items = [to_channels_last(v) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return out  # type: ignore[no-any-return]
    if isinstance(obj, list):
        return [to_channels_last(v) for v in obj]  # type: ignore[return-value]
    if isinstance(obj, MutableMapping):
        new = copy.copy(obj)  # keeps the subclass and its state (defaultdict's factory)
        for key, value in obj.items():
            new[key] = to_channels_last(value)
        return new
    if isinstance(obj, Mapping):
        return {k: to_channels_last(v) for k, v in obj.items()}  # type: ignore[return-value]
    return obj
