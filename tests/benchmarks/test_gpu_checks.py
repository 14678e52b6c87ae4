"""benchmarks/gpu_checks.sh: the script a GPU lease runs must not fail on a path or a typo."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"


def referenced_paths(text: str) -> set[str]:
    """Every repository path the script names: scripts, examples and test files or folders."""
    found = re.findall(r"(?<![\w/.-])((?:benchmarks|examples|tests)/[\w./-]*)", text)
    return {path.rstrip(".") for path in found}


def test_referenced_paths_finds_scripts_and_test_folders() -> None:
    text = 'step a 1 "$PY" benchmarks/x.py --json "$WORK/x.json"\nstep b 1 pytest tests/ddp -k y'
    assert referenced_paths(text) == {"benchmarks/x.py", "tests/ddp"}


def test_every_path_the_script_names_exists() -> None:
    paths = referenced_paths(SCRIPT.read_text())
    assert "benchmarks/amp_bench.py" in paths  # the parser still sees the script's steps
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"benchmarks/gpu_checks.sh names paths that do not exist: {missing}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_parses_and_refuses_an_unknown_part() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    proc = subprocess.run(["bash", str(SCRIPT), "bogus"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "usage" in proc.stderr


@pytest.mark.slow  # imports torch twice: several seconds
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_named_steps_run_alone_and_an_unknown_name_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "TMPDIR": str(tmp_path)}  # fmt: skip
    run = subprocess.run(["bash", str(SCRIPT), "quick", "env"], capture_output=True, text=True,
                         env=env, timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = (tmp_path / "gpu-checks-quick" / "summary.txt").read_text()
    assert re.findall(r"== step (\S+):", summary) == ["env"], summary
    bad = subprocess.run(["bash", str(SCRIPT), "quick", "env", "no_such_step"],
                         capture_output=True, text=True, env=env, timeout=240)  # fmt: skip
    assert bad.returncode == 2 and "no such step in quick: no_such_step" in bad.stdout
