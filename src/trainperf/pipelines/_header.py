"""What an image file's header says: its format, its width and height, and the pixel limit.

A decoder allocates ``width x height x channels`` bytes before it reads a single pixel, so a
file of a few kilobytes that claims 30000 x 30000 pixels (a *decompression bomb*) costs 2.7 GB
of memory and tens of seconds. Every backend therefore reads the size from the header first,
and refuses an image over one limit, ``max_pixels`` (Pillow's convention and default,
``PIL.Image.MAX_IMAGE_PIXELS`` = 89,478,485: a 0.25 GB 24-bit image).

The sizes are read here, from the bytes that hold them, without decoding anything: the JPEG
start-of-frame segment (found by walking the marker segments), the PNG ``IHDR`` chunk, the BMP
info header, the first TIFF directory, the WebP ``VP8 ``/``VP8L``/``VP8X`` chunk. The same
parser reads an open file (the up-front check) and bytes already in memory (the DALI and
nvjpeg backends check what they are about to decode). Files are opened with
:func:`open_regular`, which refuses anything but a regular file without blocking on it.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable
from typing import Any, BinaryIO, Literal

import numpy as np

__all__ = [
    "MAX_IMAGE_PIXELS",
    "ImageFormat",
    "bytes_problem",
    "file_problem",
    "image_size",
    "not_regular",
    "open_regular",
    "pixel_problem",
    "sniff_format",
    "tiff_directory",
    "tiff_tags",
]

MAX_IMAGE_PIXELS = 89_478_485
"""The default pixel limit: Pillow's ``MAX_IMAGE_PIXELS``, ``int(1024 * 1024 * 1024 // 4 // 3)``."""

ImageFormat = Literal["jpeg", "png", "bmp", "tiff", "webp"]

# Start-of-frame markers (all codings); 0xC4 (DHT), 0xC8 (reserved) and 0xCC (DAC) are not.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length: TEM, RSTn and a repeated SOI.
_STANDALONE = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})
_SOS, _EOI = 0xDA, 0xD9
# A real JPEG reaches its frame header in a few dozen segments; a file that does not in this
# many steps (segments or stray bytes) is not one, and walking further would cost seconds.
_MAX_STEPS = 65536
_MAX_TIFF_TAGS = 4096
_TRUNCATED = "is truncated: its header ends before the image size"
_BIGTIFF = (b"II+\x00", b"MM\x00+")
# Opening a FIFO to read it waits for a writer, and a terminal may become the controlling one.
_NO_WAIT = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)

# Reads up to n bytes at an offset.
_At = Callable[[int, int], bytes]


def sniff_format(head: bytes) -> ImageFormat | None:
    """The image format announced by a file's first bytes, or None.

    Example:
        >>> sniff_format(b"\\xff\\xd8\\xff\\xe0\\x00\\x10JFIF"), sniff_format(b"hello")
        ('jpeg', None)
    """
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"BM"):
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def not_regular(mode: int) -> str | None:
    """Why a file of ``mode`` (its ``st_mode``) is not read as an image, or None for a regular
    file.

    Example:
        >>> import stat
        >>> print(not_regular(stat.S_IFIFO | 0o644))
        not a regular file (a FIFO)
        >>> not_regular(stat.S_IFREG | 0o644) is None
        True
    """
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not an image file"
    kind = next((name for is_kind, name in _KINDS if is_kind(mode)), "of an unknown kind")
    return f"not a regular file ({kind})"


def open_regular(path: str) -> BinaryIO | str:
    """``path`` opened to read, if it is a regular file (links followed), else why it is not.

    A FIFO (named pipe) or a device with an image suffix would block its reader forever, so
    the file is opened without waiting and its kind checked on the open descriptor: nothing
    can swap it between the check and the read.

    Raises:
        OSError: it cannot be opened (missing, no permission, ...).

    Example:
        >>> open_regular("/")
        'is a directory, not an image file'
    """
    fd = os.open(path, os.O_RDONLY | _NO_WAIT)
    try:
        problem = not_regular(os.fstat(fd).st_mode)
        if problem is None and _NO_WAIT:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        return problem
    return os.fdopen(fd, "rb")


