"""trainperf.pipelines on a generated folder of real image files.

The folder: two classes, red-ish (class "a_red") and blue-ish ("b_blue") JPEGs of 60-140 px,
plus a grayscale JPEG, a CMYK JPEG and a PNG. Every CPU-capable backend runs over it: the
torchvision backend, DALI in its CPU-only mode, and the nvjpeg backend's own code with the CPU
standing in for the GPU.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainperf._utils.imports import is_available
from trainperf.errors import DeviceError
from trainperf.pipelines import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageLoader,
    LoaderConfig,
    image_loader,
)
from trainperf.pipelines._augment import (
    center_resize_crop,
    eval_geometry,
    normalize,
    random_flip,
    sample_crop_box,
)
from trainperf.pipelines._loader import _dali_importable
from trainperf.pipelines._source import (
    check_files,
    epoch_indices,
    load_source,
    resolve_shard,
    shard_plan,
)

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")
# CI sets TRAINPERF_REQUIRE_DALI=1 (.ci/run): there the DALI tests run, and fail, when the
# 'dali' extra did not install or does not import, instead of skipping quietly.
REQUIRE_DALI = os.environ.get("TRAINPERF_REQUIRE_DALI") == "1"
needs_dali = pytest.mark.skipif(
    not REQUIRE_DALI and not _dali_importable(),
    reason="needs nvidia-dali (TRAINPERF_REQUIRE_DALI=1 turns this skip into a failure)",
)
requires_cuda = pytest.mark.requires_cuda

SIZE = 32
RED, BLUE = (200, 50, 40), (40, 50, 200)
NO_TUNING = {"num_workers": 0}
CPU_BACKENDS = [
    pytest.param("torchvision", id="torchvision"),
    pytest.param("dali", id="dali", marks=needs_dali),
]


# --------------------------------------------------------------------------- the image folder


def _picture(w: int, h: int, colour: tuple[int, int, int], rng: np.random.Generator) -> Any:
    """A smooth colour field with texture: natural enough for resampling to matter."""
    from PIL import Image, ImageFilter

    y, x = np.mgrid[0:h, 0:w]
    wave = 25 * np.sin(x / max(w, 1) * 6 + rng.uniform(0, 6)) + 20 * np.cos(y / max(h, 1) * 5)
    pixels = np.array(colour, dtype=np.float64)[None, None, :] + wave[..., None]
    pixels += rng.normal(0, 12, size=(h, w, 3))
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return img.filter(ImageFilter.GaussianBlur(1.0))


def _write_folder(root: Path, per_class: int = 10, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for name, colour in (("a_red", RED), ("b_blue", BLUE)):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            w, h = (int(v) for v in rng.integers(60, 141, size=2))
            _picture(w, h, colour, rng).save(root / name / f"{i:02d}.jpg", quality=90)
    _picture(90, 70, (128, 128, 128), rng).convert("L").save(root / "a_red" / "gray.jpg")
    _picture(100, 80, RED, rng).convert("CMYK").save(root / "a_red" / "cmyk.jpg")
    _picture(80, 100, BLUE, rng).save(root / "b_blue" / "png_among_jpegs.png")
    (root / "b_blue" / "notes.txt").write_text("not an image suffix: ignored, like ImageFolder")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 images: 12 per class, the odd formats included."""
    root = _write_folder(tmp_path_factory.mktemp("images") / "data", per_class=10)
    (root / "b_blue" / "10.jpg").write_bytes((root / "b_blue" / "00.jpg").read_bytes())
    return root


def _loader(source: Any, backend: str, **kw: Any) -> ImageLoader:
    kw.setdefault("size", SIZE)
    kw.setdefault("device", "cpu")
    kw.setdefault("num_threads", 2)
    kw.setdefault("shard", None)
    if backend == "torchvision":
        kw.setdefault("loader_kwargs", NO_TUNING)
    return image_loader(source, kw.pop("batch_size", 5), backend=backend, **kw)  # type: ignore[arg-type]


def _epoch(loader: ImageLoader) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return list(loader.iter_with_indices())


def _indices(loader: ImageLoader) -> list[int]:
    return [i for _, _, idx in loader.iter_with_indices() for i in idx.tolist()]


