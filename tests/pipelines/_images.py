"""Shared by the pipelines tests: a generated folder of real image files, and loaders over it.

The folder: two classes, red-ish (class "a_red") and blue-ish ("b_blue") JPEGs of 60-140 px,
plus a grayscale JPEG, a CMYK JPEG and a PNG. Every CPU-capable backend runs over it: the
torchvision backend, DALI in its CPU-only mode, and the nvjpeg backend's own code with the CPU
standing in for the GPU (``tests/pipelines/test_nvjpeg.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainperf.pipelines import IMAGENET_MEAN, IMAGENET_STD, ImageLoader, image_loader
from trainperf.pipelines._loader import _dali_importable

# CI sets TRAINPERF_REQUIRE_DALI=1 (.ci/run): there the DALI tests run, and fail, when the
# 'dali' extra did not install or does not import, instead of skipping quietly.
REQUIRE_DALI = os.environ.get("TRAINPERF_REQUIRE_DALI") == "1"
needs_dali = pytest.mark.skipif(
    not REQUIRE_DALI and not _dali_importable(),
    reason="needs nvidia-dali (TRAINPERF_REQUIRE_DALI=1 turns this skip into a failure)",
)
requires_cuda = pytest.mark.requires_cuda

SIZE = 32
RED, BLUE = (200, 50, 40), (40, 50, 200)
NO_TUNING = {"num_workers": 0}
CPU_BACKENDS = [
    pytest.param("torchvision", id="torchvision"),
    pytest.param("dali", id="dali", marks=needs_dali),
]


# --------------------------------------------------------------------------- the image folder


def _picture(w: int, h: int, colour: tuple[int, int, int], rng: np.random.Generator) -> Any:
    """A smooth colour field with texture: natural enough for resampling to matter."""
    from PIL import Image, ImageFilter

    y, x = np.mgrid[0:h, 0:w]
    wave = 25 * np.sin(x / max(w, 1) * 6 + rng.uniform(0, 6)) + 20 * np.cos(y / max(h, 1) * 5)
    pixels = np.array(colour, dtype=np.float64)[None, None, :] + wave[..., None]
    pixels += rng.normal(0, 12, size=(h, w, 3))
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return img.filter(ImageFilter.GaussianBlur(1.0))


def _write_folder(root: Path, per_class: int = 10, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for name, colour in (("a_red", RED), ("b_blue", BLUE)):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            w, h = (int(v) for v in rng.integers(60, 141, size=2))
            _picture(w, h, colour, rng).save(root / name / f"{i:02d}.jpg", quality=90)
    _picture(90, 70, (128, 128, 128), rng).convert("L").save(root / "a_red" / "gray.jpg")
    _picture(100, 80, RED, rng).convert("CMYK").save(root / "a_red" / "cmyk.jpg")
    _picture(80, 100, BLUE, rng).save(root / "b_blue" / "png_among_jpegs.png")
    (root / "b_blue" / "notes.txt").write_text("not an image suffix: ignored, like ImageFolder")
    return root


# Above every image of `folder` (at most 140 x 140 = 19,600 pixels), below BIG.
SMALL_LIMIT = 20_000
BIG = (300, 200)  # a real image of 60,000 pixels: over SMALL_LIMIT, cheap to decode


def big_image(path: Path) -> None:
    """A real image of ``BIG`` pixels (JPEG or PNG by suffix): over ``SMALL_LIMIT``."""
    from PIL import Image

    Image.new("RGB", BIG, (200, 60, 50)).save(path)


def bomb_jpeg(width: int = 30000, height: int = 30000) -> bytes:
    """A decompression bomb: a real 8 x 8 JPEG of a few hundred bytes whose frame header claims
    ``width x height`` pixels (30000 x 30000: a 2.7 GB RGB image for a decoder)."""
    import io
    import struct

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (90, 120, 150)).save(out, format="JPEG")
    data = bytearray(out.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def write_tiff(path: Path, kind: str) -> Path:
    """A 48 x 32 TIFF that DALI's own decoder reads unlike PIL (and so unlike ImageFolder):
    ``"turned"`` (Orientation 6) or ``"mirrored"`` (2) by its tag, which PIL applies,
    ``"grey_alpha"`` (DALI takes the alpha for green), ``"premultiplied"`` (RGBA with
    associated alpha, which PIL undoes and DALI does not) or ``"lab"`` (DALI takes it for RGB)."""
    import struct

    from PIL import Image

    picture = _picture(48, 32, (200, 60, 40), np.random.default_rng(1))
    if kind in ("turned", "mirrored"):
        exif = Image.Exif()
        exif[0x0112] = 6 if kind == "turned" else 2
        picture.save(path, exif=exif)
    elif kind == "premultiplied":  # PIL writes unassociated alpha: mark it associated
        alpha = Image.linear_gradient("L").resize(picture.size).point(lambda v: 40 + v * 3 // 4)
        picture.putalpha(alpha)
        picture.save(path)
        data = bytearray(path.read_bytes())
        ifd = struct.unpack_from("<I", data, 4)[0]
        count = struct.unpack_from("<H", data, ifd)[0]
        tags = [struct.unpack_from("<H", data, ifd + 2 + 12 * i)[0] for i in range(count)]
        extra = ifd + 2 + 12 * tags.index(338)  # ExtraSamples: 2 (unassociated) -> 1
        data[extra + 8 : extra + 10] = struct.pack("<H", 1)
        path.write_bytes(bytes(data))
    else:
        picture.convert("LA" if kind == "grey_alpha" else "LAB").save(path)
    return path


def _loader(source: Any, backend: str, **kw: Any) -> ImageLoader:
    kw.setdefault("size", SIZE)
    kw.setdefault("device", "cpu")
    kw.setdefault("num_threads", 2)
    kw.setdefault("shard", None)
    if backend == "torchvision":
        kw.setdefault("loader_kwargs", NO_TUNING)
    return image_loader(source, kw.pop("batch_size", 5), backend=backend, **kw)  # type: ignore[arg-type]


def _epoch(loader: ImageLoader) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return list(loader.iter_with_indices())


def _indices(loader: ImageLoader) -> list[int]:
    return [i for _, _, idx in loader.iter_with_indices() for i in idx.tolist()]


def _pixels(images: torch.Tensor) -> torch.Tensor:
    """Back from normalised to 0..1 pixel units."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return images * std + mean


