"""benchmarks/amp_bench.py: a CPU smoke test of the script (its numbers are not checked)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks._scripts import load_script

# Each test here runs a script or builds the site: seconds each.
pytestmark = pytest.mark.slow

# The peers (accelerate, fabric) are left out: whether they run depends on what is installed.
CONFIGS = ("fp32", "fp32+tf32", "autocast-bf16", "autocast-bf16+cl", "trainperf")


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("amp_bench", monkeypatch)


@pytest.mark.slow  # a few seconds: five ResNet-18 builds and steps
def test_amp_bench_runs_every_requested_config_on_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("torchvision")
    bench = load_bench(monkeypatch)
    out_json = tmp_path / "amp.json"
    rc = bench.main(
        [
            *("--device", "cpu", "--model", "resnet18", "--batch-size", "2"),
            *("--image-size", "32", "--warmup", "0", "--iterations", "1", "--rounds", "1"),
            *("--configs", ",".join(CONFIGS), "--json", str(out_json)),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config "))
    rows = lines[header + 1 : header + 1 + len(CONFIGS)]
    assert [row.split()[0] for row in rows] == list(CONFIGS)
    status = {row.split()[0]: row.split()[1] for row in rows}
    assert status["fp32+tf32"] == "skipped"  # TF32 exists on CUDA only
    assert all(status[c] not in ("skipped", "failed") for c in CONFIGS if c != "fp32+tf32")
    assert lines[header + 1 + len(CONFIGS)].startswith("best raw: ")
    assert "not a CUDA device: a smoke test" in out
    assert out_json.stat().st_size > 0
