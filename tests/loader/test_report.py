"""trainperf.loader: the report, tune_loader/autotune_loader arguments, budget, step_fn."""

from __future__ import annotations

import io
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from trainperf._utils import imports as _imports
from trainperf._utils.imports import is_available
from trainperf.errors import DeviceError
from trainperf.limits import HostLimits
from trainperf.loader import (
    CandidateResult,
    TunedDataLoader,
    TuningReport,
    autotune_loader,
    tune_loader,
)
from trainperf.loader import _tune as tune_mod
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


class FakeClock:
    """``time.perf_counter`` for the tuner: advances only when a fake measurement runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_budget_is_a_hard_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    calls: list[tuple[int, float, float]] = []

    def fake_measure(
        dataset: Any, batch_size: int, kwargs: Any, *, num_workers: int, deadline: float, **kw: Any
    ) -> CandidateResult:
        # Like the real one: a candidate takes 0.7 s, but never runs past the deadline.
        calls.append((num_workers, clock.now, deadline))
        pf, pin = kw["prefetch_factor"], kw["pin_memory"]
        if deadline - clock.now <= 0.05:
            return CandidateResult(num_workers, pf, pin, "skipped", fault="budget")
        spent = min(0.7, deadline - clock.now)
        clock.now += spent
        rate = 100.0 * (1 + num_workers)
        return CandidateResult(
            num_workers,
            pf,
            pin,
            "ok",
            samples_per_s=rate,
            main_cpu=0.1,
            worker_cpu=0.1,
            startup_s=0.01,
            batch_bytes=64,
            worker_uss=1 << 20,
            elapsed_s=spent,
        )

    monkeypatch.setattr(tune_mod, "time", clock)
    monkeypatch.setattr(tune_mod, "measure", fake_measure)
    r = tune_loader(Waits(), 8, **quick(budget_s=2.0, max_workers=16))
    start = calls[0][1]
    assert {deadline for _, _, deadline in calls} == {start + 2.0}
    assert all(at < start + 2.0 for _, at, _ in calls)  # nothing starts after the deadline
    assert clock.now <= start + 2.0 + 1e-9  # the budget was never exceeded
    assert 2 <= len([c for c in r.candidates if c.ok]) <= 3  # 0.7 s each within 2 s
    assert r.elapsed_s == pytest.approx(clock.now - start)
    assert r.best_kwargs["num_workers"] in {c.num_workers for c in r.candidates if c.ok}


def test_step_fn_is_timed_and_reported() -> None:
    seen: list[int] = []

    def step(batch: dict[str, Any]) -> None:
        seen.append(len(batch["ids"]))
        time.sleep(0.02)

    r = tune_loader(Waits(), 4, **quick(max_workers=2, step_fn=step, collate_fn=collate_ids))
    assert seen and set(seen) == {4}
    assert r.step_samples_per_s is not None and r.step_samples_per_s > 0
    assert "step_fn alone" in str(r)


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_step_cpu_counts_the_step_but_not_the_tuners_synchronize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.device
    from trainperf.loader._tune import _time_step

    # A CUDA run faked on the CPU: batches stay put, and synchronize spins for 5 ms as a
    # waiting CUDA synchronisation may.
    monkeypatch.setattr(trainperf.device, "to_device", lambda batch, device, **kw: batch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: _burn(0.005))
    cuda = torch.device("cuda")
    _, idle = _time_step(Waits(), 4, {}, lambda b: None, cuda, math.inf)
    _, busy = _time_step(Waits(), 4, {}, lambda b: _burn(0.004), cuda, math.inf)
    assert idle < 0.0002  # s of CPU per sample: the 5 ms synchronize is not the step's
    assert busy >= 0.0008  # 4 ms of CPU for a batch of 4 is 1 ms per sample


def test_step_fn_gets_the_batch_moved_to_the_tuning_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.device

    moved: list[tuple[Any, torch.device]] = []
    real_to_device = trainperf.device.to_device

    def to_device(batch: Any, device: Any, **kw: Any) -> Any:
        moved.append((batch, device))
        return real_to_device(batch, device, **kw)

    monkeypatch.setattr(trainperf.device, "to_device", to_device)
    got: list[Any] = []
    r = tune_loader(Waits(), 4, **quick(max_workers=0, step_fn=got.append, collate_fn=collate_ids))
    assert r.step_samples_per_s is not None
    assert got and len(got) == len(moved) <= 6
    assert all(device == torch.device("cpu") for _, device in moved)
    for batch in got:
        assert batch["x"].device == torch.device("cpu") and batch["x"].shape == (4, 4)
        assert batch["ids"] == [int(v) for v in batch["x"][:, 0]]  # the collated batch itself


def test_step_fn_error_names_step_fn() -> None:
    def my_training_step(batch: Any) -> None:
        raise ZeroDivisionError("oops")

    with pytest.raises(
        RuntimeError, match=r"step_fn .*my_training_step raised on a batch .*moved to cpu.*oops"
    ) as info:
        tune_loader(Waits(), 4, **quick(max_workers=0, step_fn=my_training_step))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_batch_that_cannot_move_to_the_device_is_reported() -> None:
    class Stuck:
        def to(self, device: Any, **kw: Any) -> Any:
            raise TypeError("cannot move this")

    def collate_stuck(samples: list[Any]) -> Stuck:
        return Stuck()

    with pytest.raises(RuntimeError, match=r"moving a batch to cpu for step_fn failed.*cannot"):
        tune_loader(Waits(), 4, **quick(max_workers=0, step_fn=len, collate_fn=collate_stuck))


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
        ((4,), {"device": "gpu"}, "invalid device 'gpu': expected 'auto', 'cpu', 'cuda'"),
    ],
)
def test_bad_arguments_raise(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tune_loader(Waits(), *args, **{**quick(), **kwargs})


def test_device_of_the_wrong_type_raises() -> None:
    with pytest.raises(TypeError, match=r"device must be a str, int, torch\.device or None"):
        tune_loader(Waits(), 4, **quick(device=3.5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_raises() -> None:
    with pytest.raises(DeviceError, match=r"CUDA is not available.*device='cpu'"):
        tune_loader(Waits(), 4, **quick(device="cuda"))


def test_default_device_and_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    r = tune_loader(Waits(), 8, device=None, max_workers=0, budget_s=5, cache=False, progress=True)
    err = capsys.readouterr().err
    assert "tune_loader [" in err and "workers=0" in err and err.endswith("\n")
    assert "\r" not in err and len(err.splitlines()) == 2  # captured: not a terminal
    assert r.device in ("cpu", "mps") or r.device.startswith("cuda")


def test_progress_bar_disabled_writes_nothing() -> None:
    out = io.StringIO()
    bar = ProgressBar(1.0, enabled=False, stream=out)
    bar.update("x", force=True)
    bar.close()
    assert out.getvalue() == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_in_place_on_a_terminal() -> None:
    out = Terminal()
    bar = ProgressBar(10.0, stream=out, width=10)
    for n in range(3):
        bar.update(f"workers={n}", force=True)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 4  # three updates and the final redraw
    assert text.endswith("workers=2\n") and text.count("\n") == 1


def test_progress_bar_writes_a_start_and_a_final_line_elsewhere() -> None:
    out = io.StringIO()  # a CI log or a SLURM .err file: not a terminal
    bar = ProgressBar(10.0, stream=out, width=10)
    for n in range(50):
        bar.update(f"workers={n}", force=True)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2 and text.endswith("\n")
    assert lines[0] == "tune_loader: measuring DataLoader settings (budget 10 s)"
    assert lines[1].startswith("tune_loader [") and lines[1].endswith("workers=49")


def test_progress_bar_on_a_stream_without_isatty() -> None:
    class Sink:
        def __init__(self) -> None:
            self.parts: list[str] = []

        def write(self, s: str) -> int:
            self.parts.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    sink = Sink()
    bar = ProgressBar(5.0, stream=sink, width=4)  # type: ignore[arg-type]
    bar.close()  # no update: only the final line
    assert len(sink.parts) == 1 and sink.parts[0].startswith("tune_loader [")


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
