"""WatchReport and its parts (``monitor/_report.py``, ``_records.py``, ``_verdict.py``): the table,
to_dict and plot."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.monitor._fakes import samples, sleepy_loader, steps
from trainperf._utils import imports as _imports
from trainperf.monitor import (
    Fix,
    LoopSetup,
    Sample,
    StepRecord,
    Verdict,
    WatchReport,
    WhatIf,
    analyse,
    watch,
)
from trainperf.monitor._verdict import rank_fixes, with_fixes


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
    assert list(data) == [n for n in names if n not in ("timeline", "samples")] + ["what_if"]
    assert data["what_if"] == [f.to_dict() for f in report.what_if().fixes]
    assert data["setup"] == report.setup.to_dict()
    assert data["verdict"] == report.verdict.to_dict()
    assert data["findings"] == [report.findings[0].to_dict()]
    assert data["stall_steps"] == list(report.stall_steps) and data["stall_period"] == 10


def test_to_dict_with_the_timeline_is_json_safe() -> None:
    report = input_bound_with_stalls()
    data = report.to_dict(timeline=True)
    assert json.loads(json.dumps(data)) == data
    assert list(data) == [f.name for f in dataclasses.fields(WatchReport)] + ["what_if"]
    assert data["timeline"] == [s.to_dict() for s in report.timeline]
    assert data["samples"] == [s.to_dict() for s in report.samples]
    assert data["timeline"][9] == {
        "index": 9, "start": report.timeline[9].start, "wait": 0.015, "compute": 0.045,
        "samples": 32, "gpu_busy": 0.004, "wait_cpu": None, "cpu_delay": None,
    }  # fmt: skip


def test_the_parts_serialise_themselves() -> None:
    fix = Fix("input-bound", "trainperf.autotune_loader(dataset, batch_size)", 2.5, "why")
    verdict = Verdict(
        "input-bound", "waits", ("30% waiting", "saw-tooth"), "tune the loader", 2.5, "why",
        (fix,),
    )  # fmt: skip
    assert verdict.to_dict() == {
        "kind": "input-bound", "summary": "waits", "reasons": ["30% waiting", "saw-tooth"],
        "fix": "tune the loader", "predicted_speedup": 2.5, "basis": "why",
        "fixes": [{"finding": "input-bound", "call": fix.call, "predicted_speedup": 2.5,
                   "basis": "why"}],
    }  # fmt: skip
    bare = Verdict("inconclusive", "few steps", (), "watch more").to_dict()
    assert bare["predicted_speedup"] == 1.0 and bare["basis"].startswith("not predicted")
    step = StepRecord(3, 0.5, 0.01, 0.02, None, None, 0.004, 0.001)
    assert step.to_dict() == {
        "index": 3, "start": 0.5, "wait": 0.01, "compute": 0.02, "samples": None,
        "gpu_busy": None, "wait_cpu": 0.004, "cpu_delay": 0.001,
    }  # fmt: skip
    sample = Sample(0.1, None, None, 50.0, 20.0, 30.0, 4.0)
    assert sample.to_dict() == {
        "time": 0.1, "gpu_utilization": None, "gpu_memory_used": None, "process_cpu": 50.0,
        "host_cpu": 20.0, "workers_cpu": 30.0, "host_steal": 4.0,
    }  # fmt: skip
    setup = LoopSetup(num_workers=2, gpu_capability=(9, 0))
    assert json.loads(json.dumps(setup.to_dict()))["gpu_capability"] == [9, 0]


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


# --------------------------------------------------------------------------- predictions


def test_str_shows_each_prediction_and_the_what_if_table() -> None:
    report = input_bound_with_stalls()
    lines = str(report).splitlines()
    v, stalls = report.verdict, report.findings[0]
    fix_at = lines.index(f"  fix: {v.fix}")
    assert lines[fix_at + 1] == f"  predicted: {v.predicted_speedup:.2f}x with {v.fixes[0].call}"
    also = lines.index(f"  also periodic-stalls: {stalls.summary}")
    assert lines[also + 2] == (
        f"    predicted: {stalls.predicted_speedup:.2f}x with {stalls.fixes[0].call}"
    )
    table = lines.index(str(report.what_if()).splitlines()[0])
    assert lines[table:] == str(report.what_if()).splitlines()


def test_the_predicted_line_keeps_a_bound_and_a_placeholder_as_such() -> None:
    # Before: a save every 4 steps (gradient accumulation watched per micro-batch), whose
    # basis says "not predicted" (the 1.0 a placeholder), printed "predicted: 1.00x with
    # trainperf.Checkpointer(...)", a forecast of no gain; and a bound lost its "at most".
    cadence = steps(60, 0.0, 0.002)
    for i in range(3, 60, 4):
        cadence[i] = StepRecord(i, cadence[i].start, 0.0, 0.1, 32, None)
    lines = str(analyse(cadence)).splitlines()
    assert "  predicted: not predicted for trainperf.Checkpointer(directory).save(state, " \
        "step=step, blocking=False)" in lines  # fmt: skip
    at_most = Fix("periodic-stalls", "a()", 1.5, "at most: if it is a save; ...")
    report = dataclasses.replace(
        input_bound_with_stalls(), verdict=with_fixes(input_bound_with_stalls().verdict, [at_most])
    )
    assert "  predicted: at most 1.50x with a()" in str(report).splitlines()


def test_what_if_ranks_every_fix_once_by_predicted_gain() -> None:
    report = input_bound_with_stalls()
    ranked = report.what_if().fixes
    calls = [f.call for f in ranked]
    assert len(calls) == len(set(calls))
    assert [f.predicted_speedup for f in ranked] == sorted(
        (f.predicted_speedup for f in ranked), reverse=True
    )
    every = {f.call for v in (report.verdict, *report.findings) for f in v.fixes}
    assert set(calls) == every
    assert ranked[0].predicted_speedup == max(
        v.predicted_speedup for v in (report.verdict, *report.findings)
    )


def test_a_call_two_findings_name_is_listed_with_the_larger_prediction() -> None:
    small = Fix("input-bound", "trainperf.autotune_loader(dataset, batch_size)", 1.5, "a")
    large = Fix("host-bound", "trainperf.autotune_loader(dataset, batch_size)", 2.0, "b")
    other = Fix("host-bound", "torch.set_num_threads(1)", 1.7, "c")
    verdicts = [with_fixes(Verdict("input-bound", "", (), ""), [small]),
                with_fixes(Verdict("host-bound", "", (), ""), [other, large])]  # fmt: skip
    assert rank_fixes(verdicts) == (large, other)


def test_what_if_prints_and_serialises() -> None:
    fix = Fix("input-bound", "trainperf.autotune_loader(dataset, batch_size)", 2.5, "because")
    table = WhatIf((fix,), 1000.0, 31.25)
    assert str(table).splitlines() == [
        "what if (ranked by predicted gain; now 1,000.0 samples/s):",
        "  1.  2.50x  trainperf.autotune_loader(dataset, batch_size)  [input-bound]",
        "            because",
    ]
    assert json.loads(json.dumps(table.to_dict())) == {
        "fixes": [fix.to_dict()], "samples_per_s": 1000.0, "steps_per_s": 31.25,
    }  # fmt: skip
    assert str(WhatIf((), None, 2.0)) == "what if: no fix to predict"
    assert "now 2.00 steps/s" in str(WhatIf((fix,), None, 2.0))
