"""benchmarks/adapt_bench.py: the scenarios run and print their table (numbers not checked),
and the CPUs and the hog are put back whatever happens."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from tests.benchmarks._scripts import load_script

SHORT = ["--workers", "0,2", "--duration", "2.5", "--before", "1.5", "--tail", "1.5"]
SHORT += ["--warm", "0.3", "--measure", "0.8", "--latency-ms", "1"]


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("adapt_bench", monkeypatch)


@pytest.mark.slow  # about 20 s: several loaders with workers, a CPU hog for seconds
def test_every_scenario_prints_its_row_and_leaves_the_host_as_it_was(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = load_bench(monkeypatch)
    before = os.sched_getaffinity(0)
    others = set(psutil.Process().children(recursive=True))
    out_json = tmp_path / "adapt.json"
    assert bench.main([*SHORT, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for row in ("warmup   as started", "cpus     before", "CPUs halved", "CPU hog running"):
        assert row in out, out
    assert out.count("tuning_history") == 3
    assert "→" in out  # the adaptive loader changed its settings
    results = json.loads(out_json.read_text())["results"]
    assert [r["scenario"] for r in results] == ["warmup", "cpus", "hog"]
    for r in results:
        assert set(r["fixed"]) == {"0", "2"} and r["best_fixed"] > 0
        assert r["adaptive_rate"] > 0 and r["ratio"] == r["adaptive_rate"] / r["best_fixed"]
        assert all(c["at_s"] >= 0 and "batch" in c for c in r["changes"])
    assert results[1]["fixed_after"] and results[1]["before_s"] == 1.5
    assert os.sched_getaffinity(0) == before
    # No hog, no worker left.
    assert set(psutil.Process().children(recursive=True)) <= others


def test_the_affinity_comes_back_when_the_run_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs at least 2 usable CPUs to halve")
    with pytest.raises(RuntimeError, match="the loop failed"), bench.halved_cpus() as halve:
        halve()
        assert len(os.sched_getaffinity(0)) == len(before) // 2
        raise RuntimeError("the loop failed")
    assert os.sched_getaffinity(0) == before


def test_the_hog_is_killed_when_the_run_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    others = set(psutil.Process().children())  # what this test process already runs
    with pytest.raises(RuntimeError, match="the loop failed"), bench.cpu_hog() as start:
        start()
        hogs = set(psutil.Process().children()) - others
        assert len(hogs) == len(os.sched_getaffinity(0))
        raise RuntimeError("the loop failed")
    assert all(not h.is_running() or h.status() == psutil.STATUS_ZOMBIE for h in hogs)
    assert set(psutil.Process().children()) <= others


def test_rates_and_time_to_target_from_batch_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    # 10 samples every 0.1 s for 4 s, then 40 every 0.1 s: 100/s, then 400/s.
    marks = [(round(0.1 * i, 1), 10 if i <= 40 else 40) for i in range(1, 101)]
    assert bench.rate(marks, 0.0, 4.0) == pytest.approx(100.0)
    assert bench.rate(marks, 6.0, 10.0) == pytest.approx(400.0)
    # A 3 s window first averages >= 360/s once it holds 2.7 s of the fast rate: at 6.75 s.
    assert bench.time_to(marks, 360.0) == pytest.approx(6.75)
    # After a change at 4 s the window starts there at the earliest: 3 s of 400/s.
    assert bench.time_to(marks, 360.0, after=4.0) == pytest.approx(3.0)
    assert bench.time_to(marks, 1000.0) is None
    assert bench.time_to([], 1.0) is None


def test_unknown_scenarios_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    with pytest.raises(SystemExit, match=r"unknown scenarios \['nope'\]; choices: warmup"):
        bench.main(["--scenarios", "warmup,nope"])
