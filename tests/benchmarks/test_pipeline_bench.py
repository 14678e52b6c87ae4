"""Smoke tests for benchmarks/pipeline_bench.py: every row and the training comparison run.

The script is imported by path and its ``main`` called with the smallest settings, so a bug
in a code path (above all ``train_resnet``, the GPU measurement) shows up here, on the CPU,
before it costs GPU time. Nothing here asserts on a speed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.benchmarks._scripts import script_module
from trainperf.amp import _tf32
from trainperf.pipelines._loader import _dali_importable

# Each test here runs a script or builds the site: seconds each.
pytestmark = pytest.mark.slow

pytest.importorskip("torchvision")
pytest.importorskip("PIL")

# As in tests/pipelines/_images.py: CI (TRAINPERF_REQUIRE_DALI=1) expects the DALI rows to run.
HAS_DALI = os.environ.get("TRAINPERF_REQUIRE_DALI") == "1" or _dali_importable()
TINY = [
    *("--images", "8", "--threads", "1", "--batch-size", "4", "--size", "32"),
    *("--epochs", "1", "--seconds", "0", "--tune-budget", "1"),
]
requires_cuda = pytest.mark.requires_cuda


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with script_module("pipeline_bench", "pipeline_bench") as module:
        yield module


@pytest.fixture(autouse=True)
def _restore_backend_flags() -> Iterator[None]:
    """train_resnet sets cudnn.benchmark, and MixedPrecision.prepare switches TF32 on for the
    whole process on a GPU; neither may leak into the tests that run after these."""
    saved_tf32 = _tf32._snapshot()
    benchmark = torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark
        _tf32._restore(saved_tf32)


def _table_rows(out: str) -> dict[str, str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend "))
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("("):
            break
        rows[line.split()[0]] = line
    return rows


def test_every_backend_gets_a_row(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "cpu.json"
    rc = bench.main(
        [
            *TINY,
            *("--device", "cpu", "--backends", "dali,nvjpeg,torchvision"),
            *("--fixed-workers", "0", "--json", str(out_json)),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    rows = _table_rows(out)
    assert list(rows) == ["dali", "nvjpeg", "torchvision", "torchvision-w0"]
    assert "needs a CUDA device" in rows["nvjpeg"]
    result = json.loads(out_json.read_text())
    status = {r["backend"]: r["status"] for r in result["rows"]}
    notes = {r["backend"]: r.get("note") for r in result["rows"]}
    dali = "ok" if HAS_DALI else "skipped"
    assert status == {
        "dali": dali,
        "nvjpeg": "skipped",
        "torchvision": "ok",
        "torchvision-w0": "ok",
    }, notes
    for row in result["rows"]:
        if row["status"] == "ok":
            assert row["images_per_s"] > 0 and row["per_cpu_second"] > 0
            assert row["epochs_timed"] >= 1
    assert result["rows"][3]["workers"] == 0
    assert result["training"] is None
    if HAS_DALI:
        assert result["dali_vs_dataloader_per_cpu_second"] > 0
        assert "DALI vs autotuned DataLoader, images per CPU-second" in out


def test_train_resnet_runs_on_the_cpu_with_the_torchvision_feed(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "train.json"
    rc = bench.main(
        [
            *TINY,
            *("--device", "cpu", "--backends", "", "--train-resnet"),
            *("--feed-backend", "torchvision", "--warmup", "1", "--steps", "1"),
            *("--model", "resnet18"),  # the GPU default is resnet50: the same code
            *("--json", str(out_json)),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "resnet18 bfloat16 channels_last training on cpu, batch 4: synthetic" in out
    assert "torchvision-fed" in out
    training = json.loads(out_json.read_text())["training"]
    # What MixedPrecision did, not only what the benchmark asked for.
    assert training["dtype"] == "bfloat16" and training["channels_last"] is True
    assert "channels_last=True" in training["mixed_precision"]
    assert training["model"] == "resnet18" and training["feed_backend"] == "torchvision"
    assert training["fed_steps"] >= 3 and len(training["synthetic_rounds"]) == 3
    assert training["fed_images_per_s"] > 0 and training["synthetic_images_per_s"] > 0
    assert training["ratio"] == pytest.approx(
        training["fed_images_per_s"] / training["synthetic_images_per_s"]
    )


def test_train_resnet_with_the_nvjpeg_feed_needs_cuda(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = bench.main([*TINY, "--device", "cpu", "--backends", "", "--train-resnet"])
    assert rc == 0
    assert "--feed-backend nvjpeg needs a CUDA device; skipped" in capsys.readouterr().out


@requires_cuda
def test_train_resnet_fed_by_nvjpeg_on_the_gpu(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "gpu.json"
    rc = bench.main(
        [
            *TINY,
            *("--device", "cuda", "--backends", "nvjpeg", "--train-resnet"),
            *("--warmup", "1", "--steps", "1", "--json", str(out_json)),
        ]
    )
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["rows"][0]["status"] == "ok"
    training = result["training"]
    assert training["feed_backend"] == "nvjpeg"
    assert training["dtype"] == "bfloat16" and training["channels_last"] is True
    assert training["fed_steps"] >= 3
    assert "nvjpeg-fed" in capsys.readouterr().out


class _TinyLoader:
    device = torch.device("cpu")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield torch.zeros(2, 3, 4, 4), torch.zeros(2)


def test_epochs_go_on_until_cpu_time_is_measured_and_none_at_all_is_an_error(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CPU time comes in 10 ms ticks: a tiny epoch measured none (a ZeroDivisionError).
    ticks = iter([0.0, 0.0, 0.0, 0.0, 0.5])  # the start, then after 1, 2, 4 epochs, then 8
    monkeypatch.setattr(bench, "cpu_seconds", lambda: next(ticks, 0.5))
    ips, per_cpu, timed = bench.time_loader(_TinyLoader(), epochs=1, seconds=0)
    assert ips > 0
    assert timed == 8 and per_cpu == pytest.approx(8 * 2 / 0.5)
    monkeypatch.setattr(bench, "cpu_seconds", lambda: 0.0)
    monkeypatch.setattr(bench, "MAX_TIMING_S", 0.2)
    with pytest.raises(RuntimeError, match="no CPU time measured"):
        bench.time_loader(_TinyLoader(), epochs=1, seconds=0)


@pytest.mark.parametrize("backends", ["bogus", "torchvision,dali,bogus", "torchvision-wx"])
def test_unknown_backends_are_refused_before_any_work(
    bench: ModuleType,
    backends: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(bench, "make_folder", lambda *a: pytest.fail("generated the images"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--backends", backends, "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--backends takes dali, nvjpeg, torchvision or torchvision-wN" in err
    assert repr(backends.split(",")[-1]) in err
