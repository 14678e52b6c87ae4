"""trainperf.pipelines._nvjpeg: the nvjpeg backend, on the CPU (standing in for a GPU) and a GPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.pipelines._images import (
    SIZE,
    SMALL_LIMIT,
    _epoch,
    _indices,
    _loader,
    _pixels,
    _reference_eval,
    add_macos_litter,
    big_image,
    bomb_jpeg,
    requires_cuda,
)
from trainperf.pipelines import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_IMAGE_PIXELS,
    ImageLoader,
    LoaderConfig,
    image_loader,
)
from trainperf.pipelines._folder import find_images
from trainperf.pipelines._source import load_source, shard_plan

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


def _nvjpeg_on_cpu(
    source: Any,
    *,
    train: bool = True,
    batch_size: int = 5,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
    last_batch: str = "keep",
    size: int = SIZE,
    on_error: str = "raise",
    max_pixels: int | None = MAX_IMAGE_PIXELS,
) -> ImageLoader:
    """The nvjpeg backend's code with the CPU in the GPU's place (image_loader refuses this)."""
    from trainperf.pipelines._nvjpeg import NvjpegLoader

    src = load_source(source, on_error=on_error, max_pixels=max_pixels)  # type: ignore[arg-type]
    plan = shard_plan(len(src.files), batch_size, rank, world, last_batch)  # type: ignore[arg-type]
    config = LoaderConfig(
        batch_size,
        train,
        size,
        torch.device("cpu"),
        2,
        seed,
        last_batch,
        IMAGENET_MEAN,
        IMAGENET_STD,
        max_pixels,
    )  # type: ignore[arg-type]
    return NvjpegLoader(src, plan, config, "test: CPU stand-in")


def test_nvjpeg_reads_a_folder_copied_from_macos(folder: Path, tmp_path: Path) -> None:
    # AppleDouble files ("._x.jpg") failed the header check; "__MACOSX" became a class.
    import shutil

    root = Path(shutil.copytree(folder, tmp_path / "copied"))
    for where in ("root", "class", "subfolder"):
        add_macos_litter(root, where)
    loader = _nvjpeg_on_cpu(root, train=False, batch_size=4)
    assert loader.classes == ("a_red", "b_blue") and not loader.skipped
    original = [os.path.relpath(p, folder) for p, _ in find_images(folder)[0]]
    assert [os.path.relpath(p, root) for p in loader.files] == original
    assert sum(len(labels) for _, labels in loader) == len(loader.files)


def test_nvjpeg_code_on_cpu_has_the_contract_and_torchvisions_crops(folder: Path) -> None:
    loader = _nvjpeg_on_cpu(folder, batch_size=5, seed=2)
    reference = _loader(folder, "torchvision", batch_size=5, seed=2, last_batch="keep")
    assert len(loader) == len(reference) == 5
    for _epoch_number in range(2):
        ours, theirs = _epoch(loader), _epoch(reference)
        assert [len(b[1]) for b in ours] == [5, 5, 5, 5, 4]
        for (a, la, ia), (b, lb, ib) in zip(ours, theirs, strict=True):
            assert torch.equal(ia, ib) and torch.equal(la, lb)  # same order and labels
            assert a.shape == b.shape and a.dtype == torch.float32
            # Same boxes and flips; only the resampling differs (tensor vs PIL).
            assert (_pixels(a) - _pixels(b)).abs().mean().item() < 1 / 255


# 224 px (the ImageNet size) takes seconds per backend on a 2-core machine.
@pytest.mark.parametrize("size", [SIZE, pytest.param(224, marks=pytest.mark.slow)])
def test_nvjpeg_eval_on_cpu_matches_torchvision(folder: Path, size: int) -> None:
    loader = _nvjpeg_on_cpu(folder, train=False, batch_size=8, size=size)
    worst, total, count = 0.0, 0.0, 0
    for images, _, indices in loader.iter_with_indices():
        assert images.shape[-2:] == (size, size)
        for image, index in zip(images, indices.tolist(), strict=True):
            diff = (
                _pixels(image[None]) - _pixels(_reference_eval(loader.files[index], size)[None])
            ).abs()
            worst, total, count = (
                max(worst, diff.max().item()),
                total + diff.sum().item(),
                count + diff.numel(),
            )
    # torch's antialiased bilinear, rounded, vs PIL's: one grey level at most (as DALI).
    assert worst <= 1.01 / 255
    assert total / count <= 0.5 / 255


def test_nvjpeg_shards_and_an_abandoned_epoch(folder: Path) -> None:
    loaders = [
        _nvjpeg_on_cpu(folder, batch_size=4, rank=r, world=2, last_batch="drop") for r in (0, 1)
    ]
    shards = [_indices(loader) for loader in loaders]
    assert len(shards[0]) == len(shards[1]) == 12 and not set(shards[0]) & set(shards[1])
    it = loaders[0].iter_with_indices()
    next(it)
    it.close()  # the producer thread must stop, not hang
    assert len(_epoch(loaders[0])) == 3


def test_nvjpeg_closed_mid_epoch_says_so(folder: Path) -> None:
    loader = _nvjpeg_on_cpu(folder, batch_size=2)  # 12 batches: more than it prefetches
    it = loader.iter_with_indices()
    next(it)
    loader.close()  # cancels the reads the producer thread is waiting on
    with pytest.raises(RuntimeError, match=r"^this image loader was closed$"):
        for _ in it:
            pass


def test_nvjpeg_closed_after_the_whole_epoch_was_read_says_so_at_once(folder: Path) -> None:
    # One batch holds the whole epoch, so nothing is left to read when close() comes: the
    # producer has finished and only its "done" is queued, which must not end the epoch quietly.
    loader = _nvjpeg_on_cpu(folder, batch_size=64, last_batch="keep")
    assert len(loader) == 1
    it = loader.iter_with_indices()
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match=r"^this image loader was closed$"):
        next(it)


@pytest.fixture()
def bad_marker_folder(folder: Path, tmp_path: Path) -> Path:
    """The folder plus a JPEG whose header and end marker are intact but whose middle is not."""
    import shutil

    root = Path(shutil.copytree(folder, tmp_path / "bad_marker"))
    data = bytearray((root / "a_red" / "00.jpg").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 200] = b"\x00\xff" * 100  # 0xFF 0x00 ... is no marker JPEG knows
    (root / "a_red" / "bad_marker.jpg").write_bytes(bytes(data))
    return root


@pytest.mark.parametrize(
    ("damaged", "name"),
    [
        # no end-of-image marker: decoded on the CPU from the start
        ("truncated_folder", "truncated.jpg"),
        # sent to the batched decode, which fails; then one by one, and the CPU fallback
        ("bad_marker_folder", "bad_marker.jpg"),
    ],
)
def test_nvjpeg_names_a_file_it_cannot_decode(
    request: pytest.FixtureRequest, damaged: str, name: str
) -> None:
    from trainperf.pipelines._nvjpeg import _gpu_decodable

    root: Path = request.getfixturevalue(damaged)
    path = next(root.rglob(name))
    assert _gpu_decodable(np.fromfile(path, dtype=np.uint8)) == (name == "bad_marker.jpg")
    loader = _nvjpeg_on_cpu(root, train=False, batch_size=25)
    with pytest.raises(RuntimeError, match=rf"could not decode image .*{name}"):
        _epoch(loader)
    loader.close()
    with pytest.raises(RuntimeError, match="was closed"):
        _epoch(loader)


@requires_cuda
def test_nvjpeg_on_the_gpu_names_a_truncated_jpeg(truncated_folder: Path) -> None:
    # The truncated file lacks its end-of-image marker, so it is decoded on the CPU, which
    # refuses it: the error does not depend on what nvJPEG makes of a truncated stream.
    loader = image_loader(
        truncated_folder,
        25,
        size=SIZE,
        backend="nvjpeg",
        device="cuda",
        shard=None,
        train=False,
        last_batch="keep",
    )
    with pytest.raises(RuntimeError, match=r"could not decode image .*truncated\.jpg"):
        _epoch(loader)
    loader.close()


def test_jpeg_frame_tells_coding_and_components(folder: Path, tmp_path: Path) -> None:
    from PIL import Image

    from trainperf.pipelines._nvjpeg import _gpu_decodable, jpeg_frame

    with Image.open(folder / "a_red" / "00.jpg") as im:
        im.save(tmp_path / "progressive.jpg", progressive=True)
    frames = {
        name: jpeg_frame(path.read_bytes())
        for name, path in [
            ("grey", folder / "a_red" / "gray.jpg"),
            ("colour", folder / "a_red" / "00.jpg"),
            ("cmyk", folder / "a_red" / "cmyk.jpg"),
            ("progressive", tmp_path / "progressive.jpg"),
        ]
    }
    assert frames == {
        "grey": (0xC0, 1),
        "colour": (0xC0, 3),
        "cmyk": (0xC0, 4),
        "progressive": (0xC2, 3),
    }
    assert jpeg_frame(b"\xff\xd8garbage") is None
    gpu = _gpu_decodable(np.fromfile(folder / "a_red" / "00.jpg", dtype=np.uint8))
    assert gpu and not _gpu_decodable(np.fromfile(tmp_path / "progressive.jpg", dtype=np.uint8))


def test_jpeg_frame_is_found_after_a_large_icc_profile(folder: Path, tmp_path: Path) -> None:
    from PIL import Image

    from trainperf.pipelines._nvjpeg import _gpu_decodable, jpeg_frame

    path = tmp_path / "camera.jpg"
    with Image.open(folder / "a_red" / "00.jpg") as im:
        # PIL splits the profile over several APP2 segments: the frame header is at ~200 KB.
        im.save(path, quality=90, icc_profile=bytes(200_000))
    data = path.read_bytes()
    assert data.index(b"\xff\xc0") > 3 * 65536
    assert jpeg_frame(data) == (0xC0, 3)
    array = np.fromfile(path, dtype=np.uint8)
    assert jpeg_frame(array) == (0xC0, 3) and _gpu_decodable(array)
    assert jpeg_frame(data[: 3 * 65536]) is None  # cut before the frame header
    # and the file decodes like any other, through the nvjpeg code
    loader = _nvjpeg_on_cpu([(str(path), 0), (str(path), 0)], train=False, batch_size=2)
    images = _epoch(loader)[0][0]
    assert images.shape == (2, 3, SIZE, SIZE)
    assert torch.equal(images[0], images[1])


@requires_cuda
def test_nvjpeg_on_the_gpu_matches_its_cpu_run(folder: Path) -> None:
    gpu = image_loader(
        folder, 5, size=SIZE, backend="nvjpeg", device="cuda", shard=None, seed=2, last_batch="keep"
    )
    cpu = _nvjpeg_on_cpu(folder, batch_size=5, seed=2)
    assert gpu.backend == "nvjpeg"
    for (a, la, ia), (b, lb, ib) in zip(_epoch(gpu), _epoch(cpu), strict=True):
        assert a.device.type == "cuda" and la.device.type == "cuda"
        assert torch.equal(ia, ib) and torch.equal(la.cpu(), lb)
        # nvJPEG's IDCT differs from libjpeg-turbo's by a few levels at most.
        assert (_pixels(a.cpu()) - _pixels(b)).abs().mean().item() < 3 / 255


@requires_cuda
def test_nvjpeg_on_the_gpu_eval_matches_torchvision(folder: Path) -> None:
    loader = image_loader(
        folder,
        8,
        size=SIZE,
        backend="nvjpeg",
        device="cuda",
        shard=None,
        train=False,
        last_batch="keep",
    )
    for images, _, indices in loader.iter_with_indices():
        for image, index in zip(images.cpu(), indices.tolist(), strict=True):
            diff = (
                _pixels(image[None]) - _pixels(_reference_eval(loader.files[index], SIZE)[None])
            ).abs()
            assert diff.mean().item() < 2 / 255


@pytest.mark.parametrize("train", [False, True])
def test_nvjpeg_scales_a_16_bit_png_like_the_other_backends(tmp_path: Path, train: bool) -> None:
    from tests.pipelines.test_decode import GREY8, write_grey16

    (tmp_path / "grey").mkdir()
    write_grey16(tmp_path / "grey" / "g16.png")
    [(images, _)] = list(_nvjpeg_on_cpu(tmp_path, train=train, batch_size=1))
    levels = (_pixels(images) * 255).round()
    assert levels.min().item() == levels.max().item() == GREY8


def test_nvjpeg_code_refuses_or_skips_images_over_max_pixels_up_front(bomb_folder: Path) -> None:
    with pytest.raises(ValueError, match=r"(?s)2 of 26 files.*bomb\.jpg: has 30000x30000"):
        _nvjpeg_on_cpu(bomb_folder, max_pixels=SMALL_LIMIT)
    loader = _nvjpeg_on_cpu(bomb_folder, on_error="skip", max_pixels=SMALL_LIMIT)
    names = sorted(Path(b.path).name for b in loader.skipped)
    assert names == ["big.png", "bomb.jpg"]
    assert sorted(_indices(loader)) == list(range(24))


@pytest.mark.parametrize("replacement", ["big", "bomb", "text"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_nvjpeg_code_checks_the_bytes_it_decodes(
    fresh_folder: Path, on_error: str, replacement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.pipelines._nvjpeg as nvjpeg

    decoded: list[int] = []
    real = nvjpeg._decode_on_cpu

    def spy(data: Any, path: str) -> Any:
        decoded.append(len(data))
        return real(data, path)

    monkeypatch.setattr(nvjpeg, "_decode_on_cpu", spy)
    loader = _nvjpeg_on_cpu(
        fresh_folder, train=False, batch_size=8, on_error=on_error, max_pixels=SMALL_LIMIT
    )
    victim = fresh_folder / "a_red" / "03.jpg"
    if replacement == "big":
        big_image(victim)
        said = r"has 300x200 = 60,000 pixels, over max_pixels=20,000"
    elif replacement == "bomb":
        victim.write_bytes(bomb_jpeg())
        said = r"has 30000x30000 = 900,000,000 pixels, over max_pixels=20,000"
    else:
        victim.write_text("overwritten with text")
        said = r"not a supported image \(starts with b'overwrit'"
    with pytest.raises(RuntimeError, match=rf"03\.jpg' {said}.*changed after the loader checked"):
        _epoch(loader)
    assert victim.stat().st_size not in decoded  # refused before any decoder saw it


def test_nvjpeg_reads_a_relative_folder_after_the_working_directory_changes(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder.parent)
    loader = _nvjpeg_on_cpu(folder.name, train=False, batch_size=6)
    monkeypatch.chdir(tmp_path)
    assert sorted(_indices(loader)) == list(range(24))
