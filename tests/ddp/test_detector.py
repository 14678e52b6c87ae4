"""trainperf.ddp._detector: the launcher's hang check on hand-made slots and stack dumps (the
launched cases are in test_hang_cases)."""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trainperf.ddp import _detector
from trainperf.ddp._detector import HangDetector
from trainperf.ddp._progress_slots import BUSY_CAP
from trainperf.ddp._progress_tracker import Tracker
from trainperf.ddp._stacks import Frame, ThreadStack

TORCH = os.path.dirname(torch.__file__)
MAIN = threading.main_thread().ident or 0
USER = "/home/me/train.py"
RUNNING: dict[int, Any] = {0: object(), 1: object()}  # the group's live processes


@pytest.fixture
def detector(monkeypatch: pytest.MonkeyPatch) -> Iterator[HangDetector]:
    """Two ranks: rank 0 waits in all_reduce, rank 1 runs its own code."""
    det = HangDetector(2, 0.15)
    try:
        waits, runs = Tracker(det.slots, 0), Tracker(det.slots, 1)
        for rank, tracker in enumerate((waits, runs)):
            tracker.ready(armed=True)
            det.started(rank, os.getpid())
        waits.enter("all_reduce", (torch.ones(4),), {})
        det.trackers = (waits, runs)  # type: ignore[attr-defined]
        yield det
    finally:
        det.close()


def _stacks(*extra: ThreadStack) -> dict[int, list[ThreadStack]]:
    c10d = Frame(f"{TORCH}/distributed/distributed_c10d.py", 3900, "all_reduce")
    waiting = ThreadStack(MAIN, False, (c10d, Frame(USER, 24, "main")))
    running = ThreadStack(MAIN, False, (Frame(USER, 21, "main"),))
    return {0: [waiting], 1: [running, *extra]}


def _check_after_timeout(det: HangDetector) -> Any:
    assert det.check(RUNNING, {}) is None  # starts the clock
    time.sleep(det.timeout + 0.1)
    return det.check(RUNNING, {})


