"""trainperf.pipelines._torchvision: the DataLoader backend, its workers and the autotuner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines._images import SIZE, _epoch, _indices, _loader, _reference_eval, requires_cuda
from trainperf.pipelines._source import load_source

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


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


@pytest.mark.slow
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


@pytest.mark.slow
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
