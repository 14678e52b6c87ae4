"""Where the images come from: the file list, its labels, its checks, and each rank's share.

A source is an ImageFolder-style directory (``root/<class>/<image>``) or a list of
``(path, label)`` pairs. Every file is checked once, up front, in threads, so that a bad file
is reported by name before training starts rather than crashing a decoder mid-epoch:

- ``"header"`` (``on_error="raise"``): the file exists, is not empty, and its first bytes
  are those of a JPEG, PNG, BMP, TIFF or WebP image. Costs one small read per file.
- ``"decode"`` (``on_error="skip"``): the header check, then a full decode with PIL (JPEGs
  in draft mode, at 1/8 scale, which still reads every byte of the compressed stream), so
  truncated and corrupt files are found and left out.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from trainperf._utils import launch_env
from trainperf._utils.validate import non_negative_int

__all__ = [
    "IMAGE_EXTENSIONS",
    "BadFile",
    "ImageSource",
    "Shard",
    "check_files",
    "epoch_indices",
    "find_images",
    "resolve_shard",
    "shard_plan",
    "sniff_format",
]

# The suffixes torchvision's ImageFolder takes, less the rare PPM/PGM/TIF-variants DALI and
# torchvision.io do not all decode.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")

ImageFormat = Literal["jpeg", "png", "bmp", "tiff", "webp"]
Check = Literal["header", "decode"]
# More threads than cores: the header check waits on the disk, not the CPU.
_CHECK_THREADS = 16


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


def _header_problem(path: str) -> tuple[ImageFormat | None, str | None]:
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        return None, "file not found"
    except IsADirectoryError:
        return None, "is a directory, not an image file"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    if not head:
        return None, "empty file"
    fmt = sniff_format(head)
    if fmt is None:
        return None, (
            f"not a supported image (starts with {head[:8]!r}; JPEG, PNG, BMP, TIFF and WebP "
            "are read)"
        )
    return fmt, None


def _decode_problem(path: str) -> str | None:
    from PIL import Image

    try:
        with Image.open(path) as im:
            # Draft mode makes libjpeg decode at 1/8 scale: the entropy-coded data is still
            # read to the end, so truncation and corruption surface, at a fraction of the cost.
            im.draft("RGB", (1, 1))
            im.convert("RGB").load()
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error...
        return f"cannot be decoded ({type(e).__name__}: {e})"
    return None


def _check_one(path: str, check: Check) -> tuple[ImageFormat | None, str | None]:
    fmt, problem = _header_problem(path)
    if problem is None and check == "decode":
        problem = _decode_problem(path)
    return fmt, problem


def check_files(
    files: Sequence[str], check: Check = "header", *, threads: int = _CHECK_THREADS
) -> list[tuple[ImageFormat | None, str | None]]:
    """Check every file; return ``(format, problem)`` per file (problem None when fine).

    Args:
        files: paths to check.
        check: ``"header"`` (first bytes) or ``"decode"`` (header, then a PIL decode).
        threads: reader threads.

    Returns:
        One ``(format, problem)`` pair per file, in order.

    Example:
        >>> check_files(["/no/such/file.jpg"])
        [(None, 'file not found')]
    """
    if len(files) < 64 or threads <= 1:
        return [_check_one(f, check) for f in files]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="trainperf-check") as pool:
        return list(pool.map(lambda f: _check_one(f, check), files, chunksize=64))


def _dir_key(path: str) -> tuple[int, int] | None:
    """The identity of the directory ``path`` leads to (links followed), or None if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _walk_class(
    top: str, seen: dict[tuple[int, int], str], repeats: list[tuple[str, str]]
) -> list[str]:
    """The image files under ``top``, each real directory read once across the whole folder.

    Directory links are followed, but a directory already read (``seen``: identity -> the path
    it was first read through) is not read again; ``(path, first path)`` goes to ``repeats``.
    Subfolders are walked in sorted order, so which path reaches a directory first is fixed.
    """
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        kept = []
        for name in sorted(dirnames):
            sub = os.path.join(dirpath, name)
            key = _dir_key(sub)
            if key is not None and key in seen:
                repeats.append((sub, seen[key]))
                continue
            if key is not None:
                seen[key] = sub
            kept.append(name)
        dirnames[:] = kept  # os.walk descends only into what is left here
        found.extend(
            os.path.join(dirpath, f) for f in filenames if f.lower().endswith(IMAGE_EXTENSIONS)
        )
    return sorted(found)


def _scan_classes(
    path: Path, classes: Sequence[str]
) -> tuple[list[list[str]], list[tuple[str, str]]]:
    """Each class's files, and the directories skipped as already read.

    The root and every class folder are claimed before any is walked, so a link to the root
    (``up -> ..``) or to another class folder is a repeat, and a class folder is read as its
    own class even when a link in an earlier class leads to it.
    """
    seen: dict[tuple[int, int], str] = {}
    for top in (str(path), *(os.path.join(path, name) for name in classes)):
        key = _dir_key(top)
        if key is not None:
            seen.setdefault(key, top)
    repeats: list[tuple[str, str]] = []
    per_class: list[list[str]] = []
    for name in classes:
        top = os.path.join(path, name)
        first = seen.get(_dir_key(top) or (-1, -1), top)
        if first != top:  # two class folders that are the same directory: read it once
            repeats.append((top, first))
            per_class.append([])
        else:
            per_class.append(_walk_class(top, seen, repeats))
    return per_class, repeats


