"""Whether an image file reaches its end, read from its structure, whatever Pillow is told.

``PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True`` (a common fix for "image file is truncated",
set by many training scripts) makes Pillow decode a truncated file without an error, its
missing part grey. The ``on_error="skip"`` check decodes with Pillow, so this reads the
file's own structure instead, and finds the same files Pillow refuses by default:

- JPEG: an end-of-image marker (``FF D9``) after the start of the image data (the first
  start-of-scan segment). Bytes after it (camera trailers, padding) are allowed; an EXIF
  thumbnail's marker, which comes before the image data, does not count.
- PNG: the chunks, walked by their lengths from the signature, reach ``IEND``, or another
  chunk after the image data (``IDAT`` chunks, each with its data and CRC), or the file ends
  right after an ``IDAT`` chunk whose compressed stream is complete: Pillow decodes a file
  that stops after its image data, without ``IEND``, to all its pixels.
- BMP (uncompressed): the file holds every row the header announces; the last row needs
  only its pixels, not the padding to 4 bytes after them (Pillow does not read it).
- TIFF: the file holds the first directory (the image Pillow decodes) and every strip or
  tile it points to: a compressed one to the last byte of its byte count (libtiff, which
  decodes those, wants them all); an uncompressed one to the last byte of its pixels that
  Pillow reads (a byte count that overstates them is no harm, nor is an edge tile's padding
  after its last row). A file whose directory comes last loses it when cut, and fails the
  header check already.

WebP is left to the decoder: Pillow's WebP decoder refuses a truncated file whatever the
setting.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from typing import BinaryIO

from trainperf.pipelines._header import ImageFormat, tiff_directory

__all__ = ["truncation"]

_SOS, _EOI = 0xDA, 0xD9
# Markers without a length: TEM, RSTn and a repeated SOI.
_STANDALONE = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})
_MAX_STEPS = 65536  # as the header check: a real file reaches its image data in far fewer
_CHUNK = 1 << 20
_UNCOMPRESSED_BMP = (0, 3, 6)  # BI_RGB, BI_BITFIELDS, BI_ALPHABITFIELDS
_HEADER_CUT = "is truncated: it ends inside its header"
# TIFF tags: the image's width and length, bits per sample, compression, samples per pixel,
# rows per strip, planar configuration; the strips' and the tiles' offsets and byte counts.
_WIDTH, _LENGTH, _BITS, _COMPRESSION, _SAMPLES, _ROWS, _PLANAR = 256, 257, 258, 259, 277, 278, 284
_TILE_WIDTH, _TILE_LENGTH = 322, 323
_STRIPS, _TILES = (273, 279), (324, 325)
_TIFF_TYPES = {3: "H", 4: "I"}  # SHORT, LONG: the types of the tags read here


def _at(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def _jpeg_scan_start(f: BinaryIO) -> int | None:
    """Where the first start-of-scan marker is, walking the segments; None if not reached."""
    pos = 2
    for _ in range(_MAX_STEPS):
        head = _at(f, pos, 4)
        if len(head) < 4:
            return None
        if head[0] != 0xFF or head[1] == 0xFF:  # a stray byte (skipped, as the header check
            pos += 1  # does) or a fill byte before a marker
        elif head[1] == _SOS:
            return pos
        elif head[1] in _STANDALONE:
            pos += 2
        else:
            pos += 2 + struct.unpack(">H", head[2:4])[0]
    return None


def _jpeg_truncation(f: BinaryIO, size: int) -> str | None:
    scan = _jpeg_scan_start(f)
    if scan is None:
        return "is truncated: it ends before its image data"
    if _at(f, size - 2, 2) == b"\xff\xd9":  # nearly every file: nothing after the image
        return None
    f.seek(scan)
    tail = b""
    while block := f.read(_CHUNK):
        if b"\xff\xd9" in tail + block:  # the byte before carried over: a marker across blocks
            return None
        tail = block[-1:]
    return "is truncated: its image data ends without the JPEG end-of-image marker"


def _png_truncation(f: BinaryIO, size: int) -> str | None:
    pos = 8
    idat: list[tuple[int, int]] = []  # (offset, length) of each IDAT chunk's data
    # No step limit: each step moves on 12 bytes or more, and a limit would cut off a large
    # PNG (libpng writes 8 KiB IDAT chunks: 65,536 of them fill 512 MiB).
    while True:
        head = _at(f, pos, 8)
        if len(head) < 8:
            break
        length, kind = struct.unpack(">I4s", head)
        if kind == b"IEND" or (idat and kind != b"IDAT"):  # past the image data: whole
            return None
        end = pos + 12 + length  # length, type, data, CRC
        if kind == b"IDAT" and end > size:
            return "is truncated: it ends inside its image data (an IDAT chunk)"
        if kind == b"IDAT":
            idat.append((pos + 8, length))
        pos = end
    if idat and _zlib_stream_ends(f, idat):  # stops after its last IDAT, without IEND
        return None
    return "is truncated: it ends before its IEND chunk"


def _zlib_stream_ends(f: BinaryIO, chunks: list[tuple[int, int]]) -> bool:
    """Whether the compressed stream split over ``chunks`` (offset, length) is complete: a
    file cut between two IDAT chunks ends at a chunk boundary, but not at the stream's end.
    Inflated ``_CHUNK`` bytes at a time: a decompression bomb allocates no more."""
    stream = zlib.decompressobj()
    for offset, length in chunks:
        f.seek(offset)
        while length > 0 and not stream.eof:
            data = f.read(min(length, _CHUNK))
            length -= len(data)
            while data and not stream.eof:
                try:
                    stream.decompress(data, _CHUNK)
                except zlib.error:  # corrupt, not cut: Pillow's decode has its say on that
                    return False
                data = stream.unconsumed_tail
    return stream.eof


def _bmp_truncation(f: BinaryIO, size: int) -> str | None:
    head = _at(f, 10, 20)  # pixel data offset, info header size, width, height, planes, bits
    offset, info = struct.unpack("<II", head[:8])
    if len(head) < (16 if info == 12 else 20):
        return _HEADER_CUT
    if info == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes, never compressed
        width, height, _, bits = struct.unpack("<HHHH", head[8:16])
        compression = 0
    else:
        width, height, _, bits = struct.unpack("<iiHH", head[8:20])
        compression = struct.unpack("<I", _at(f, 30, 4).ljust(4, b"\x00"))[0]
    if compression not in _UNCOMPRESSED_BMP:
        return None  # run-length coded: its length is not fixed by the header
    needed = offset + _bmp_pixel_bytes(abs(width), abs(height), bits)
    if size < needed:
        return f"is truncated: {size:,} bytes, but its header announces {needed:,}"
    return None


def _bmp_pixel_bytes(width: int, height: int, bits: int) -> int:
    """The bytes of a BMP's rows that Pillow reads: each row padded to 4 bytes but the last,
    whose padding it does not read (a file without it decodes to the same pixels).

    Example:
        >>> _bmp_pixel_bytes(5, 5, 24)  # 4 rows of 15 + 1 padding, then 15
        79
    """
    if width == 0 or height == 0:
        return 0
    stride = (width * bits + 31) // 32 * 4
    return stride * (height - 1) + (width * bits + 7) // 8


# (type, count, value field) of a TIFF directory's entries, by tag
_Entries = dict[int, tuple[int, int, bytes]]


def _tiff_values(
    f: BinaryIO, size: int, order: str, entry: tuple[int, int, bytes]
) -> list[int] | None:
    """A SHORT or LONG TIFF tag's values (in its value field if they fit in 4 bytes, else at
    the offset there); None for another type. Raises struct.error if the file (``size``
    bytes) ends first."""
    kind, count, field = entry
    code = _TIFF_TYPES.get(kind)
    if code is None:
        return None
    n = struct.calcsize(code) * count
    if n <= 4:
        data = field[:n]
    else:
        offset = struct.unpack(order + "I", field)[0]
        if offset + n > size:
            # Checked before reading: a count of up to 2**32 - 1 from a corrupt file would
            # allocate gigabytes for the read.
            raise struct.error("the values run past the end of the file")
        data = _at(f, offset, n)
    return list(struct.unpack(f"{order}{count}{code}", data))


def _tiff_directory(f: BinaryIO) -> tuple[str, _Entries] | None:
    """The byte order and the first directory's entries, the first of a repeated tag; None
    if the file ends before the directory does."""
    directory = tiff_directory(lambda offset, n: _at(f, offset, n))
    if isinstance(directory, str) or not directory[2]:
        return None
    order, found, _ = directory
    entries: _Entries = {}
    for tag, kind, n, field in found:
        entries.setdefault(tag, (kind, n, field))
    return order, entries


def _tiff_truncation(f: BinaryIO, size: int) -> str | None:
    directory = _tiff_directory(f)
    if directory is None:
        return _HEADER_CUT
    try:
        blocks = _tiff_blocks(f, size, *directory)
    except struct.error:
        return _HEADER_CUT
    if blocks is None:
        return None
    end = max((offset + n for offset, n in blocks if n), default=0)
    if end > size:
        return f"is truncated: {size:,} bytes, but its image data runs to byte {end:,}"
    return None


def _tiff_blocks(
    f: BinaryIO, size: int, order: str, entries: _Entries
) -> list[tuple[int, int]] | None:
    """Each strip's or tile's ``(offset, bytes the decoder reads)``; None without byte counts
    (some old writers), which leaves the file to the decoder."""

    def values(tag: int) -> list[int] | None:
        return _tiff_values(f, size, order, entries[tag]) if tag in entries else None

    tiled = _TILES[0] in entries
    offsets, counts = (values(tag) for tag in (_TILES if tiled else _STRIPS))
    if offsets is None or counts is None or len(offsets) != len(counts):
        return None
    if (values(_COMPRESSION) or [1])[0] == 1:  # Pillow reads the pixels, not the byte count
        needed = _tiff_pixel_bytes(values, tiled, len(counts))
        counts = [min(count, n) for count, n in zip(counts, needed, strict=True)]
    return list(zip(offsets, counts, strict=True))


def _tiff_pixel_bytes(
    values: Callable[[int], list[int] | None], tiled: bool, blocks: int
) -> list[int]:
    """The bytes Pillow reads of each uncompressed strip or tile: its rows within the image,
    each of the pixels within the image, the last without the padding after them."""

    def first(tag: int, default: int) -> int:
        return (values(tag) or [default])[0]

    width, length = first(_WIDTH, 0), first(_LENGTH, 0)
    planar, bits = first(_PLANAR, 1) == 2, first(_BITS, 1)
    pixel_bits = bits if planar else bits * first(_SAMPLES, 1)  # a plane holds one sample
    if tiled:
        block_width, block_length = first(_TILE_WIDTH, 0), first(_TILE_LENGTH, 0)
    else:
        block_width, block_length = width, min(first(_ROWS, length), length)
    if min(width, length, block_width, block_length) <= 0:
        return [0] * blocks
    across = -(-width // block_width)
    per_plane = across * -(-length // block_length)
    needed = []
    for i in range(blocks):
        x = (i % per_plane % across) * block_width
        y = (i % per_plane // across) * block_length
        rows = min(block_length, length - y)
        row = (min(block_width, width - x) * pixel_bits + 7) // 8
        # Pillow steps over an edge tile's padded rows (stride), but stops after the last.
        stride = block_width * pixel_bits // 8 if x + block_width > width else row
        needed.append((rows - 1) * stride + row if rows > 0 else 0)
    return needed


_CHECKS = {
    "jpeg": _jpeg_truncation,
    "png": _png_truncation,
    "bmp": _bmp_truncation,
    "tiff": _tiff_truncation,
}


def truncation(fmt: ImageFormat, f: BinaryIO) -> str | None:
    """Why the open image file ``f`` (of format ``fmt``) is truncated, or None: it reaches
    its end (or is of a format left to the decoder, WebP).

    Example:
        >>> import io
        >>> print(truncation("png", io.BytesIO(b"\\x89PNG\\r\\n\\x1a\\n" + bytes(8))))
        is truncated: it ends before its IEND chunk
    """
    check = _CHECKS.get(fmt)
    if check is None:
        return None
    size = f.seek(0, os.SEEK_END)
    try:
        return check(f, size)
    except (struct.error, OSError) as e:
        return f"is truncated ({e})"
