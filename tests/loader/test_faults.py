"""trainperf.loader faults: crashing, segfaulting, hanging and unpicklable workers, /dev/shm.

Each broken configuration must be reported (fault and fix), tuning must fall back to
``num_workers=0`` with a warning, and no worker may be left alive (the root conftest fails
any test that leaves a child process).
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from tests.loader._fakes import tune_two_workers as tune
from tests.loader._spies import record_closes
from trainperf.loader import TuningReport, measure
from trainperf.loader._faults import classify_fault, hang_timeout


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> Iterator[None]:
    # The spawn start method starts multiprocessing's resource tracker, a long-lived helper
    # that is not a DataLoader worker; start it before the leak check takes its snapshot.
    multiprocessing.resource_tracker.ensure_running()
    yield


class Faulty(Dataset[torch.Tensor]):
    """Fine in the main process; misbehaves in a DataLoader worker as ``how`` says."""

    def __init__(self, how: str, n: int = 64) -> None:
        self.how = how
        self.n = n
        self.calls = 0  # in this process (each worker counts its own)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            if self.how == "exit":
                os._exit(3)
            if self.how == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            self.calls += 1
            # What the out-of-memory killer does: SIGKILL, at once or after some batches.
            if self.how == "sigkill" or (self.how == "late-sigkill" and self.calls > 24):
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(120)
            if self.how == "shm":
                raise RuntimeError(
                    "unable to write to file </torch_123_456_7>: No space left on device (28)"
                )
            if self.how == "raise":
                raise ValueError(f"bad sample {i}")
            if self.how == "timeout-error" and i >= 8:  # a network read's own error
                raise RuntimeError(f"reading sample {i} timed out after 5 s")
            if self.how == "slow" and self.calls > 4:  # after the worker's first batch of 4
                time.sleep(0.2)
        time.sleep(0.001)
        return torch.zeros(16)


class Unpicklable(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.transform = lambda x: x  # lambdas cannot be pickled for spawn

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(torch.zeros(4))


def assert_no_workers_left() -> None:
    me = psutil.Process()
    alive = [
        p
        for p in me.children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert alive == []


def failed(report: TuningReport) -> list[Any]:
    return [c for c in report.candidates if c.status == "failed"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "segv"])
def test_crashing_worker_falls_back_to_zero_workers(how: str) -> None:
    with pytest.warns(RuntimeWarning, match="falls back to num_workers=0"):
        report = tune(Faulty(how))
    assert report.best_kwargs["num_workers"] == 0
    bad = failed(report)
    assert len(bad) == 1, "a crash is not retried with other worker counts"
    assert bad[0].fault == "crash"
    assert "exited unexpectedly" in (bad[0].reason or "")
    assert any("falls back" in n for n in report.notes)
    assert_no_workers_left()


@pytest.mark.slow  # about 2 s: a worker started and killed
def test_a_sigkilled_worker_is_reported_as_likely_out_of_memory() -> None:
    with pytest.warns(RuntimeWarning, match="out-of-memory killer"):
        report = tune(Faulty("sigkill"))
    assert report.best_kwargs["num_workers"] == 0
    bad = failed(report)
    assert [c.fault for c in bad] == ["memory"], "not a generic crash"
    reason = bad[0].reason or ""
    assert "killed by SIGKILL (exit code -9), most likely by the out-of-memory killer" in reason
    assert "fewer workers" in reason
    assert_no_workers_left()


@pytest.mark.slow  # about 2 s: a pool killed after some batches
def test_a_sigkill_after_some_batches_quotes_the_workers_memory() -> None:
    r = measure(
        Faulty("late-sigkill", n=4096),
        4,
        {},
        num_workers=2,
        prefetch_factor=2,
        pin_memory=False,
        deadline=time.perf_counter() + 30,
        memory_available=5 << 30,
    )
    assert (r.status, r.fault) == ("failed", "memory")
    assert re.search(
        r"SIGKILL \(exit code -9\), most likely by the out-of-memory killer: 2 workers had "
        r"reached [\d.]+ [KMG]iB resident together \([\d.]+ [KMG]iB private each at the first "
        r"reading\), "
        r"with 5\.0 GiB available when tuning started; fix: ",
        r.reason or "",
    ), r.reason
    assert_no_workers_left()


@pytest.mark.slow  # about 2-3 s: a 1 s hang limit
@pytest.mark.timeout(60)  # hung workers that were joined instead of killed would hang here
def test_hanging_worker_is_detected_by_timeout_and_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    closes = record_closes(monkeypatch)
    with pytest.warns(RuntimeWarning, match="hang"):
        report = tune(Faulty("hang"), timeout=1.0)
    # The hung candidate was the only one with workers; they were killed before the join.
    assert closes == [True], "hung workers must be killed, not joined"
    bad = failed(report)
    assert [c.fault for c in bad] == ["hang"]
    assert "1.0 s" in (bad[0].reason or "")
    assert report.best_kwargs["num_workers"] == 0
    # No workers: the caller's timeout would make the loader fail at iter(); dropped, said.
    assert "timeout" not in report.best_kwargs
    assert "timeout dropped: it needs num_workers > 0" in report.notes
    assert_no_workers_left()


@pytest.mark.slow  # about 4 s: a 4 s budget
@pytest.mark.timeout(60)
def test_hang_under_a_small_budget_keeps_the_budget_and_is_reported() -> None:
    # The default hang limit (10 s) is longer than the budget: the wait is cut to the time
    # left, so the call ends on time, and the empty-handed pool is still reported.
    with pytest.warns(RuntimeWarning, match="left of the time budget") as caught:
        report = tune(Faulty("hang"), budget_s=4.0)
    assert report.elapsed_s <= 4.0 + 1.0, "budget_s is a hard limit (plus the workers' cleanup)"
    bad = failed(report)
    assert [c.fault for c in bad] == ["hang"]
    reason = bad[0].reason or ""
    assert "may hang" in reason and "budget_s" in reason and "timeout=" in reason
    assert "budget_s" in str(caught[0].message)
    assert any("falls back" in n for n in report.notes)
    assert report.best_kwargs["num_workers"] == 0
    assert_no_workers_left()


@pytest.mark.slow  # about 4 s: a 4 s budget
@pytest.mark.timeout(60)
def test_budget_spent_on_slow_workers_is_a_note_not_a_fault(
    recwarn: pytest.WarningsRecorder,
) -> None:
    # Batches arrive (0.8 s each per worker after its first), but not enough for one
    # steady-state window (12 batches: 9.6 s). The first comes at once and the budget
    # leaves the pool over 2 s for it, so a busy host's slow worker start (about 1 s on
    # 2 cores running two other processes) is not the budget cut that reads as a hang.
    report = tune(Faulty("slow"), budget_s=4.0)
    assert report.elapsed_s <= 4.0 + 1.0
    assert [c.fault for c in report.candidates if c.num_workers > 0] == ["budget"]
    assert report.best_kwargs["num_workers"] == 0
    assert any("budget ran out before any worker configuration" in n for n in report.notes)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert_no_workers_left()


@pytest.mark.slow  # about 11 s: the default hang limit is 10 s
@pytest.mark.timeout(60)
def test_hang_is_detected_by_the_default_timeout() -> None:
    with pytest.warns(RuntimeWarning, match="hang"):
        report = tune(Faulty("hang"), budget_s=20.0)
    bad = failed(report)
    assert [c.fault for c in bad] == ["hang"]
    reason = bad[0].reason or ""
    # A real hang limit, not the budget's: the reason says so and names the fix.
    assert "no batch arrived within 10.0 s" in reason and "budget" not in reason
    assert "timeout=" in reason
    assert report.elapsed_s <= 20.0 + 1.0
    assert "timeout" not in report.best_kwargs
    assert_no_workers_left()


def test_unpicklable_dataset_under_spawn_is_reported() -> None:
    with pytest.warns(RuntimeWarning, match="pickle"):
        report = tune(Unpicklable(), multiprocessing_context="spawn")
    bad = failed(report)
    assert [c.fault for c in bad] == ["pickle"]
    assert "'spawn'" in (bad[0].reason or "") and "lambda" in (bad[0].reason or "")
    # num_workers=0 rejects a multiprocessing_context, so it is dropped (and said so).
    assert report.best_kwargs["num_workers"] == 0
    assert "multiprocessing_context" not in report.best_kwargs
    assert any("multiprocessing_context dropped" in n for n in report.notes)
    # The reason is in the candidate's row once; the note points at it instead of repeating.
    assert str(report).count("cannot be pickled") == 1, str(report)
    assert_no_workers_left()


@pytest.mark.slow  # about 2 s: a pool started and failed
def test_dataset_error_in_worker_is_reported() -> None:
    with pytest.warns(RuntimeWarning, match="bad sample"):
        report = tune(Faulty("raise"))
    assert [c.fault for c in failed(report)] == ["error"]
    assert_no_workers_left()


def test_a_dataset_error_that_says_timed_out_in_a_worker_is_the_datasets_error() -> None:
    # Before: its words made it DataLoader's own timeout, so the measurement ended as if
    # the budget had (or the fault read "no batch arrived within 30.0 s": a hang).
    r = measure(
        Faulty("timeout-error"),
        4,
        {},
        num_workers=1,
        prefetch_factor=2,
        pin_memory=False,
        deadline=time.perf_counter() + 20.0,
        hang_timeout_s=30.0,
    )
    assert (r.status, r.fault) == ("failed", "error")
    assert r.reason is not None and "timed out after 5 s" in r.reason
    assert_no_workers_left()


def failing_init(worker_id: int) -> None:
    """A caller's worker_init_fn that raises (module level: picklable)."""
    raise RuntimeError("init boom")


