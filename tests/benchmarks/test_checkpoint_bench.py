"""benchmarks/checkpoint_bench.py: a tiny CPU smoke test of the script (its numbers are not
checked: tests never assert on speed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

# Starts a child process (the SIGTERM part) and two forked gloo ranks: seconds.
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_bench.py"


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("checkpoint_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "checkpoint_bench", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_checkpoint_bench_measures_every_part_on_a_tiny_state(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_bench(monkeypatch)
    out_json = tmp_path / "ckpt.json"
    rc = bench.main(
        [
            *("--size-mb", "4", "--repeats", "1", "--seconds", "0.2", "--step-ms", "2"),
            *("--agree-steps", "20", "--dir", str(tmp_path / "d"), "--json", str(out_json)),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for label in (
        "torch.save",
        "save_checkpoint",
        "Checkpointer.save(blocking=False) [process]",
        "Checkpointer.save(blocking=False) [thread]",
        "during a process write",
        "during a thread write",
        "SIGTERM to exit with a 4 MB final save",
        "agreement on 2 gloo ranks",
    ):
        assert label in out, label
    result = json.loads(out_json.read_text())
    assert [r["what"] for r in result["blocked"]][:2] == ["torch.save", "save_checkpoint"]
    assert all(r["blocked_s"] > 0 for r in result["blocked"])
    assert result["sigterm"]["exit_code"] == 0 and "saved" in result["sigterm"]["child"]
    assert result["agreement"]["check_every"] >= 1
    assert result["settings"]["size_mb"] == 4


def test_bad_options_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    with pytest.raises(SystemExit):
        bench.main(["--writers", "fork"])
