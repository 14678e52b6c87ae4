"""channels_last for :class:`trainperf.amp.MixedPrecision`: when to convert, and converting batches.

channels_last (NHWC) lets convolutions run on tensor cores without layout transposes; it helps
models that convolve over feature maps, so "auto" looks for such convolutions. It is a 4-D
memory format: 5-D weights and inputs (``Conv3d``, video) keep their layout.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import torch
from torch import nn

from trainperf._utils.format import plural

__all__ = [
    "channels_last_decision",
    "conv_share",
    "feature_map_convs",
    "is_patch_embedding",
    "model_to_channels_last",
]

M = TypeVar("M", bound=nn.Module)


def is_patch_embedding(conv: nn.Conv2d | nn.ConvTranspose2d) -> bool:
    """Whether ``conv`` cuts its input into non-overlapping patches (kernel == stride > 1x1).

    A ViT's ``conv_proj`` (16x16, stride 16) or a Swin's stem (4x4, stride 4): in effect one
    matmul per patch, not a convolution over feature maps.
    """
    return (
        conv.kernel_size == conv.stride
        and any(k > 1 for k in conv.kernel_size)
        and all(d == 1 for d in conv.dilation)
    )


def feature_map_convs(model: nn.Module) -> tuple[int, int]:
    """``(convolutions over feature maps, patch embeddings)`` among ``model``'s 2-D convolutions.

    Every ``Conv2d``/``ConvTranspose2d`` that is not a patch embedding (see
    :func:`is_patch_embedding`) counts as a convolution over feature maps; a shared module is
    counted once.
    """
    convs = patches = 0
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
            if is_patch_embedding(module):
                patches += 1
            else:
                convs += 1
    return convs, patches


def conv_share(model: nn.Module) -> float:
    """The share of ``model``'s parameters held by 2-D convolutions and 2-D batch norms.

    Reported as extra information only: it is no guide to compute (VGG-16's convolutions hold
    ~11 % of its parameters and nearly all of its FLOPs).
    """
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
    """Whether to convert ``model`` to channels_last, and why (pure: touches no device).

    "auto" converts on CUDA, when tensor cores are in use, a model with at least one 2-D
    convolution over feature maps (a patch embedding alone, as in a ViT, does not count).
    """
    if setting is True:
        return True, "channels_last: requested"
    if setting is False:
        return False, "channels_last: off (requested)"
    if device.type != "cuda":
        return False, f"channels_last: not on {device.type} ('auto' converts on CUDA only)"
    convs, patches = feature_map_convs(model)
    if not convs:
        others = _other_convs(model)
        if others:
            return False, (
                f"channels_last: no, no 2-D convolution over feature maps, only {others}: "
                "channels_last is a layout of 4-D tensors"
            )
        only = f", only {plural(patches, 'patch embedding')}" if patches else ""
        return False, (
            f"channels_last: no, no 2-D convolution over feature maps{only}: "
            "not a convolutional model"
        )
    if not tensor_cores:
        return False, "channels_last: no, no tensor cores in use (fp32 without TF32, or < 7.0)"
    return True, (
        f"channels_last: yes, {plural(convs, '2-D convolution')} over feature maps "
        f"({conv_share(model):.0%} of parameters in Conv2d/BatchNorm2d)"
    )


_OTHER_CONVS = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose3d)


def _other_convs(model: nn.Module) -> str:
    """``model``'s 1-D and 3-D convolutions, counted by class ("2 Conv3d"), "" without any.

    Example:
        >>> _other_convs(torch.nn.Sequential(torch.nn.Conv3d(3, 8, 3), torch.nn.Conv1d(3, 8, 3)))
        '1 Conv3d, 1 Conv1d'
    """
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, _OTHER_CONVS):
            name = type(module).__name__
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def model_to_channels_last(model: M) -> M:
    """``model``'s 4-D parameters and buffers -> channels_last, in place; others keep their layout.

    ``model.to(memory_format=torch.channels_last)`` also converts 5-D tensors and fails on them
    ("required rank 4 tensor to use channels_last format"), so a model with a ``Conv3d``
    could not be converted at all; here its 5-D weights stay as they are (NCDHW).

    Example:
        >>> model = model_to_channels_last(torch.nn.Sequential(
        ...     torch.nn.Conv2d(3, 8, 3), torch.nn.Conv3d(8, 8, 3)))
        >>> model[0].weight.is_contiguous(memory_format=torch.channels_last)
        True
        >>> model[1].weight.is_contiguous()
        True
    """

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t

    # Module.to's own machinery (parameters, their gradients, buffers), with this conversion.
    model._apply(convert)  # type: ignore[no-untyped-call]
    return model
