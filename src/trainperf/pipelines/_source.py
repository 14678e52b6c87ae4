"""Where the images come from: the file list, its labels and its checks (each rank's share of
it is :mod:`._shard`'s).

A source is an ImageFolder-style directory (``root/<class>/<image>``, see :mod:`._folder`) or a
list of ``(path, label)`` pairs. Every file is checked once, up front, in threads, so that a
bad file is reported by name before training starts rather than crashing a decoder mid-epoch:

- ``"header"`` (``on_error="raise"``): the file exists, is a regular file (a FIFO with an
  image suffix would block its reader forever), is not empty, its first bytes are
  those of a JPEG, PNG, BMP, TIFF or WebP image, and the image size in its header is within
  ``max_pixels`` (:mod:`._header`). Costs a small read or two per file; nothing is decoded,
  so a decompression bomb is refused without allocating its pixels.
- ``"decode"`` (``on_error="skip"``): the header check, then a full decode with PIL (JPEGs
  in draft mode, at 1/8 scale, which still reads every byte of the compressed stream), so
  truncated and corrupt files are found and left out; JPEG, PNG, BMP and TIFF files are
  also checked for truncation from their own structure (:mod:`._truncation`), which
  ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True`` does not turn off. A file that fails the
  header check (a bomb among them) is never decoded.

With ``on_error="raise"`` that Pillow setting is the user's and is kept, with a warning: it
makes the backends that decode with Pillow train on truncated images, half grey.
"""

from __future__ import annotations

import operator
import os
import re
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import torch

from trainperf._utils.stack import user_stacklevel
from trainperf.pipelines._folder import IMAGE_EXTENSIONS, find_images
from trainperf.pipelines._header import (
    MAX_IMAGE_PIXELS,
    ImageFormat,
    bytes_problem,
    file_problem,
    open_regular,
    sniff_format,
)
from trainperf.pipelines._shard import (
    Shard,
    epoch_batches,
    epoch_indices,
    resolve_shard,
    shard_plan,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "BadFile",
    "ImageSource",
    "Shard",
    "check_files",
    "epoch_indices",
    "find_images",
    "resolve_shard",
    "changed_file_error",
    "epoch_batches",
    "read_checked",
    "shard_plan",
    "shown",
]

Check = Literal["header", "decode"]
# More threads than cores: the header check waits on the disk, not the CPU.
_CHECK_THREADS = 16
# A list's largest label is refused when it is at least this, and this many times the number
# of labels used: the class names it would make could take gigabytes.
_SPARSE_LABEL = 1_000_000
_SPARSITY = 100
# What shown() escapes: C0 and C1 controls, DEL, and the characters str.splitlines() also
# breaks a line at (U+2028, U+2029; U+0085 is a C1 control).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def shown(path: str) -> str:
    """``path`` as it is printed in messages: bytes that are not UTF-8 as ``\\xNN`` escapes,
    and control characters and line separators as ``repr()`` writes them (``\\n``,
    ``\\x1b``, ``\\u2028``).

    A file name may hold any bytes but ``/`` and NUL; Python keeps the non-UTF-8 ones as
    lone surrogates (``os.fsdecode``), which many log handlers refuse to write. A newline or
    an escape sequence printed raw would split a one-line-per-file list, or recolour the
    terminal.

    Example:
        >>> import os
        >>> print(shown(os.fsdecode(b"caf\\xe9.jpg")))
        caf\\xe9.jpg
        >>> print(shown("a\\nb.jpg"))
        a\\nb.jpg
    """
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


@dataclass(frozen=True)
class BadFile:
    """A file that failed the up-front check.

    Attributes:
        path: the file.
        reason: what is wrong with it, e.g. ``"empty file"``.
    """

    path: str
    reason: str


@dataclass(frozen=True)
class ImageSource:
    """The checked file list.

    Attributes:
        files: image paths, absolute (read from the directory current when the source was
            loaded), in a fixed order (ImageFolder's, for a directory).
        labels: class index of each file.
        formats: the format each file's first bytes announce.
        classes: class names, index = label (folder names, or ``"0"``, ``"1"``, … for a list).
        skipped: files left out by ``on_error="skip"``.
    """

    files: tuple[str, ...]
    labels: tuple[int, ...]
    formats: tuple[ImageFormat, ...]
    classes: tuple[str, ...]
    skipped: tuple[BadFile, ...] = ()


