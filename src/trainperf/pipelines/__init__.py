"""Image input pipelines that keep JPEG decoding off the Python workers.

One function, :func:`image_loader`, returns an iterable of ``(images, labels)`` batches (the
contract of a torchvision DataLoader) from one of three backends:

- ``"dali"``: NVIDIA DALI (``pip install 'trainperf[dali]'``) decodes and augments in C++
  threads, or with nvJPEG on the GPU;
- ``"nvjpeg"``: CPU threads read bytes, ``torchvision.io.decode_jpeg`` decodes whole batches on
  the GPU, and the augmentation runs there too;
- ``"torchvision"``: PIL and torchvision transforms in an autotuned DataLoader, the fallback
  everywhere.

Nothing here imports DALI or torchvision until a loader is built.
"""

from __future__ import annotations

from trainperf._utils.public import set_public_module
from trainperf.pipelines._base import ImageLoader, LoaderConfig
from trainperf.pipelines._loader import IMAGENET_MEAN, IMAGENET_STD, MAX_IMAGE_PIXELS, image_loader
from trainperf.pipelines._source import BadFile, Shard

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MAX_IMAGE_PIXELS",
    "BadFile",
    "ImageLoader",
    "LoaderConfig",
    "Shard",
    "image_loader",
]

set_public_module(globals(), __all__, __name__)