def test_a_worker_init_fn_that_raises_is_named_with_the_fix() -> None:
    # Before: "the dataset raised in a worker: RuntimeError: init boom", blaming the dataset
    # with no fix.
    with pytest.warns(RuntimeWarning, match="worker_init_fn failing_init raised"):
        report = tune(Faulty("none"), worker_init_fn=failing_init, multiprocessing_context="fork")
    assert report.best_kwargs["num_workers"] == 0
    bad = failed(report)
    assert [c.fault for c in bad] == ["error"]
    reason = bad[0].reason or ""
    assert reason.startswith("worker_init_fn failing_init raised in a worker"), reason
    assert "RuntimeError: init boom" in reason and "dataset" not in reason, reason
    assert "fix: make worker_init_fn work in every worker process" in reason, reason
    assert_no_workers_left()


@pytest.mark.slow  # about 2-3 s: pools started and failed
def test_shm_exhaustion_in_worker_says_how_to_fix_it() -> None:
    with pytest.warns(RuntimeWarning, match="shm-size"):
        report = tune(Faulty("shm"))
    bad = failed(report)
    assert bad and all(c.fault == "shm" for c in bad)
    # /dev/shm running out is retried with fewer workers before giving up.
    assert bad[-1].num_workers == 1
    assert_no_workers_left()