def _pixels(images: torch.Tensor) -> torch.Tensor:
    """Back from normalised to 0..1 pixel units."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return images * std + mean


def _reference_eval(path: str, size: int) -> torch.Tensor:
    import torchvision.transforms as T
    from PIL import Image

    transform = T.Compose(
        [
            T.Resize(int(size / 0.875)),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    with Image.open(path) as im:
        out: torch.Tensor = transform(im.convert("RGB"))
    return out


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
) -> ImageLoader:
    """The nvjpeg backend's code with the CPU in the GPU's place (image_loader refuses this)."""
    from trainperf.pipelines._nvjpeg import NvjpegLoader

    src = load_source(source, on_error="raise")
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
    )  # type: ignore[arg-type]
    return NvjpegLoader(src, plan, config, "test: CPU stand-in")


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batches_have_the_dataloader_contract_and_the_right_labels(
    folder: Path, backend: str, train: bool
) -> None:
    loader = _loader(folder, backend, batch_size=5, last_batch="keep", train=train)
    assert loader.backend == backend
    assert loader.classes == ("a_red", "b_blue")
    assert len(loader.files) == 24 and len(loader) == 5
    batches = _epoch(loader)
    assert len(batches) == len(loader)
    assert [len(b[1]) for b in batches] == [5, 5, 5, 5, 4]
    source_labels = dict(
        zip(loader.files, load_source(folder, on_error="raise").labels, strict=True)
    )
    seen = []
    for images, labels, indices in batches:
        assert images.shape == (len(labels), 3, SIZE, SIZE)
        assert images.dtype == torch.float32 and images.device.type == "cpu"
        assert images.is_contiguous()
        assert labels.dtype == torch.int64 and labels.shape == (len(labels),)
        rgb = _pixels(images).mean(dim=(2, 3))
        for colour, label, index in zip(rgb, labels.tolist(), indices.tolist(), strict=True):
            path = loader.files[index]
            assert label == source_labels[path]
            r, g, b = colour.tolist()
            if path.endswith("gray.jpg"):
                assert abs(r - g) < 0.02 and abs(g - b) < 0.02, (path, colour)
            elif label == 0:
                assert r > b + 0.3, (path, colour)  # red-ish: CMYK came back as RGB
            else:
                assert b > r + 0.3, (path, colour)  # blue-ish, the PNG too
            seen.append(index)
    assert sorted(seen) == list(range(24))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_each_epoch_is_reshuffled_deterministically(folder: Path, backend: str) -> None:
    loader = _loader(folder, backend, batch_size=6, seed=3)
    first, second = _indices(loader), _indices(loader)
    assert sorted(first) == sorted(second) == list(range(24))
    assert first != second
    again = _loader(folder, backend, batch_size=6, seed=3)
    assert _indices(again) == first and _indices(again) == second
    other = _loader(folder, backend, batch_size=6, seed=4)
    assert _indices(other) != first
    assert loader.epoch == 2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_eval_keeps_file_order_every_epoch(folder: Path, backend: str) -> None:
    loader = _loader(folder, backend, train=False, batch_size=8)
    assert _indices(loader) == _indices(loader) == list(range(24))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("last_batch", ["keep", "drop"])
@pytest.mark.parametrize("num_files", [24, 23])
def test_two_ranks_get_disjoint_covering_shards_of_equal_length(
    folder: Path, backend: str, last_batch: str, num_files: int
) -> None:
    source = load_source(folder, on_error="raise")
    pairs = list(zip(source.files, source.labels, strict=True))[:num_files]
    loaders = [
        _loader(pairs, backend, batch_size=4, shard=(rank, 2), last_batch=last_batch, seed=1)
        for rank in range(2)
    ]
    assert len(loaders[0]) == len(loaders[1])
    for _epoch_number in range(2):
        shards = [_indices(loader) for loader in loaders]
        assert len(shards[0]) == len(shards[1]) == loaders[0].shard.samples
        union = set(shards[0]) | set(shards[1])
        if last_batch == "keep":
            assert union == set(range(num_files))  # covering
            assert len(shards[0]) + len(shards[1]) - len(union) == num_files % 2  # the padding
        else:
            assert len(set(shards[0]) & set(shards[1])) == 0  # disjoint
            assert len(union) == 2 * (num_files // 2 // 4) * 4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_eval_shards_stay_put_and_cover_the_files(folder: Path, backend: str) -> None:
    loaders = [
        _loader(folder, backend, train=False, batch_size=5, shard=(rank, 2), last_batch="keep")
        for rank in range(2)
    ]
    first = [_indices(loader) for loader in loaders]
    assert [_indices(loader) for loader in loaders] == first  # every epoch the same
    assert sorted(first[0] + first[1]) == list(range(24))


@pytest.mark.parametrize("size", [SIZE, 224])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_eval_matches_torchvision_resize_centercrop_normalize(
    folder: Path, backend: str, size: int
) -> None:
    loader = _loader(folder, backend, train=False, batch_size=8, last_batch="keep", size=size)
    worst, total, count = 0.0, 0.0, 0
    for images, _, indices in loader.iter_with_indices():
        assert images.shape[-2:] == (size, size)
        for image, index in zip(images, indices.tolist(), strict=True):
            expected = _reference_eval(loader.files[index], size)
            diff = (_pixels(image[None]) - _pixels(expected[None])).abs()
            worst, total, count = (
                max(worst, diff.max().item()),
                total + diff.sum().item(),
                count + diff.numel(),
            )
    if backend == "torchvision":
        assert worst < 1e-6
    else:
        # DALI's resampling rounds differently from PIL: at most one grey level per pixel.
        assert worst <= 1.01 / 255
        assert total / count <= 0.5 / 255


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_last_batch_drop_and_keep(folder: Path, backend: str) -> None:
    keep = _loader(folder, backend, batch_size=7, last_batch="keep")
    drop = _loader(folder, backend, batch_size=7, last_batch="drop")
    assert (len(keep), len(drop)) == (4, 3)
    assert [len(b[1]) for b in _epoch(keep)] == [7, 7, 7, 3]
    for _ in range(2):  # the dropped remainder must not leak into the next epoch
        assert [len(b[1]) for b in _epoch(drop)] == [7, 7, 7]


@needs_dali
def test_dali_epoch_abandoned_part_way_is_finished_before_the_next(folder: Path) -> None:
    loader = _loader(folder, "dali", batch_size=5, last_batch="keep")
    it = loader.iter_with_indices()
    next(it)
    it.close()
    assert sorted(_indices(loader)) == list(range(24))
    assert len(_epoch(loader)) == len(loader)


@needs_dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_cpu_batches_a_caller_keeps_stay_intact(folder: Path, train: bool) -> None:
    # On the CPU, eval batches are DALI's own buffers (dynamic executor, no copy) and train
    # batches reused ones (CpuTrainFinish): a batch that is kept must not be written over by
    # later batches, nor by writes into them.
    loader = _loader(folder, "dali", batch_size=5, last_batch="keep", train=train)
    kept = [(images, images.clone()) for images, _, _ in _epoch(loader)[:2]]
    for _ in range(2):
        for images, _, _ in _epoch(loader):
            images.mul_(0)
    for images, snapshot in kept:
        assert torch.equal(images, snapshot)
        assert snapshot.abs().sum() > 0


def test_torchvision_persistent_workers_end_with_close(folder: Path) -> None:
    import psutil

    def children() -> set[psutil.Process]:
        return set(psutil.Process().children(recursive=True))

    # Earlier tests may have started long-lived helpers (multiprocessing's resource tracker).
    before = children()
    loader = _loader(
        folder,
        "torchvision",
        batch_size=12,
        loader_kwargs={"num_workers": 1, "persistent_workers": True},
    )
    assert sorted(_indices(loader)) == list(range(24))
    workers = children() - before
    assert workers  # the worker outlives the epoch...
    loader.close()
    assert psutil.wait_procs(list(workers), timeout=10)[1] == []  # ...not close()


def test_file_dataset_takes_a_plain_index_as_epoch_zero(folder: Path) -> None:
    from trainperf.pipelines._torchvision import FileDataset

    files = load_source(folder, on_error="raise").files
    dataset = FileDataset(files, train=True, size=SIZE, seed=0)
    image, index = dataset[3]
    assert index == 3 and image.shape == (SIZE, SIZE, 3) and image.dtype == torch.uint8
    assert torch.equal(image, dataset[(3, 0)][0]) and not torch.equal(image, dataset[(3, 1)][0])


def test_torchvision_results_do_not_depend_on_the_worker_count(folder: Path) -> None:
    inline = _loader(folder, "torchvision", batch_size=12, seed=5)
    workers = _loader(
        folder, "torchvision", batch_size=12, seed=5, loader_kwargs={"num_workers": 2}
    )
    for (a, la, ia), (b, lb, ib) in zip(_epoch(inline), _epoch(workers), strict=True):
        assert torch.equal(ia, ib) and torch.equal(la, lb) and torch.equal(a, b)


@needs_dali
def test_auto_picks_dali_when_installed_and_reports_it(folder: Path) -> None:
    loader = image_loader(folder, 8, size=SIZE, device="cpu", shard=None)
    assert loader.backend == "dali"
    assert "DALI" in loader.backend_reason and "backend='dali'" in repr(loader)


def test_auto_falls_back_to_torchvision_without_dali(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.pipelines._loader as pipelines

    monkeypatch.setattr(pipelines, "is_available", lambda name: name != "nvidia.dali")
    loader = image_loader(folder, 8, size=SIZE, device="cpu", shard=None, loader_kwargs=NO_TUNING)
    assert loader.backend == "torchvision"
    assert "DALI is not installed" in loader.backend_reason


def test_dali_missing_names_the_extra(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainperf.pipelines._loader as pipelines

    monkeypatch.setattr(pipelines, "is_available", lambda name: False)
    with pytest.raises(
        ModuleNotFoundError, match=r"needs NVIDIA DALI: pip install 'trainperf\[dali\]'"
    ):
        image_loader(folder, 8, backend="dali", device="cpu")
    with pytest.raises(ModuleNotFoundError, match=r"trainperf\[dali\].*trainperf\[vision\]"):
        image_loader(folder, 8, device="cpu")


def test_dali_installed_but_broken_names_the_import_error_and_the_fix(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    import trainperf.pipelines._loader as pipelines

    real_import = builtins.__import__

    def import_without_cuda(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "nvidia.dali" or name.startswith("nvidia.dali."):
            raise OSError("libcudart.so.12: cannot open shared object file: No such file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(pipelines, "is_available", lambda name: True)  # the wheel is there
    monkeypatch.setattr(builtins, "__import__", import_without_cuda)
    with pytest.raises(
        ImportError,
        match=r"NVIDIA DALI is installed but cannot be used \(OSError: libcudart\.so\.12.*\)"
        r".*pip install --force-reinstall 'trainperf\[dali\]'.*CUDA 12",
    ) as raised:
        image_loader(folder, 8, backend="dali", device="cpu")
    assert type(raised.value) is ImportError  # not ModuleNotFoundError: it is installed
    assert isinstance(raised.value.__cause__, OSError)
    loader = image_loader(folder, 8, size=SIZE, device="cpu", shard=None, loader_kwargs=NO_TUNING)
    assert loader.backend == "torchvision"
    assert "DALI is installed but cannot be used" in loader.backend_reason


@pytest.mark.parametrize(
    ("version", "says"),
    [
        ("1.30.0", r"NVIDIA DALI 1\.30\.0 is older than 1\.44"),
        ("1.43.1", r"NVIDIA DALI 1\.43\.1 is older than 1\.44"),
        (None, r"cannot tell which NVIDIA DALI this is \(__version__ = None\); .* needs 1\.44"),
    ],
)
def test_dali_older_than_supported_is_refused_with_the_version_and_fix(
    folder: Path, monkeypatch: pytest.MonkeyPatch, version: str | None, says: str
) -> None:
    import types

    import trainperf.pipelines._loader as pipelines

    dali = types.ModuleType("nvidia.dali")
    if version is not None:
        dali.__version__ = version  # type: ignore[attr-defined]
    nvidia = types.ModuleType("nvidia")
    nvidia.dali = dali  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.dali", dali)
    monkeypatch.setattr(pipelines, "is_available", lambda name: True)
    with pytest.raises(
        ImportError,
        match=rf"cannot be used \(ImportError: {says}.*\).*pip install --force-reinstall "
        r"'trainperf\[dali\]'",
    ):
        image_loader(folder, 8, backend="dali", device="cpu")
    loader = image_loader(folder, 8, size=SIZE, device="cpu", shard=None, loader_kwargs=NO_TUNING)
    assert loader.backend == "torchvision"
    assert "DALI is installed but cannot be used" in loader.backend_reason


def test_torchvision_missing_names_the_extra(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainperf._utils.imports as imports

    real = imports.is_available
    monkeypatch.setattr(imports, "is_available", lambda name: name != "torchvision" and real(name))
    with pytest.raises(ModuleNotFoundError, match=r"backend='torchvision'\) needs torchvision"):
        image_loader(folder, 8, backend="torchvision", device="cpu")


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


# --------------------------------------------------------------------------- bad input


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


@pytest.fixture()
def bad_folder(folder: Path, tmp_path: Path) -> Path:
    import shutil

    root = shutil.copytree(folder, tmp_path / "bad")
    (root / "a_red" / "notes.jpg").write_text("a text file with an image suffix")
    (root / "b_blue" / "empty.jpg").write_bytes(b"")
    return Path(root)


@pytest.fixture()
def truncated_folder(folder: Path, tmp_path: Path) -> Path:
    import shutil

    root = Path(shutil.copytree(folder, tmp_path / "truncated"))
    data = (root / "a_red" / "00.jpg").read_bytes()
    (root / "a_red" / "truncated.jpg").write_bytes(data[: len(data) // 2])
    return root


def test_non_image_and_empty_files_are_named_up_front(bad_folder: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"(?s)2 of 26 files.*notes\.jpg: not a supported image"
        r".*empty\.jpg: empty file.*on_error='skip'",
    ):
        image_loader(bad_folder, 4, device="cpu", backend="torchvision", loader_kwargs=NO_TUNING)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_skip_leaves_bad_files_out_with_a_warning(bad_folder: Path, backend: str) -> None:
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable file\(s\)"):
        loader = _loader(bad_folder, backend, on_error="skip", batch_size=6)
    assert sorted(Path(b.path).name for b in loader.skipped) == ["empty.jpg", "notes.jpg"]
    assert len(loader.files) == 24
    assert sorted(_indices(loader)) == list(range(24))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_truncated_jpeg_raises_naming_the_file_when_reached(
    truncated_folder: Path, backend: str
) -> None:
    loader = _loader(truncated_folder, backend, batch_size=25, train=False, last_batch="keep")
    with pytest.raises(RuntimeError, match=r"could not decode .*truncated\.jpg"):
        _epoch(loader)


@needs_dali
def test_dali_after_a_decode_error_says_so_instead_of_hanging(truncated_folder: Path) -> None:
    from trainperf.pipelines._dali import _cause

    loader = _loader(truncated_folder, "dali", batch_size=25, train=False, last_batch="keep")
    with pytest.raises(RuntimeError, match="cannot continue after an error"):
        _epoch(loader)
    with pytest.raises(RuntimeError, match=r"failed earlier: DALI could not decode .*truncated"):
        _epoch(loader)
    message = (
        "Error in CPU operator\n  File x\nencountered:\n\nbad thing\n"
        "Current pipeline object is no longer valid."
    )
    assert _cause(message) == "bad thing"


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
    with pytest.raises(ValueError, match=r"source\[1\] label must be an int >= 0, got -1"):
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


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1, got 0"),
        ({"size": 0}, ValueError, "size must be an int >= 1"),
        ({"train": "yes"}, ValueError, "train must be True or False"),
        ({"backend": "pil"}, ValueError, "backend must be one of"),
        ({"last_batch": "pad"}, ValueError, "last_batch must be one of"),
        ({"on_error": "ignore"}, ValueError, "on_error must be one of"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0"),
        ({"mean": (0.5, 0.5)}, ValueError, "mean must be 3 numbers"),
        ({"mean": "abc"}, ValueError, "mean must be 3 numbers"),
        ({"std": (0.2, 0.0, 0.2)}, ValueError, "std must be 3 positive numbers"),
        ({"shard": (2, 2)}, ValueError, "0 <= rank < world_size"),
        ({"shard": "everything"}, ValueError, "shard must be 'auto', None or a"),
        ({"shard": (0, 1, 2)}, ValueError, "shard must be 'auto', None or a"),
        ({"num_threads": 0}, ValueError, "num_threads must be an int >= 1"),
        ({"device": "toaster"}, ValueError, "invalid device 'toaster': expected 'auto', 'cpu'"),
        ({"backend": "nvjpeg"}, ValueError, "backend='nvjpeg' decodes on a CUDA GPU"),
        ({"batch_size": 25}, ValueError, r"batch_size=25 is larger than the 24 images"),
        (
            {"backend": "torchvision", "loader_kwargs": {"shuffle": True}},
            ValueError,
            "loader_kwargs may not set 'shuffle'",
        ),
    ],
)
def test_bad_arguments_are_refused(
    folder: Path, kwargs: dict[str, Any], error: type, match: str
) -> None:
    kwargs = {"batch_size": 4, "device": "cpu", "shard": None, **kwargs}
    if kwargs.get("backend") == "torchvision":
        kwargs.setdefault("loader_kwargs", {})
    with pytest.raises(error, match=match):
        image_loader(folder, **kwargs)


@needs_dali
def test_loader_kwargs_with_another_backend_are_refused(folder: Path) -> None:
    with pytest.raises(ValueError, match="backend='dali' takes none"):
        image_loader(folder, 4, device="cpu", backend="dali", loader_kwargs=NO_TUNING)
    with pytest.raises(ValueError, match="backend='dali' runs on 'cpu' or a CUDA device"):
        image_loader(folder, 4, device="meta", backend="dali")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_is_a_device_error(folder: Path) -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        image_loader(folder, 4, device="cuda")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_closed_loader_refuses_to_iterate(folder: Path, backend: str) -> None:
    with _loader(folder, backend, batch_size=8) as loader:
        assert len(_epoch(loader)) == 3
    with pytest.raises(RuntimeError, match="was closed"):
        _epoch(loader)


def test_import_loads_neither_dali_nor_torchvision() -> None:
    code = (
        "import sys, trainperf.pipelines\n"
        "print([m for m in ('torchvision', 'nvidia.dali', 'PIL') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- the nvjpeg backend


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


@pytest.mark.parametrize("size", [SIZE, 224])
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


@requires_cuda
def test_torchvision_backend_on_cuda_normalises_there_exactly(folder: Path) -> None:
    loader = _loader(
        folder, "torchvision", device="cuda", train=False, batch_size=8, last_batch="keep"
    )
    for images, labels, indices in loader.iter_with_indices():
        assert images.device.type == labels.device.type == "cuda" and images.is_contiguous()
        for image, index in zip(images.cpu(), indices.tolist(), strict=True):
            expected = _reference_eval(loader.files[index], SIZE)
            torch.testing.assert_close(image, expected, atol=1e-5, rtol=0)


@requires_cuda
@pytest.mark.skipif(is_available("nvidia.dali"), reason="auto would pick DALI")
def test_auto_on_cuda_without_dali_picks_nvjpeg(folder: Path) -> None:
    loader = image_loader(folder, 8, size=SIZE, device="cuda", shard=None)
    assert loader.backend == "nvjpeg" and "GPU decode" in loader.backend_reason
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, SIZE, SIZE) and images.device.type == labels.device.type


# --------------------------------------------------------------------------- DALI's GPU graph


def _graph_ops(pipe: Any) -> list[tuple[str, str, str]]:
    """(operator, device, spec text) of a defined, unbuilt DALI pipeline."""
    pipe._build_graph()
    out = []
    for op in pipe._ops:
        spec = str(op.spec)
        name = spec.splitlines()[0].removeprefix("OpSpec for ").rstrip(":")
        device = next(line.split(":")[1].strip() for line in spec.splitlines() if "device:" in line)
        out.append((name, device, spec))
    return out


def _dali_graph(files: list[str], **kw: Any) -> Any:
    """The DALI pipeline for ``files`` (labels 0, 1, ...), defined without a GPU
    (``device_id=None``), one thread, seed 0, rank 0 of 1 unless ``kw`` says otherwise."""
    from trainperf.pipelines._dali import build_pipeline

    args: dict[str, Any] = {
        "gpu": False,
        "device_id": None,
        "batch_size": len(files),
        "num_threads": 1,
        "seed": 0,
        "rank": 0,
        "world_size": 1,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        **kw,
    }
    return build_pipeline(files, list(range(len(files))), **args)


@needs_dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_gpu_graph_decodes_mixed_and_augments_on_the_gpu(train: bool) -> None:
    # device_id=None lets the graph be defined without a GPU; gpu=True picks the GPU operators.
    pipe = _dali_graph(["a.jpg", "b.jpg"], gpu=True, rank=1, world_size=2, train=train, size=224)
    ops = _graph_ops(pipe)
    devices = {name: device for name, device, _ in ops}
    reader = next(spec for name, _, spec in ops if name == "readers__File")
    assert devices["readers__File"] == "cpu"
    assert (
        "shard_id: 1" in reader and "num_shards: 2" in reader and "pad_last_batch: True" in reader
    )
    decoder = "decoders__ImageRandomCrop" if train else "decoders__Image"
    assert devices[decoder] == "mixed"
    assert devices["Resize"] == "gpu" and devices["CropMirrorNormalize"] == "gpu"
    if train:
        assert "shuffle_after_epoch: True" in reader
    else:
        assert devices["Slice"] == "gpu" and "stick_to_shard: True" in reader


@needs_dali
@pytest.mark.parametrize("gpu", [False, True])
def test_dali_zero_copy_executor_on_the_cpu_only(gpu: bool) -> None:
    pipe = _dali_graph(["a.jpg"], gpu=gpu, train=True, size=32)
    assert pipe.exec_dynamic is (not gpu)


@needs_dali
@pytest.mark.parametrize("gpu", [False, True])
def test_dali_train_graph_resizes_antialiased_on_the_gpu_and_leaves_the_cpu_crops_to_torch(
    gpu: bool,
) -> None:
    pipe = _dali_graph(["a.jpg"], gpu=gpu, train=True, size=32)
    ops = {name: spec for name, _, spec in _graph_ops(pipe)}
    assert "decoders__ImageRandomCrop" in ops
    if gpu:
        assert "antialias: True" in ops["Resize"] and "CropMirrorNormalize" in ops
    else:  # CpuTrainFinish resizes (antialiased), mirrors and normalises in torch
        assert "Resize" not in ops and "CropMirrorNormalize" not in ops


def _reference_finish(
    crop: torch.Tensor, flip: bool, size: int, mean: list[float], std: list[float]
) -> torch.Tensor:
    """torchvision's tensor transforms: Resize (antialiased) on uint8, hflip, ToTensor-style
    scaling, Normalize."""
    import torchvision.transforms.functional as TF

    img = TF.resize(crop.permute(2, 0, 1).contiguous(), [size, size], antialias=True)
    if flip:
        img = TF.hflip(img)
    return TF.normalize(img.float() / 255, mean, std)


# 24 px: one row band; 128 px: two bands, the second shorter (see CpuTrainFinish).
@pytest.mark.parametrize("size", [24, 128])
def test_cpu_train_finish_matches_torchvision_resize_flip_normalize(size: int) -> None:
    from trainperf.pipelines._dali import CpuTrainFinish

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    g = torch.Generator().manual_seed(0)
    # down, same size, up, and mixed
    shapes = [(2 * size + 3, 3 * size), (size, size), (size // 2, size // 3), (size * 4, 31)]
    crops = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g) for h, w in shapes]
    flips = [True, False, True, False]
    batch = CpuTrainFinish(size, mean=mean, std=std)(crops, flips)
    assert batch.shape == (4, 3, size, size) and batch.dtype == torch.float32
    assert batch.is_contiguous()
    # torch's uint8 resize rounds in fixed point on channels_last input and in float on
    # contiguous input (torchvision's Resize here): results can differ by one 8-bit level.
    level = 1 / (255 * min(std)) + 1e-5
    for got, crop, flip in zip(batch, crops, flips, strict=True):
        expected = _reference_finish(crop, flip, size, mean, std)
        torch.testing.assert_close(got, expected, rtol=0, atol=level)
        assert (got - expected).abs().mean() < level / 4  # off by a level at a few pixels


def _solid(value: int) -> list[torch.Tensor]:
    return [torch.full((10, 10, 3), value, dtype=torch.uint8)] * 2


def test_cpu_train_finish_reuses_a_buffer_only_once_nothing_holds_it() -> None:
    from trainperf.pipelines._dali import CpuTrainFinish

    finish = CpuTrainFinish(8, mean=[0.0] * 3, std=[1.0] * 3, keep=3)
    no_flip = [False, False]
    first = finish(_solid(10), no_flip)
    first_ptr = first.data_ptr()
    del first
    assert finish(_solid(20), no_flip).data_ptr() == first_ptr  # dropped at once: reused

    # Each holder keeps its batch's buffer: the tensor, a view, a .numpy() array.
    kept = finish(_solid(30), no_flip)
    view = finish(_solid(40), no_flip)[1:]
    array = finish(_solid(50), no_flip).numpy()
    after = finish(_solid(60), no_flip)  # all three kept buffers in use: fresh memory
    again = finish(_solid(70), no_flip)
    pointers = {kept.data_ptr(), view.data_ptr() - view[0].nbytes, array.ctypes.data}
    assert len(pointers) == 3
    assert after.data_ptr() not in pointers and again.data_ptr() not in pointers
    for batch, value in ((kept, 30), (view, 40), (torch.from_numpy(array), 50), (after, 60)):
        torch.testing.assert_close(batch, torch.full_like(batch, value / 255))
    torch.testing.assert_close(again, torch.full_like(again, 70 / 255))

    kept_ptr = kept.data_ptr()
    del kept
    assert finish(_solid(80), no_flip).data_ptr() == kept_ptr  # let go: reused


# --------------------------------------------------------------------------- pieces


def test_crop_boxes_follow_random_resized_crop() -> None:
    rng = random.Random(0)
    areas = []
    for _ in range(300):
        top, left, h, w = sample_crop_box(375, 500, rng)
        assert 0 <= top <= 375 - h and 0 <= left <= 500 - w
        areas.append(h * w / (375 * 500))
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    assert 0.07 <= min(areas) < 0.2 and max(areas) > 0.9
    # Nothing fits a 1000x10 strip at these ratios: the centred fallback.
    assert sample_crop_box(10, 1000, random.Random(1)) == (0, 493, 10, 13)


@pytest.mark.parametrize(("h", "w"), [(375, 500), (500, 375), (97, 131), (64, 64), (61, 140)])
def test_eval_geometry_is_torchvisions(h: int, w: int) -> None:
    import torchvision.transforms as T

    img = torch.arange(h * w, dtype=torch.float64).reshape(1, h, w)
    new_h, new_w, top, left = eval_geometry(h, w, 56)
    resized = T.Resize(int(56 / 0.875), antialias=True)(img)
    assert resized.shape[-2:] == (new_h, new_w)
    assert torch.equal(T.CenterCrop(56)(resized), resized[:, top : top + 56, left : left + 56])


def test_normalize_is_bit_identical_to_totensor_normalize() -> None:
    import torchvision.transforms as T

    pixels = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    expected = torch.stack(
        [T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(p.float().div(255)) for p in pixels]
    )
    assert torch.equal(normalize(pixels, IMAGENET_MEAN, IMAGENET_STD), expected)


def test_random_flip_and_center_crop() -> None:
    batch = torch.arange(8.0).reshape(2, 1, 1, 4)
    assert random_flip(batch, [False, True]).tolist() == [[[[0, 1, 2, 3]]], [[[7, 6, 5, 4]]]]
    assert random_flip(batch, [False, False]) is batch
    img = torch.randint(0, 256, (3, 90, 120), dtype=torch.uint8)
    out = center_resize_crop(img, 48)
    assert out.shape == (3, 48, 48) and torch.equal(out, out.round())


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


def test_header_check_reports_each_problem(tmp_path: Path) -> None:
    (tmp_path / "dir.jpg").mkdir()
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("hello")
    (tmp_path / "ok.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 8)
    results = check_files(
        [str(tmp_path / n) for n in ("dir.jpg", "empty.jpg", "text.jpg", "ok.png", "gone.jpg")]
    )
    assert [r[0] for r in results] == [None, None, None, "png", None]
    assert results[0][1] == "is a directory, not an image file"
    assert results[1][1] == "empty file"
    assert (results[2][1] or "").startswith("not a supported image (starts with b'hello'")
    assert results[3][1] is None and results[4][1] == "file not found"


def test_many_files_are_checked_in_threads(tmp_path: Path) -> None:
    paths = []
    for i in range(80):
        p = tmp_path / f"{i}.bmp"
        p.write_bytes(b"BM" + bytes(14) if i % 7 else b"")
        paths.append(str(p))
    results = check_files(paths, threads=4)
    assert [r[1] == "empty file" for r in results] == [i % 7 == 0 for i in range(80)]


def test_torchvision_backend_builds_its_dataloader_with_the_autotuner(folder: Path) -> None:
    loader = _loader(
        folder,
        "torchvision",
        batch_size=6,
        loader_kwargs={"budget_s": 10, "cache": False, "progress": False, "max_workers": 1},
    )
    report = loader.dataloader.tuning_report  # type: ignore[attr-defined]
    assert report.num_workers in (0, 1)
    assert sorted(_indices(loader)) == list(range(24))


def test_autotuned_torchvision_backend_shows_no_progress_bar_unless_asked(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.loader

    seen: list[dict[str, Any]] = []
    real = trainperf.loader.autotune_loader

    def autotune_loader(dataset: Any, batch_size: int, **kw: Any) -> Any:
        seen.append(kw)
        return real(dataset, batch_size, **{**kw, "max_workers": 0, "budget_s": 5})

    monkeypatch.setattr(trainperf.loader, "autotune_loader", autotune_loader)
    _loader(folder, "torchvision", loader_kwargs={"cache": False})
    _loader(folder, "torchvision", loader_kwargs={"cache": False, "progress": True})
    assert [kw["progress"] for kw in seen] == [False, True]
    assert all(kw["cache"] is False for kw in seen)


def test_num_threads_auto_divides_cpus_by_the_local_world_size(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainperf.limits

    monkeypatch.setattr(trainperf.limits, "host_limits", lambda: _limits_with_cpus(8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _loader(folder, "torchvision", num_threads="auto").config.num_threads == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    assert _loader(folder, "torchvision", num_threads="auto").config.num_threads == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE must be a whole number >= 1.*'two'"):
        _loader(folder, "torchvision", num_threads="auto")


def _limits_with_cpus(cpus: int) -> Any:
    from trainperf.limits import HostLimits

    return HostLimits(cpus, cpus, None, cpus, 1 << 34, None, 1 << 33, None, None)


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