def _jpeg_size(at: _At) -> tuple[int, int] | str:
    pos = 2
    for _ in range(_MAX_STEPS):
        pair = at(pos, 2)
        if len(pair) < 2:
            return _TRUNCATED
        if pair[0] != 0xFF:  # stray bytes before a marker: skipped, as libjpeg and PIL do
            pos += 1
            continue
        marker = pair[1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker in _STANDALONE:
            pos += 2
        elif marker in _SOF:
            frame = at(pos + 4, 5)  # precision, height, width (after the segment length)
            if len(frame) < 5:
                return _TRUNCATED
            height, width = struct.unpack(">HH", frame[1:5])
            return width, height
        elif marker in (_SOS, _EOI):
            return "is not a valid JPEG: no frame header before its image data"
        else:
            length = at(pos + 2, 2)
            if len(length) < 2:
                return _TRUNCATED
            pos += 2 + struct.unpack(">H", length)[0]
    return f"is not a valid JPEG: no frame header in its first {_MAX_STEPS} segments"


def _png_size(at: _At) -> tuple[int, int] | str:
    chunk = at(8, 16)  # length, "IHDR", width, height
    if len(chunk) < 16:
        return _TRUNCATED
    if chunk[4:8] != b"IHDR":
        return f"is not a valid PNG: its first chunk is {bytes(chunk[4:8])!r}, not b'IHDR'"
    width, height = struct.unpack(">II", chunk[8:16])
    return width, height


def _bmp_size(at: _At) -> tuple[int, int] | str:
    info = at(14, 12)  # info header size, then width and height
    if len(info) < 8:
        return _TRUNCATED
    if struct.unpack("<I", info[:4])[0] == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes
        width, height = struct.unpack("<HH", info[4:8])
        return width, height
    if len(info) < 12:
        return _TRUNCATED
    width, height = struct.unpack("<ii", info[4:12])
    return abs(width), abs(height)  # a negative height is a top-down bitmap


# (tag, type, count, value field) of a TIFF directory entry
TiffEntry = tuple[int, int, int, bytes]


def tiff_directory(at: _At, limit: int = 0xFFFF) -> tuple[str, list[TiffEntry], bool] | str:
    """A TIFF's byte order (``"<"`` or ``">"``) and its first directory's entries in file
    order (the first ``limit`` of them), and whether those were read to their end; or what
    is wrong with the header (it ends before the directory's entry count).

    Example:
        >>> import struct
        >>> ifd = struct.pack("<HHHII", 1, 274, 3, 1, 6)  # one entry: Orientation, SHORT, 6
        >>> data = b"II*\\x00" + struct.pack("<I", 8) + ifd
        >>> tiff_directory(lambda offset, n: data[offset : offset + n])
        ('<', [(274, 3, 1, b'\\x06\\x00\\x00\\x00')], True)
    """
    order = "<" if at(0, 2) == b"II" else ">"
    first = at(4, 4)
    if len(first) < 4:
        return _TRUNCATED
    ifd = struct.unpack(order + "I", first)[0]
    count_bytes = at(ifd, 2)
    if len(count_bytes) < 2:
        return _TRUNCATED
    count = min(struct.unpack(order + "H", count_bytes)[0], limit)
    raw = at(ifd + 2, 12 * count)
    whole = len(raw) // 12 * 12
    entries = list(struct.iter_unpack(order + "HHI4s", raw[:whole]))
    return order, entries, whole == 12 * count


def _tiff_tags(at: _At) -> tuple[dict[int, int], bool] | str:
    """The first TIFF directory's SHORT and LONG values by tag (the first value of each), and
    whether the directory was read to its end; or what is wrong with the header."""
    directory = tiff_directory(at, _MAX_TIFF_TAGS)
    if isinstance(directory, str):
        return directory
    order, entries, complete = directory
    values: dict[int, int] = {}
    for tag, kind, _, field in entries:
        if kind in (3, 4):  # SHORT or LONG
            short = kind == 3  # a SHORT sits in the first two bytes of the value field
            values[tag] = struct.unpack(
                order + ("H" if short else "I"), field[:2] if short else field
            )[0]
    return values, complete


def _tiff_size(at: _At) -> tuple[int, int] | str:
    tags = _tiff_tags(at)
    if isinstance(tags, str):
        return tags
    values, complete = tags
    if 256 not in values or 257 not in values:  # ImageWidth, ImageLength
        return "is a TIFF without its image size" if complete else _TRUNCATED
    return values[256], values[257]


def tiff_tags(data: bytes | np.ndarray[Any, Any]) -> dict[int, int]:
    """The SHORT and LONG values of a TIFF's first directory, by tag (``{}`` if unreadable).

    Example:
        >>> import struct
        >>> ifd = struct.pack("<HHHII", 1, 274, 3, 1, 6)  # one entry: Orientation, SHORT, 6
        >>> tiff_tags(b"II*\\x00" + struct.pack("<I", 8) + ifd)
        {274: 6}
    """
    raw = data.data.cast("B") if isinstance(data, np.ndarray) else memoryview(data)
    try:
        tags = _tiff_tags(lambda offset, n: bytes(raw[offset : offset + n]))
    except struct.error:
        return {}
    return {} if isinstance(tags, str) else tags[0]


def _webp_size(at: _At) -> tuple[int, int] | str:
    head = at(12, 18)  # the first chunk's type and size, then its first 10 bytes
    if len(head) < 18:
        return _TRUNCATED
    kind, data = head[:4], head[8:18]
    if kind == b"VP8 ":  # lossy: a key frame's start code, then 14-bit sizes
        if data[3:6] != b"\x9d\x01\x2a":
            return "is not a valid WebP: no key frame in its VP8 chunk"
        width, height = struct.unpack("<HH", data[6:10])
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L":  # lossless: a signature byte, then 14-bit sizes minus one
        if data[0] != 0x2F:
            return "is not a valid WebP: bad VP8L signature"
        bits = struct.unpack("<I", data[1:5])[0]
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":  # extended: the canvas size, 24 bits each, minus one
        return 1 + int.from_bytes(data[4:7], "little"), 1 + int.from_bytes(data[7:10], "little")
    return f"is not a valid WebP: unknown first chunk {bytes(kind)!r}"


_PARSERS: dict[ImageFormat, Callable[[_At], tuple[int, int] | str]] = {
    "jpeg": _jpeg_size,
    "png": _png_size,
    "bmp": _bmp_size,
    "tiff": _tiff_size,
    "webp": _webp_size,
}


def _file_reader(f: BinaryIO) -> _At:
    def at(offset: int, n: int) -> bytes:
        f.seek(offset)
        return f.read(n)

    return at


def image_size(fmt: ImageFormat, data: BinaryIO | bytes | memoryview) -> tuple[int, int] | str:
    """``(width, height)`` from an image's header, or what is wrong with the header.

    Args:
        fmt: the format :func:`sniff_format` found.
        data: the open file (binary, seekable) or its bytes.

    Returns:
        ``(width, height)``, or a reason such as ``"is truncated: ..."``.

    Example:
        >>> ihdr = (13).to_bytes(4, "big") + b"IHDR" + (300).to_bytes(4, "big") + bytes(4)
        >>> image_size("png", b"\\x89PNG\\r\\n\\x1a\\n" + ihdr[:-1] + b"\\xc8")
        (300, 200)
    """
    if isinstance(data, (bytes, memoryview)):
        view = memoryview(data)
        at: _At = lambda offset, n: bytes(view[offset : offset + n])  # noqa: E731
    else:
        at = _file_reader(data)
    try:
        return _PARSERS[fmt](at)
    except (struct.error, OSError) as e:  # a seek past the end on some file systems
        return f"{_TRUNCATED} ({e})"


def pixel_problem(width: int, height: int, max_pixels: int | None) -> str | None:
    """Why an image of ``width x height`` is refused, or None: the decision rule of the limit.

    Example:
        >>> print(pixel_problem(30000, 30000, MAX_IMAGE_PIXELS))
        has 30000x30000 = 900,000,000 pixels, over max_pixels=89,478,485 (a bomb guard)
        >>> pixel_problem(640, 480, MAX_IMAGE_PIXELS) is None, pixel_problem(30000, 30000, None)
        (True, None)
    """
    if max_pixels is None or width * height <= max_pixels:
        return None
    return (
        f"has {width}x{height} = {width * height:,} pixels, over max_pixels={max_pixels:,} "
        "(a bomb guard)"
    )


def _problem(
    head: bytes, data: BinaryIO | memoryview, max_pixels: int | None
) -> tuple[ImageFormat | None, str | None]:
    if not head:
        return None, "empty file"
    fmt = sniff_format(head)
    if fmt is None and head[:4] in _BIGTIFF:
        return None, "BigTIFF is not supported; convert it to a classic TIFF"
    if fmt is None:
        return None, (
            f"not a supported image (starts with {head[:8]!r}; JPEG, PNG, BMP, TIFF and WebP "
            "are read)"
        )
    size = image_size(fmt, data)
    if isinstance(size, str):
        return fmt, size
    width, height = size
    if width == 0 or height == 0:
        return fmt, f"has no pixels: its header says {width}x{height}"
    return fmt, pixel_problem(width, height, max_pixels)


def file_problem(f: BinaryIO, max_pixels: int | None) -> tuple[ImageFormat | None, str | None]:
    """``(format, problem)`` of an open image file, reading only its header.

    Example:
        >>> import io
        >>> file_problem(io.BytesIO(b"\\x89PNG\\r\\n\\x1a\\n" + bytes(8)), None)
        ('png', 'is truncated: its header ends before the image size')
    """
    return _problem(f.read(16), f, max_pixels)


def bytes_problem(
    data: bytes | np.ndarray[Any, Any], max_pixels: int | None
) -> tuple[ImageFormat | None, str | None]:
    """``(format, problem)`` of an image already read into memory (bytes or a uint8 array).

    Example:
        >>> bytes_problem(b"", None)
        (None, 'empty file')
    """
    raw = data.data.cast("B") if isinstance(data, np.ndarray) else memoryview(data)
    return _problem(bytes(raw[:16]), raw, max_pixels)
