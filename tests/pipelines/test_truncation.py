"""trainperf.pipelines._truncation: truncated files found from their structure."""

from __future__ import annotations

import io
import struct
import zlib

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
    # len - 17: inside the last IDAT's data (before its CRC and the 12-byte IEND), inside a
    # BMP's last row of pixels (its 2 bytes of padding are not needed), or a JPEG's scan.
    for cut in (len(data) // 2, len(data) - 17):
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
    # 30 pixels of 24 bits: rows of 90 bytes and 2 of padding, not needed after the last row
    assert truncation("bmp", io.BytesIO(data[:-3])) == (
        f"is truncated: {len(data) - 3:,} bytes, but its header announces {len(data) - 2:,}"
    )


def _pillow_decodes(data: bytes) -> bool:
    """Whether Pillow, as set by default, decodes ``data`` to the pixels of the whole file."""
    try:
        with PIL.open(io.BytesIO(data)) as im:
            im.load()
    except OSError:
        return False
    return True


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunks.append((kind, data[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return chunks


def _png_with_two_idats() -> tuple[bytes, int]:
    """A PNG whose compressed stream is split over two IDAT chunks, and where the first ends."""
    out, cut = bytearray(_encoded("PNG")[:8]), 0
    for kind, body in _png_chunks(_encoded("PNG")):
        parts = [body[: len(body) // 2], body[len(body) // 2 :]] if kind == b"IDAT" else [body]
        for part in parts:
            out += struct.pack(">I4s", len(part), kind) + part
            out += struct.pack(">I", zlib.crc32(kind + part))
            cut = len(out) if kind == b"IDAT" and cut == 0 else cut
    return bytes(out), cut


def test_a_png_that_stops_after_its_image_data_is_whole_as_pillow_decodes_it() -> None:
    # The walk had to reach IEND: a file cut just before it, which Pillow decodes to every
    # pixel, was left out by on_error="skip".
    data = _encoded("PNG")
    assert _pillow_decodes(data[:-12]) and truncation("png", io.BytesIO(data[:-12])) is None
    assert truncation("png", io.BytesIO(data[:-5])) is None  # IEND itself cut
    assert truncation("png", io.BytesIO(data[:-16])) == (  # the last IDAT's CRC missing
        "is truncated: it ends inside its image data (an IDAT chunk)"
    )


def test_a_png_cut_between_two_idat_chunks_is_truncated() -> None:
    data, cut = _png_with_two_idats()
    assert truncation("png", io.BytesIO(data)) is None
    assert not _pillow_decodes(data[:cut])
    assert (
        truncation("png", io.BytesIO(data[:cut])) == "is truncated: it ends before its IEND chunk"
    )
    assert _pillow_decodes(data[:-12]) and truncation("png", io.BytesIO(data[:-12])) is None


def _top_down(bmp: bytes, width: int, height: int, bits: int) -> bytes:
    """``bmp`` (bottom-up) rewritten top-down: negative height, rows in the other order."""
    offset = struct.unpack("<I", bmp[10:14])[0]
    stride = (width * bits + 31) // 32 * 4
    rows = [bmp[offset + i * stride : offset + (i + 1) * stride] for i in range(height)]
    head = bmp[:22] + struct.pack("<i", -height) + bmp[26:offset]
    return head + b"".join(reversed(rows))


@pytest.mark.parametrize("top_down", [False, True], ids=["bottom-up", "top-down"])
@pytest.mark.parametrize(
    ("mode", "bits", "width"), [("RGB", 24, 5), ("RGB", 24, 7), ("L", 8, 6), ("1", 1, 9)]
)
def test_a_bmp_without_its_last_rows_padding_is_whole_as_pillow_decodes_it(
    mode: str, bits: int, width: int, top_down: bool
) -> None:
    # The whole padded last row was required: a file without its 1-3 padding bytes, which
    # Pillow decodes to the same pixels, was left out by on_error="skip".
    out = io.BytesIO()
    PIL.new(mode, (width, 3), 1).save(out, format="BMP")
    data = _top_down(out.getvalue(), width, 3, bits) if top_down else out.getvalue()
    pad = (width * bits + 31) // 32 * 4 - (width * bits + 7) // 8
    assert pad > 0
    for cut in range(pad + 2):
        cut_data = data[: len(data) - cut]
        whole = truncation("bmp", io.BytesIO(cut_data)) is None
        assert whole == (cut <= pad) == _pillow_decodes(cut_data), cut
