"""benchmarks/launch_bench.py: a CPU smoke test of the hang-detection part (numbers unchecked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "launch_bench.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_detection_overhead_part_runs_and_records_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "launch.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    args = ["--only-detection", "--detection-rounds", "2", "--detection-steps", "2"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args, "--step-ms", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=150, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Hang detection on a" in run.stdout and "us per collective" in run.stdout
    record = json.loads(out.read_text())
    detection = record["detection"]
    assert set(detection["step_s"]) == {"off", "on"}
    assert detection["collective_s"] > 0 and detection["step_hook_s"] > 0
    assert len(detection["per_round_ratios"]) == 2 * 2  # 2 rounds on each of 2 ranks
    assert record["settings"]["nprocs"] == 2
