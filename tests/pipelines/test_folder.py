"""trainperf.pipelines._folder: the order of an image folder's files, and the link warning."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines._images import CPU_BACKENDS, _loader, add_macos_litter
from trainperf.pipelines._folder import find_images

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")

# One class with files beside its subfolders, which whole-path sorting puts out of
# ImageFolder's order ('/' sorts before digits and letters): upper-case suffixes, digits,
# underscores, and subfolder names that are prefixes of each other and of file names.
_NAMES = [
    "a/x1.JPG", "a/sub0.jpg", "a/sub/deep.PNG", "a/sub/inner/w.jpg", "a/sub_1/y.jpeg",
    "a/sub-x/z.png", "a/Sub/big.jpg", "a/10.jpg", "a/9.jpg", "a/a_2.png", "a/A.PNG",
    "a/sub.jpg", "b_2/1.jpg", "b_2/n/0.png", "b10/only.bmp",
]  # fmt: skip


def _mixed_folder(root: Path) -> Path:
    for name in _NAMES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        image = PIL.new("RGB", (8, 8), (10, 20, 30))
        image.save(root / name, format="PNG" if name.lower().endswith(".png") else None)
    return root


def _imagefolder_samples(root: Path) -> list[tuple[str, int]]:
    samples: list[tuple[str, int]] = torchvision.datasets.ImageFolder(str(root)).samples
    return samples


def test_files_come_in_imagefolders_exact_order(tmp_path: Path) -> None:
    root = _mixed_folder(tmp_path / "data")
    items, classes, unlisted = find_images(root)
    assert classes == ("a", "b10", "b_2") and unlisted == []
    assert items == _imagefolder_samples(root)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_both_backends_read_the_files_in_imagefolders_order(tmp_path: Path, backend: str) -> None:
    root = _mixed_folder(tmp_path / "data")
    loader = _loader(root, backend, train=False, size=8, batch_size=1, last_batch="keep")
    expected = _imagefolder_samples(root)
    assert list(zip(loader.files, loader.source.labels, strict=True)) == expected
    labels = [int(label) for _, batch_labels in loader for label in batch_labels]
    assert labels == [label for _, label in expected]


def test_a_link_warning_shows_a_name_that_is_not_utf8_escaped(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "b").mkdir(parents=True)
    PIL.new("RGB", (4, 4)).save(root / "b" / "b.png")
    try:
        os.symlink(".", os.path.join(os.fsencode(root / "b"), b"loop\xe9"))
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    with pytest.warns(UserWarning, match=r"skipped 1 directory link") as caught:
        find_images(root)
    message = str(caught[0].message)
    assert "b/loop\\xe9 (= b)" in message
    message.encode("utf-8")  # lone surrogates here are what logging handlers refuse to write


@pytest.mark.parametrize("layout", ["empty_class", "link"])
def test_folder_warnings_name_the_line_that_called_image_loader(
    tmp_path: Path, layout: str
) -> None:
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    PIL.new("RGB", (4, 4)).save(root / "a" / "0.png")
    if layout == "empty_class":
        (root / "b").mkdir()
    else:
        (root / "a" / "loop").symlink_to(".")
    with pytest.warns(UserWarning, match=r"class folder\(s\) with no images|directory link") as w:
        _loader(root, "torchvision", batch_size=1)
    assert [os.path.basename(r.filename) for r in w] == ["_images.py"]  # _loader's line


def test_a_class_folder_linked_to_another_does_not_take_its_images(tmp_path: Path) -> None:
    # "Z -> cat" sorts before "cat": the link was read first and took cat's images, and the
    # real folder was reported as a class with no images.
    root = tmp_path / "data"
    (root / "cat").mkdir(parents=True)
    PIL.new("RGB", (4, 4)).save(root / "cat" / "0.png")
    (root / "Z").symlink_to(root / "cat")
    with pytest.warns(UserWarning) as caught:
        items, classes, _ = find_images(root)
    assert classes == ("Z", "cat")
    assert items == [(str(root / "cat" / "0.png"), 1)]
    messages = " ".join(str(w.message) for w in caught)
    assert "Z (= cat)" in messages and "no images: 'Z' (label 0)" in messages


def test_a_relative_root_gives_absolute_paths_and_messages_quote_it_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _mixed_folder(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    items, _, _ = find_images("./data")
    assert [p for p, _ in items] == [str(root / name) for name in _order(root)]
    monkeypatch.chdir(root / "a")
    nested = [p for p, _ in find_images(Path("..", "..", "data"))[0]]
    assert nested == [str(tmp_path / "data" / "a" / ".." / ".." / "data" / n) for n in _order(root)]
    assert all(os.path.exists(p) for p in nested)  # ".." is kept: links stay followed as given
    (tmp_path / "empty" / "c").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"image folder 'empty' has class subfolders"):
        find_images("empty")


def _order(root: Path) -> list[str]:
    return [os.path.relpath(p, root) for p, _ in _imagefolder_samples(root)]


@pytest.mark.parametrize("where", ["root", "class", "subfolder"])
def test_hidden_files_and_macos_folders_are_not_read(tmp_path: Path, where: str) -> None:
    # AppleDouble files ("._x.jpg") failed the header check; "__MACOSX" became class 0.
    root = _mixed_folder(tmp_path / "data")
    expected = find_images(root)
    add_macos_litter(root, where)
    if where == "root":  # its hidden folders hold real images: ImageFolder reads them
        with pytest.warns(UserWarning, match=r"3 top-level folder\(s\) holding images"):
            assert find_images(root) == expected
    else:
        assert find_images(root) == expected


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_backend_reads_a_folder_copied_from_macos(
    folder: Path, tmp_path: Path, backend: str
) -> None:
    import shutil

    root = Path(shutil.copytree(folder, tmp_path / "copied"))
    for where in ("root", "class", "subfolder"):
        add_macos_litter(root, where)
    with pytest.warns(UserWarning, match=r"top-level folder\(s\) holding images"):
        loader = _loader(root, backend, train=False, batch_size=4, last_batch="keep")
    assert loader.classes == ("a_red", "b_blue") and not loader.skipped
    original = [os.path.relpath(p, folder) for p, _ in find_images(folder)[0]]
    assert [os.path.relpath(p, root) for p in loader.files] == original
    assert sum(len(labels) for _, labels in loader) == len(loader.files)


def test_a_folder_with_only_hidden_folders_names_them(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "__MACOSX" / "cat").mkdir(parents=True)
    (root / ".git").mkdir()
    PIL.new("RGB", (4, 4)).save(root / "__MACOSX" / "cat" / "0.png")
    with pytest.raises(
        ValueError, match=r"has no class subfolders \(only '.git', '__MACOSX', not read\)"
    ):
        find_images(root)


@pytest.mark.parametrize(
    "name", ["@eaDir", "#recycle", "#snapshot", "$RECYCLE.BIN", "System Volume Information",
             "lost+found"],
)  # fmt: skip
def test_nas_and_system_folders_are_neither_classes_nor_read(tmp_path: Path, name: str) -> None:
    # A Synology NAS puts "@eaDir/<image>/SYNOPHOTO_THUMB_XL.jpg" (real JPEGs) beside every
    # image: at the top it became a class, inside a class it added each image's thumbnails.
    root = _mixed_folder(tmp_path / "data")
    expected = find_images(root)
    for parent in (root, root / "a", root / "a" / "sub"):
        litter = parent / name / "x.jpg"
        litter.mkdir(parents=True)
        PIL.new("RGB", (8, 8)).save(litter / "SYNOPHOTO_THUMB_XL.jpg")
    with pytest.warns(UserWarning, match=rf"holding images .*{re.escape(repr(name))}"):
        assert find_images(root) == expected  # named, as ImageFolder reads it as a class


def test_images_directly_in_the_root_are_counted_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    for name in ("b.jpg", "a.png", "notes.txt"):
        PIL.new("RGB", (4, 4)).save(root / name, format="PNG")
    with pytest.raises(
        ValueError,
        match=r"has no class subfolders, but 2 images directly in it \('a.png', 'b.jpg'\).*"
        r"one folder per class.*list of \(path, label\) pairs",
    ):
        find_images(root)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_jfif_and_jpe_files_are_read_by_every_backend(tmp_path: Path, backend: str) -> None:
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    for name in ("0.jpg", "1.jfif", "2.JPE"):
        PIL.new("RGB", (8, 8), (200, 10, 10)).save(root / "a" / name, format="JPEG")
    loader = _loader(root, backend, train=False, size=8, batch_size=3, last_batch="keep")
    assert [os.path.basename(p) for p in loader.files] == ["0.jpg", "1.jfif", "2.JPE"]
    images = torch.cat([batch for batch, _ in loader])
    assert images.shape[0] == 3 and bool(torch.equal(images[0], images[1]))


def test_image_files_left_out_are_counted_in_one_warning(tmp_path: Path) -> None:
    root = _mixed_folder(tmp_path / "data")
    for name in ("a/0.heic", "a/sub/1.HEIC", "b10/2.gif", "b10/labels.txt", "b10/.x.heic"):
        (root / name).write_bytes(b"not read")
    PIL.new("RGB", (4, 4)).save(root / "stray.jpg")
    with pytest.warns(UserWarning) as caught:
        items, _, _ = find_images(root)
    assert items == _imagefolder_samples(root)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "3 image file(s) with a suffix that is not read (.heic: 2, .gif: 1)" in message
    assert "1 image file(s) directly in the folder, outside every class folder" in message
    assert "convert" in message and "labels.txt" not in message


def test_a_folder_of_only_unread_formats_says_which_and_how_to_convert_them(
    tmp_path: Path,
) -> None:
    # GTSRB ships as class folders of .ppm files, which ImageFolder reads: the error said
    # "no images in them", and the warning that names the .ppm files never came (it raised
    # first), so nothing said what was found or what to do.
    root = tmp_path / "GTSRB"
    for cls in ("00000", "00001"):
        (root / cls).mkdir(parents=True)
        for i in range(2):
            PIL.new("RGB", (8, 8)).save(root / cls / f"{i}.ppm")
    (root / "00001" / "x.pgm").write_bytes(b"P5 1 1 255 x")
    with pytest.raises(
        ValueError,
        match=r"but no images in them .*; they hold 5 image file\(s\) of formats no backend "
        r"here decodes \(\.ppm: 4, \.pgm: 1\): convert them to PNG or JPEG to use them",
    ):
        find_images(root)


def test_a_folder_without_left_out_files_does_not_warn(tmp_path: Path) -> None:
    import warnings

    root = _mixed_folder(tmp_path / "data")
    (root / "a" / "labels.txt").write_text("cat")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_images(root)


@pytest.mark.parametrize("name", [".cats", "lost+found", "#recycle", "@eaDir"])
def test_a_passed_over_top_level_folder_holding_images_is_named_once(
    tmp_path: Path, name: str
) -> None:
    # A real class folder with such a name was dropped without a word, so every label after
    # it differed from ImageFolder's.
    root = _mixed_folder(tmp_path / "data")
    (root / name / "deep").mkdir(parents=True)
    PIL.new("RGB", (4, 4)).save(root / name / "deep" / "0.jpg")
    (root / ".empty").mkdir()
    with pytest.warns(UserWarning) as caught:
        _, classes, _ = find_images(root)
    assert name not in classes
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "1 top-level folder(s) holding images not read as classes" in message
    assert repr(name) in message and "'.empty'" not in message
    assert "ImageFolder" in message and "rename it" in message
    assert "list of (path, label) pairs" in message


def test_passed_over_top_level_folders_without_images_do_not_warn(tmp_path: Path) -> None:
    import warnings

    root = _mixed_folder(tmp_path / "data")
    add_macos_litter(root, "class")
    (root / "__MACOSX" / "a").mkdir(parents=True)  # what a macOS zip holds: AppleDouble only
    (root / "__MACOSX" / "a" / "._x1.JPG").write_bytes(b"\x00\x05\x16\x07")
    (root / ".git" / "objects").mkdir(parents=True)
    (root / ".git" / "objects" / "ab12").write_bytes(b"not an image")
    (root / "lost+found").mkdir()
    (root / ".DS_Store").write_bytes(bytes(16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_images(root)


def test_folder_warnings_name_the_line_that_called_find_images(tmp_path: Path) -> None:
    # stacklevel=7 counted the frames from image_loader: called any other way, the warning
    # named a line inside pytest or the standard library.
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    PIL.new("RGB", (4, 4)).save(root / "a" / "0.png")
    with pytest.warns(UserWarning, match=r"class folder\(s\) with no images") as caught:
        find_images(root)
    assert [r.filename for r in caught] == [__file__]


class _CountedScandir:
    """``os.scandir``'s iterator, recording the path of every entry it yields."""

    def __init__(self, entries: os._ScandirIterator[str], read: list[str]) -> None:
        self.entries, self.read = entries, read

    def __enter__(self) -> _CountedScandir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.entries.close()

    def __iter__(self) -> _CountedScandir:
        return self

    def __next__(self) -> os.DirEntry[str]:
        entry = next(self.entries)
        self.read.append(entry.path)
        return entry

    def close(self) -> None:
        self.entries.close()


