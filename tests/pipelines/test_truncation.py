"""trainperf.pipelines._truncation: truncated files found from their structure."""

from __future__ import annotations

import io

import numpy as np
import pytest

import trainperf.pipelines._truncation as truncation_module
from trainperf.pipelines._truncation import truncation

PIL = pytest.importorskip("PIL.Image")


def _encoded(fmt: str, **save: object) -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.fromarray(pixels).save(out, format=fmt, **save)
    return out.getvalue()


def _exif_with_thumbnail() -> bytes:
    """A JPEG whose APP1 (EXIF) segment holds a whole thumbnail JPEG, end marker and all."""
    thumb = _encoded("JPEG")
    exif = PIL.Exif()
    exif[0x010E] = "has a thumbnail"
    app1 = b"Exif\x00\x00" + bytes(exif.tobytes()) + thumb
    segment = b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1
    main = _encoded("JPEG")
    return main[:2] + segment + main[2:]


@pytest.mark.parametrize("fmt", ["jpeg", "png", "bmp"])
def test_whole_files_pass_and_cut_ones_are_named(fmt: str) -> None:
    data = _encoded(fmt.upper())
    assert truncation(fmt, io.BytesIO(data)) is None  # type: ignore[arg-type]
    for cut in (len(data) // 2, len(data) - 5):
        reason = truncation(fmt, io.BytesIO(data[:cut]))  # type: ignore[arg-type]
        assert reason is not None and reason.startswith("is truncated")


def test_a_thumbnails_end_marker_does_not_make_a_cut_jpeg_whole() -> None:
    data = _exif_with_thumbnail()
    assert truncation("jpeg", io.BytesIO(data)) is None
    assert truncation("jpeg", io.BytesIO(data[:-100])) == (
        "is truncated: its image data ends without the JPEG end-of-image marker"
    )
    assert (
        truncation("jpeg", io.BytesIO(data[:40])) == "is truncated: it ends before its image data"
    )


def test_an_end_marker_split_across_read_blocks_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encoded("JPEG") + b"trailer"
    monkeypatch.setattr(truncation_module, "_CHUNK", 7)  # every split of FF D9 comes up
    for pad in range(7):
        assert truncation("jpeg", io.BytesIO(data + b"\x00" * pad)) is None


def test_formats_left_to_the_decoder_are_not_judged() -> None:
    assert truncation("tiff", io.BytesIO(b"II*\x00")) is None
    assert truncation("webp", io.BytesIO(b"RIFF")) is None


def test_a_bmp_cut_inside_its_header_or_rows_says_so() -> None:
    data = _encoded("BMP")
    assert truncation("bmp", io.BytesIO(data[:20])) == "is truncated: it ends inside its header"
    assert truncation("bmp", io.BytesIO(data[:-1])) == (
        f"is truncated: {len(data) - 1:,} bytes, but its header announces {len(data):,}"
    )
