"""Crop, resize, flip and normalise on tensors, on whatever device they live on.

The nvjpeg backend runs these on the GPU after decoding there; the torchvision backend uses
:func:`normalize` on whole batches. They are plain tensor code, so the CPU tests exercise
the very functions the GPU runs.

Every backend draws an image's crop box and flip with :func:`train_params`, from a generator
seeded with ``(seed, epoch, index)`` (:func:`sample_seed`): the same image in the same epoch
gets the same augmentation in every backend, however many workers or threads run, and when
an epoch is run again or resumed on a new loader.

The geometry follows torchvision: :func:`sample_crop_box` is
``RandomResizedCrop.get_params`` drawing from a seeded ``random.Random`` instead of torch's
global generator, and :func:`eval_geometry` reproduces ``Resize(int(size / 0.875))`` (shorter
side, the longer one truncated) followed by ``CenterCrop(size)`` (offsets rounded half to even,
as Python's ``round`` does).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "CROP_RATIO",
    "center_resize_crop",
    "eval_geometry",
    "normalize",
    "random_flip",
    "resized_crop",
    "sample_crop_box",
    "sample_seed",
    "train_params",
]

# Eval images are resized so that the centre crop keeps 87.5 % of the shorter side (224/256),
# the ImageNet convention.
CROP_RATIO = 0.875


def sample_crop_box(
    height: int,
    width: int,
    rng: random.Random,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """A random ``(top, left, crop_height, crop_width)``, as ``RandomResizedCrop`` picks it.

    Ten tries at an area fraction in ``scale`` and an aspect ratio (log-uniform) in
    ``ratio``; if none fits, the largest centred crop whose ratio is within bounds.

    Example:
        >>> top, left, h, w = sample_crop_box(375, 500, random.Random(0))
        >>> 0 <= top <= 375 - h and 0 <= left <= 500 - w
        True
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def _pair(a: int, b: int) -> int:
    """Cantor's pairing: one distinct number for every pair of numbers >= 0."""
    return (a + b) * (a + b + 1) // 2 + b


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one image's augmentation in one epoch: distinct for every
    ``(seed, epoch, index)``, however many images (``random.Random`` takes any int).

    Example:
        >>> sample_seed(0, 1, 2) != sample_seed(0, 2, 1)
        True
        >>> sample_seed(0, 0, 1_000_003) != sample_seed(0, 1, 0)
        True
    """
    return _pair(_pair(seed, epoch), index)


def train_params(
    seed: int, epoch: int, index: int, height: int, width: int
) -> tuple[tuple[int, int, int, int], bool]:
    """The training crop box ``(top, left, h, w)`` and flip of image ``index`` (``height x
    width``) in ``epoch``: a function of its arguments alone, the same in every backend.

    Example:
        >>> train_params(0, 3, 7, 375, 500) == train_params(0, 3, 7, 375, 500)
        True
        >>> box, flip = train_params(0, 0, 0, 375, 500)
        >>> box[0] + box[2] <= 375 and box[1] + box[3] <= 500 and isinstance(flip, bool)
        True
    """
    rng = random.Random(sample_seed(seed, epoch, index))
    box = sample_crop_box(height, width, rng)
    return box, rng.random() < 0.5


def eval_geometry(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """``(resized_height, resized_width, top, left)`` of the eval resize and centre crop.

    Example:
        >>> eval_geometry(375, 500, 224)
        (256, 341, 16, 58)
    """
    short = int(size / CROP_RATIO)
    if height <= width:
        new_h, new_w = short, int(short * width / height)
    else:
        new_h, new_w = int(short * height / width), short
    top = round((new_h - size) / 2.0)
    left = round((new_w - size) / 2.0)
    return new_h, new_w, top, left


def _resize(img: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    x = img.unsqueeze(0).float()
    if x.shape[-2:] != (out_h, out_w):
        x = F.interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True)
    return x[0]


def resized_crop(img: torch.Tensor, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    """Crop ``box`` out of a ``[C, H, W]`` image and resize it to ``size x size``.

    Bilinear with antialiasing, in float: the result is float in the input's range.

    Example:
        >>> img = torch.arange(16, dtype=torch.uint8).reshape(1, 4, 4)
        >>> resized_crop(img, (1, 1, 2, 2), 2).tolist()
        [[[5.0, 6.0], [9.0, 10.0]]]
    """
    top, left, h, w = box
    return _resize(img[:, top : top + h, left : left + w], size, size)


def center_resize_crop(img: torch.Tensor, size: int) -> torch.Tensor:
    """The eval transform's geometry on a ``[C, H, W]`` uint8 image: float ``[C, size, size]``.

    Rounded to whole values, as torchvision's resize of a PIL or uint8 image is.

    Example:
        >>> center_resize_crop(torch.full((3, 60, 80), 7, dtype=torch.uint8), 32).shape
        torch.Size([3, 32, 32])
    """
    new_h, new_w, top, left = eval_geometry(img.shape[-2], img.shape[-1], size)
    out = _resize(img, new_h, new_w)[:, top : top + size, left : left + size]
    return out.round_().clamp_(0, 255)


def random_flip(batch: torch.Tensor, flips: Sequence[bool]) -> torch.Tensor:
    """Mirror the images of ``[N, C, H, W]`` whose entry in ``flips`` is True.

    Example:
        >>> random_flip(torch.tensor([[[[1, 2]]], [[[3, 4]]]]), [True, False]).flatten().tolist()
        [2, 1, 3, 4]
    """
    if not any(flips):
        return batch
    mask = torch.tensor(list(flips), dtype=torch.bool).to(batch.device, non_blocking=True)
    return torch.where(mask.view(-1, 1, 1, 1), batch.flip(-1), batch)


def normalize(batch: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Pixels in 0..255 to ``(x / 255 - mean) / std`` in float32, per channel.

    The same operations, in the same order, as torchvision's ``ToTensor`` then
    ``Normalize``, so the results agree bit for bit.

    Example:
        >>> white = torch.full((1, 3, 1, 1), 255, dtype=torch.uint8)
        >>> normalize(white, [0.5] * 3, [0.5] * 3).flatten().tolist()
        [1.0, 1.0, 1.0]
    """
    m = torch.tensor(mean, dtype=torch.float32).to(batch.device, non_blocking=True)
    s = torch.tensor(std, dtype=torch.float32).to(batch.device, non_blocking=True)
    x = batch.to(torch.float32).div_(255) if batch.dtype == torch.uint8 else batch.div(255)
    return x.sub_(m.view(1, -1, 1, 1)).div_(s.view(1, -1, 1, 1))