def _count_entries_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    read: list[str] = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": _CountedScandir(scandir(path), read))
    return read


def test_a_huge_hidden_top_level_folder_is_searched_for_images_only_so_far(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The search for images in a passed-over folder walked its whole tree: a .cache or a
    # .venv of a million files beside the classes was read on every scan.
    import trainperf.pipelines._folder as folder_module

    root = _mixed_folder(tmp_path / "data")
    for i in range(30):
        (root / ".cache" / f"{i:02d}").mkdir(parents=True)
        for j in range(10):
            (root / ".cache" / f"{i:02d}" / f"{j}.bin").write_bytes(b"")
    (root / ".cats" / "deep").mkdir(parents=True)
    PIL.new("RGB", (4, 4)).save(root / ".cats" / "deep" / "0.jpg")
    monkeypatch.setattr(folder_module, "_MAX_SEARCHED", 100)
    read = _count_entries_read(monkeypatch)
    with pytest.warns(UserWarning, match="holding images") as caught:
        _, classes, _ = find_images(root)
    assert ".cache" not in classes and ".cats" not in classes
    assert 0 < sum(os.sep + ".cache" + os.sep in p for p in read) <= 100
    (message,) = [str(w.message) for w in caught if "holding images" in str(w.message)]
    # A hidden class folder's entries are images: 100 without one is no class, and not
    # warned of (before: "'.cache' (over 100 entries: may hold images)", on every scan).
    assert "'.cats'" in message and ".cache" not in message


@pytest.mark.parametrize("position", [99, 100, 101])
def test_a_hidden_folder_is_warned_of_only_for_an_image_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, position: int
) -> None:
    # Before: a folder of exactly 100 entries, read whole, was named as "over 100 entries:
    # may hold images", as was any larger one without an image among its first 100.
    import warnings

    import trainperf.pipelines._folder as folder_module

    root = _mixed_folder(tmp_path / "data")
    # A folder's own entries are read before those of its subfolders: .cache's files and
    # "deep", then the image in deep, the position-th entry read.
    (root / ".cache" / "deep").mkdir(parents=True)
    for i in range(position - 2):
        (root / ".cache" / f"{i:03d}.bin").write_bytes(b"")
    PIL.new("RGB", (4, 4)).save(root / ".cache" / "deep" / "0.jpg")
    monkeypatch.setattr(folder_module, "_MAX_SEARCHED", 100)
    if position <= 100:
        with pytest.warns(UserWarning, match="holding images") as caught:
            _, classes, _ = find_images(root)
        (message,) = [str(w.message) for w in caught if "holding images" in str(w.message)]
        assert "'.cache'" in message
    else:  # 100 entries read without an image: no class, and not warned of
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, classes, _ = find_images(root)
    assert ".cache" not in classes