@pytest.mark.parametrize(
    ("message", "kwargs", "kind", "words"),
    [
        ("DataLoader worker (pid(s) 77) exited unexpectedly", {}, "crash", "num_workers=0"),
        # SIGKILL: the out-of-memory killer, most likely (issue 20.2), not a generic crash.
        ("DataLoader worker (pid 77) is killed by signal: Killed. ", {}, "memory", "out-of-memory"),
        (
            "DataLoader worker (pid(s) 77) exited unexpectedly",
            {"start_method": "spawn"},
            "crash",
            "__main__",
        ),
        (
            "DataLoader worker (pid 77) is killed by signal: Bus error. It is possible that "
            "dataloader's workers are out of shared memory.",
            {"shm_free": 1 << 20},
            "shm",
            "--shm-size",
        ),
        ("DataLoader timed out after 3 seconds", {}, "hang", "timeout="),
        (
            "Can't pickle local object 'f.<locals>.<lambda>'",
            {"start_method": "spawn"},
            "pickle",
            "module-level",
        ),
        (
            "Caught KeyError in DataLoader worker process 0.\nOriginal Traceback:\nKeyError: 5",
            {},
            "error",
            "KeyError: 5",
        ),
        # The dataset's own errors, whatever their words: not a hang, not a pickling fault.
        (
            "Caught TimeoutError in DataLoader worker process 1.\nOriginal Traceback:\n"
            "TimeoutError: reading sample 9 timed out after 5 s",
            {},
            "error",
            "TimeoutError: reading sample 9 timed out after 5 s",
        ),
        # A batch the worker could not send back (trainperf.loader._picklable), under fork.
        (
            "Caught PicklingError in DataLoader worker process 0.\nOriginal "
            "_pickle.PicklingError: batch 3 (counted from 0 in this iteration) cannot be sent "
            "to the main process: batch[0] is a _thread.lock, which cannot be pickled",
            {},
            "pickle",
            "batch 3 (counted",
        ),
        (
            "Caught UnpicklingError in DataLoader worker process 0.\nOriginal Traceback:\n"
            "_pickle.UnpicklingError: invalid load key, 'x'.",
            {"start_method": "spawn"},
            "error",
            "invalid load key",
        ),
        (
            "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback:\n"
            "RuntimeError: unable to write to file </torch_1_2_3>: No space left on device (28)",
            {},
            "shm",
            "--shm-size",
        ),
    ],
)
def test_classify_fault(message: str, kwargs: dict[str, Any], kind: str, words: str) -> None:
    args: dict[str, Any] = {"start_method": "fork", "timeout_s": 3.0}
    args.update(kwargs)
    got_kind, reason = classify_fault(RuntimeError(message), **args)
    assert got_kind == kind
    assert words in reason


