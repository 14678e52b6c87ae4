"""trainperf.pipelines._dali: the DALI backend, its graphs and CpuTrainFinish."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines._images import _epoch, _indices, _loader, needs_dali
from trainperf.pipelines import IMAGENET_MEAN, IMAGENET_STD

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


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
