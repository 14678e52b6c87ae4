"""trainperf.pipelines._source: finding and checking the files, sharding, epoch order."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.pipelines._images import (
    CPU_BACKENDS,
    NO_TUNING,
    SIZE,
    SMALL_LIMIT,
    _indices,
    _loader,
)
from trainperf.pipelines import image_loader
from trainperf.pipelines._source import (
    check_files,
    epoch_indices,
    find_images,
    load_source,
    read_checked,
    resolve_shard,
    shard_plan,
    shown,
)

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


def test_shard_auto_follows_torch_distributed(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert resolve_shard("auto") == (1, 2)
    loader = image_loader(
        folder, 4, size=SIZE, device="cpu", backend="torchvision", loader_kwargs=NO_TUNING
    )
    assert (loader.shard.rank, loader.shard.world_size, len(loader)) == (1, 2, 3)
    assert _indices(loader) == epoch_indices(
        24, 1, 2, shuffle=True, seed=0, epoch=0, last_batch="drop"
    )


def test_shard_auto_reads_torchrun_variables_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_shard("auto") == (3, 4)
    monkeypatch.delenv("RANK")
    assert resolve_shard("auto") == (0, 1)


def test_shard_auto_reads_an_srun_tasks_variables_before_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert resolve_shard("auto") == (2, 4)
    monkeypatch.delenv("SLURM_STEP_ID")  # the batch script itself: one process
    assert resolve_shard("auto") == (0, 1)


def test_shard_auto_uses_trainperf_ddp_rank_and_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.ddp

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(trainperf.ddp, "rank", lambda: 2)
    monkeypatch.setattr(trainperf.ddp, "world_size", lambda: 5)
    assert resolve_shard("auto") == (2, 5)
    monkeypatch.setattr(trainperf.ddp, "rank", lambda: 5)
    with pytest.raises(ValueError, match=r"shard needs 0 <= rank < world_size, got rank=5"):
        resolve_shard("auto")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_order_is_exactly_distributed_samplers(world: int, drop: bool, shuffle: bool) -> None:
    from torch.utils.data import DistributedSampler

    data = list(range(23))
    for rank in range(world):
        sampler = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop
        )
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            ours = epoch_indices(
                23,
                rank,
                world,
                shuffle=shuffle,
                seed=7,
                epoch=epoch,
                last_batch="drop" if drop else "keep",
            )
            assert ours == list(sampler)


def test_shard_plan_gives_every_rank_the_same_number_of_batches() -> None:
    for n in range(1, 40):
        for world in (1, 2, 3, 4):
            for batch in (1, 3, 8):
                for last in ("keep", "drop"):
                    per_rank = n // world if last == "drop" else math.ceil(n / world)
                    if (per_rank < batch and last == "drop") or per_rank == 0:
                        continue
                    plans = [shard_plan(n, batch, r, world, last) for r in range(world)]  # type: ignore[arg-type]
                    assert len({(p.batches, p.samples) for p in plans}) == 1
                    p = plans[0]
                    assert (p.batches - 1) * batch + p.last_batch_size == p.samples


def test_missing_path_empty_folder_and_wrong_layout(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        image_loader(tmp_path / "nope", 4, device="cpu")
    (tmp_path / "file.jpg").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        image_loader(tmp_path / "file.jpg", 4, device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        image_loader(tmp_path / "empty", 4, device="cpu")
    (tmp_path / "empty" / "cats").mkdir()
    (tmp_path / "empty" / "cats" / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match="but no images in them"):
        image_loader(tmp_path / "empty", 4, device="cpu")


def test_an_empty_folder_path_is_refused_not_read_as_the_current_directory(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.environ.get("DATA", "") unset: Path("") is ".", which holds a dataset here.
    monkeypatch.chdir(folder)
    with pytest.raises(FileNotFoundError, match=r"image folder path is empty \(''\).*'\.' for"):
        image_loader("", 4, device="cpu", backend="torchvision", loader_kwargs=NO_TUNING)
    assert len(load_source(".", on_error="raise").files) == 24  # "." says so: it is read


def test_a_bytes_folder_path_is_refused_with_the_fix(folder: Path) -> None:
    # bytes are a Sequence, of ints: this said "source[0] must be a (path, label) pair, got 47"
    with pytest.raises(TypeError, match=r"got bytes b'/.*'; pass os\.fsdecode\(source\)"):
        image_loader(os.fsencode(folder), 4, device="cpu", backend="torchvision")


def test_non_image_and_empty_files_are_named_up_front(bad_folder: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"(?s)2 of 26 files.*notes\.jpg: not a supported image"
        r".*empty\.jpg: empty file.*on_error='skip'",
    ):
        image_loader(bad_folder, 4, device="cpu", backend="torchvision", loader_kwargs=NO_TUNING)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_truncated_jpeg_is_skipped_by_the_decode_check(
    truncated_folder: Path, backend: str
) -> None:
    with pytest.warns(UserWarning, match="truncated.jpg"):
        loader = _loader(truncated_folder, backend, on_error="skip", batch_size=8)
    assert [Path(b.path).name for b in loader.skipped] == ["truncated.jpg"]
    assert "cannot be decoded" in loader.skipped[0].reason
    assert sorted(_indices(loader)) == list(range(24))


def test_every_file_bad_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.jpg").write_text("nope")
    with pytest.raises(ValueError, match="none of the 1 files"):
        load_source(tmp_path, on_error="skip")


def test_list_sources_are_checked(folder: Path) -> None:
    good = str(next(folder.glob("a_red/*.jpg")))
    with pytest.raises(ValueError, match=r"list of .* pairs is empty"):
        image_loader([], 4, device="cpu")
    with pytest.raises(TypeError, match=r"source\[0\] must be a \(path, label\) pair"):
        image_loader([good], 4, device="cpu")  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"source\[1\] label must be an integer >= 0 .*, got -1"):
        image_loader([(good, 0), (good, -1)], 4, device="cpu")
    with pytest.raises(TypeError, match=r"source\[0\] path must be a str"):
        image_loader([(3, 0)], 4, device="cpu")  # type: ignore[list-item]
    with pytest.raises(TypeError, match="source must be a folder path or a list"):
        image_loader(42, 4, device="cpu")  # type: ignore[arg-type]
    loader = image_loader(
        [(good, 2), (good, 0)],
        2,
        device="cpu",
        backend="torchvision",
        size=SIZE,
        loader_kwargs=NO_TUNING,
    )
    assert loader.classes == ("0", "1", "2")


def test_list_labels_may_be_numpy_or_torch_integers(folder: Path) -> None:
    good = str(next(folder.glob("a_red/*.jpg")))
    items = [(good, np.int64(2)), (good, torch.tensor(0)), (good, np.uint8(1))]
    source = load_source(items, on_error="raise")
    assert source.labels == (2, 0, 1)
    assert all(type(label) is int for label in source.labels)
    assert source.classes == ("0", "1", "2")


@pytest.mark.parametrize(
    "label", [True, np.bool_(False), torch.tensor(True), 1.0, np.float64(1), "1", np.int64(-1)]
)
def test_list_labels_that_are_not_integers_are_refused(folder: Path, label: object) -> None:
    good = str(next(folder.glob("a_red/*.jpg")))
    with pytest.raises(ValueError, match=r"source\[0\] label must be an integer >= 0 \(int, numpy"):
        load_source([(good, label)], on_error="raise")


def test_header_check_reports_each_problem(tmp_path: Path) -> None:
    (tmp_path / "dir.jpg").mkdir()
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("hello")
    # The header is all the check reads: a PNG's signature and IHDR chunk (4 x 4 pixels).
    ihdr = (13).to_bytes(4, "big") + b"IHDR" + (4).to_bytes(4, "big") + (4).to_bytes(4, "big")
    (tmp_path / "ok.png").write_bytes(b"\x89PNG\r\n\x1a\n" + ihdr)
    (tmp_path / "cut.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 8)  # no image size
    names = ("dir.jpg", "empty.jpg", "text.jpg", "ok.png", "gone.jpg", "cut.png")
    results = check_files([str(tmp_path / n) for n in names])
    assert [r[0] for r in results] == [None, None, None, "png", None, "png"]
    assert results[0][1] == "is a directory, not an image file"
    assert results[1][1] == "empty file"
    assert (results[2][1] or "").startswith("not a supported image (starts with b'hello'")
    assert results[3][1] is None and results[4][1] == "file not found"
    assert results[5][1] == "is truncated: its header ends before the image size"


def test_many_files_are_checked_in_threads(tmp_path: Path) -> None:
    paths = []
    for i in range(80):
        p = tmp_path / f"{i}.bmp"
        p.write_bytes(b"BM" + bytes(14) if i % 7 else b"")
        paths.append(str(p))
    results = check_files(paths, threads=4)
    assert [r[1] == "empty file" for r in results] == [i % 7 == 0 for i in range(80)]


def _tiny_png(path: Path) -> None:
    PIL.new("RGB", (4, 4), (10, 20, 30)).save(path)


def _looping_folder(root: Path) -> Path:
    """12 files in two classes, with ``a/loop -> .`` and ``b/up -> ..`` (the sweep's case)."""
    for name in ("a", "b"):
        (root / name / "sub").mkdir(parents=True)
        for i in range(3):
            _tiny_png(root / name / f"{i}.png")
            _tiny_png(root / name / "sub" / f"{i}.png")
    (root / "a" / "loop").symlink_to(".")
    (root / "b" / "up").symlink_to("..")
    return root


def test_directory_symlink_loops_count_each_file_once_under_its_class(tmp_path: Path) -> None:
    root = _looping_folder(tmp_path / "data")
    with pytest.warns(UserWarning, match=r"skipped 2 directory link\(s\).*a/loop.*b/up"):
        src = load_source(root, on_error="raise")
    assert len(src.files) == 12
    assert len({os.path.realpath(f) for f in src.files}) == 12
    for path, label in zip(src.files, src.labels, strict=True):
        parts = Path(path).relative_to(root).parts
        assert parts[0] == src.classes[label]
        assert "loop" not in parts and "up" not in parts


def test_directory_links_are_followed_once_and_first_reached_wins(tmp_path: Path) -> None:
    root = tmp_path / "data"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    _tiny_png(outside / "x.png")
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        _tiny_png(root / name / "own.png")
    (root / "a" / "more").symlink_to(outside)  # a real link out of the tree: followed
    (root / "b" / "same").symlink_to(outside)  # the same directory again: skipped, named
    (root / "b" / "to_a").symlink_to(root / "a")  # another class folder: skipped, named
    with pytest.warns(UserWarning, match=r"skipped 2 directory link\(s\)") as caught:
        items, classes, unlisted = find_images(root)
    message = str(caught[0].message)
    assert "b/same (= a/more)" in message and "b/to_a (= a)" in message
    assert classes == ("a", "b") and unlisted == []
    names = sorted((Path(p).relative_to(root).as_posix(), label) for p, label in items)
    assert names == [("a/more/x.png", 0), ("a/own.png", 0), ("b/own.png", 1)]


def test_empty_class_folder_warns_by_name_and_keeps_its_index(tmp_path: Path) -> None:
    root = tmp_path / "data"
    for name in ("a", "b_empty", "c"):
        (root / name).mkdir(parents=True)
    _tiny_png(root / "a" / "1.png")
    _tiny_png(root / "c" / "1.png")
    (root / "b_empty" / "readme.txt").write_text("no images here")
    with pytest.warns(UserWarning, match=r"class folder\(s\) with no images: 'b_empty'"):
        src = load_source(root, on_error="raise")
    assert src.classes == ("a", "b_empty", "c")
    assert src.labels == (0, 2)


# ------------------------------------------------------------------ the pixel limit, up front

BOMB_REASON = "has 30000x30000 = 900,000,000 pixels, over max_pixels=20,000 (a bomb guard)"
BIG_REASON = "has 300x200 = 60,000 pixels, over max_pixels=20,000 (a bomb guard)"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_images_over_max_pixels_are_refused_up_front_naming_them_and_the_fix(
    bomb_folder: Path, backend: str
) -> None:
    with pytest.raises(ValueError) as refused:
        _loader(bomb_folder, backend, max_pixels=SMALL_LIMIT)
    message = str(refused.value)
    assert "2 of 26 files" in message
    assert f"bomb.jpg: {BOMB_REASON}" in message and f"big.png: {BIG_REASON}" in message
    assert "pass a larger image_loader(..., max_pixels=...) (now 20,000; None: no limit)" in message
    # The default limit (Pillow's) lets the real 300 x 200 image through, not the bomb.
    with pytest.raises(ValueError, match=r"(?s)1 of 26 files.*bomb\.jpg: has 30000x30000"):
        _loader(bomb_folder, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_images_over_max_pixels_are_skipped_without_being_decoded(
    bomb_folder: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.pipelines._source as source_module

    decoded: list[str] = []
    real = source_module.decode_problem

    def spy(path: str) -> str | None:
        decoded.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(source_module, "decode_problem", spy)
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable file\(s\).*bomb\.jpg"):
        loader = _loader(
            bomb_folder, backend, on_error="skip", max_pixels=SMALL_LIMIT, last_batch="keep"
        )
    assert {Path(b.path).name: b.reason for b in loader.skipped} == {
        "bomb.jpg": BOMB_REASON,
        "big.png": BIG_REASON,
    }
    # Refused from its header: the bomb (and the big image) never reached a decoder.
    assert len(decoded) == 24 and "bomb.jpg" not in decoded and "big.png" not in decoded
    assert sorted(_indices(loader)) == list(range(24))


def test_max_pixels_none_is_no_limit_and_the_limit_is_inclusive(bomb_folder: Path) -> None:
    big = str(bomb_folder / "b_blue" / "big.png")
    assert load_source([(big, 0)], on_error="raise", max_pixels=None).files == (big,)
    assert load_source([(big, 0)], on_error="skip", max_pixels=300 * 200).files == (big,)
    with pytest.raises(ValueError, match="300x200 = 60,000 pixels, over max_pixels=59,999"):
        load_source([(big, 0)], on_error="raise", max_pixels=300 * 200 - 1)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pillows_own_limit_is_named_with_its_fix_in_the_skip_check(
    bomb_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_pixels allows the image, but Pillow's global limit (here lowered) refuses it.
    monkeypatch.setattr(PIL, "MAX_IMAGE_PIXELS", 1000)
    big = str(bomb_folder / "b_blue" / "big.png")
    with pytest.raises(ValueError, match=r"DecompressionBombError.*PIL\.Image\.MAX_IMAGE_PIXELS"):
        load_source([(big, 0)], on_error="skip", max_pixels=None)


def test_a_name_that_is_not_utf8_is_shown_escaped(tmp_path: Path) -> None:
    try:
        path = os.path.join(os.fsencode(tmp_path), b"caf\xe9.jpg")
        open(path, "wb").close()
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    with pytest.raises(ValueError, match=r"caf\\xe9\.jpg: empty file"):
        load_source([(os.fsdecode(path), 0)], on_error="raise")


def test_shown_escapes_control_characters_as_repr_does() -> None:
    assert shown("a\nb\tc\rd\x1b[31m\x7f\x85\u2028.jpg") == (
        "a\\nb\\tc\\rd\\x1b[31m\\x7f\\x85\\u2028.jpg"
    )
    assert shown(os.fsdecode(b"caf\xe9\n.jpg")) == "caf\\xe9\\n.jpg"
    assert shown("caf\u00e9 \u65e5\u672c.jpg") == "caf\u00e9 \u65e5\u672c.jpg"  # printable: kept


def test_a_name_with_a_newline_keeps_the_bad_file_list_one_line_per_file(tmp_path: Path) -> None:
    # Before: the newline was printed raw, so "b.jpg: empty file" read as a file of its own.
    try:
        path = tmp_path / "a\nb.jpg"
        path.write_bytes(b"")
    except OSError:
        pytest.skip("this file system refuses a newline in a name")
    with pytest.raises(ValueError) as info:
        load_source([(str(path), 0)], on_error="raise")
    listed = [line for line in str(info.value).splitlines() if "empty file" in line]
    assert listed == [f"  {tmp_path}{os.sep}a\\nb.jpg: empty file"], str(info.value)


# ------------------------------------------------------------- files and folders not readable

FIFO_REASON = "not a regular file (a FIFO)"


def test_a_fifo_with_an_image_suffix_is_refused_by_name(fifo_folder: Path) -> None:
    with pytest.raises(ValueError, match=r"(?s)1 of 26 files.*pipe\.jpg: not a regular file"):
        load_source(fifo_folder, on_error="raise")


def test_a_fifo_with_an_image_suffix_is_skipped_and_a_file_link_still_read(
    fifo_folder: Path,
) -> None:
    src = load_source(fifo_folder, on_error="skip")
    assert [(Path(b.path).name, b.reason) for b in src.skipped] == [("pipe.jpg", FIFO_REASON)]
    assert len(src.files) == 25 and str(fifo_folder / "b_blue" / "link.jpg") in src.files


def test_a_file_that_became_a_fifo_is_not_read(fifo_folder: Path) -> None:
    with pytest.raises(RuntimeError, match=r"pipe\.jpg' not a regular file \(a FIFO\), so it"):
        read_checked(str(fifo_folder / "a_red" / "pipe.jpg"), None)


def _unlistable(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make the folders called ``names`` unlistable, as without read permission (the tests may
    run as root, whom permissions do not stop)."""
    import errno

    scandir = os.scandir

    def refusing(path: Any = ".") -> Any:
        if os.path.basename(os.fspath(path)) in names:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)


def _unlistable_folder(root: Path) -> Path:
    for name in ("a", "b"):
        (root / name / "sub").mkdir(parents=True)
        _tiny_png(root / name / "1.png")
        _tiny_png(root / name / "sub" / "2.png")
    return root


def test_an_unlistable_subfolder_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _unlistable_folder(tmp_path / "data")
    _unlistable(monkeypatch, "sub")
    with pytest.raises(
        ValueError,
        match=r"(?s)2 folders in .* cannot be listed.*a/sub: cannot be listed \(Permission "
        r"denied\).*b/sub: cannot be listed.*on_error='skip'",
    ):
        load_source(root, on_error="raise")
    src = load_source(root, on_error="skip")
    assert [(Path(b.path).relative_to(root).as_posix(), b.reason) for b in src.skipped] == [
        ("a/sub", "cannot be listed (Permission denied)"),
        ("b/sub", "cannot be listed (Permission denied)"),
    ]
    assert [Path(f).relative_to(root).as_posix() for f in src.files] == ["a/1.png", "b/1.png"]


def test_an_unlistable_class_folder_says_so_not_no_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    root = _unlistable_folder(tmp_path / "data")
    _unlistable(monkeypatch, "b")
    with pytest.raises(ValueError, match=r"(?s)1 folder in .*b: cannot be listed \(Permission"):
        load_source(root, on_error="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "class folder(s) with no images" warning
        src = load_source(root, on_error="skip")
    assert src.classes == ("a", "b") and src.labels == (0, 0)
    assert [b.reason for b in src.skipped] == ["cannot be listed (Permission denied)"]
    _unlistable(monkeypatch, "a", "b")
    with pytest.raises(ValueError, match=r"(?s)none of .*a: cannot be listed.*b: cannot be"):
        load_source(root, on_error="skip")


def test_an_unlistable_subfolder_is_warned_about_under_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _unlistable_folder(tmp_path / "data")
    _unlistable(monkeypatch, "sub")
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable file\(s\) or folder\(s\).*a/sub"):
        loader = _loader(root, "torchvision", on_error="skip", batch_size=1)
    assert len(loader.skipped) == 2


# ------------------------------------------------------------------------ labels of a list


def test_a_label_far_beyond_the_labels_used_is_refused_not_materialised(folder: Path) -> None:
    good = str(next(folder.glob("a_red/*.jpg")))
    with pytest.raises(
        ValueError,
        match=r"source\[1\] label 2000000 would make 2,000,001 classes .* 2 distinct labels "
        r"are used; re-index the labels to 0\.\.1",
    ):
        load_source([(good, 0), (good, 2_000_000)], on_error="raise")
    dense = [(good, i) for i in range(0, 3000, 3)]  # sparse, but well under the bound
    assert len(load_source(dense, on_error="raise").classes) == 2998


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["folder", "list"])
def test_relative_paths_are_still_read_after_the_working_directory_changes(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, kind: str
) -> None:
    monkeypatch.chdir(folder.parent)
    given = load_source(folder, on_error="raise")
    relative = [
        (os.path.relpath(p, folder.parent), label)
        for p, label in zip(given.files, given.labels, strict=True)
    ]
    source: Any = folder.name if kind == "folder" else relative
    loader = _loader(source, backend, batch_size=6, train=False)
    assert list(loader.files) == list(given.files)  # absolute, as the folder's own paths
    monkeypatch.chdir(tmp_path)  # e.g. a training script that moves into its run directory
    assert sorted(_indices(loader)) == list(range(24))


def test_a_relative_list_path_is_named_as_absolute_and_an_empty_one_stays_empty(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder)
    source = load_source([("a_red/00.jpg", 0), ("./missing.jpg", 1), ("", 1)], on_error="skip")
    assert source.files == (str(folder / "a_red" / "00.jpg"),)
    assert [(b.path, b.reason) for b in source.skipped] == [
        (str(folder / "missing.jpg"), "file not found"),
        ("", "file not found"),
    ]


_SUFFIX = {"JPEG": "jpg", "PNG": "png", "BMP": "bmp", "TIFF": "tif"}


def _complete_and_cut(root: Path, fmt: str, **save: Any) -> None:
    """``root/a/``: a whole image, the same with bytes after its end, and one cut in half."""
    (root / "a").mkdir(parents=True)
    pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    whole = root / "a" / f"whole.{_SUFFIX[fmt]}"
    PIL.fromarray(pixels).save(whole, format=fmt, **save)
    data = whole.read_bytes()
    (root / "a" / f"trailer.{_SUFFIX[fmt]}").write_bytes(data + b"\x00" * 64 + b"camera data")
    (root / "a" / f"cut.{_SUFFIX[fmt]}").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("fmt", "save"),
    [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {}), ("BMP", {}), ("TIFF", {})],
    ids=["jpeg", "progressive-jpeg", "png", "bmp", "tiff"],
)
def test_a_truncated_file_is_left_out_even_with_pils_load_truncated_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, save: dict[str, Any]
) -> None:
    # A user script that sets this Pillow global made the decode check pass truncated
    # files, which then decoded half grey (torchvision) or stopped DALI mid-epoch.
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    _complete_and_cut(tmp_path / "data", fmt, **save)
    source = load_source(tmp_path / "data", on_error="skip")
    assert [Path(p).stem for p in source.files] == ["trailer", "whole"]
    assert [Path(b.path).stem for b in source.skipped] == ["cut"]
    assert source.skipped[0].reason.startswith("is truncated: ")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_truncated_tiff_is_left_out_by_every_backend_whatever_pillow_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    # TIFF was left to the decoder: with LOAD_TRUNCATED_IMAGES, on_error="skip" kept a cut
    # TIFF, which the torchvision backend trained on half grey and DALI stopped on, saying
    # that PIL reads it and telling the user to convert it.
    from PIL import ImageFile

    _complete_and_cut(tmp_path / "data", "TIFF")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.warns(UserWarning, match=r"cut\.tif \(is truncated: "):
        loader = _loader(tmp_path / "data", backend, on_error="skip", train=False, batch_size=2)
    assert [Path(b.path).name for b in loader.skipped] == ["cut.tif"]
    assert sorted(_indices(loader)) == [0, 1]


def test_files_pillow_decodes_whole_are_kept_by_the_skip_check(tmp_path: Path) -> None:
    # A PNG that stops after its image data (no IEND) and a BMP without its last row's
    # padding decode to every pixel, but on_error="skip" left them out as truncated.
    (tmp_path / "a").mkdir()
    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    for fmt, cut in (("PNG", 12), ("BMP", 1)):  # 5 RGB pixels: 15 bytes a row, 1 of padding
        whole = tmp_path / "a" / f"whole.{_SUFFIX[fmt]}"
        PIL.fromarray(pixels).save(whole, format=fmt)
        (tmp_path / "a" / f"short.{_SUFFIX[fmt]}").write_bytes(whole.read_bytes()[:-cut])
    source = load_source(tmp_path, on_error="skip")
    assert source.skipped == ()
    assert sorted(Path(p).name for p in source.files) == [
        "short.bmp",
        "short.png",
        "whole.bmp",
        "whole.png",
    ]
    for path in source.files:
        with PIL.open(path) as im:
            assert np.array_equal(np.asarray(im.convert("RGB")), pixels), path


def test_load_truncated_images_set_by_the_user_is_kept_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    from PIL import ImageFile

    _complete_and_cut(tmp_path / "data", "JPEG")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.warns(
        UserWarning, match=r"LOAD_TRUNCATED_IMAGES is True.*on_error='skip'"
    ) as caught:
        loader = _loader(tmp_path / "data", "torchvision", train=False, batch_size=3)
    assert [os.path.basename(w.filename) for w in caught] == ["_images.py"]  # _loader
    assert len(loader.files) == 3 and ImageFile.LOAD_TRUNCATED_IMAGES is True
    assert sum(len(labels) for _, labels in loader) == 3  # the cut file decodes, as asked
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "skip" finds truncation itself: nothing to warn of
        load_source(tmp_path / "data", on_error="skip")


def test_the_load_truncated_images_warning_names_the_line_that_called_load_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stacklevel=4 counted the frames from image_loader: called directly, load_source's
    # warning named a line inside pytest.
    from PIL import ImageFile

    _complete_and_cut(tmp_path / "data", "JPEG")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.warns(UserWarning, match=r"LOAD_TRUNCATED_IMAGES is True") as caught:
        load_source(tmp_path / "data", on_error="raise")
    assert [w.filename for w in caught] == [__file__]
