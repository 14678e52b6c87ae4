"""trainperf.loader._tune: tune_loader and autotune_loader end to end.

Arguments passed through, the budget as a hard limit, step_fn, the host's limits and local
ranks, errors from the dataset, and one real search over an I/O-bound dataset.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler, TensorDataset

from tests.loader._fakes import Waits, collate_ids, quick
from trainperf.limits import HostLimits
from trainperf.loader import (
    CandidateResult,
    TunedDataLoader,
    TuningReport,
    autotune_loader,
    tune_loader,
)
from trainperf.loader import _tune as tune_mod
from trainperf.loader import _tune_prepare as tune_prepare
from trainperf.loader import _tune_setup as tune_setup
from trainperf.loader import _tune_stale as tune_stale

GiB = 1 << 30


@pytest.mark.slow  # the shared tuning run (about 5 s)
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


@pytest.mark.slow
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

    for module in (tune_mod, tune_prepare, tune_stale):  # every clock the tuner reads
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(tune_prepare, "measure", fake_measure)
    r = tune_loader(Waits(), 8, **quick(budget_s=2.0, max_workers=16))
    start = calls[0][1]
    assert {deadline for _, _, deadline in calls} == {start + 2.0}
    assert all(at < start + 2.0 for _, at, _ in calls)  # nothing starts after the deadline
    assert clock.now <= start + 2.0 + 1e-9  # the budget was never exceeded
    assert 2 <= len([c for c in r.candidates if c.ok]) <= 3  # 0.7 s each within 2 s
    assert r.elapsed_s == pytest.approx(clock.now - start)
    assert r.best_kwargs["num_workers"] in {c.num_workers for c in r.candidates if c.ok}


@pytest.mark.slow  # about 3-5 s: a real search with workers
def test_step_fn_is_timed_and_reported() -> None:
    seen: list[int] = []

    def step(batch: dict[str, Any]) -> None:
        seen.append(len(batch["ids"]))
        time.sleep(0.02)

    r = tune_loader(Waits(), 4, **quick(max_workers=2, step_fn=step, collate_fn=collate_ids))
    assert seen and set(seen) == {4}
    assert r.step_samples_per_s is not None and r.step_samples_per_s > 0
    assert "step_fn alone" in str(r)


def test_dataset_failing_in_the_main_process_raises() -> None:
    class Broken(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            raise IndexError("nope")

    with pytest.raises(RuntimeError, match=r"fails in the main process.*nope"):
        tune_loader(Broken(), 2, **quick())


def test_a_dataset_raising_value_error_in_the_main_process_raises_runtime_error() -> None:
    # Before: a ValueError of the dataset's own (a corrupt sample) came out bare, as if an
    # argument were wrong, unlike every other error of the dataset's.
    class Corrupt(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            if i == 5:
                raise ValueError("corrupt sample 5")
            return i

    with pytest.raises(RuntimeError, match=r"fails in the main process.*corrupt sample 5"):
        tune_loader(Corrupt(), 2, **quick())
    # DataLoader's own refusal of the arguments stays a ValueError.
    with pytest.raises(ValueError, match="mutually exclusive"):
        tune_loader(range(8), 2, **quick(sampler=[0, 1], shuffle=True))


def test_dataset_failing_in_the_main_process_names_the_index() -> None:
    # Before: "...nothing to tune: KeyError('missing label')", with no word of which sample.
    class OneBad(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, idx: int) -> int:
            if idx == 5:
                raise KeyError("missing label")
            return idx

    with pytest.raises(RuntimeError, match=r"at dataset\[5\], so .*missing label"):
        tune_loader(OneBad(), 2, **quick())


def test_dataset_whose_len_lies_is_named_as_such() -> None:
    # __len__ says 8, __getitem__ serves 4: the IndexError is explained by the length.
    class Short(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            return list(range(4))[i]

    with pytest.raises(RuntimeError, match=r"at dataset\[4\].*len\(dataset\) is 8.*__len__"):
        tune_loader(Short(), 2, **quick())


def test_a_failing_collate_fn_names_no_index() -> None:
    def refuse(batch: list[int]) -> Any:
        raise TypeError("cannot collate")

    with pytest.raises(RuntimeError, match=r"main process \(num_workers=0\), so .*cannot"):
        tune_loader(range(8), 2, **quick(collate_fn=refuse))


def test_empty_loader_raises() -> None:
    with pytest.raises(ValueError, match=r"yields no batch .*: give a dataset with at least one"):
        tune_loader(Waits(), 100, **quick(drop_last=True))


def test_default_device_and_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    r = tune_loader(Waits(), 8, device=None, max_workers=0, budget_s=5, cache=False, progress=True)
    err = capsys.readouterr().err
    assert "tune_loader [" in err and "workers=0" in err and err.endswith("\n")
    assert "\r" not in err and len(err.splitlines()) == 2  # captured: not a terminal
    assert r.device in ("cpu", "mps") or r.device.startswith("cuda")


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


def test_a_fallback_warning_names_the_callers_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(dataset: Any, batch_size: int, kwargs: Any, **kw: Any) -> CandidateResult:
        n, pf, pin = kw["num_workers"], kw["prefetch_factor"], kw["pin_memory"]
        if n == 0:
            return CandidateResult(0, None, pin, "ok", samples_per_s=100.0, main_cpu=1.0)
        return CandidateResult(n, pf, pin, "failed", fault="crash", reason="a worker died")

    monkeypatch.setattr(tune_prepare, "measure", measure)
    with pytest.warns(RuntimeWarning, match="falls back to num_workers=0") as caught:
        r = tune_loader(Waits(), 8, **quick(max_workers=2))
    assert caught[0].filename == __file__
    assert r.num_workers == 0
    # However deep inside the tuner it starts: autotune_loader's caller, too.
    with pytest.warns(RuntimeWarning, match="falls back to num_workers=0") as caught:
        autotune_loader(Waits(), 8, **quick(max_workers=2))
    assert caught[0].filename == __file__


# --------------------------------------------------------------------------- limits, end to end


def fake_limits(cpus: int) -> HostLimits:
    return HostLimits(
        cpus_host=64,
        cpus_affinity=64,
        cpu_quota=float(cpus),
        cpus=cpus,
        memory_total=64 * GiB,
        memory_limit=None,
        memory_available=32 * GiB,
        shm_total=32 * GiB,
        shm_free=32 * GiB,
    )


class BusyLoop(Dataset[torch.Tensor]):
    """Compute-bound: a pure-Python loop of 1 ms of CPU time per sample (CPU time, not wall
    time: on a VM whose CPUs other tenants share, a wall-clock loop demands less)."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.thread_time() + 0.001
        while time.thread_time() < end:
            pass
        return torch.zeros(8)


