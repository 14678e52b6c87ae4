"""trainperf.pipelines._loader: image_loader's arguments, backend choice and missing extras."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.pipelines._images import (
    CPU_BACKENDS,
    NO_TUNING,
    SIZE,
    _indices,
    _loader,
    needs_dali,
    requires_cuda,
)
from trainperf._utils.imports import is_available
from trainperf.errors import DeviceError
from trainperf.pipelines import image_loader

PIL = pytest.importorskip("PIL.Image")
torchvision = pytest.importorskip("torchvision")


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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_skip_leaves_bad_files_out_with_a_warning(bad_folder: Path, backend: str) -> None:
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable file\(s\)"):
        loader = _loader(bad_folder, backend, on_error="skip", batch_size=6)
    assert sorted(Path(b.path).name for b in loader.skipped) == ["empty.jpg", "notes.jpg"]
    assert len(loader.files) == 24
    assert sorted(_indices(loader)) == list(range(24))


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
        # A set has no channel order: its items came out in hash order, silently.
        ({"std": {0.2, 0.3, 0.4}}, ValueError, r"std must be 3 numbers in R, G, B order"),
        ({"std": (0.2, 0.0, 0.2)}, ValueError, "std must be 3 positive numbers"),
        ({"mean": [float("nan")] * 3}, ValueError, r"mean must be finite, got \[nan, nan, nan\]"),
        ({"std": (0.2, float("nan"), 0.2)}, ValueError, r"std must be finite, got \(0\.2, nan"),
        ({"std": [float("inf")] * 3}, ValueError, r"^std must be finite, got \[inf, inf, inf\]$"),
        ({"mean": (0, float("-inf"), 0)}, ValueError, r"^mean must be finite, got \(0, -inf, 0\)$"),
        (
            {"mean": (123.675, 116.28, 103.53)},
            ValueError,
            r"mean must be in 0\.\.1 units .* looks like 0\.\.255 units; "
            r"pass mean=\(0\.485, 0\.456, 0\.406\)",
        ),
        (
            {"std": (0.229 * 255, 0.224 * 255, 0.225 * 255)},
            ValueError,
            r"std must be in 0\.\.1 units .* pass std=\(0\.229, 0\.224, 0\.225\)",
        ),
        ({"seed": 2**64}, ValueError, r"seed must be < 2\*\*64 .* got 18446744073709551616"),
        ({"seed": 2**64 + 5}, ValueError, r"seed must be < 2\*\*64 .* seed % 2\*\*64 = 5"),
        ({"shard": (2, 2)}, ValueError, "0 <= rank < world_size"),
        ({"shard": "everything"}, ValueError, "shard must be 'auto', None or a"),
        ({"shard": (0, 1, 2)}, ValueError, "shard must be 'auto', None or a"),
        ({"num_threads": 0}, ValueError, "num_threads must be an int >= 1"),
        ({"max_pixels": 0}, ValueError, r"max_pixels must be None or an int >= 1, got 0"),
        ({"max_pixels": 1e8}, ValueError, r"max_pixels must be None or an int >= 1, got 1"),
        ({"max_pixels": True}, ValueError, r"max_pixels must be None or an int >= 1, got True"),
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


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1])
def test_the_largest_seeds_shuffle_epoch_after_epoch(folder: Path, seed: int) -> None:
    # 2**64 - 1 + epoch 1 overflowed torch.Generator ("Overflow when unpacking long long").
    loader = _loader(folder, "torchvision", seed=seed, batch_size=8)
    epochs = [_indices(loader) for _ in range(2)]
    assert all(sorted(e) == list(range(24)) for e in epochs) and epochs[0] != epochs[1]


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


@pytest.mark.slow
def test_import_loads_neither_dali_nor_torchvision() -> None:
    code = (
        "import sys, trainperf.pipelines\n"
        "print([m for m in ('torchvision', 'nvidia.dali', 'PIL') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


@requires_cuda
@pytest.mark.skipif(is_available("nvidia.dali"), reason="auto would pick DALI")
def test_auto_on_cuda_without_dali_picks_nvjpeg(folder: Path) -> None:
    loader = image_loader(folder, 8, size=SIZE, device="cuda", shard=None)
    assert loader.backend == "nvjpeg" and "GPU decode" in loader.backend_reason
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, SIZE, SIZE) and images.device.type == labels.device.type


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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_eval_loader_keeps_its_last_batch_by_default(folder: Path, backend: str) -> None:
    evaluate = _loader(folder, backend, train=False, batch_size=5)
    assert evaluate.config.last_batch == "keep" and len(evaluate) == 5
    assert _indices(evaluate) == list(range(24))  # every image, once
    train = _loader(folder, backend, batch_size=5)
    assert train.config.last_batch == "drop" and len(train) == 4
    dropped = _loader(folder, backend, train=False, batch_size=5, last_batch="drop")
    assert _indices(dropped) == list(range(20))


def test_an_eval_loader_keeps_its_last_batch_on_every_rank(folder: Path) -> None:
    shards = [
        _loader(folder, "torchvision", train=False, batch_size=5, shard=(rank, 2))
        for rank in (0, 1)
    ]
    assert [len(s) for s in shards] == [3, 3]
    assert sorted(i for s in shards for i in _indices(s)) == list(range(24))