@pytest.mark.parametrize("name", [".git", ".hg", ".svn", ".dvc"])
def test_a_version_control_folder_is_not_searched_for_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # A dataset kept in a repository has its .git beside the classes: never a class, and it
    # can hold millions of objects, so it is not read at all (and not warned of).
    import warnings

    root = _mixed_folder(tmp_path / "data")
    (root / name / "lfs").mkdir(parents=True)
    PIL.new("RGB", (4, 4)).save(root / name / "lfs" / "cat.jpg")
    read = _count_entries_read(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, classes, _ = find_images(root)
    assert name not in classes
    assert not [p for p in read if os.sep + name + os.sep in p]


def test_a_link_loop_beside_the_classes_is_not_a_class_and_does_not_stop_the_scan(
    tmp_path: Path,
) -> None:
    # A link that leads to itself (z -> z) made DirEntry.is_dir() raise "Too many levels of
    # symbolic links": find_images failed with a bare OSError, leaking its directory listing.
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    PIL.new("RGB", (4, 4)).save(root / "a" / "0.png")
    (root / "z").symlink_to("z")
    (root / ".cats").mkdir()
    (root / ".cats" / "loop").symlink_to("loop")
    PIL.new("RGB", (4, 4)).save(root / ".cats" / "0.png")
    with pytest.warns(UserWarning, match="'.cats'"):
        items, classes, unlisted = find_images(root)
    assert classes == ("a",) and unlisted == []
    assert [Path(p).name for p, _ in items] == ["0.png"]


class _OutOfReach:
    """A directory entry for a link whose target cannot be reached (``EACCES``: a folder on
    the way without search permission), which a root user cannot make happen for real."""

    def __init__(self, entry: os.DirEntry[str]) -> None:
        self.name, self.path = entry.name, entry.path

    def _refused(self) -> PermissionError:
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), self.path)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        raise self._refused()

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        raise self._refused()

    def is_symlink(self) -> bool:
        return True