def _reference_eval(path: str, size: int) -> torch.Tensor:
    import torchvision.transforms as T
    from PIL import Image

    transform = T.Compose(
        [
            T.Resize(int(size / 0.875)),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    with Image.open(path) as im:
        out: torch.Tensor = transform(im.convert("RGB"))
    return out


# What macOS leaves in a folder it copies or zips: AppleDouble files (metadata, not images,
# named like the image they describe), .DS_Store, and the zip's __MACOSX/ folder of them.
_APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)


def add_macos_litter(root: Path, where: str) -> None:
    """Put macOS's litter, and other hidden files and folders, into the image folder ``root``
    (two or more classes): at its top (``"root"``: hidden and ``__MACOSX`` folders that would
    be classes), in its class folders (``"class"``: ``._<image>`` and ``.DS_Store`` beside the
    images) or in a folder below a class (``"subfolder"``: hidden and ``__MACOSX`` folders
    holding files with image suffixes, real images among them)."""
    from PIL import Image

    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if where == "root":
        for name in ("__MACOSX", ".ipynb_checkpoints", ".Trashes"):
            (root / name / classes[0].name).mkdir(parents=True)
            (root / name / classes[0].name / "._00.jpg").write_bytes(_APPLE_DOUBLE)
            Image.new("RGB", (8, 8)).save(root / name / "real.png")
        (root / ".DS_Store").write_bytes(bytes(16))
    elif where == "class":
        for folder in classes:
            for image in sorted(folder.iterdir()):
                (folder / f"._{image.name}").write_bytes(_APPLE_DOUBLE)
            (folder / ".DS_Store").write_bytes(bytes(16))
            Image.new("RGB", (8, 8)).save(folder / ".hidden.png")
    else:
        for name in ("__MACOSX", ".thumbnails"):
            sub = classes[-1] / name
            sub.mkdir()
            (sub / "._00.jpg").write_bytes(_APPLE_DOUBLE)
            Image.new("RGB", (8, 8)).save(sub / "thumb.jpg")
            (sub / ".nested").mkdir()
            Image.new("RGB", (8, 8)).save(sub / ".nested" / "x.jpg")
