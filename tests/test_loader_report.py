"""trainperf.loader: the report, tune_loader/autotune_loader arguments, budget, step_fn."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from trainperf import _imports
from trainperf._imports import is_available
from trainperf.limits import HostLimits
from trainperf.loader import (
    CandidateResult,
    TunedDataLoader,
    TuningReport,
    autotune_loader,
    tune_loader,
)
from trainperf.loader._progress import ProgressBar
from trainperf.loader._report import format_bytes

GiB = 1 << 30


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class Waits(Dataset[dict[str, Any]]):
    """Mostly waiting (2 ms per sample), so one worker overlaps well even on 2 cores."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(0.002)
        return {"x": torch.full((4,), float(i)), "i": i}


def collate_ids(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {"x": torch.stack([s["x"] for s in samples]), "ids": [s["i"] for s in samples]}


def quick(**kw: Any) -> dict[str, Any]:
    return {"device": "cpu", "budget_s": 10.0, "cache": False, "progress": False, **kw}


@pytest.fixture(scope="module")
def report() -> TuningReport:
    return tune_loader(Waits(), 4, **quick(max_workers=2, collate_fn=collate_ids, drop_last=True))


def test_best_kwargs_pass_the_callers_arguments_through(report: TuningReport) -> None:
    kw = report.best_kwargs
    assert kw["collate_fn"] is collate_ids
    assert kw["drop_last"] is True
    assert kw["batch_size"] == 4
    assert set(kw) >= {"num_workers", "pin_memory", "persistent_workers"}
    assert kw["pin_memory"] is False  # CPU target: pinning is never chosen
    if kw["num_workers"] == 0:
        assert "prefetch_factor" not in kw and kw["persistent_workers"] is False
    else:
        assert kw["prefetch_factor"] in (2, 4)
    loader = DataLoader(Waits(), **kw)
    batch = next(iter(loader))
    assert batch["x"].shape == (4, 4) and batch["ids"] == [0, 1, 2, 3]
    del loader


def test_report_fields_and_table(report: TuningReport) -> None:
    assert report.candidates[0].num_workers == 0 and report.candidates[0].ok
    assert report.baseline_samples_per_s == report.candidates[0].samples_per_s
    assert report.samples_per_s is not None and report.samples_per_s > 0
    assert report.chosen() is not None
    assert report.chosen().samples_per_s == report.samples_per_s  # type: ignore[union-attr]
    assert report.speedup == pytest.approx(report.samples_per_s / report.baseline_samples_per_s)
    assert report.elapsed_s < report.budget_s + 3
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
    assert format_bytes(3 * GiB) == "3.0 GiB" and format_bytes(512) == "0 KiB"


@pytest.mark.skipif(not is_available("matplotlib"), reason="needs matplotlib")
def test_plot_writes_an_image(report: TuningReport, tmp_path: Path) -> None:
    out = report.plot(tmp_path / "throughput.png")
    assert out.exists() and out.stat().st_size > 1000


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


def test_autotune_loader_returns_a_dataloader_with_its_report() -> None:
    sampler = SequentialSampler(range(32))
    loader = autotune_loader(Waits(), 8, **quick(max_workers=0, sampler=sampler))
    assert isinstance(loader, DataLoader) and isinstance(loader, TunedDataLoader)
    assert isinstance(loader.tuning_report, TuningReport)
    assert loader.sampler is sampler
    assert loader.num_workers == loader.tuning_report.num_workers == 0
    assert len(loader) == 4
    assert [int(b["i"][0]) for b in loader] == [0, 8, 16, 24]


def test_shuffle_and_persistent_workers_given_by_the_caller_are_kept() -> None:
    r = tune_loader(Waits(), 8, **quick(max_workers=0, shuffle=True, persistent_workers=True))
    assert r.best_kwargs["shuffle"] is True
    # persistent_workers needs workers; with num_workers=0 it is dropped, and said so.
    assert r.best_kwargs["persistent_workers"] is False
    assert any("persistent_workers=True dropped" in n for n in r.notes)


def test_persistent_workers_decision() -> None:
    from trainperf.loader._tune import _persistent

    c = CandidateResult(4, 2, False, "ok", samples_per_s=1000.0, startup_s=2.0)
    assert _persistent(c, None, 10_000, 10)[0] is True  # 2 s start-up vs 10 s epochs
    assert _persistent(c, 1, 10_000, 10)[0] is False  # one epoch: nothing to keep
    keep, why = _persistent(c, 5, 10_000_000, 10)  # 10,000 s epochs: start-up negligible
    assert keep is False and why is not None and "under 1 %" in why
    assert (
        _persistent(CandidateResult(0, None, False, "ok", samples_per_s=1.0), None, 10, 1)[0]
        is False
    )


def test_budget_is_a_hard_limit() -> None:
    class Slow(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(0.01)
            return torch.zeros(2)

    start = time.perf_counter()
    r = tune_loader(Slow(), 8, **quick(budget_s=2.0, max_workers=4))
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0 + 3.0
    assert r.elapsed_s == pytest.approx(elapsed, abs=0.5)
    assert r.best_kwargs["num_workers"] in range(5)


def test_step_fn_is_timed_and_reported() -> None:
    seen: list[int] = []

    def step(batch: dict[str, Any]) -> None:
        seen.append(len(batch["ids"]))
        time.sleep(0.02)

    r = tune_loader(Waits(), 4, **quick(max_workers=2, step_fn=step, collate_fn=collate_ids))
    assert seen and set(seen) == {4}
    assert r.step_samples_per_s is not None and 0 < r.step_samples_per_s <= 4 / 0.02
    assert "step_fn alone" in str(r)


def test_step_fn_error_raises() -> None:
    def step(batch: Any) -> None:
        raise ZeroDivisionError("oops")

    with pytest.raises(RuntimeError, match=r"step_fn raised.*oops"):
        tune_loader(Waits(), 4, **quick(max_workers=0, step_fn=step))


def test_dataset_failing_in_the_main_process_raises() -> None:
    class Broken(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            raise IndexError("nope")

    with pytest.raises(RuntimeError, match=r"fails in the main process.*nope"):
        tune_loader(Broken(), 2, **quick())


def test_empty_loader_raises() -> None:
    with pytest.raises(ValueError, match="yields no batch"):
        tune_loader(Waits(), 100, **quick(drop_last=True))


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, "batch_size must be an int >= 1, got 0"),
        ((4,), {"max_workers": -1}, "max_workers must be None or an int >= 0"),
        ((4,), {"budget_s": 0}, "budget_s must be a positive number"),
        ((4,), {"epochs_hint": 0}, "epochs_hint must be None or an int >= 1"),
        ((4,), {"step_fn": 3}, "step_fn must be callable"),
        ((4,), {"num_workers": 2}, "num_workers is what tune_loader chooses"),
        ((4,), {"prefetch_factor": 2}, "prefetch_factor is what tune_loader chooses"),
        ((4,), {"batch_sampler": [[0]]}, "batch_sampler is not supported"),
        ((4,), {"num_worker": 2}, "unknown DataLoader argument 'num_worker'; choices:"),
        ((4,), {"device": 3.5}, "device must be a str, a torch.device or None"),
        ((4,), {"device": "gpu"}, "device must be like 'cpu' or 'cuda:0', got 'gpu'"),
    ],
)
def test_bad_arguments_raise(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tune_loader(Waits(), *args, **{**quick(), **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_raises() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        tune_loader(Waits(), 4, **quick(device="cuda"))


def test_default_device_and_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    r = tune_loader(Waits(), 8, device=None, max_workers=0, budget_s=5, cache=False, progress=True)
    err = capsys.readouterr().err
    assert "tune_loader [" in err and "workers=0" in err and err.endswith("\n")
    assert r.device in ("cpu", "mps") or r.device.startswith("cuda")


def test_progress_bar_disabled_writes_nothing() -> None:
    import io

    out = io.StringIO()
    bar = ProgressBar(1.0, enabled=False, stream=out)
    bar.update("x", force=True)
    bar.close()
    assert out.getvalue() == ""


@pytest.mark.requires_cuda
def test_cuda_target_pins_memory() -> None:
    r = tune_loader(Waits(), 8, **quick(device="cuda", max_workers=2))
    assert any(c.pin_memory for c in r.candidates)
    if r.best_kwargs["num_workers"] > 0:
        assert isinstance(r.best_kwargs["pin_memory"], bool)


def test_budget_too_small_to_measure_anything() -> None:
    r = tune_loader(Waits(), 4, **quick(budget_s=0.01))
    assert r.best_kwargs["num_workers"] == 0
    assert r.samples_per_s is None and r.speedup is None
    assert r.candidates[0].fault == "budget"
    assert any("could not be measured" in n for n in r.notes)
    assert "not measured" in str(r)
