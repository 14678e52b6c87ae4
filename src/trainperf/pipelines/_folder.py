"""Finding the images of an ImageFolder-style directory: classes, files and directory links.

``root/<class>/**/<image>``, as torchvision's ImageFolder reads it, except that every real
directory is read once (links to a directory already read are skipped, and named), a class
folder without images is kept as a class, with a warning, and a folder that cannot be listed
is reported by name (the caller treats it as it treats an unreadable file), and hidden files
and folders (names starting with ".") and the folders operating systems and NAS boxes leave
behind are not read: macOS leaves AppleDouble files (``._photo.jpg``: metadata, not an image)
and ``.DS_Store`` in folders it copies, and ``__MACOSX/`` in the zip files it makes; a
Synology NAS puts real thumbnail JPEGs in an ``@eaDir/`` beside every image; Windows drives
have ``$RECYCLE.BIN/`` (deleted files, suffixes kept) and ``System Volume Information/``, and
ext file systems ``lost+found/``. ImageFolder would take all of them for images and classes.
Image files that are not read (a suffix no backend decodes, such as ``.heic``, or an image
directly in the root, outside every class folder) are counted in one warning, and a top-level
folder passed over that holds images (a real class named ``.cats`` or ``lost+found``: every
later label would differ from ImageFolder's) is named in another.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from trainperf._utils.stack import user_stacklevel

__all__ = ["IMAGE_EXTENSIONS", "Unlisted", "find_images", "is_ignored"]

# The suffixes torchvision's ImageFolder takes, less the rare PPM/PGM/TIF-variants DALI and
# torchvision.io do not all decode, plus JPEG's other suffixes (.jfif, .jpe): every backend
# finds the format from the bytes (trainperf hands DALI and nvJPEG bytes, never a file name).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jfif", ".jpe", ".png", ".bmp", ".tif", ".tiff", ".webp")

# Image formats no backend here decodes: files with these suffixes are left out, and counted
# in a warning (other files, such as labels.txt, are left out without a word).
_UNREAD_IMAGE_SUFFIXES = frozenset(
    (".heic", ".heif", ".avif", ".gif", ".ppm", ".pgm", ".pbm", ".pnm", ".jp2", ".j2k", ".jxl",
     ".tga", ".ico", ".dng", ".cr2", ".nef", ".arw")
)  # fmt: skip

# Folders, compared in lower case, that systems make and no dataset means: macOS's Archive
# Utility's AppleDouble files of a zip (__MACOSX); a Synology NAS's thumbnails (@eaDir), recycle
# bin and snapshots (full copies of the share); a Windows drive's recycle bin ($RECYCLE.BIN:
# deleted files, suffixes kept) and System Volume Information; an ext file system's
# lost+found.
_SYSTEM_FOLDERS = frozenset(
    ("__macosx", "@eadir", "#recycle", "#snapshot", "$recycle.bin", "system volume information",
     "lost+found")
)  # fmt: skip

# Top-level folders passed over are searched for images (to warn that ImageFolder reads them
# as classes) no further than this many entries: a class folder's entries are images, so one
# with none among so many is no class (a large .cache). Those of version control, never a
# class and holding up to millions of objects (a dataset kept in a repository), not at all.
_MAX_SEARCHED = 10_000
_VERSION_CONTROL = frozenset((".git", ".hg", ".svn", ".dvc"))

# (folder, why it cannot be listed), e.g. ("root/cat/sub", "cannot be listed (Permission denied)")
Unlisted = list[tuple[str, str]]


def is_ignored(name: str) -> bool:
    """Whether a file or folder named ``name`` is passed over when a folder is read: hidden
    (``.DS_Store``, ``._photo.jpg``, ``.git``) or a system's folder (``__MACOSX``,
    Synology's ``@eaDir``, ``#recycle`` and ``#snapshot``, ``$RECYCLE.BIN``, ``System Volume
    Information``, ``lost+found``; in any case).

    Example:
        >>> [is_ignored(n) for n in ("._photo.jpg", "__MACOSX", "@eaDir", "photo.jpg", "_a")]
        [True, True, True, False, False]
    """
    return name.startswith(".") or name.lower() in _SYSTEM_FOLDERS


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not is_ignored(name)


def _unread_suffix(name: str) -> str | None:
    """The suffix of an image file that is not read (``".heic"``), or None."""
    suffix = os.path.splitext(name)[1].lower()
    return suffix if suffix in _UNREAD_IMAGE_SUFFIXES and not is_ignored(name) else None


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a directory, links followed: a link that leads to itself (``z ->
    z``) is not one (``DirEntry.is_dir`` raises for it), as a broken link is not (it says
    False for that itself). A link whose target cannot be reached (no permission, an I/O
    error, a stale NFS handle) counts as one: a class folder out of reach is reported as one
    that cannot be listed (``_walk_class``), not dropped, which would shift every later
    class's label."""
    try:
        return entry.is_dir()
    except OSError as e:
        return e.errno != errno.ELOOP