@pytest.mark.slow  # about 7 s: two tuning runs
def test_worker_cap_follows_host_limits_and_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake_limits(3))
    report = tune_loader(BusyLoop(), 4, device="cpu", budget_s=10, cache=False, progress=False)
    assert (report.cpus, report.worker_cpus, report.max_workers) == (3, 2, 12)
    assert report.limits.cpu_quota == 3.0
    # Compute-bound workers demand about a core each, so the CPU rule keeps the count near
    # the 2 cores left for workers, far below max_workers=12. A worker's demand measured on
    # a crowded VM (run-queue and hypervisor delays not spread evenly) can read as little as
    # two thirds of a core, which floor((2 + 0.5) / demand) rounds to 3: never more.
    tried = [c.num_workers for c in report.candidates if c.status != "skipped"]
    assert max(tried) <= 3, report

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake_limits(6))
    report = tune_loader(
        BusyLoop(), 4, device="cpu", budget_s=10, max_workers=0, cache=False, progress=False
    )
    assert (report.cpus, report.worker_cpus) == (2, 1)


@pytest.mark.slow  # about 2-3 s: three tuning runs
def test_step_fn_replaces_the_kept_core_with_what_it_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake_limits(3))
    # A step that does nothing: the main process only takes batches, so every core may
    # go to workers (the loader-alone case).
    idle = tune_loader(
        BusyLoop(),
        4,
        device="cpu",
        budget_s=10,
        max_workers=0,
        step_fn=lambda b: None,
        cache=False,
        progress=False,
    )
    assert idle.main_cores < 0.5 and idle.worker_cpus == 3
    assert "kept for the main process, as step_fn measured" in str(idle)

    def busy_step(batch: Any) -> None:  # keeps one core busy for 5 ms
        end = time.process_time() + 0.005
        while time.process_time() < end:
            pass

    busy = tune_loader(
        BusyLoop(),
        4,
        device="cpu",
        budget_s=10,
        max_workers=0,
        step_fn=busy_step,
        cache=False,
        progress=False,
    )
    assert 0.5 <= busy.main_cores <= 3.0 and busy.worker_cpus == 2
    unknown = tune_loader(
        BusyLoop(), 4, device="cpu", budget_s=10, max_workers=0, cache=False, progress=False
    )
    assert (unknown.main_cores, unknown.worker_cpus) == (1.0, 2)
    assert "(2 for workers, one kept for the main process)" in str(unknown)