def _header_problem(path: str, max_pixels: int | None) -> tuple[ImageFormat | None, str | None]:
    try:
        f = open_regular(path)
        if isinstance(f, str):  # a FIFO, a device, a directory: never read
            return None, f
        with f:
            return file_problem(f, max_pixels)
    except FileNotFoundError:
        return None, "file not found"
    except IsADirectoryError:
        return None, "is a directory, not an image file"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"


def decode_problem(path: str) -> str | None:
    """Why PIL cannot decode ``path`` (draft mode for JPEGs), or why it is truncated (JPEG,
    PNG, BMP, TIFF: :mod:`._truncation`, which ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` does
    not turn off), or None. Check the header first: this allocates the image."""
    from PIL import Image

    from trainperf.pipelines._decode import pil_failure
    from trainperf.pipelines._truncation import truncation

    try:
        f = open_regular(path)
        if isinstance(f, str):  # no longer a regular file since the header check
            return f
        with f, Image.open(f) as im:
            # Draft mode makes libjpeg decode at 1/8 scale: the entropy-coded data is still
            # read to the end, so truncation and corruption surface, at a fraction of the cost.
            im.draft("RGB", (1, 1))
            im.convert("RGB").load()
            fmt = sniff_format(_at_start(f))
            return None if fmt is None else truncation(fmt, f)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error...
        return f"cannot be decoded ({pil_failure(e)})"


def _at_start(f: BinaryIO) -> bytes:
    f.seek(0)
    return f.read(16)


def check_one(
    path: str, check: Check, max_pixels: int | None = MAX_IMAGE_PIXELS
) -> tuple[ImageFormat | None, str | None]:
    """``(format, problem)`` of one file: the header, then (``"decode"``) a PIL decode."""
    fmt, problem = _header_problem(path, max_pixels)
    if problem is None and check == "decode":
        problem = decode_problem(path)
    return fmt, problem


def check_files(
    files: Sequence[str],
    check: Check = "header",
    *,
    threads: int = _CHECK_THREADS,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> list[tuple[ImageFormat | None, str | None]]:
    """Check every file; return ``(format, problem)`` per file (problem None when fine).

    Args:
        files: paths to check.
        check: ``"header"`` (first bytes and image size) or ``"decode"`` (header, then a PIL
            decode of the files whose header passed).
        threads: reader threads.
        max_pixels: the most pixels an image may have (None: no limit).

    Returns:
        One ``(format, problem)`` pair per file, in order.

    Example:
        >>> check_files(["/no/such/file.jpg"])
        [(None, 'file not found')]
    """
    if len(files) < 64 or threads <= 1:
        return [check_one(f, check, max_pixels) for f in files]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="trainperf-check") as pool:
        return list(pool.map(lambda f: check_one(f, check, max_pixels), files, chunksize=64))


def _list_items(items: Sequence[object]) -> list[tuple[str, int]]:
    if len(items) == 0:
        raise ValueError("the list of (path, label) pairs is empty")
    out: list[tuple[str, int]] = []
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"source[{i}] must be a (path, label) pair, got {item!r}")
        p, label = item
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"source[{i}] path must be a str or os.PathLike, got {p!r}")
        out.append((_absolute(os.fspath(p)), _label(i, label)))
    return out


def _absolute(path: str) -> str:
    """``path`` made absolute from the current directory, so that a later ``os.chdir`` does
    not change which file it names; ``.`` segments dropped, ``..`` kept (collapsing it would
    change where a path through a directory link leads). ``""`` stays ``""``: no file.

    Example:
        >>> import os
        >>> _absolute("./cat/../1.jpg") == os.path.join(os.getcwd(), "cat", "..", "1.jpg")
        True
    """
    return str(Path(path).absolute()) if path else path