def _dir_key(path: str) -> tuple[int, int] | None:
    """The identity of the directory ``path`` leads to (links followed), or None if unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _walk_class(
    top: str,
    seen: dict[tuple[int, int], str],
    repeats: list[tuple[str, str]],
    unlisted: Unlisted,
    unread: Counter[str],
) -> list[str]:
    """The image files under ``top``, each real directory read once across the whole folder.

    Directory links are followed, but a directory already read (``seen``: identity -> the path
    it was first read through) is not read again; ``(path, first path)`` goes to ``repeats``.
    Subfolders are walked in sorted order, so which path reaches a directory first is fixed.
    Files come in ImageFolder's order: folders sorted by path, files by name within each.
    A directory that cannot be listed (no read permission) goes to ``unlisted``: os.walk
    would pass over it, and its images would vanish without a word. Image files with a suffix
    that is not read are counted, by suffix, in ``unread``.
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
        images = sorted(f for f in filenames if _is_image(f))
        unread.update(s for s in map(_unread_suffix, filenames) if s is not None)
        per_dir.append((dirpath, images))
    # ImageFolder's order (torchvision's make_dataset: sorted(os.walk(...)), then sorted
    # file names): folders by their path, each folder's files by name. Sorting whole file
    # paths instead would put a/sub/x.jpg before a/sub0.jpg ('/' < '0'), not after a/z.jpg.
    return [os.path.join(d, f) for d, images in sorted(per_dir) for f in images]


