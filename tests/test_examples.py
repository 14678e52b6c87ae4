"""Smoke tests: every example runs on CPU with tiny settings and says what it did."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 240) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_quickstart_trains_and_reloads_identically(tmp_path: Path) -> None:
    out = run_example("quickstart.py", "--samples", "128", "--epochs", "2", "--out", str(tmp_path))
    assert "epoch 2/2" in out
    assert "outputs identical to the trained model: True" in out
    assert (tmp_path / "model.pt").is_file()
