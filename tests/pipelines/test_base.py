"""trainperf.pipelines._base: the ImageLoader contract every CPU-capable backend keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines._images import (
    CPU_BACKENDS,
    SIZE,
    SMALL_LIMIT,
    _epoch,
    _indices,
    _loader,
    _pixels,
    _reference_eval,
    big_image,
    bomb_jpeg,
)
from trainperf.pipelines._source import load_source

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


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


# 224 px (the ImageNet size) takes seconds per backend on a 2-core machine.
@pytest.mark.parametrize("size", [SIZE, pytest.param(224, marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_truncated_jpeg_raises_naming_the_file_when_reached(
    truncated_folder: Path, backend: str
) -> None:
    loader = _loader(truncated_folder, backend, batch_size=25, train=False, last_batch="keep")
    with pytest.raises(RuntimeError, match=r"could not decode .*truncated\.jpg"):
        _epoch(loader)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_closed_loader_refuses_to_iterate(folder: Path, backend: str) -> None:
    with _loader(folder, backend, batch_size=8) as loader:
        assert len(_epoch(loader)) == 3
    with pytest.raises(RuntimeError, match="was closed"):
        _epoch(loader)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("replacement", ["big", "bomb", "bomb_over_pillows_limit"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_file_replaced_after_the_check_is_refused_before_it_is_decoded(
    fresh_folder: Path,
    backend: str,
    on_error: str,
    replacement: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.pipelines._torchvision as tv

    decoded: list[tuple[int, int]] = []
    real = tv.pil_to_rgb

    def spy(im: Any) -> Any:
        decoded.append(im.size)
        return real(im)

    monkeypatch.setattr(tv, "pil_to_rgb", spy)
    loader = _loader(
        fresh_folder,
        backend,
        on_error=on_error,
        max_pixels=SMALL_LIMIT,
        train=False,
        batch_size=8,
        last_batch="keep",
    )
    victim = fresh_folder / "a_red" / "03.jpg"  # in the first batch
    if replacement == "big":
        big_image(victim)  # a real 300 x 200 JPEG
    elif replacement == "bomb":  # header-only, 10000 x 10000: Pillow's own check only warns
        victim.write_bytes(bomb_jpeg(10000, 10000))
    else:  # over twice Pillow's limit: Pillow's Image.open would refuse it itself
        victim.write_bytes(bomb_jpeg(30000, 30000))
    size = {
        "big": "300x200 = 60,000",
        "bomb": "10000x10000 = 100,000,000",
        "bomb_over_pillows_limit": "30000x30000 = 900,000,000",
    }[replacement]
    with pytest.raises(
        RuntimeError,
        match=rf"03\.jpg' has {size} pixels, over max_pixels=20,000 \(a bomb guard\), so it is "
        r"not decoded: it changed after the loader checked it .*max_pixels=\.\.\.\) \(now 20,000",
    ):
        _epoch(loader)
    assert (300, 200) not in decoded and (10000, 10000) not in decoded
    if backend == "dali":  # refused by trainperf's feed: DALI never had the bytes
        assert "03.jpg' has" in (loader._feed.error or "")  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_set_epoch_picks_the_next_passs_order_like_a_distributed_sampler(
    folder: Path, backend: str
) -> None:
    loader = _loader(folder, backend, batch_size=6, seed=3)
    reference = _loader(folder, backend, batch_size=6, seed=3)
    orders = [_indices(reference) for _ in range(3)]
    for epoch in (2, 0, 2):  # forward, back, and a sampler-style loop's own epoch
        loader.set_epoch(epoch)
        assert loader.epoch == epoch
        assert _indices(loader) == orders[epoch]
    assert loader.epoch == 3


@pytest.mark.parametrize("epoch", [-1, 1.0, True, "2", None])
def test_set_epoch_and_assigning_epoch_refuse_what_is_not_an_int_at_least_0(
    folder: Path, epoch: object
) -> None:
    loader = _loader(folder, "torchvision", batch_size=6)
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0, got"):
        loader.set_epoch(epoch)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0, got"):
        loader.epoch = epoch  # type: ignore[assignment]
    assert loader.epoch == 0


def test_set_epoch_takes_a_numpy_integer_and_keeps_a_python_int(folder: Path) -> None:
    import numpy as np

    loader = _loader(folder, "torchvision", batch_size=6)
    loader.set_epoch(np.int64(4))
    assert loader.epoch == 4 and type(loader.epoch) is int


def test_passes_started_from_several_threads_each_get_their_own_epoch() -> None:
    # The epoch was read and counted on in two steps: threads starting passes together read
    # the same epoch (the same order and crops twice) and lost counts.
    import sys
    import threading

    from trainperf.pipelines._base import ImageLoader

    class Counting(ImageLoader):  # the epoch bookkeeping alone, no files
        backend = "nvjpeg"

        def __init__(self) -> None:
            pass

        def _epoch(self, epoch: int) -> Any:
            return iter(())

    loader, passes = Counting(), 3000
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [
            threading.Thread(target=lambda: [loader.iter_with_indices() for _ in range(passes)])
            for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert loader.epoch == 4 * passes
