"""Finding the images of an ImageFolder-style directory: classes, files and directory links.

``root/<class>/**/<image>``, as torchvision's ImageFolder reads it, except that every real
directory is read once (links to a directory already read are skipped, and named), a class
folder without images is kept as a class, with a warning, and a folder that cannot be listed
is reported by name (the caller treats it as it treats an unreadable file), and hidden files
and folders (names starting with ".") and ``__MACOSX`` folders are not read: macOS leaves
AppleDouble files (``._photo.jpg``: metadata, not an image) and ``.DS_Store`` in folders it
copies, and ``__MACOSX/`` in the zip files it makes, which ImageFolder would take for images
and a class.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["IMAGE_EXTENSIONS", "Unlisted", "find_images", "is_ignored"]

# The suffixes torchvision's ImageFolder takes, less the rare PPM/PGM/TIF-variants DALI and
# torchvision.io do not all decode.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")

# The folder macOS's Archive Utility puts the AppleDouble files of a zip's contents in.
_MACOS_ARCHIVE_FOLDER = "__MACOSX"

# (folder, why it cannot be listed), e.g. ("root/cat/sub", "cannot be listed (Permission denied)")
Unlisted = list[tuple[str, str]]


def is_ignored(name: str) -> bool:
    """Whether a file or folder named ``name`` is passed over when a folder is read: hidden
    (``.DS_Store``, ``._photo.jpg``, ``.git``) or macOS's ``__MACOSX``.

    Example:
        >>> [is_ignored(n) for n in ("._photo.jpg", "__MACOSX", ".cache", "photo.jpg", "_a")]
        [True, True, True, False, False]
    """
    return name.startswith(".") or name == _MACOS_ARCHIVE_FOLDER


def _dir_key(path: str) -> tuple[int, int] | None:
    """The identity of the directory ``path`` leads to (links followed), or None if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _walk_class(
    top: str, seen: dict[tuple[int, int], str], repeats: list[tuple[str, str]], unlisted: Unlisted
) -> list[str]:
    """The image files under ``top``, each real directory read once across the whole folder.

    Directory links are followed, but a directory already read (``seen``: identity -> the path
    it was first read through) is not read again; ``(path, first path)`` goes to ``repeats``.
    Subfolders are walked in sorted order, so which path reaches a directory first is fixed.
    Files come in ImageFolder's order: folders sorted by path, files by name within each.
    A directory that cannot be listed (no read permission) goes to ``unlisted``: os.walk
    would pass over it, and its images would vanish without a word.
    """

    def refused(e: OSError) -> None:
        unlisted.append((e.filename or top, f"cannot be listed ({e.strerror or e})"))

    per_dir: list[tuple[str, list[str]]] = []
    for dirpath, dirnames, filenames in os.walk(top, onerror=refused, followlinks=True):
        kept = []
        for name in sorted(n for n in dirnames if not is_ignored(n)):
            sub = os.path.join(dirpath, name)
            key = _dir_key(sub)
            if key is not None and key in seen:
                repeats.append((sub, seen[key]))
                continue
            if key is not None:
                seen[key] = sub
            kept.append(name)
        dirnames[:] = kept  # os.walk descends only into what is left here
        images = sorted(
            f for f in filenames if f.lower().endswith(IMAGE_EXTENSIONS) and not is_ignored(f)
        )
        per_dir.append((dirpath, images))
    # ImageFolder's order (torchvision's make_dataset: sorted(os.walk(...)), then sorted
    # file names): folders by their path, each folder's files by name. Sorting whole file
    # paths instead would put a/sub/x.jpg before a/sub0.jpg ('/' < '0'), not after a/z.jpg.
    return [os.path.join(d, f) for d, images in sorted(per_dir) for f in images]


def _scan_classes(
    path: Path, classes: Sequence[str]
) -> tuple[list[list[str]], list[tuple[str, str]], Unlisted]:
    """Each class's files, the directories skipped as already read, and those not listed.

    The root and every class folder are claimed before any is walked, so a link to the root
    (``up -> ..``) or to another class folder is a repeat, and a class folder is read as its
    own class even when a link in an earlier class leads to it. Real class folders are
    claimed before links to them: a class folder that is a link to another (``Z -> cat``)
    is the repeat, even when it sorts first.
    """
    seen: dict[tuple[int, int], str] = {}
    tops = sorted((os.path.join(path, name) for name in classes), key=os.path.islink)
    for top in (str(path), *tops):
        key = _dir_key(top)
        if key is not None:
            seen.setdefault(key, top)
    repeats: list[tuple[str, str]] = []
    unlisted: Unlisted = []
    per_class: list[list[str]] = []
    for name in classes:
        top = os.path.join(path, name)
        first = seen.get(_dir_key(top) or (-1, -1), top)
        if first != top:  # two class folders that are the same directory: read it once
            repeats.append((top, first))
            per_class.append([])
        else:
            per_class.append(_walk_class(top, seen, repeats, unlisted))
    return per_class, repeats, unlisted


