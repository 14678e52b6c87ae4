"""trainperf.pipelines._header: image sizes read from headers, and the pixel limit."""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import pytest

from tests.pipelines._images import bomb_jpeg
from trainperf.pipelines import MAX_IMAGE_PIXELS
from trainperf.pipelines._header import (
    bytes_problem,
    file_problem,
    image_size,
    pixel_problem,
    sniff_format,
)

PIL = pytest.importorskip("PIL.Image")


def _encoded(mode: str, fmt: str, size: tuple[int, int] = (53, 37), **save: Any) -> bytes:
    rng = np.random.default_rng(0)
    w, h = size
    if mode == "I;16":
        img = PIL.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    else:
        img = PIL.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    img.save(out, format=fmt, **save)
    return out.getvalue()


_CASES = [
    ("RGB", "JPEG", {}),
    ("RGB", "JPEG", {"progressive": True}),
    ("L", "JPEG", {}),
    ("CMYK", "JPEG", {}),
    # The frame header after 60 KB of EXIF and a 200 KB ICC profile (4 APP2 segments).
    ("RGB", "JPEG", {"exif": b"Exif\x00\x00" + bytes(60000), "icc_profile": bytes(200000)}),
    ("RGB", "PNG", {}),
    ("I;16", "PNG", {}),
    ("P", "PNG", {}),
    ("RGB", "BMP", {}),
    ("1", "BMP", {}),
    ("RGB", "TIFF", {}),
    ("RGB", "TIFF", {"compression": "tiff_lzw"}),
    ("I;16", "TIFF", {}),
    ("RGB", "WEBP", {}),
    ("RGB", "WEBP", {"lossless": True}),
    ("RGBA", "WEBP", {"exif": b"Exif\x00\x00" + bytes(16)}),  # VP8X, the extended format
]


@pytest.mark.parametrize(("mode", "fmt", "save"), _CASES)
def test_sizes_from_headers_agree_with_pil(mode: str, fmt: str, save: dict[str, Any]) -> None:
    data = _encoded(mode, fmt, **save)
    kind = sniff_format(data[:16])
    assert kind == fmt.lower()
    expected = PIL.open(io.BytesIO(data)).size
    assert expected == (53, 37)
    assert image_size(kind, data) == expected
    assert image_size(kind, io.BytesIO(data)) == expected  # an open file: the same parser
    assert bytes_problem(np.frombuffer(data, dtype=np.uint8), None) == (kind, None)


def test_webp_extended_header_is_the_one_read() -> None:
    data = _encoded("RGBA", "WEBP", exif=b"Exif\x00\x00" + bytes(16))
    assert data[12:16] == b"VP8X"


def test_big_endian_tiff_and_top_down_bmp() -> None:
    # A big-endian TIFF: header, then one directory with ImageWidth (LONG) and ImageLength
    # (SHORT), the two encodings of a size.
    entries = struct.pack(">HHII", 256, 4, 1, 70000) + struct.pack(">HHIHH", 257, 3, 1, 9, 0)
    tiff = b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 2) + entries
    assert image_size("tiff", tiff) == (70000, 9)
    bmp = bytearray(_encoded("RGB", "BMP"))
    bmp[22:26] = struct.pack("<i", -37)  # a negative height is a top-down bitmap
    assert image_size("bmp", bytes(bmp)) == (53, 37)
    assert PIL.open(io.BytesIO(bytes(bmp))).size == (53, 37)


def test_jpeg_stray_bytes_before_a_marker_are_skipped_as_libjpeg_does() -> None:
    data = _encoded("RGB", "JPEG")
    sof = data.index(b"\xff\xc0")
    odd = data[:sof] + b"\x00\x13\x37" + data[sof:]
    assert image_size("jpeg", odd) == (53, 37) == PIL.open(io.BytesIO(odd)).size


def test_a_header_only_bomb_is_refused_from_a_few_hundred_bytes() -> None:
    bomb = bomb_jpeg(30000, 30000)
    assert len(bomb) < 2048
    fmt, problem = file_problem(io.BytesIO(bomb), MAX_IMAGE_PIXELS)
    assert fmt == "jpeg"
    assert problem == (
        "has 30000x30000 = 900,000,000 pixels, over max_pixels=89,478,485 (a bomb guard)"
    )
    assert file_problem(io.BytesIO(bomb), None) == ("jpeg", None)  # no limit
    assert MAX_IMAGE_PIXELS == PIL.MAX_IMAGE_PIXELS == 89_478_485  # Pillow's default


def test_pixel_limit_rule() -> None:
    assert pixel_problem(100, 100, 10_000) is None  # at the limit: allowed
    assert pixel_problem(100, 101, 10_000) == (
        "has 100x101 = 10,100 pixels, over max_pixels=10,000 (a bomb guard)"
    )
    assert pixel_problem(65535, 65535, None) is None


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"", "empty file"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "is truncated: its header ends before the image size"),
        (b"\xff\xd8\xff\xda\x00\x02", "is not a valid JPEG: no frame header before its image data"),
        (
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\x04IDAT" + bytes(8),
            "is not a valid PNG: its first chunk is b'IDAT', not b'IHDR'",
        ),
        (b"BM" + bytes(14), "is truncated: its header ends before the image size"),
        (
            b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 0),
            "is a TIFF without its image size",
        ),
        (
            b"RIFF" + bytes(4) + b"WEBPVP8 " + bytes(14),
            "is not a valid WebP: no key frame in its VP8 chunk",
        ),
    ],
)
def test_broken_headers_are_named(data: bytes, problem: str) -> None:
    assert bytes_problem(data, MAX_IMAGE_PIXELS)[1] == problem


def test_an_image_of_no_pixels_is_refused() -> None:
    assert bytes_problem(bomb_jpeg(0, 8), None)[1] == "has no pixels: its header says 0x8"


def test_a_jpeg_of_endless_segments_is_given_up_on() -> None:
    # 70,000 empty APP0 segments: a walk that does not stop would take seconds per file.
    data = b"\xff\xd8" + b"\xff\xe0\x00\x02" * 70000
    assert "no frame header in its first 65536 segments" in (bytes_problem(data, None)[1] or "")


@pytest.mark.parametrize("order", [b"II+\x00", b"MM\x00+"])
def test_a_bigtiff_is_named_as_such_with_the_fix(order: bytes) -> None:
    big = _encoded("RGB", "TIFF", big_tiff=True)
    assert big[:4] == b"II+\x00"
    fmt, problem = bytes_problem(order + big[4:], None)
    assert fmt is None
    assert problem == "BigTIFF is not supported; convert it to a classic TIFF"