def test_a_stall_with_one_rank_waiting_is_a_hang(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(detector, "_dump", lambda ranks: _stacks())
    report = _check_after_timeout(detector)
    assert report is not None and report.verdict.root == (1,)


def test_a_rank_whose_main_called_sys_exit_is_named_so_in_the_report(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(detector, "_dump", lambda ranks: _stacks())
    detector.trackers[0].returned()  # type: ignore[attr-defined]
    detector.returned(0, "sys.exit(0)")
    report = detector.report(detector._states(), {1: object()}, {0: None}, 1.0)  # type: ignore[dict-item]
    assert report.ranks[0].doing() == "called sys.exit(0) in main"
    detector.reset()  # a new attempt: rank 0 may return this time
    detector.trackers[0].returned()  # type: ignore[attr-defined]
    detector.returned(0)
    report = detector.report(detector._states(), {1: object()}, {0: None}, 1.0)  # type: ignore[dict-item]
    assert report.ranks[0].doing() == "returned from main"


def test_torch_compile_on_a_rank_s_other_thread_is_not_a_hang(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = ThreadStack(
        0x99, False, (Frame(f"{TORCH}/_dynamo/convert_frame.py", 900, "compile"),)
    )
    monkeypatch.setattr(detector, "_dump", lambda ranks: _stacks(compiler))
    assert _check_after_timeout(detector) is None


def test_a_rank_that_moves_while_the_stacks_are_taken_is_not_a_hang(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dump_while_moving(ranks: list[int]) -> dict[int, list[ThreadStack]]:
        detector.trackers[1].batch()  # type: ignore[attr-defined]
        return _stacks()

    monkeypatch.setattr(detector, "_dump", dump_while_moving)
    assert _check_after_timeout(detector) is None


def test_a_rank_in_busy_work_progresses_until_the_cap_then_is_named(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(detector, "_dump", lambda ranks: _stacks())
    saving = detector.trackers[1]  # type: ignore[attr-defined]
    saving.busy_enter("saving checkpoint /ckpt/step-9.pt")
    assert _check_after_timeout(detector) is None
    assert detector.check(RUNNING, {}) is None
    # Past BUSY_CAP x hang_timeout in the block it counts no more: named as stuck in it.
    saving.busy_since = time.time() - BUSY_CAP * detector.timeout - 1.0
    saving._write()
    report = _check_after_timeout(detector)
    assert report is not None and report.verdict.root == (1,)
    assert "rank 1 is stuck in saving checkpoint /ckpt/step-9.pt for " in report.verdict.headline
    assert "raise hang_timeout" in report.verdict.advice
    assert report.to_dict()["ranks"][1]["doing"].startswith("is stuck in saving checkpoint")


def _dir_with_owner(base: Any, name: str, **fields: Any) -> Any:
    import dataclasses
    import json

    from trainperf.ddp import _rundir

    path = base / f"{_rundir.PREFIX}{name}"
    path.mkdir()
    record = {**dataclasses.asdict(_rundir.this_process()), **fields}
    (path / _rundir.OWNER_FILE).write_text(json.dumps(record))
    return path


def test_stale_run_directories_are_judged_by_owner_not_by_pid(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(_detector, "_base_dir", lambda: str(tmp_path))
    # Another container's live launcher: its pid means nothing in this pid namespace.
    other_container = _dir_with_owner(tmp_path, f"{gone.pid}-a", pid=gone.pid, pid_ns="pid:[1]")
    # This launcher's pid, but another start time: the pid was reused, the owner is gone.
    reused = _dir_with_owner(tmp_path, f"{os.getpid()}-b", start=1)
    live = _dir_with_owner(tmp_path, f"{os.getpid()}-c")
    dead = _dir_with_owner(tmp_path, f"{gone.pid}-d", pid=gone.pid)
    # A live launcher holds the flock on its owner record (the others' holders are gone).
    locks = [_hold(other_container), _hold(live)]
    det = HangDetector(1, 5.0)
    try:
        assert det.dir.parent == tmp_path
        assert other_container.exists() and live.exists()
        assert not reused.exists() and not dead.exists()
    finally:
        det.close()
        for fd in locks:
            os.close(fd)
    assert not det.dir.exists()


def _hold(path: Any) -> int:
    import fcntl

    from trainperf.ddp import _rundir

    fd = os.open(path / _rundir.OWNER_FILE, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_collective_inside_busy_work_is_a_hang_at_once(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sharded state_dict() inside a save: rank 1 is in all_reduce inside busy(), waiting
    # for the others; not hidden for BUSY_CAP x hang_timeout (was: no report until then).
    monkeypatch.setattr(detector, "_dump", lambda ranks: _stacks())
    saving = detector.trackers[1]  # type: ignore[attr-defined]
    saving.busy_enter("saving checkpoint /ckpt/step-9.pt")
    saving.enter("barrier", (), {})
    report = _check_after_timeout(detector)
    assert report is not None


@pytest.mark.slow
def test_the_stall_is_measured_from_the_last_progress_not_from_busy_work(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(detector, "_dump", lambda ranks: _stacks())
    saving = detector.trackers[1]  # type: ignore[attr-defined]
    saving.busy_enter("saving checkpoint /ckpt/step-9.pt")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:  # below the cap: progress, each check
        assert detector.check(RUNNING, {}) is None
        time.sleep(0.05)
    saving.busy_since = time.time() - BUSY_CAP * detector.timeout - 1.0
    saving._write()
    report = _check_after_timeout(detector)
    assert report is not None and report.stalled_s >= 0.6, report  # was: one timeout


def test_torch_compile_counts_as_progress_only_up_to_the_cap(
    detector: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = ThreadStack(
        0x99, False, (Frame(f"{TORCH}/_inductor/compile_fx.py", 900, "compile_fx_inner"),)
    )
    monkeypatch.setattr(detector, "_dump", lambda ranks: _stacks(compiler))
    assert _check_after_timeout(detector) is None
    detector._moved -= BUSY_CAP * detector.timeout  # no progress for the cap by now
    time.sleep(detector.timeout + 0.1)
    report = detector.check(RUNNING, {})
    assert report is not None and report.verdict.root == (1,)
    assert "rank 1 is stuck in torch.compile's compilation" in report.verdict.headline
    assert "torch.compile's compiler" in report.verdict.advice


def _last_calls(*calls: tuple[str, Any, bool]) -> HangDetector:
    """A detector whose rank i last called ``calls[i]``: ``(op, first argument, still
    inside it)``, the ranks' one collective so far (the same sequence number)."""
    det = HangDetector(len(calls), 5.0)
    for rank, (op, arg, inside) in enumerate(calls):
        tracker = Tracker(det.slots, rank)
        tracker.ready(armed=True)
        tracker.enter(op, (arg,), {})
        if not inside:
            tracker.exit()
    return det


_OWN_ERROR = 'raised ValueError: bad batch at step 7\nTraceback ...\n  File "/home/me/train.py"'
_C10D = f"{TORCH}/distributed/distributed_c10d.py"
_IN_GLOO = f'raised RuntimeError: [gloo] Connection reset\n  File "{_C10D}", in all_reduce'


@pytest.mark.parametrize(
    ("calls", "failure", "note"),
    [
        # A send and the recv it matched, then a rank's own error: no mismatch (was one).
        ([("send", torch.ones(4), False), ("recv", torch.ones(4), False)], _OWN_ERROR, False),
        # Point-to-point calls pair unlike ops even while one of them still waits.
        ([("isend", torch.ones(4), False), ("recv", torch.ones(4), True)], _IN_GLOO, False),
        # Both calls returned and the failure came from the rank's own code (was one).
        (
            [("all_reduce", torch.ones(4), False), ("all_reduce", torch.ones(8), False)],
            _OWN_ERROR,
            False,
        ),
        # The same, but the failure was raised inside torch.distributed: a mismatch.
        (
            [("all_reduce", torch.ones(4), False), ("all_reduce", torch.ones(8), False)],
            _IN_GLOO,
            True,
        ),
        # gloo aborts on a size mismatch: the ranks died inside the collective.
        ([("all_reduce", torch.ones(4), True), ("all_reduce", torch.ones(8), True)], "", True),
        # One rank still waits in a call the other never made.
        ([("barrier", None, True), ("all_reduce", torch.ones(4), False)], _OWN_ERROR, True),
        # The same call on every rank is no mismatch.
        ([("all_reduce", torch.ones(4), True), ("all_reduce", torch.ones(4), True)], "", False),
    ],
)
def test_a_collective_mismatch_is_noted_only_on_evidence_of_one(
    calls: list[tuple[str, Any, bool]], failure: str, note: bool
) -> None:
    det = _last_calls(*calls)
    try:
        lines = det.mismatch_note(failure)
    finally:
        det.close()
    assert bool(lines) is note, lines
    if note:
        assert lines[1] == "The ranks called different collectives (a collective mismatch):"
        assert lines[2].startswith(f"  rank 0: {calls[0][0]}")


# ---------------------------------------------------------- before every rank joined


@pytest.fixture
def starting(monkeypatch: pytest.MonkeyPatch) -> Iterator[HangDetector]:
    """Two ranks, neither has joined the process group yet."""
    monkeypatch.setattr(_detector, "STARTUP_FLOOR_S", 0.0)
    det = HangDetector(2, 0.15)
    try:
        for rank in (0, 1):
            det.started(rank, os.getpid())
        yield det
    finally:
        det.close()


def test_a_rank_that_never_loads_main_while_another_waits_to_join_is_named(
    starting: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(starting, "_dump", lambda ranks: pytest.fail("no handler to signal"))
    assert starting.check(RUNNING, {}, {0}) is None  # starts the clock
    time.sleep(starting.timeout + 0.1)
    report = starting.check(RUNNING, {}, {0})
    assert report is not None and report.verdict.root == (1,)
    assert [v.activity for v in report.ranks] == ["joining", "starting"]
    assert "rank 1 has not joined the process group: it is still starting" in str(report)
    assert "rank 0 waits for every rank to join the process group" in report.verdict.headline
    assert "a line its stack could not show" in report.verdict.advice


def test_a_starting_rank_with_its_handler_installed_is_named_at_its_line(
    starting: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    Tracker(starting.slots, 1)  # its worker code ran: the stack-dump handler is installed
    asked: list[list[int]] = []

    def dump(ranks: list[int]) -> dict[int, list[ThreadStack]]:
        asked.append(ranks)
        return {1: [ThreadStack(MAIN, False, (Frame(USER, 7, "<module>"),))]}

    monkeypatch.setattr(starting, "_dump", dump)
    later = types.SimpleNamespace(time=lambda: time.time() + 5.0, monotonic=time.monotonic)
    monkeypatch.setattr(_detector, "time", later)  # its slot was written 5 s ago
    assert starting.check(RUNNING, {}, {0}) is None
    time.sleep(starting.timeout + 0.1)
    report = starting.check(RUNNING, {}, {0})
    assert asked == [[1]] and report is not None
    assert f"still importing main's module or unpickling its arguments at {USER}:7" in str(report)


def test_start_up_is_no_hang_while_ranks_load_or_before_the_floor(
    starting: HangDetector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(starting, "_dump", lambda ranks: {})
    for loaded in (set(), {0, 1}):  # nobody waits yet, or everybody is joining
        assert starting.check(RUNNING, {}, loaded) is None
        time.sleep(starting.timeout + 0.1)
        assert starting.check(RUNNING, {}, loaded) is None
    # Each rank that loads restarts the clock.
    assert starting.check({**RUNNING, 2: object()}, {}, {0}) is None
    time.sleep(starting.timeout + 0.1)
    assert starting.check({**RUNNING, 2: object()}, {}, {0, 2}) is None
    # Below the floor, a slow start is no hang however short hang_timeout is.
    monkeypatch.setattr(_detector, "STARTUP_FLOOR_S", 60.0)
    assert starting.check(RUNNING, {}, {0}) is None
    time.sleep(starting.timeout + 0.1)
    assert starting.check(RUNNING, {}, {0}) is None
