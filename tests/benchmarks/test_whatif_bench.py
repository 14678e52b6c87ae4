"""benchmarks/whatif_bench.py: a CPU smoke test of the script (its numbers are not checked)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.benchmarks._scripts import load_script

# The script runs real loops: a second or more.
pytestmark = pytest.mark.slow


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("whatif_bench", monkeypatch)


def test_whatif_bench_prints_predicted_against_measured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_bench(monkeypatch)
    out_json = tmp_path / "whatif.json"
    rc = bench.main(["--scenarios", "sync-save", "--rounds", "1", "--scale", "0.5",
                     "--reports", "--json", str(out_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- sync-save: the baseline report" in out and "what if (ranked" in out
    (row,) = [line for line in out.splitlines() if line.startswith("sync-save ")]
    assert "trainperf.Checkpointer" in row and ("ok" in row or "MISS" in row)
    assert "predictions within +-20% of the measured speed-up" in out
    data = json.loads(out_json.read_text())
    (result,) = data["rows"]
    assert result["scenario"] == "sync-save" and result["measured"] > 0
    assert result["predicted"] is None or result["predicted"] >= 1.0
    assert len(result["rounds"]) == 1 and result["rounds"][0]["report"].startswith(
        "trainperf.watch: "
    )


def test_whatif_bench_refuses_what_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench(monkeypatch)
    assert bench.main(["--scenarios", "nope"]) == 2
    assert "unknown scenarios ['nope']" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err


def test_the_gpu_scenarios_run_on_the_cpu_in_a_dry_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("torchvision")
    bench = load_bench(monkeypatch)
    out_json = tmp_path / "whatif-gpu.json"
    rc = bench.main(["--device", "cuda", "--dry-run", "--rounds", "1", "--budget", "2",
                     "--json", str(out_json)])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["scenario"], r["fix"].split("(")[0]) for r in rows] == [
        ("fp32-compute", "trainperf.MixedPrecision"),
        ("jpeg-gpu", "trainperf.autotune_loader"),
        ("jpeg-gpu", "trainperf.pipelines.image_loader"),
    ]
    assert all(r["measured"] > 0 for r in rows)
