"""benchmarks/adapt_bench.py runs and prints the fixed settings and the adaptive loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "adapt_bench.py"


@pytest.mark.slow  # a few seconds: several loaders with workers
def test_adapt_bench_prints_every_row_and_the_history() -> None:
    args = ["--samples", "96", "--epochs", "2", "--latency-ms", "1", "--step-ms", "0.5"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    for row in ("fixed workers=0", "fixed workers=8", "adaptive", "tuning_history:"):
        assert row in proc.stdout, proc.stdout
    assert "→" in proc.stdout  # it changed the settings after the first epoch
