"""trainperf.pipelines._truncation: truncated files found from their structure."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize("fmt", ["jpeg", "png", "bmp", "tiff"])
def test_whole_files_pass_and_cut_ones_are_named(fmt: str) -> None:
    data = _encoded(fmt.upper())
    assert truncation(fmt, io.BytesIO(data)) is None  # type: ignore[arg-type]
    # len - 17: inside the last IDAT's data (before its CRC and the 12-byte IEND), inside a
    # BMP's last row of pixels (its 2 bytes of padding are not needed), a JPEG's scan, or an
    # uncompressed TIFF's strip (Pillow writes its directory first, its pixels last).
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


def _tiff(
    pixels: np.ndarray[Any, Any],
    *,
    order: str = "<",
    rows: int = 0,
    tile: int = 0,
    deflate: bool = False,
    overstate: int = 0,
) -> bytes:
    """A greyscale TIFF with its directory first and its pixels last, as cameras, scanners
    and Pillow's uncompressed writer lay it out (a cut file keeps its directory): ``rows`` per
    strip (0: one strip), or ``tile`` x ``tile`` tiles; the last block's byte count
    ``overstate`` bytes more than it holds."""
    height, width = pixels.shape
    if tile:
        padded = np.pad(pixels, ((0, -height % tile), (0, -width % tile)))
        blocks = [
            padded[y : y + tile, x : x + tile]
            for y in range(0, height, tile)
            for x in range(0, width, tile)
        ]
    else:
        blocks = [pixels[y : y + (rows or height)] for y in range(0, height, rows or height)]
    data = [zlib.compress(b.tobytes()) if deflate else b.tobytes() for b in blocks]
    n = len(data)
    table = 8 + 2 + 12 * (10 if tile else 9) + 4  # the offsets and counts, after the directory
    first = table + (8 * n if n > 1 else 0)
    offsets = [first + sum(map(len, data[:i])) for i in range(n)]
    counts = [len(d) for d in data]
    counts[-1] += overstate

    def entry(tag: int, kind: int, value: int, count: int = 1) -> bytes:
        field = (
            struct.pack(order + "H", value) + bytes(2)
            if kind == 3
            else struct.pack(order + "I", value)
        )
        return struct.pack(order + "HHI", tag, kind, count) + field

    def block_entries(offsets_tag: int, counts_tag: int) -> list[bytes]:
        if n == 1:  # one value: held in the entry itself
            return [entry(offsets_tag, 4, offsets[0]), entry(counts_tag, 4, counts[0])]
        return [entry(offsets_tag, 4, table, n), entry(counts_tag, 4, table + 4 * n, n)]

    entries = [
        entry(256, 4, width),
        entry(257, 4, height),
        entry(258, 3, 8),
        entry(259, 3, 8 if deflate else 1),
        entry(262, 3, 1),
        entry(277, 3, 1),
        *(
            [entry(322, 4, tile), entry(323, 4, tile), *block_entries(324, 325)]
            if tile
            else [entry(278, 4, rows or height), *block_entries(273, 279)]
        ),
    ]
    entries.sort(key=lambda e: struct.unpack(order + "H", e[:2])[0])
    magic = b"II*\x00" if order == "<" else b"MM\x00*"
    head = magic + struct.pack(order + "IH", 8, len(entries)) + b"".join(entries) + bytes(4)
    arrays = struct.pack(f"{order}{2 * n}I", *offsets, *counts) if n > 1 else b""
    return head + arrays + b"".join(data)


_TIFF_LAYOUTS = {
    "one-strip": {},
    "strips": {"rows": 7},
    "big-endian-strips": {"order": ">", "rows": 7},
    "deflate-strips": {"deflate": True, "rows": 7},
    "tiles": {"tile": 16},
    "deflate-tiles": {"deflate": True, "tile": 16},
}


@pytest.mark.parametrize("layout", list(_TIFF_LAYOUTS))
def test_a_tiff_cut_inside_its_pixels_is_truncated_as_pillow_judges_it(layout: str) -> None:
    # TIFF was left to the decoder, so with PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True a cut
    # TIFF passed on_error="skip" and was trained on half grey (DALI stopped on it instead).
    pixels = np.random.default_rng(2).integers(0, 256, (40, 36), dtype=np.uint8)
    data = _tiff(pixels, **_TIFF_LAYOUTS[layout])  # type: ignore[arg-type]
    with PIL.open(io.BytesIO(data)) as im:
        assert np.array_equal(np.asarray(im), pixels)
    assert truncation("tiff", io.BytesIO(data)) is None
    assert truncation("tiff", io.BytesIO(data + b"trailer")) is None
    half = len(data) // 2
    reason = truncation("tiff", io.BytesIO(data[:half]))
    assert reason is not None
    assert reason.startswith(f"is truncated: {half:,} bytes, but its image data runs to byte ")
    # Cut by 1 to 199 bytes: inside the last block's pixels, or (uncompressed tiles) inside
    # the padding of the last tile, past the image's edge, which Pillow does not read.
    for cut in range(1, 200, 3):
        short = data[:-cut]
        assert (truncation("tiff", io.BytesIO(short)) is None) == _pillow_decodes(short), cut


def test_a_tiff_whose_last_byte_count_is_overstated_is_judged_as_pillow_decodes_it() -> None:
    # Pillow reads an uncompressed strip's pixels, not its byte count; libtiff, which decodes
    # the compressed ones, wants every byte counted.
    pixels = np.random.default_rng(3).integers(0, 256, (40, 36), dtype=np.uint8)
    raw = _tiff(pixels, rows=7, overstate=5)
    assert _pillow_decodes(raw) and truncation("tiff", io.BytesIO(raw)) is None
    deflated = _tiff(pixels, rows=7, deflate=True, overstate=5)
    assert not _pillow_decodes(deflated)
    assert truncation("tiff", io.BytesIO(deflated)) == (
        f"is truncated: {len(deflated):,} bytes, but its image data runs to byte "
        f"{len(deflated) + 5:,}"
    )


def test_a_tiff_cut_inside_its_directory_says_so() -> None:
    data = _tiff(np.zeros((20, 20), dtype=np.uint8), rows=7)
    for cut in (4, 9, 40):  # the directory's offset, its entry count, its entries
        assert truncation("tiff", io.BytesIO(data[:cut])) == (
            "is truncated: it ends inside its header"
        )
    arrays = 8 + 2 + 12 * 9 + 4
    assert truncation("tiff", io.BytesIO(data[: arrays + 6])) == (
        "is truncated: it ends inside its header"
    )


class _ReadSizes(io.BytesIO):
    """A file in memory that records the largest read asked of it."""

    largest = 0

    def read(self, n: int | None = -1) -> bytes:
        self.largest = max(self.largest, n or 0)
        return super().read(n)


def test_a_tiff_whose_byte_counts_run_past_its_end_is_judged_without_reading_them(
    tmp_path: Path,
) -> None:
    # Before: the 2**31 LONG byte counts that a corrupt directory claimed were read in one
    # go, an 8 GiB read (a MemoryError, or gigabytes allocated) to judge a 1 KiB file.
    data = bytearray(_tiff(np.zeros((20, 20), dtype=np.uint8), rows=7))
    entries = 8 + 2
    at = next(e for e in range(entries, entries + 12 * 9, 12) if data[e : e + 2] == b"\x17\x01")
    struct.pack_into("<I", data, at + 4, 2**31)  # the StripByteCounts (279) entry's count
    f = _ReadSizes(bytes(data))
    assert truncation("tiff", f) == "is truncated: it ends inside its header"
    assert f.largest <= len(data)
    path = tmp_path / "corrupt.tif"
    path.write_bytes(data)
    with path.open("rb") as real:
        assert truncation("tiff", real) == "is truncated: it ends inside its header"