def _listed(names: Sequence[str], limit: int = 5) -> str:
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def _class_names(path: Path, root: str | os.PathLike[str]) -> tuple[str, ...]:
    """The sorted class folder names of ``path`` (``root`` as given, for the error)."""
    folders = [e.name for e in os.scandir(path) if e.is_dir()]
    classes = tuple(sorted(name for name in folders if not is_ignored(name)))
    if not classes:
        passed_over = [repr(name) for name in sorted(set(folders) - set(classes))]
        raise ValueError(
            f"image folder {str(root)!r} has no class subfolders"
            + (f" (only {_listed(passed_over)}, not read)" if passed_over else "")
            + "; the layout is root/<class>/<image> (e.g. root/cat/1.jpg, root/dog/2.jpg)"
        )
    return classes


def find_images(
    root: str | os.PathLike[str],
) -> tuple[list[tuple[str, int]], tuple[str, ...], Unlisted]:
    """List ``root/<class>/**/<image>`` like torchvision's ImageFolder.

    Classes are the sorted subfolder names; files are those with an image suffix
    (case-insensitive), searched recursively, in ImageFolder's order: by class, then by
    folder path, then by file name within each folder (``a/z.jpg`` before ``a/sub/b.jpg``).
    Other files are ignored, and so are hidden files and folders (names starting with
    ``"."``, such as macOS's AppleDouble ``._photo.jpg``) and ``__MACOSX`` folders, at every
    level: neither is a class, and nothing in them is read (ImageFolder reads them).

    Directory links are followed, but every real directory is read once: a link to a
    directory already read (``loop -> .``, ``up -> ..``, a second link to the same place, a
    link to another class folder) is skipped, with a warning that names it, so each file is
    counted once, under the class folder it is first reached from (classes in sorted order,
    subfolders sorted); a class folder that is a link to another one (``Z -> cat``) is the
    skipped one, whatever the sort order. File links are files: two links to one image are
    two samples, as in ImageFolder.

    A class folder without images stays a class (its index is kept, so every label still
    matches the sorted folder names), with a warning that names it; torchvision's
    ImageFolder raises instead. A folder that cannot be listed (a class folder or one below
    it) is returned, with the reason, for the caller to refuse or skip like an unreadable
    file; it is not a class folder "with no images".

    Args:
        root: the dataset directory.

    Returns:
        ``([(path, label), ...], classes, [(folder, reason), ...])``; the paths are absolute
        (a relative ``root`` is taken from the current directory, once), so a later
        ``os.chdir`` does not change which files they name.

    Raises:
        FileNotFoundError: ``root`` does not exist, or is ``""`` (which ``Path`` would take
            for the current directory).
        NotADirectoryError: ``root`` is a file.
        ValueError: ``root`` has no class subfolders (hidden ones and ``__MACOSX`` do not
            count), or no images in them and no folder that could not be listed.

    Example:
        >>> find_images("/no/such/dir")
        Traceback (most recent call last):
        ...
        FileNotFoundError: image folder '/no/such/dir' does not exist
    """
    if isinstance(root, str) and not root:  # Path("") is ".": the whole working directory
        raise FileNotFoundError(
            "image folder path is empty (''), which would read the current directory as the "
            "dataset; pass the dataset's folder (an unset environment variable?), or '.' for "
            "the current directory"
        )
    # Absolute, so that the files are still found after an os.chdir; ".." kept as given
    # (collapsing it would change where a path through a directory link leads).
    path = Path(root).absolute()
    if not path.exists():
        raise FileNotFoundError(f"image folder {str(root)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(
            f"image source {str(root)!r} is a file; pass a folder laid out as "
            "root/<class>/<image>, or a list of (path, label) pairs"
        )
    classes = _class_names(path, root)
    per_class, repeats, unlisted = _scan_classes(path, classes)
    items = [(f, label) for label, found in enumerate(per_class) for f in found]
    if not items and not unlisted:
        raise ValueError(
            f"image folder {str(root)!r} has class subfolders {list(classes)[:5]} but no "
            f"images in them (suffixes read: {', '.join(IMAGE_EXTENSIONS)})"
        )
    import warnings

    # stacklevel=5: find_images <- _resolve <- load_source <- image_loader <- the caller's line.
    if repeats:
        # shown(): a name that is not UTF-8 would reach the warning as lone surrogates, which
        # logging handlers (logging.captureWarnings) refuse to write, dropping the warning.
        from trainperf.pipelines._source import shown  # not at the top: _source imports this

        rel = [
            f"{shown(os.path.relpath(p, path))} (= {shown(os.path.relpath(first, path))})"
            for p, first in repeats
        ]
        warnings.warn(
            f"image folder {str(root)!r}: skipped {len(repeats)} directory link(s) to folders "
            f"already read, so that each file is counted once, under the class folder it is "
            f"first reached from: {_listed(rel)}; remove the links to silence this",
            stacklevel=5,
        )
    refused = {folder for folder, _ in unlisted}
    empty = [
        f"{name!r} (label {i})"
        for i, name in enumerate(classes)
        if not per_class[i] and os.path.join(path, name) not in refused
    ]
    if empty:
        warnings.warn(
            f"image folder {str(root)!r} has {len(empty)} class folder(s) with no images: "
            f"{_listed(empty)}; kept as classes so that every label matches the sorted folder "
            "names (torchvision's ImageFolder would raise); remove the folder to drop the class, "
            "or add its images",
            stacklevel=5,
        )
    return items, classes, unlisted
