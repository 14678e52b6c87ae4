"""Smoke tests: every example runs on CPU with tiny settings and says what it did."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainperf._utils.imports import is_available
from trainperf.pipelines._loader import _dali_importable

# Each test here runs a script or builds the site: seconds each.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# As in tests/pipelines/_images.py: CI (TRAINPERF_REQUIRE_DALI=1) fails rather than skips.
REQUIRE_DALI = os.environ.get("TRAINPERF_REQUIRE_DALI") == "1"


def run_example(
    name: str, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_quickstart_runs_every_stage(tmp_path: Path) -> None:
    out = run_example(
        "quickstart.py",
        *("--per-class", "12", "--image-size", "32", "--epochs", "1", "--tune-budget", "4"),
        *("--out", str(tmp_path)),
    )
    assert "1. trainperf doctor" in out and " ok," in out
    assert "chosen: num_workers=" in out  # the autotuner's report
    assert "trainperf.watch: " in out  # the verdict
    assert "outputs identical: True" in out
    assert "final loss per rank: " in out  # the 2-rank ddp.launch
    assert (tmp_path / "model.pt").is_file()
    assert len(list((tmp_path / "images").rglob("*.jpg"))) == 48
    if is_available("matplotlib"):
        assert (tmp_path / "loader_tuning.png").stat().st_size > 1000
        assert (tmp_path / "watch_timeline.png").stat().st_size > 1000


def test_checkpoint_across_devices_reloads_into_a_plain_model(tmp_path: Path) -> None:
    out = run_example("checkpoint_across_devices.py", "--steps", "3", "--out", str(tmp_path))
    assert "the wrapped model's keys look like 'module._orig_mod." in out
    assert "saved keys look like '0.weight'" in out
    assert "every key loaded: True; weights identical: True" in out
    assert "outputs identical to the trained model: True" in out or "outputs match" in out
    assert "truncated (save or copy interrupted): CheckpointCorruptError" in out
    assert "empty: CheckpointCorruptError" in out
    assert "NotACheckpointError" in out
    assert "missing: CheckpointNotFoundError" in out
    assert (tmp_path / "model.pt").is_file()


def test_diagnose_my_loop_finds_the_slow_loader(tmp_path: Path) -> None:
    plot = tmp_path / "timeline.png"
    out = run_example("diagnose_my_loop.py", "--steps", "12", "--plot", str(plot))
    assert "trainperf.watch: input-bound" in out
    assert "fix: feed the loop faster: trainperf.autotune_loader(" in out
    assert "what if (ranked by predicted gain" in out
    # The plot is optional: either it was written, or the example says how to get matplotlib.
    assert plot.is_file() or "no plot: WatchReport.plot() needs matplotlib" in out


def test_notebook_launch_runs_two_forked_ranks() -> None:
    out = run_example("notebook_launch.py")
    assert "launch -> rank 0 returned {'rank': 0," in out
    assert "launch_all -> rank 1:" in out
    assert "ranks hold the same weights after training: True" in out
    assert "a lambda under fork: [0, 10]" in out
    assert "the same under spawn: ValueError: start_method='spawn'" in out


@pytest.mark.parametrize(
    "backend",
    [
        "torchvision",
        pytest.param(
            "dali",
            marks=pytest.mark.skipif(
                not REQUIRE_DALI and not _dali_importable(),
                reason="needs nvidia-dali (TRAINPERF_REQUIRE_DALI=1 turns this into a failure)",
            ),
        ),
    ],
)
def test_train_imagefolder_trains_with_the_backend_asked_for(tmp_path: Path, backend: str) -> None:
    out = run_example(
        "train_imagefolder.py",
        *("--backend", backend, "--device", "cpu", "--epochs", "1"),
        *("--images-per-class", "8", "--size", "32", "--tune-budget", "2"),
        env={"XDG_CACHE_HOME": str(tmp_path / "cache")},  # the autotuner's cache
    )
    assert f"ImageLoader(backend='{backend}', device='cpu'" in out
    assert "images=24, classes=3" in out
    assert "MixedPrecision(device='cpu'" in out
    found = re.search(r"epoch 0: loss (\d+\.\d+), eval accuracy (\d+\.\d)%", out)
    assert found, out
    assert 0 <= float(found.group(2)) <= 100


def test_tune_batch_size_keeps_the_global_batch_and_trains_with_it(tmp_path: Path) -> None:
    plot = tmp_path / "bs.png"
    out = run_example(
        "tune_batch_size.py",
        *("--device", "cpu", "--samples", "128", "--size", "8", "--global-batch", "32"),
        *("--max-size", "8", "--budget", "6", "--loader-budget", "2", "--plot", str(plot)),
    )
    assert "MixedPrecision(device='cpu'" in out
    assert out.count("<- chosen") == 1
    found = re.search(r"chosen: batch_size=(\d+), accumulation_steps=(\d+)", out)
    assert found, out
    assert int(found.group(1)) * int(found.group(2)) == 32 and int(found.group(1)) <= 8
    assert "model and RNG left as they were: True" in out
    assert "DataLoader: num_workers=" in out and out.count("input pipeline: one batch is") == 2
    assert re.search(r"epoch 0: batch \d+ x \d+ accumulated = 32 per update", out), out
    assert plot.is_file() or "no chart: BatchSizeReport.plot() needs matplotlib" in out


def test_resume_after_preemption_survives_sigterm_and_sigkill(tmp_path: Path) -> None:
    out = run_example(
        "resume_after_preemption.py",
        *("--steps", "40", "--term-at", "15", "--kill-at", "33", "--out", str(tmp_path)),
    )
    assert "SIGTERM: saved step 15" in out
    assert "exit code 0; checkpoints: [10, 15]" in out
    assert "starting at step 15" in out and "exit code -9; checkpoints: [20, 30]" in out
    assert "starting at step 30" in out
    assert "weights and optimizer state identical to the uninterrupted run: True" in out


def test_ddp_train_runs_two_cpu_ranks_with_hang_detection() -> None:
    out = run_example("ddp_train.py", "--epochs", "1", "--nprocs", "2", "--hang-timeout", "120")
    assert "2 rank(s), gloo on cpu" in out
    assert re.search(r"^final loss \d+\.\d+$", out, re.MULTILINE), out