def _listed(names: Sequence[str], limit: int = 5) -> str:
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def find_images(root: str | os.PathLike[str]) -> tuple[list[tuple[str, int]], tuple[str, ...]]:
    """List ``root/<class>/**/<image>`` like torchvision's ImageFolder.

    Classes are the sorted subfolder names; files are those with an image suffix
    (case-insensitive), sorted, searched recursively. Other files are ignored.

    Directory links are followed, but every real directory is read once: a link to a
    directory already read (``loop -> .``, ``up -> ..``, a second link to the same place, a
    link to another class folder) is skipped, with a warning that names it, so each file is
    counted once, under the class folder it is first reached from (classes in sorted order,
    subfolders sorted). File links are files: two links to one image are two samples, as in
    ImageFolder.

    A class folder without images stays a class (its index is kept, so every label still
    matches the sorted folder names), with a warning that names it; torchvision's
    ImageFolder raises instead.

    Args:
        root: the dataset directory.

    Returns:
        ``([(path, label), ...], classes)``.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is a file.
        ValueError: ``root`` has no class subfolders, or no images in them.

    Example:
        >>> find_images("/no/such/dir")
        Traceback (most recent call last):
        ...
        FileNotFoundError: image folder '/no/such/dir' does not exist
    """
    path = Path(root)
    if not path.exists():
        raise FileNotFoundError(f"image folder {str(root)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(
            f"image source {str(root)!r} is a file; pass a folder laid out as "
            "root/<class>/<image>, or a list of (path, label) pairs"
        )
    classes = tuple(sorted(e.name for e in os.scandir(path) if e.is_dir()))
    if not classes:
        raise ValueError(
            f"image folder {str(root)!r} has no class subfolders; the layout is "
            "root/<class>/<image> (e.g. root/cat/1.jpg, root/dog/2.jpg)"
        )
    per_class, repeats = _scan_classes(path, classes)
    items = [(f, label) for label, found in enumerate(per_class) for f in found]
    if not items:
        raise ValueError(
            f"image folder {str(root)!r} has class subfolders {list(classes)[:5]} but no "
            f"images in them (suffixes read: {', '.join(IMAGE_EXTENSIONS)})"
        )
    import warnings

    # stacklevel=4: find_images <- load_source <- image_loader <- the caller's line.
    if repeats:
        rel = [
            f"{os.path.relpath(p, path)} (= {os.path.relpath(first, path)})" for p, first in repeats
        ]
        warnings.warn(
            f"image folder {str(root)!r}: skipped {len(repeats)} directory link(s) to folders "
            f"already read, so that each file is counted once, under the class folder it is "
            f"first reached from: {_listed(rel)}; remove the links to silence this",
            stacklevel=4,
        )
    empty = [f"{name!r} (label {i})" for i, name in enumerate(classes) if not per_class[i]]
    if empty:
        warnings.warn(
            f"image folder {str(root)!r} has {len(empty)} class folder(s) with no images: "
            f"{_listed(empty)}; kept as classes so that every label matches the sorted folder "
            "names (torchvision's ImageFolder would raise); remove the folder to drop the class, "
            "or add its images",
            stacklevel=4,
        )
    return items, classes


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
        out.append((os.fspath(p), non_negative_int(f"source[{i}] label", label)))
    return out


def _describe_bad(bad: Sequence[BadFile], limit: int = 10) -> str:
    lines = [f"  {b.path}: {b.reason}" for b in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    return "\n".join(lines)


def load_source(
    source: str | os.PathLike[str] | Sequence[tuple[str | os.PathLike[str], int]],
    *,
    on_error: Literal["raise", "skip"],
    threads: int = _CHECK_THREADS,
) -> ImageSource:
    """Resolve ``source`` to a checked :class:`ImageSource`.

    Args:
        source: an ImageFolder directory or a list of ``(path, label)`` pairs.
        on_error: ``"raise"`` checks headers and raises on a bad file; ``"skip"`` also
            decodes every file and leaves the bad ones out (see the module docstring).
        threads: threads for the checks.

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
    results = check_files(
        [p for p, _ in items], "decode" if on_error == "skip" else "header", threads=threads
    )
    good: list[tuple[str, int, ImageFormat]] = []
    bad: list[BadFile] = []
    for (p, label), (fmt, problem) in zip(items, results, strict=True):
        if problem is None and fmt is not None:
            good.append((p, label, fmt))
        else:
            bad.append(BadFile(p, problem or "unknown format"))
    if bad and on_error == "raise":
        raise ValueError(
            f"{len(bad)} of {len(items)} files in {where} are not readable images:\n"
            f"{_describe_bad(bad)}\nFix or remove them, or pass on_error='skip' to leave "
            "them out"
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
        g.manual_seed(seed + epoch)
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
