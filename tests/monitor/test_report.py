"""WatchReport and its parts (``monitor/_report.py``): the table, to_dict and plot."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.monitor._fakes import samples, sleepy_loader, steps
from trainperf._utils import imports as _imports
from trainperf.monitor import Sample, StepRecord, Verdict, WatchReport, analyse, watch


def test_the_report_prints_serialises_and_can_be_taken_inside_the_loop() -> None:
    with watch(device="cpu", warmup_steps=0) as w:
        for i, _ in enumerate(w.iter(sleepy_loader(8, 0.002))):
            w.step()
            if i == 5:
                partial = w.report()
    assert partial.steps == 6
    report = w.report()
    text = str(report)
    assert text.startswith(f"trainperf.watch: {report.verdict.kind}") and "fix:" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert "timeline" not in data and data["verdict"]["kind"] == report.verdict.kind
    full = json.loads(json.dumps(report.to_dict(timeline=True)))
    assert len(full["timeline"]) == 8


# --------------------------------------------------------------------------- plot


def _report() -> WatchReport:
    return analyse(steps(20, 0.01, 0.01), samples(10, 50.0, 100, 30), cuda_used=True)


def test_plot_without_matplotlib_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = _imports.is_available
    monkeypatch.setattr(_imports, "is_available", lambda n: n != "matplotlib" and real(n))
    with pytest.raises(ModuleNotFoundError, match=r"pip install .trainperf\[plot\]."):
        _report().plot(tmp_path / "timeline.png")


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = _report().plot(tmp_path / "timeline.png")
    assert out == tmp_path / "timeline.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- the protocol


def input_bound_with_stalls() -> WatchReport:
    """Input-bound, with a stall every 10 steps as an "also" finding, on a GPU NVML samples."""
    timeline = steps(60, 0.015, 0.005, gpu_busy=0.004)
    for i in range(9, 60, 10):
        timeline[i] = StepRecord(i, timeline[i].start, 0.015, 0.045, 32, 0.004)
    return analyse(timeline, samples(15, 40.0, 100, 20), gpu_present=True, cuda_used=True, cpus=8)


def test_to_dict_with_no_arguments_is_json_safe() -> None:
    report = input_bound_with_stalls()
    assert [f.kind for f in report.findings] == ["periodic-stalls"]
    data = report.to_dict()
    # Only str, int, float, bool, None, lists and dicts survive a JSON round trip unchanged.
    assert json.loads(json.dumps(data)) == data
    names = [f.name for f in dataclasses.fields(WatchReport)]
    assert list(data) == [n for n in names if n not in ("timeline", "samples")]
    assert data["verdict"] == report.verdict.to_dict()
    assert data["findings"] == [report.findings[0].to_dict()]
    assert data["stall_steps"] == list(report.stall_steps) and data["stall_period"] == 10


def test_to_dict_with_the_timeline_is_json_safe() -> None:
    report = input_bound_with_stalls()
    data = report.to_dict(timeline=True)
    assert json.loads(json.dumps(data)) == data
    assert list(data) == [f.name for f in dataclasses.fields(WatchReport)]
    assert data["timeline"] == [s.to_dict() for s in report.timeline]
    assert data["samples"] == [s.to_dict() for s in report.samples]
    assert data["timeline"][9] == {
        "index": 9, "start": report.timeline[9].start, "wait": 0.015, "compute": 0.045,
        "samples": 32, "gpu_busy": 0.004,
    }  # fmt: skip


def test_the_parts_serialise_themselves() -> None:
    verdict = Verdict("input-bound", "waits", ("30% waiting", "saw-tooth"), "tune the loader")
    assert verdict.to_dict() == {
        "kind": "input-bound", "summary": "waits", "reasons": ["30% waiting", "saw-tooth"],
        "fix": "tune the loader",
    }  # fmt: skip
    step = StepRecord(3, 0.5, 0.01, 0.02, None, None)
    assert step.to_dict() == {
        "index": 3, "start": 0.5, "wait": 0.01, "compute": 0.02, "samples": None,
        "gpu_busy": None,
    }  # fmt: skip
    sample = Sample(0.1, None, None, 50.0, 20.0)
    assert sample.to_dict() == {
        "time": 0.1, "gpu_utilization": None, "gpu_memory_used": None, "process_cpu": 50.0,
        "host_cpu": 20.0,
    }  # fmt: skip


def test_str_is_the_table_a_person_reads() -> None:
    report = input_bound_with_stalls()
    lines = str(report).splitlines()
    assert lines[0] == "trainperf.watch: input-bound: the training step waits for data"
    assert lines[1].startswith("  60 steps (2 warm-up left out), ")
    assert lines[2].startswith("  GPU: CUDA events span ") and "memory up to 1.0 GiB" in lines[2]
    assert lines[3].startswith("  CPU: this process and its workers 100% (of 800% usable)")
    assert [line[4:] for line in lines if line.startswith("  - ")] == list(report.verdict.reasons)
    assert f"  fix: {report.verdict.fix}" in lines
    also = lines.index(f"  also periodic-stalls: {report.findings[0].summary}")
    assert lines[also + 1] == f"    fix: {report.findings[0].fix}"