def _numbered_classes(items: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """``"0"``, ``"1"``, ... up to a list's largest label. A largest label far beyond the
    labels used (an id rather than an index) is refused: it would make that many classes."""
    i, top = max(enumerate(label for _, label in items), key=operator.itemgetter(1))
    used = len({label for _, label in items})
    if top >= _SPARSE_LABEL and top >= _SPARSITY * used:
        raise ValueError(
            f"source[{i}] label {top} would make {top + 1:,} classes (a list's labels index "
            f"loader.classes, '0' to '{top}'), but only {used} distinct labels are used; "
            f"re-index the labels to 0..{used - 1}, e.g. with "
            "{old: new for new, old in enumerate(sorted(set(labels)))}"
        )
    return tuple(str(k) for k in range(top + 1))


def _is_bool(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return isinstance(value, (bool, np.bool_))


def _label(i: int, label: object) -> int:
    """``label`` as a Python int: any integer type (numpy's, a one-element integer tensor, as
    pandas and torch hand them out) >= 0; a bool or a float is refused."""
    try:
        value = operator.index(label)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or _is_bool(label) or value < 0:
        raise ValueError(
            f"source[{i}] label must be an integer >= 0 (int, numpy or torch integer), "
            f"got {label!r}"
        )
    return value


def _describe_bad(bad: Sequence[BadFile], limit: int = 10) -> str:
    lines = [f"  {shown(b.path)}: {b.reason}" for b in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    return "\n".join(lines)


def pixel_limit_fix(max_pixels: int) -> str:
    """The fix for an image over the pixel limit, said wherever one is refused."""
    return (
        f"if it is a real image and not a decompression bomb, pass a larger "
        f"image_loader(..., max_pixels=...) (now {max_pixels:,}; None: no limit)"
    )


def read_checked(path: str, max_pixels: int | None) -> np.ndarray[Any, Any]:
    """The bytes of ``path``, after the header check (format, image size within
    ``max_pixels``) on those very bytes, which are what a backend then decodes.

    Raises:
        RuntimeError: the file is gone, is no longer a regular file, or is no longer an image
            within the limit (it passed the check when the loader was built, so it has
            changed since).
    """
    try:
        f = open_regular(path)
        if isinstance(f, str):
            raise changed_file_error(path, f, max_pixels)
        with f:
            data = np.fromfile(f, dtype=np.uint8)
    except OSError as e:
        raise changed_file_error(path, f"cannot be read ({e.strerror or e})", max_pixels) from e
    _, problem = bytes_problem(data, max_pixels)
    if problem is not None:
        raise changed_file_error(path, problem, max_pixels)
    return data


def changed_file_error(path: str, problem: str, max_pixels: int | None) -> RuntimeError:
    """The error for a file that fails the header check when a backend reads it to decode it:
    it passed the same check when the loader was built, so it has changed since."""
    fix = "fix or remove the file"
    if max_pixels is not None and "max_pixels=" in problem:
        fix += f"; {pixel_limit_fix(max_pixels)}"
    return RuntimeError(
        f"image '{shown(path)}' {problem}, so it is not decoded: it changed after the loader "
        f"checked it (on_error='skip' leaves out only files that are bad then); {fix}"
    )


def _resolve(
    source: str | os.PathLike[str] | Sequence[tuple[str | os.PathLike[str], int]],
) -> tuple[list[tuple[str, int]], tuple[str, ...], list[BadFile], str]:
    """``(items, classes, folders that cannot be listed, where)`` of a folder or a list."""
    if isinstance(source, (str, os.PathLike)):
        items, classes, unlisted = find_images(source)
        bad_dirs = [BadFile(folder, why) for folder, why in unlisted]
        return items, classes, bad_dirs, f"image folder {os.fspath(source)!r}"
    given: object = source  # bytes are not in the signature, but callers pass them
    if isinstance(given, (bytes, bytearray)):  # a Sequence too: of ints, not of pairs
        raise TypeError(
            f"source must be a folder path (str or os.PathLike) or a list of (path, label) "
            f"pairs, got bytes {bytes(given)!r}; pass os.fsdecode(source)"
        )
    if isinstance(source, Sequence):
        items = _list_items(source)
        return items, _numbered_classes(items), [], "the image list"
    raise TypeError(
        "source must be a folder path or a list of (path, label) pairs, "
        f"got {type(source).__name__}"
    )


def _what_is_bad(bad_dirs: int, bad_files: int, files: int, where: str) -> str:
    """E.g. ``"1 folder in image folder 'x' cannot be listed and 2 of 9 files found in it are
    not readable images"``."""
    said = []
    if bad_dirs:
        said.append(f"{bad_dirs} folder{'s' if bad_dirs > 1 else ''} in {where} cannot be listed")
    if bad_files:
        said.append(
            f"{bad_files} of {files} files {'found in it' if bad_dirs else 'in ' + where} are "
            "not readable images"
        )
    return " and ".join(said)


def _warn_if_pillow_keeps_truncated_files() -> None:
    """Warn that ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` is set: it is the user's setting, and
    kept, but it turns truncated files into half-grey training images without a word."""
    image_file = sys.modules.get("PIL.ImageFile")  # set only if imported: no import here
    if not getattr(image_file, "LOAD_TRUNCATED_IMAGES", False):
        return
    import warnings

    warnings.warn(
        "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True, so Pillow decodes a truncated image "
        "without an error, its missing part grey: the torchvision backend (and the nvjpeg "
        "backend, for the files it decodes on the CPU) will train on such images, and the DALI "
        "backend stops when it reaches one. To find truncated files up front and leave them "
        "out, pass on_error='skip' (its check finds truncated JPEG, PNG, BMP and TIFF files "
        "whatever this setting)",
        stacklevel=user_stacklevel(),  # the caller's image_loader(...) or load_source(...)
    )


def load_source(
    source: str | os.PathLike[str] | Sequence[tuple[str | os.PathLike[str], int]],
    *,
    on_error: Literal["raise", "skip"],
    threads: int = _CHECK_THREADS,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> ImageSource:
    """Resolve ``source`` to a checked :class:`ImageSource`.

    Args:
        source: an ImageFolder directory or a list of ``(path, label)`` pairs.
        on_error: ``"raise"`` checks headers and raises on a bad file; ``"skip"`` also
            decodes every file and leaves the bad ones out (see the module docstring).
        threads: threads for the checks.
        max_pixels: images with more pixels (read from the header) are bad files; None: no
            limit.

    Returns:
        The files, labels, formats and classes.

    Raises:
        FileNotFoundError, NotADirectoryError: the folder is missing or is a file.
        TypeError: a list item is not a ``(path, label)`` pair.
        ValueError: no images; a bad file or a folder that cannot be listed under
            ``on_error="raise"``; every file bad; a list's largest label far beyond the
            labels used (>= 1,000,000 and >= 100 times the number of distinct labels).

    Example:
        >>> load_source([], on_error="raise")
        Traceback (most recent call last):
        ...
        ValueError: the list of (path, label) pairs is empty
    """
    items, classes, unlisted, where = _resolve(source)
    if on_error == "raise":
        _warn_if_pillow_keeps_truncated_files()
    check: Check = "decode" if on_error == "skip" else "header"
    results = check_files([p for p, _ in items], check, threads=threads, max_pixels=max_pixels)
    good: list[tuple[str, int, ImageFormat]] = []
    bad: list[BadFile] = []
    for (p, label), (fmt, problem) in zip(items, results, strict=True):
        if problem is None and fmt is not None:
            good.append((p, label, fmt))
        else:
            bad.append(BadFile(p, problem or "unknown format"))
    if (bad or unlisted) and on_error == "raise":
        too_big = max_pixels is not None and any("max_pixels=" in b.reason for b in bad)
        raise ValueError(
            f"{_what_is_bad(len(unlisted), len(bad), len(items), where)}:\n"
            f"{_describe_bad(unlisted + bad)}\nFix or remove them, or pass on_error='skip' to "
            "leave them out"
            + (
                f"; for an image over max_pixels: {pixel_limit_fix(max_pixels)}"
                if too_big and max_pixels is not None
                else ""
            )
        )
    if not good:
        also = f" ({len(unlisted)} folder(s) could not be listed)" if unlisted else ""
        raise ValueError(
            f"none of the {len(items)} files found in {where} is a readable image{also}:\n"
            f"{_describe_bad(unlisted + bad)}"
        )
    return ImageSource(
        files=tuple(p for p, _, _ in good),
        labels=tuple(label for _, label, _ in good),
        formats=tuple(fmt for _, _, fmt in good),
        classes=classes,
        skipped=tuple(unlisted + bad),
    )