class _Listing:
    """``os.scandir``'s iterator, its entries named in ``out_of_reach`` replaced."""

    def __init__(self, entries: os._ScandirIterator[str], out_of_reach: set[str]) -> None:
        self.entries, self.out_of_reach = entries, out_of_reach

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.entries.close()

    def __iter__(self) -> _Listing:
        return self

    def __next__(self) -> os.DirEntry[str] | _OutOfReach:
        entry = next(self.entries)
        return _OutOfReach(entry) if entry.path in self.out_of_reach else entry

    def close(self) -> None:
        self.entries.close()


@pytest.mark.parametrize("name", ["b", ".b"])
def test_a_class_folder_link_out_of_reach_is_unlisted_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Before: DirEntry.is_dir() raising PermissionError for a link to a place out of reach
    # dropped the folder as no class, so every later class took the label before it.
    root = _mixed_folder(tmp_path / "data")
    (tmp_path / "elsewhere").mkdir()
    PIL.new("RGB", (4, 4)).save(tmp_path / "elsewhere" / "0.png")
    (root / name).symlink_to(tmp_path / "elsewhere")
    (root / "zebra").mkdir()
    PIL.new("RGB", (4, 4)).save(root / "zebra" / "1.png")
    link = str(root / name)
    scandir = os.scandir

    def out_of_reach(path: Any = ".") -> _Listing:
        if os.fspath(path) == link:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), link)
        return _Listing(scandir(path), {link})

    monkeypatch.setattr(os, "scandir", out_of_reach)
    items, classes, unlisted = find_images(root)
    if name == "b":  # a class as any folder is: reported as one that cannot be listed
        assert "b" in classes
        assert unlisted == [(link, "cannot be listed (Permission denied)")]
    else:  # hidden: passed over, as it was, and not searched
        assert ".b" not in classes and unlisted == []
    zebra = classes.index("zebra")
    assert zebra == len(classes) - 1
    assert {label for p, label in items if Path(p).parent.name == "zebra"} == {zebra}