def _scan_classes(
    path: Path, classes: Sequence[str]
) -> tuple[list[list[str]], list[tuple[str, str]], Unlisted, Counter[str]]:
    """Each class's files, the directories skipped as already read, those not listed, and
    the image files not read, by suffix.

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
    unread: Counter[str] = Counter()
    per_class: list[list[str]] = []
    for name in classes:
        top = os.path.join(path, name)
        first = seen.get(_dir_key(top) or (-1, -1), top)
        if first != top:  # two class folders that are the same directory: read it once
            repeats.append((top, first))
            per_class.append([])
        else:
            per_class.append(_walk_class(top, seen, repeats, unlisted, unread))
    return per_class, repeats, unlisted, unread


def _listed(names: Sequence[str], limit: int = 5) -> str:
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def _class_names(
    path: Path, root: str | os.PathLike[str]
) -> tuple[tuple[str, ...], int, list[str]]:
    """The sorted class folder names of ``path`` (``root`` as given, for the error), the
    number of image files directly in it (which no class folder holds, so are not read), and
    the sorted names of the folders passed over (hidden or a system's)."""
    folders: list[str] = []
    loose: list[str] = []
    with os.scandir(path) as entries:
        for entry in entries:
            if _is_dir(entry):
                folders.append(entry.name)
            elif _is_image(entry.name):
                loose.append(entry.name)
    classes = tuple(sorted(name for name in folders if not is_ignored(name)))
    passed_over = sorted(set(folders) - set(classes))
    if not classes:
        images = [repr(name) for name in sorted(loose)]
        not_read = [repr(name) for name in passed_over]
        raise ValueError(
            f"image folder {str(root)!r} has no class subfolders"
            + (f" (only {_listed(not_read)}, not read)" if passed_over else "")
            + (f", but {len(loose)} images directly in it ({_listed(images)})" if loose else "")
            + "; the layout is root/<class>/<image> (e.g. root/cat/1.jpg, root/dog/2.jpg): "
            "put the images in one folder per class, or pass a list of (path, label) pairs"
        )
    return classes, len(loose), passed_over


def find_images(
    root: str | os.PathLike[str],
) -> tuple[list[tuple[str, int]], tuple[str, ...], Unlisted]:
    """List ``root/<class>/**/<image>`` like torchvision's ImageFolder.

    Classes are the sorted subfolder names; files are those with an image suffix
    (:data:`IMAGE_EXTENSIONS`, case-insensitive; ImageFolder's, plus JPEG's ``.jfif`` and
    ``.jpe``), searched recursively, in ImageFolder's order: by class, then by folder path,
    then by file name within each folder (``a/z.jpg`` before ``a/sub/b.jpg``). Other files are
    ignored, and so are hidden files and folders (names starting with ``"."``, such as macOS's
    AppleDouble ``._photo.jpg``) and systems' folders (:func:`is_ignored`: ``__MACOSX``,
    Synology's ``@eaDir`` thumbnails, ``$RECYCLE.BIN``, ``lost+found``, ...), at every level:
    neither is a class, and nothing in them is read (ImageFolder reads them). Image files left
    out (a suffix no backend decodes, such as ``.heic`` or ``.gif``; an image directly in
    ``root``) are counted in one warning. A hidden or system's folder directly in ``root``
    that holds image files (not only AppleDouble ``._*`` ones; one among its first 10,000
    entries, and none at all for ``.git``, ``.hg``, ``.svn`` and ``.dvc``) is named in a
    warning: ImageFolder reads it as a class, so its classes and labels differ from these.

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
        ValueError: ``root`` has no class subfolders (hidden and systems' folders do not
            count; the message counts the images directly in ``root``), or no images in them
            and no folder that could not be listed.

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
    classes, loose, passed_over = _class_names(path, root)
    per_class, repeats, unlisted, unread = _scan_classes(path, classes)
    items = [(f, label) for label, found in enumerate(per_class) for f in found]
    if not items and not unlisted:
        raise ValueError(
            f"image folder {str(root)!r} has class subfolders {list(classes)[:5]} but no "
            f"images in them (suffixes read: {', '.join(IMAGE_EXTENSIONS)})" + _unread_fix(unread)
        )
    _warn_repeats(path, root, repeats)
    _warn_empty(path, root, classes, per_class, unlisted)
    _warn_left_out(root, unread, loose)
    _warn_passed_over(path, root, passed_over)
    return items, classes, unlisted


def _unread_fix(unread: Counter[str]) -> str:
    """What the no-images error adds when the class folders hold only images of formats not
    read (a GTSRB-style folder of ``.ppm`` files, which ImageFolder reads): which, and the fix.
    """
    if not unread:
        return ""
    by_suffix = ", ".join(f"{suffix}: {n}" for suffix, n in unread.most_common())
    return (
        f"; they hold {sum(unread.values())} image file(s) of formats no backend here decodes "
        f"({by_suffix}): convert them to PNG or JPEG to use them (where Pillow reads them: "
        "PIL.Image.open(p).save(p.with_suffix('.png')))"
    )


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, stacklevel=user_stacklevel())  # the caller's image_loader(...)


def _warn_empty(
    path: Path,
    root: str | os.PathLike[str],
    classes: Sequence[str],
    per_class: list[list[str]],
    unlisted: Unlisted,
) -> None:
    """Warn of the class folders with no images (not those that cannot be listed), if any."""
    refused = {folder for folder, _ in unlisted}
    empty = [
        f"{name!r} (label {i})"
        for i, name in enumerate(classes)
        if not per_class[i] and os.path.join(path, name) not in refused
    ]
    if empty:
        _warn(
            f"image folder {str(root)!r} has {len(empty)} class folder(s) with no images: "
            f"{_listed(empty)}; kept as classes so that every label matches the sorted folder "
            "names (torchvision's ImageFolder would raise); remove the folder to drop the class, "
            "or add its images"
        )


def _warn_repeats(path: Path, root: str | os.PathLike[str], repeats: list[tuple[str, str]]) -> None:
    """Warn of the directory links skipped, if any."""
    if not repeats:
        return
    # shown(): a name that is not UTF-8 would reach the warning as lone surrogates, which
    # logging handlers (logging.captureWarnings) refuse to write, dropping the warning.
    from trainperf.pipelines._source import shown  # not at the top: _source imports this

    rel = [
        f"{shown(os.path.relpath(p, path))} (= {shown(os.path.relpath(first, path))})"
        for p, first in repeats
    ]
    _warn(
        f"image folder {str(root)!r}: skipped {len(repeats)} directory link(s) to folders "
        f"already read, so that each file is counted once, under the class folder it is "
        f"first reached from: {_listed(rel)}; remove the links to silence this"
    )


def _warn_left_out(root: str | os.PathLike[str], unread: Counter[str], loose: int) -> None:
    """Warn, once, of the image files not read: by suffix, and those outside the classes."""
    said = []
    if unread:
        by_suffix = ", ".join(f"{suffix}: {n}" for suffix, n in unread.most_common())
        said.append(
            f"{sum(unread.values())} image file(s) with a suffix that is not read ({by_suffix}); "
            "convert them to JPEG or PNG to use them"
        )
    if loose:
        said.append(
            f"{loose} image file(s) directly in the folder, outside every class folder, so "
            "without a label; move them into their class folder to use them"
        )
    if said:
        _warn(f"image folder {str(root)!r}: left out " + "; and ".join(said))


def _holds_images(folder: str) -> bool:
    """Whether ``folder`` holds, at any depth (links to folders not followed), a file with an
    image suffix that is not macOS's AppleDouble metadata (``._photo.jpg``, all that a
    ``__MACOSX`` folder holds) among its first ``_MAX_SEARCHED`` entries. Stops at the first;
    False once it has read that many without finding one: a class folder's entries are
    images, so such a folder is no class (a ``.cache`` of a million files beside the
    classes, which would otherwise be read, and warned of, on every scan)."""
    pending, left = [folder], _MAX_SEARCHED
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    name = entry.name
                    if _is_dir(entry):
                        if not entry.is_symlink():
                            pending.append(entry.path)
                    elif name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith("._"):
                        return True
                    left -= 1
                    if left == 0:
                        return False
        except OSError:  # cannot be listed: passed over, as os.walk does
            continue
    return False


def _warn_passed_over(path: Path, root: str | os.PathLike[str], passed_over: list[str]) -> None:
    """Warn, once, of the top-level folders passed over (hidden or a system's) that hold
    images: ImageFolder reads each as a class, so its classes and labels differ from these."""
    from trainperf.pipelines._source import shown  # not at the top: _source imports this

    with_images = [
        f"'{shown(name)}'"
        for name in passed_over
        if name.lower() not in _VERSION_CONTROL and _holds_images(os.path.join(path, name))
    ]
    if with_images:
        _warn(
            f"image folder {str(root)!r}: {len(with_images)} top-level folder(s) holding images "
            f"not read as classes, being hidden or a system's folder: {_listed(with_images)}; "
            "torchvision's ImageFolder reads each as a class, so its classes and labels differ "
            "from these. To keep such a folder as a class, rename it (no leading '.', not a "
            "system's folder name) or pass a list of (path, label) pairs; if it is not a class, "
            "move it out of the image folder to silence this"
        )
