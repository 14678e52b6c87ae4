"""Decoded pixels to 8-bit RGB the same way in every backend, 16-bit images included.

A 16-bit image (a greyscale PNG or TIFF) holds levels 0..65535. PIL's ``convert("RGB")``
clips them to 255, so most of such an image comes out white, and ``torchvision.io`` returns
them as ``uint16``, which the 8-bit arithmetic downstream does not expect. Here they are
scaled as DALI scales them: ``round(value * 255 / 65535)`` (30000 becomes 117).

PIL reads 16-bit colour PNGs as 8-bit ``"RGB"`` itself, keeping each sample's high byte
(``value >> 8``): within one level of the rounded scale. The nvjpeg backend's
``torchvision.io`` path gets the full 16 bits and rounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = ["SIXTEEN_BIT_MODES", "pil_failure", "pil_to_rgb", "to_uint8"]

# PIL's modes of 16-bit greyscale (little, big and native endian).
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
_MAX16 = 65535


def _scale16(levels: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # value * 255 / 65535 is never exactly half a level (65535 is odd), so adding just under
    # half of 65535 before the floor division rounds to nearest.
    wide = np.clip(levels.astype(np.int64), 0, _MAX16)
    scaled: np.ndarray[Any, Any] = ((wide * 255 + _MAX16 // 2) // _MAX16).astype(np.uint8)
    return scaled


def pil_to_rgb(im: Image) -> Image:
    """``im`` as 8-bit RGB: ``im.convert("RGB")``, with 16-bit greyscale scaled, not clipped,
    and floating-point greyscale (mode ``"F"``) taken as 0..1 (``round(v * 255)``, clipped).

    Mode ``"I"`` (32-bit integers) is treated as 16-bit only when it comes from a PNG, which
    has no deeper greyscale (older Pillows open 16-bit PNGs as ``"I"``); other ``"I"``
    images keep PIL's conversion.

    Example:
        >>> from PIL import Image
        >>> grey16 = Image.frombytes("I;16", (1, 1), (30000).to_bytes(2, "little"))
        >>> pil_to_rgb(grey16).getpixel((0, 0))
        (117, 117, 117)
    """
    from PIL import Image as PILImage

    if im.mode in SIXTEEN_BIT_MODES or (im.mode == "I" and im.format == "PNG"):
        grey = PILImage.fromarray(_scale16(np.asarray(im)), mode="L")
        return grey.convert("RGB")
    if im.mode == "F":  # floating point (TIFF): 0..1 to 0..255, as DALI decodes it
        scaled = np.clip(np.rint(np.asarray(im, dtype=np.float64) * 255.0), 0, 255)
        return PILImage.fromarray(scaled.astype(np.uint8), mode="L").convert("RGB")
    return im.convert("RGB")


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """A ``uint16`` tensor scaled to ``uint8`` (``round(v * 255 / 65535)``); others as they are.

    Example:
        >>> to_uint8(torch.tensor([0, 30000, 65535], dtype=torch.uint16)).tolist()
        [0, 117, 255]
    """
    if pixels.dtype != torch.uint16:
        return pixels
    wide = pixels.to(torch.int32)
    return torch.div(wide * 255 + _MAX16 // 2, _MAX16, rounding_mode="floor").to(torch.uint8)


def pil_failure(error: BaseException) -> str:
    """A PIL decode error for a message: Pillow's own pixel limit is named, with its fix.

    Pillow refuses, in ``Image.open``, images over twice ``PIL.Image.MAX_IMAGE_PIXELS`` (a
    global, 89,478,485 by default), whatever ``max_pixels`` allows: only an image that
    ``max_pixels`` lets through and Pillow's limit does not can meet this.

    Example:
        >>> from PIL import Image
        >>> pil_failure(OSError("image file is truncated"))
        'OSError: image file is truncated'
        >>> "PIL.Image.MAX_IMAGE_PIXELS" in pil_failure(Image.DecompressionBombError("big"))
        True
    """
    from PIL import Image as PILImage

    said = f"{type(error).__name__}: {error}"
    if isinstance(error, PILImage.DecompressionBombError):
        return (
            f"{said}; Pillow, which decodes this file, also obeys its own limit, "
            f"PIL.Image.MAX_IMAGE_PIXELS (now {PILImage.MAX_IMAGE_PIXELS}): raise it along "
            "with max_pixels (None: no limit)"
        )
    return said
