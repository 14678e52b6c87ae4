"""Where the images come from: the file list, its labels, its checks, and each rank's share.

A source is an ImageFolder-style directory (``root/<class>/<image>``, see :mod:`._folder`) or a
list of ``(path, label)`` pairs. Every file is checked once, up front, in threads, so that a
bad file is reported by name before training starts rather than crashing a decoder mid-epoch:

- ``"header"`` (``on_error="raise"``): the file exists, is not empty, its first bytes are
  those of a JPEG, PNG, BMP, TIFF or WebP image, and the image size in its header is within
  ``max_pixels`` (:mod:`._header`). Costs a small read or two per file; nothing is decoded,
  so a decompression bomb is refused without allocating its pixels.
- ``"decode"`` (``on_error="skip"``): the header check, then a full decode with PIL (JPEGs
  in draft mode, at 1/8 scale, which still reads every byte of the compressed stream), so
  truncated and corrupt files are found and left out. A file that fails the header check
  (a bomb among them) is never decoded.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from trainperf._utils import launch_env
from trainperf.pipelines._folder import IMAGE_EXTENSIONS, find_images
from trainperf.pipelines._header import MAX_IMAGE_PIXELS, ImageFormat, bytes_problem, file_problem

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


def shown(path: str) -> str:
    """``path`` as it is printed in messages: bytes that are not UTF-8 as ``\\xNN`` escapes.

    A file name may hold any bytes but ``/`` and NUL; Python keeps the non-UTF-8 ones as
    lone surrogates (``os.fsdecode``), which many log handlers refuse to write.

    Example:
        >>> import os
        >>> print(shown(os.fsdecode(b"caf\\xe9.jpg")))
        caf\\xe9.jpg
    """
    return os.fsencode(path).decode("utf-8", "backslashreplace")


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
        files: image paths, in a fixed order (sorted within each class for a directory).
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


@dataclass(frozen=True)
class Shard:
    """One rank's share of an epoch, the same length on every rank.

    Attributes:
        rank: this process's index among ``world_size``.
        world_size: number of processes reading disjoint shards.
        samples: images this rank yields per epoch.
        batches: batches this rank yields per epoch.
        last_batch_size: size of the final batch (``batch_size`` unless it is partial).
    """

    rank: int
    world_size: int
    samples: int
    batches: int
    last_batch_size: int


def _header_problem(path: str, max_pixels: int | None) -> tuple[ImageFormat | None, str | None]:
    try:
        with open(path, "rb") as f:
            return file_problem(f, max_pixels)
    except FileNotFoundError:
        return None, "file not found"
    except IsADirectoryError:
        return None, "is a directory, not an image file"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"


def decode_problem(path: str) -> str | None:
    """Why PIL cannot decode ``path`` (draft mode for JPEGs), or None. Check the header first:
    this allocates the image."""
    from PIL import Image

    from trainperf.pipelines._decode import pil_failure

    try:
        with Image.open(path) as im:
            # Draft mode makes libjpeg decode at 1/8 scale: the entropy-coded data is still
            # read to the end, so truncation and corruption surface, at a fraction of the cost.
            im.draft("RGB", (1, 1))
            im.convert("RGB").load()
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error...
        return f"cannot be decoded ({pil_failure(e)})"
    return None


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
        out.append((os.fspath(p), _label(i, label)))
    return out


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
        RuntimeError: the file is gone, or is no longer an image within the limit (it passed
            the check when the loader was built, so it has changed since).
    """
    try:
        data = np.fromfile(path, dtype=np.uint8)
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
        ValueError: no images; a bad file under ``on_error="raise"``; every file bad.

    Example:
        >>> load_source([], on_error="raise")
        Traceback (most recent call last):
        ...
        ValueError: the list of (path, label) pairs is empty
    """
    if isinstance(source, (str, os.PathLike)):
        items, classes = find_images(source)
        where = f"image folder {os.fspath(source)!r}"
    elif isinstance(source, Sequence):
        items = _list_items(source)
        classes = tuple(str(i) for i in range(max(label for _, label in items) + 1))
        where = "the image list"
    else:
        raise TypeError(
            "source must be a folder path or a list of (path, label) pairs, "
            f"got {type(source).__name__}"
        )
    check: Check = "decode" if on_error == "skip" else "header"
    results = check_files([p for p, _ in items], check, threads=threads, max_pixels=max_pixels)
    good: list[tuple[str, int, ImageFormat]] = []
    bad: list[BadFile] = []
    for (p, label), (fmt, problem) in zip(items, results, strict=True):
        if problem is None and fmt is not None:
            good.append((p, label, fmt))
        else:
            bad.append(BadFile(p, problem or "unknown format"))
    if bad and on_error == "raise":
        too_big = max_pixels is not None and any("max_pixels=" in b.reason for b in bad)
        raise ValueError(
            f"{len(bad)} of {len(items)} files in {where} are not readable images:\n"
            f"{_describe_bad(bad)}\nFix or remove them, or pass on_error='skip' to leave "
            "them out"
            + (
                f"; for an image over max_pixels: {pixel_limit_fix(max_pixels)}"
                if too_big and max_pixels is not None
                else ""
            )
        )
    if not good:
        raise ValueError(
            f"none of the {len(items)} files in {where} is a readable image:\n{_describe_bad(bad)}"
        )
    return ImageSource(
        files=tuple(p for p, _, _ in good),
        labels=tuple(label for _, label, _ in good),
        formats=tuple(fmt for _, _, fmt in good),
        classes=classes,
        skipped=tuple(bad),
    )


# --------------------------------------------------------------------------- sharding


def resolve_shard(shard: Literal["auto"] | tuple[int, int] | None) -> tuple[int, int]:
    """``(rank, world_size)`` for ``shard``.

    ``"auto"``: :func:`trainperf.ddp.rank` and :func:`trainperf.ddp.world_size` (the
    process group's when one is initialised, else torchrun's ``RANK``/``WORLD_SIZE``
    variables, so the process group may come later) when a process group exists or both
    variables are set; else ``(0, 1)``. ``None`` means ``(0, 1)``: this process reads
    everything.

    Raises:
        ValueError: a malformed tuple, or ``rank`` outside ``[0, world_size)`` (given, or
            from the process group or the environment).

    Example:
        >>> resolve_shard((1, 4)), resolve_shard(None)
        ((1, 4), (0, 1))
    """
    if shard is None:
        return 0, 1
    if isinstance(shard, str):
        if shard != "auto":
            raise ValueError(
                f"shard must be 'auto', None or a (rank, world_size) tuple, got {shard!r}"
            )
        import torch.distributed as dist

        import trainperf.ddp as ddp

        grouped = dist.is_available() and dist.is_initialized()
        # A lone RANK or WORLD_SIZE is not a launch (ddp.rank() would default the other one
        # and give a shard that no other process reads alongside): read everything then.
        if not grouped and not (launch_env.is_set("RANK") and launch_env.is_set("WORLD_SIZE")):
            return 0, 1
        return resolve_shard((ddp.rank(), ddp.world_size()))
    if (
        not isinstance(shard, tuple)
        or len(shard) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
    ):
        raise ValueError(f"shard must be 'auto', None or a (rank, world_size) tuple, got {shard!r}")
    rank, world = shard
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard needs 0 <= rank < world_size, got rank={rank}, world_size={world}")
    return rank, world


def shard_plan(
    num_files: int,
    batch_size: int,
    rank: int,
    world_size: int,
    last_batch: Literal["drop", "keep"],
) -> Shard:
    """How many samples and batches every rank yields per epoch.

    ``"keep"`` pads each rank to ``ceil(N / world_size)`` samples by repeating some (as
    ``DistributedSampler`` does) and keeps a partial last batch; ``"drop"`` trims each rank to
    ``floor(N / world_size)`` samples and drops the partial batch. Either way every rank
    yields the same number of batches, so no rank waits forever in a collective.

    Raises:
        ValueError: a rank would get no batch at all.

    Example:
        >>> shard_plan(25, 4, 0, 2, "keep")
        Shard(rank=0, world_size=2, samples=13, batches=4, last_batch_size=1)
        >>> shard_plan(25, 4, 1, 2, "drop").batches
        3
    """
    if last_batch == "drop":
        per_rank = num_files // world_size
        batches = per_rank // batch_size
        samples, last = batches * batch_size, batch_size
    else:
        per_rank = math.ceil(num_files / world_size)
        batches = math.ceil(per_rank / batch_size)
        samples, last = per_rank, per_rank - (batches - 1) * batch_size
    if batches == 0:
        raise ValueError(
            f"batch_size={batch_size} is larger than the {per_rank} images each of "
            f"{world_size} rank(s) gets from {num_files} images, so an epoch would be empty; "
            "lower batch_size or pass last_batch='keep'"
        )
    return Shard(rank, world_size, samples, batches, last)


def epoch_indices(
    num_files: int,
    rank: int,
    world_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    last_batch: Literal["drop", "keep"],
) -> list[int]:
    """This rank's file indices for one epoch, exactly as ``DistributedSampler`` orders them.

    A permutation from a generator seeded with ``seed + epoch`` (identity without shuffle),
    padded by wrapping round (``"keep"``) or trimmed (``"drop"``) to a multiple of
    ``world_size``, then every ``world_size``-th index from ``rank``.

    Example:
        >>> epoch_indices(5, 1, 2, shuffle=False, seed=0, epoch=0, last_batch="keep")
        [1, 3, 0]
    """
    if shuffle:
        g = torch.Generator()
        g.manual_seed((seed + epoch) % 2**64)  # what DistributedSampler seeds, within 64 bits
        order: list[int] = torch.randperm(num_files, generator=g).tolist()
    else:
        order = list(range(num_files))
    if last_batch == "drop":
        order = order[: (num_files // world_size) * world_size]
    else:
        total = math.ceil(num_files / world_size) * world_size
        pad = total - num_files
        order += (order * math.ceil(pad / num_files))[:pad] if pad else []
    return order[rank::world_size]


def epoch_batches(
    num_files: int,
    shard: Shard,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    last_batch: Literal["drop", "keep"],
) -> list[list[int]]:
    """This rank's batches of file indices for one epoch: :func:`epoch_indices` cut into
    ``shard.batches`` batches of ``batch_size`` (the last one partial with ``"keep"``).

    Example:
        >>> epoch_batches(5, shard_plan(5, 2, 0, 1, "keep"), 2, shuffle=False, seed=0, epoch=0,
        ...               last_batch="keep")
        [[0, 1], [2, 3], [4]]
    """
    order = epoch_indices(
        num_files,
        shard.rank,
        shard.world_size,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        last_batch=last_batch,
    )
    starts = range(0, len(order), batch_size)
    return [order[i : i + batch_size] for i in starts][: shard.batches]