@pytest.mark.slow  # about 4 s: a tuning run with a worker
def test_one_usable_cpu_is_worded_as_shared_with_the_main_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One CPU leaves none to keep for the main process: its core is the workers' too.
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake_limits(1))
    report = tune_loader(
        BusyLoop(), 4, device="cpu", budget_s=10, max_workers=2, cache=False, progress=False
    )
    text = str(report)
    assert "limits: 1 usable CPU (1 for workers, shared with the main process)," in text
    # A CPU skip (two workers of a compute-bound dataset, as measured) words it the same.
    for c in report.candidates:
        if c.fault == "cpu":
            assert (c.reason or "").endswith("1 is left for workers (shared with the main process)")


def test_bad_local_world_size_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE must be a whole number >= 1.*'zero'"):
        tune_loader(BusyLoop(), 4, device="cpu", cache=False, progress=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE must be a whole number >= 1.*'0'"):
        tune_loader(BusyLoop(), 4, device="cpu", cache=False, progress=False)


def test_slurm_tasks_per_node_divide_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake_limits(6))
    report = tune_loader(
        BusyLoop(), 4, device="cpu", budget_s=10, max_workers=0, cache=False, progress=False
    )
    assert (report.cpus, report.worker_cpus) == (3, 2)


class Sleepy(Dataset[torch.Tensor]):
    """I/O-bound: 20 ms of waiting per sample and almost no CPU."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.02)
        return torch.zeros(8)


@pytest.mark.slow  # about 9-13 s: a real search with workers (one measured first)
def test_io_bound_dataset_gets_workers_end_to_end() -> None:
    # A 4x-8x effect (sleeping workers overlap), far beyond timing noise.
    report = tune_loader(
        Sleepy(), 2, device="cpu", max_workers=8, budget_s=20, cache=False, progress=False
    )
    assert report.num_workers >= 2
    assert report.best_kwargs["prefetch_factor"] >= 2
    chosen = report.chosen()
    assert chosen is not None and chosen.ok
    # The choice is the measured best, or one with fewer workers within 2 % of it.
    best = max(c.samples_per_s or 0.0 for c in report.candidates if c.ok)
    assert chosen.samples_per_s is not None and chosen.samples_per_s >= 0.98 * best
    baseline = report.candidates[0].samples_per_s
    assert report.speedup == pytest.approx(chosen.samples_per_s / baseline)  # type: ignore[operator]


def _python_numbers(data: Any) -> list[Any]:
    """Every number in ``data`` (dicts and lists, as ``to_dict()`` gives) not of a Python
    number type (a NumPy scalar)."""
    if isinstance(data, dict):
        return [x for v in data.values() for x in _python_numbers(v)]
    if isinstance(data, (list, tuple)):
        return [x for v in data for x in _python_numbers(v)]
    plain = data is None or type(data) in (bool, int, float, str)
    return [] if plain else [data]


# On a busy host the worker may miss the short budget: the fallback is not what is tested.
@pytest.mark.filterwarnings("ignore:tune_loader falls back:RuntimeWarning")
def test_numpy_numbers_tune_as_python_ones() -> None:
    # Before: np.int64(8) passed the checks and then failed in DataLoader ("batch_size
    # should be a positive integer value"), and a NumPy max_workers, budget_s or num_workers
    # reached the report, whose to_dict() json.dumps then refused.
    numbers = {
        "max_workers": np.int64(1),
        "budget_s": np.float64(1.5),
        "epochs_hint": np.int64(2),
        "num_workers": np.int64(1),
        "prefetch_factor": np.int64(2),
        "timeout": np.float64(20.0),
    }
    r = tune_loader(TensorDataset(torch.zeros(64, 2)), np.int64(8), **quick(**numbers))
    assert (type(r.batch_size), type(r.max_workers), type(r.budget_s)) == (int, int, float)
    assert (r.batch_size, r.max_workers, r.budget_s) == (8, 1, 1.5)
    assert r.user_setting is not None
    assert r.user_setting.given == {"num_workers": 1, "prefetch_factor": 2}
    assert _python_numbers(r.best_kwargs) == _python_numbers(r.user_setting.given) == []
    data = r.to_dict()
    assert _python_numbers(data) == []
    json.dumps(data)
    assert type(r.best_kwargs["batch_size"]) is int