def test_hang_timeout() -> None:
    fork: dict[str, Any] = {
        "user_timeout": 0.0,
        "start_method": "fork",
        "cpus": 5,
        "main_cores": 1.0,
    }
    assert hang_timeout(2, batch_s=0.01, **fork) == 10.0  # at least 10 s
    assert hang_timeout(2, batch_s=1.0, **fork) == 20.0  # 20 batches
    assert hang_timeout(8, batch_s=1.0, **fork) == 40.0  # twice as many workers as cores
    assert hang_timeout(8, batch_s=1.0, **{**fork, "main_cores": 3.0}) == 80.0  # 2 cores left
    assert hang_timeout(8, batch_s=1.0, **{**fork, "start_method": "spawn"}) == 60.0
    assert hang_timeout(8, batch_s=1.0, **{**fork, "user_timeout": 2.5}) == 2.5


@pytest.mark.parametrize(
    "message",
    [
        # torch, in the main process, rebuilding a worker's tensor from shared memory
        "unable to open shared memory object </torch_1234_5678_0> in read-write mode: "
        "Too many open files (24)",
        # the same, raised in a worker and re-raised by torch
        "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback:\n"
        "RuntimeError: unable to open shared memory object </torch_1_2_3> in read-write "
        "mode: Too many open files (24)",
    ],
)
def test_too_many_open_files_is_not_blamed_on_dev_shm(message: str) -> None:
    # "shared memory" is in the message, but /dev/shm has room: the process ran out of file
    # descriptors, and --shm-size would not help.
    kind, reason = classify_fault(
        RuntimeError(message), start_method="fork", timeout_s=3.0, shm_free=1 << 30
    )
    assert kind == "error"
    assert "Too many open files" in reason
    assert "ulimit -n" in reason and "set_sharing_strategy('file_system')" in reason
    assert "/dev/shm" not in reason and "--shm-size" not in reason
    assert "the dataset raised" not in reason
