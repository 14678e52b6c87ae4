"""trainperf.loader._report: the table, the plot and to_dict of TuningReport and CandidateResult."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from trainperf._utils import imports as _imports
from trainperf._utils.imports import is_available
from trainperf.limits import HostLimits
from trainperf.loader import CandidateResult, TuningReport
from trainperf.loader._report import format_bytes

GiB = 1 << 30


@pytest.mark.slow  # the shared tuning run (about 5 s)
def test_report_fields_and_table(report: TuningReport) -> None:
    assert report.candidates[0].num_workers == 0 and report.candidates[0].ok
    assert report.baseline_samples_per_s == report.candidates[0].samples_per_s
    assert report.samples_per_s is not None and report.samples_per_s > 0
    assert report.chosen() is not None
    assert report.chosen().samples_per_s == report.samples_per_s  # type: ignore[union-attr]
    assert report.speedup == pytest.approx(report.samples_per_s / report.baseline_samples_per_s)
    # Candidates are measured one after another inside the call.
    assert report.elapsed_s >= sum(c.elapsed_s for c in report.candidates)
    assert isinstance(report.limits, HostLimits)
    assert report.device == "cpu" and report.batch_size == 4 and not report.from_cache
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith("DataLoader tuning: batch_size=4, device cpu")
    assert f"{report.cpus} usable CPUs ({report.worker_cpus} for workers" in lines[1]
    header = lines[2].split()
    assert header[:4] == ["workers", "prefetch", "pin", "samples/s"]
    rows = lines[3 : 3 + len(report.candidates)]
    for row, c in zip(rows, report.candidates, strict=True):
        assert row.split()[0] == str(c.num_workers)
        assert row.split()[-1] == c.status or f"{c.status} ({c.fault}):" in row
        if c.ok:
            assert f"{c.samples_per_s:,.1f}" in row
    chosen = next(ln for ln in lines if ln.startswith("chosen: "))
    assert f"num_workers={report.num_workers}" in chosen
    assert "x num_workers=0" in chosen


def test_a_skipped_candidate_shows_its_reason() -> None:
    skipped = CandidateResult(4, 2, False, "skipped", fault="memory", reason="needs 9 GiB")
    ok = CandidateResult(
        0, None, False, "ok", samples_per_s=1234.5, spread=0.012, startup_s=0.01, main_cpu=1.0
    )
    limits = HostLimits(2, 2, None, 2, 8 * GiB, None, 4 * GiB, None, None)
    r = TuningReport(
        {"num_workers": 0, "pin_memory": False, "persistent_workers": False},
        1234.5,
        1234.5,
        500.0,
        (ok, skipped),
        1.0,
        5.0,
        limits,
        2,
        1,
        8,
        "cpu",
        16,
        notes=("a note",),
    )
    text = str(r)
    assert "skipped (memory): needs 9 GiB" in text
    assert "1,234.5" in text and "1.2%" in text and "0.01s" in text
    assert "no /dev/shm" in text
    assert "step_fn alone: 500.0 samples/s" in text
    assert "note: a note" in text
    assert r.chosen() is ok and r.speedup == 1.0
    assert format_bytes(3 * GiB) == "3.0 GiB" and format_bytes(512) == "512 B"


@pytest.mark.slow  # the shared tuning run, and matplotlib (about 2 s)
@pytest.mark.skipif(not is_available("matplotlib"), reason="needs matplotlib")
def test_plot_writes_an_image(report: TuningReport, tmp_path: Path) -> None:
    out = report.plot(tmp_path / "throughput.png")
    assert out.exists() and out.stat().st_size > 1000


@pytest.mark.slow  # the shared tuning run (about 5 s)
def test_plot_without_matplotlib_names_the_fix(
    report: TuningReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _imports.is_available
    monkeypatch.setattr(_imports, "is_available", lambda n: n != "matplotlib" and real(n))
    with pytest.raises(
        ModuleNotFoundError,
        match=r"TuningReport.plot\(\) needs matplotlib: pip install 'trainperf\[plot\]'",
    ):
        report.plot(tmp_path / "x.png")


def _bare_report() -> TuningReport:
    limits = HostLimits(2, 2, None, 2, 2**33, None, 2**32, None, None)
    return TuningReport(
        {"num_workers": 0}, None, None, None, (), 0.0, 1.0, limits, 2, 1, 4, "cpu", 8
    )


def test_plot_into_a_missing_folder_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(
        FileNotFoundError, match=r"TuningReport\.plot\(.*folder .*no/such.* does not exist.*mkdir"
    ):
        _bare_report().plot(missing / "loader.png")
    assert not missing.exists()


def test_plot_to_a_folder_is_refused_not_written_beside_it(tmp_path: Path) -> None:
    # matplotlib would write "<folder>.png" beside it and the call return the folder.
    with pytest.raises(IsADirectoryError, match=r"is a folder.*pass a file path"):
        _bare_report().plot(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()


@pytest.mark.slow  # matplotlib's import and one figure: about a second
@pytest.mark.skipif(not is_available("matplotlib"), reason="needs matplotlib")
def test_plot_to_a_path_without_a_suffix_writes_a_png_at_that_path(tmp_path: Path) -> None:
    out = _bare_report().plot(tmp_path / "loader")
    assert out == tmp_path / "loader"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["loader"]


# --------------------------------------------------------------------------- to_dict

CANDIDATE_FIELDS = {f.name for f in dataclasses.fields(CandidateResult)}


def test_candidate_to_dict_is_json_safe_and_round_trips() -> None:
    c = CandidateResult(
        4, 2, True, "failed", spread=math.inf, startup_s=0.5, fault="crash", reason="died"
    )
    data = c.to_dict()
    assert set(data) == CANDIDATE_FIELDS
    assert (data["num_workers"], data["fault"], data["reason"]) == (4, "crash", "died")
    assert CandidateResult(**json.loads(json.dumps(data))) == c


@pytest.mark.slow  # the shared tuning run (about 5 s)
def test_report_to_dict_is_json_safe_and_names_every_field(report: TuningReport) -> None:
    data = json.loads(json.dumps(report.to_dict()))
    report_fields = {f.name for f in dataclasses.fields(TuningReport)}
    assert set(data) == report_fields | {"num_workers", "speedup"}
    assert data["num_workers"] == report.num_workers
    assert data["speedup"] == pytest.approx(report.speedup)
    assert data["samples_per_s"] == report.samples_per_s
    assert data["limits"] == dataclasses.asdict(report.limits)
    assert data["notes"] == list(report.notes)
    assert [CandidateResult(**c) for c in data["candidates"]] == list(report.candidates)
    # The caller's collate_fn is named, the tuned settings are kept as they are.
    assert data["best_kwargs"]["collate_fn"] == "tests.loader._fakes.collate_ids"
    for k in ("num_workers", "pin_memory", "persistent_workers", "batch_size", "drop_last"):
        assert data["best_kwargs"][k] == report.best_kwargs[k]


def test_report_to_dict_describes_what_json_cannot_hold() -> None:
    import multiprocessing

    from torch.utils.data import SequentialSampler

    sampler = SequentialSampler(range(4))
    limits = HostLimits(2, 2, None, 2, 8 * GiB, None, 4 * GiB, None, None)
    r = TuningReport(
        {
            "num_workers": 2,
            "collate_fn": len,
            "sampler": sampler,
            "multiprocessing_context": multiprocessing.get_context("spawn"),
            "timeout": 5.0,
        },
        None,
        None,
        None,
        (),
        0.1,
        5.0,
        limits,
        2,
        1,
        8,
        "cpu",
        16,
        from_cache=True,
        notes=("a note",),
    )
    data = json.loads(json.dumps(r.to_dict()))
    kw = data["best_kwargs"]
    assert kw["collate_fn"] == "builtins.len"
    assert kw["multiprocessing_context"] == "spawn"
    assert kw["sampler"] == repr(sampler)
    assert kw["timeout"] == 5.0
    assert data["speedup"] is None and data["samples_per_s"] is None
    assert data["candidates"] == [] and data["from_cache"] is True
    assert data["notes"] == ["a note"]


@pytest.mark.slow
def test_a_report_without_candidates_prints_no_empty_table(report: TuningReport) -> None:
    # An entry cached by an older version holds only the choice: no header without rows.
    bare = dataclasses.replace(report, candidates=())
    assert "workers RSS" not in str(bare) and "num_workers=" in str(bare)
    assert "workers RSS" in str(report)


def _limits_line(cpus: int, worker_cpus: int, main_cores: float, measured: bool) -> str:
    limits = HostLimits(cpus, cpus, None, cpus, 8 * GiB, None, 4 * GiB, None, None)
    r = TuningReport(
        {"num_workers": 0},
        None,
        None,
        500.0 if measured else None,
        (),
        0.1,
        1.0,
        limits,
        cpus,
        worker_cpus,
        8,
        "cpu",
        16,
        main_cores=main_cores,
    )
    return str(r).splitlines()[1]


@pytest.mark.parametrize(
    ("cpus", "worker_cpus", "main_cores", "measured", "words"),
    [
        (1, 1, 1.0, False, "1 usable CPU (1 for workers, shared with the main process)"),
        (4, 3, 1.0, False, "4 usable CPUs (3 for workers, one kept for the main process)"),
        (2, 2, 0.04, True, "2 usable CPUs (2 for workers, 0.04 kept for the main process, as"),
        (
            2,
            1,
            1.8,
            True,
            "2 usable CPUs (1 for workers, shared with the main process, which step_fn "
            "measured at 1.80 cores)",
        ),
    ],
    ids=["one-cpu", "several-cpus", "measured-kept", "measured-shared"],
)
def test_the_limits_line_words_the_cpu_split(
    cpus: int, worker_cpus: int, main_cores: float, measured: bool, words: str
) -> None:
    # One CPU leaves none to keep for the main process: the workers share its core.
    assert _limits_line(cpus, worker_cpus, main_cores, measured).startswith(f"limits: {words}")
