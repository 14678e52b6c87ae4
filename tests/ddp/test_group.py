"""trainperf.ddp._group: the first failure is named with its traceback and the rest are stopped.

Every test ends in bounded time (pytest-timeout) and the root conftest fails any test that
leaves a child process alive. Most launches use ``start_method="fork"`` (no interpreter
start-up per rank).
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import time
from typing import Any

import pytest

from tests.ddp import _workers as workers
from tests.ddp._distributed import LONG, fast_start_method, launch_fork
from trainperf.ddp import _group
from trainperf.ddp._failures import DEATH_SLACK_S, Problem, summarize
from trainperf.ddp._procs import SignalGuard
from trainperf.ddp._worker import Failure, WorkerSpec
from trainperf.errors import HangError, LaunchError


@pytest.mark.timeout(60)
def test_a_raising_rank_is_named_with_its_own_traceback_and_the_others_are_stopped() -> None:
    # Rank 1 raises while ranks 0, 2, 3 wait in a collective with a 30-minute timeout.
    with pytest.raises(LaunchError) as info:
        launch_fork(workers.raise_on_rank, 1, 0.3, nprocs=4, timeout=LONG)
    text = str(info.value)
    assert text.startswith("rank 1 of 4 raised ValueError: deliberate failure on rank 1")
    assert "Traceback from rank 1:" in text
    assert 'raise ValueError(f"deliberate failure on rank {bad_rank}")' in text
    assert "_workers.py" in text and "in raise_on_rank" in text
    assert "_worker.py" not in text  # the launcher's own frames are trimmed
    # The victims either were stopped or failed after it; none is blamed.
    assert not text.startswith(("rank 0", "rank 2", "rank 3"))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_escalation_to_sigkill_stops_a_rank_that_ignores_sigterm() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 raised ValueError: deliberate") as info:
        launch_fork(workers.raise_while_peer_ignores_sigterm, 1, timeout=LONG)
    assert "Stopped by the launcher: rank 0" in str(info.value)
    # Bounded by the SIGTERM grace period, not by the 120 s the rank would sleep.
    assert time.monotonic() - start < 60


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("worker", "bad", "first", "hint"),
    [
        # A peer that left: reported without waiting for the timeout, with the hint.
        (workers.return_early_on_rank, 1, "rank 0 of 2 raised RuntimeError", True),
        # A rank's own error after a peer returned: no hint about collectives.
        (workers.raise_after_peer_returned, 0, "rank 0 of 2 raised ValueError: its own", False),
    ],
)
def test_a_peer_that_returned_is_named_and_blamed_only_for_a_peer_gone_failure(
    worker: Any, bad: int, first: str, hint: bool
) -> None:
    with pytest.raises(LaunchError) as info:
        launch_fork(worker, bad, timeout=LONG)
    text = str(info.value)
    assert text.startswith(first)
    assert "Already returned from main: rank 1" in text
    assert ("(a collective that not every rank calls" in text) is hint


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_that_left_is_blamed_even_when_its_exit_is_seen_after_the_peers_report(
    code: int,
) -> None:
    # Rank 1 leaves (os._exit) and rank 0's all_reduce fails with "Connection closed by
    # peer" before the launcher sees rank 1's exit: rank 0 was blamed, and rank 1 listed as
    # "Stopped by the launcher" (its exit status read as the stop's own doing).
    if fast_start_method() != "fork":
        pytest.skip("the rank forks a child that keeps the launcher's pipes open")
    with pytest.raises(LaunchError) as info:
        launch_fork(workers.exit_on_rank_seen_late, 1, code, timeout=LONG)
    text = str(info.value)
    assert text.startswith(f"rank 1 of 2 exited with code {code} without"), text
    assert "Stopped by the launcher: rank 1" not in text


def test_a_rank_that_exited_with_code_0_is_blamed_over_the_peer_it_left_behind() -> None:
    # Both seen in one wake-up: the peer's report is stamped when it raised, the exit when
    # the launcher woke up, later; a code-0 exit was not dated back as other deaths are.
    group = _make_group(2)
    victim = Failure(0, 11, "RuntimeError", "Connection closed by peer", "tb0", time=100.2)
    group.problems.append(Problem(0, victim.time, summarize(victim), "tb0"))
    group.problems.append(group._no_report(1, 0, 100.5))
    text = group._message()
    assert text.startswith("rank 1 of 2 exited with code 0 without returning from main"), text
    assert "rank 0 raised RuntimeError: Connection closed by peer" in text


@pytest.mark.parametrize("code", [0, 3])
def test_a_real_error_is_blamed_over_an_exit_seen_after_it(code: int) -> None:
    # Rank 1 raises; rank 0 catches its broken collective and calls os._exit, and the
    # launcher sees that exit 0.5 s after rank 1 raised: dated 1 s back, the exit was blamed.
    group = _make_group(2)
    cause = Failure(1, 11, "ValueError", "bad batch", "tb1", time=100.0)
    group.problems.append(Problem(1, cause.time, summarize(cause), "tb1"))
    group.problems.append(group._no_report(0, code, 100.5))
    text = group._message()
    assert text.startswith("rank 1 of 2 raised ValueError: bad batch"), text
    assert f"  rank 0 exited with code {code} without" in text, text


_SYSTEM_ERROR = (
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:219, unhandled system error, "
    "NCCL version 2.10.3"
)


@pytest.mark.parametrize(
    ("code", "kind", "message", "blamed"),
    [
        # Killed (the OOM killer's SIGKILL, a crash's SIGSEGV): a survivor's error within the
        # slack, own-looking or not (NCCL < 2.13 says "unhandled system error" when a peer
        # dies), is its fallout; the dead rank could not have caught it and exited.
        (-9, "RuntimeError", _SYSTEM_ERROR, 0),
        (-9, "ValueError", "bad batch", 0),
        (-11, "torch.OutOfMemoryError", "CUDA out of memory", 0),
        # Exited through its own exit path: the error it may have caught comes first, unless
        # that error may as well be the exit's fallout (NCCL < 2.13's system error).
        (0, "RuntimeError", _SYSTEM_ERROR, 0),
        (3, "ValueError", "bad batch", 1),
    ],
)
def test_a_rank_killed_by_a_signal_is_blamed_over_errors_within_its_slack(
    code: int, kind: str, message: str, blamed: int
) -> None:
    group = _make_group(2)
    f = Failure(1, 11, kind, message, "tb1", time=100.2)
    group.problems.append(Problem(1, f.time, summarize(f), f.traceback))
    group.problems.append(group._no_report(0, code, 100.5))
    assert group._message().startswith(f"rank {blamed} of 2 "), group._message()


@pytest.mark.parametrize(
    ("reports", "seen_at", "first"),
    [
        # A lost-peer error before the exit was seen: the exit explains it.
        ([(1, "RuntimeError", "Connection closed by peer", 100.2)], 100.5, 0),
        # Its own error first, a lost peer after it, then the clean exit: the error.
        (
            [(1, "ValueError", "bad batch", 100.0), (2, "RuntimeError", "Broken pipe", 100.1)],
            100.5,
            1,
        ),
        # A lost peer before the other rank's own error: someone had left already.
        (
            [(1, "RuntimeError", "Connection closed by peer", 100.0), (2, "KeyError", "x", 100.2)],
            100.5,
            0,
        ),
        # An error raised more than the slack before the exit was seen.
        ([(1, "ValueError", "bad batch", 99.0)], 100.5, 1),
    ],
)
def test_an_exit_seen_without_a_report_is_dated_back_only_before_lost_peer_errors(
    reports: list[tuple[int, str, str, float]], seen_at: float, first: int
) -> None:
    group = _make_group(3)
    for rank, kind, message, at in reports:
        f = Failure(rank, 10 + rank, kind, message, f"tb{rank}", time=at)
        group.problems.append(Problem(rank, f.time, summarize(f), f.traceback))
    group.problems.append(group._no_report(0, 0, seen_at))
    assert group._message().startswith(f"rank {first} of 3 "), group._message()


@pytest.mark.parametrize(
    ("kind", "message", "lost"),
    [
        (
            "torch.distributed.DistBackendError",
            "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process "
            "exited or there was a network error, NCCL version 2.20.5",
            True,
        ),
        (
            "torch.distributed.DistBackendError",
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
            "OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for 600017 "
            "milliseconds before timing out.",
            True,
        ),
        ("torch.distributed.DistBackendError", "NCCL communicator was aborted on rank 1. ", True),
        (
            "torch.distributed.DistNetworkError",
            "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server "
            "shutdown or crash?",
            True,
        ),
        # NCCL's word for a mistake of the rank's own: that rank is blamed.
        (
            "torch.distributed.DistBackendError",
            "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, invalid "
            "usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.21.5",
            False,
        ),
    ],
)
def test_a_rank_that_left_is_blamed_over_the_nccl_and_store_errors_it_causes(
    kind: str, message: str, lost: bool
) -> None:
    # Rank 0 leaves; rank 1's NCCL collective (or the TCPStore rank 0 served) fails before
    # the launcher sees rank 0 gone. Only gloo's wording read as a lost peer: rank 1 was
    # blamed for the NCCL error, and the launcher did not wait for rank 0 to be seen gone.
    group = _make_group(2)
    f = Failure(1, 11, kind, message, "tb1", time=100.2)
    group.problems.append(Problem(1, f.time, summarize(f), f.traceback))
    assert group._only_lost_peers() is lost
    group.problems.append(group._no_report(0, 0, 100.5))
    blamed = 0 if lost else 1
    assert group._message().startswith(f"rank {blamed} of 2 "), group._message()


# What a survivor raises, with NCCL before 2.13 (PyTorch 1.10-1.12's NCCL 2.10.3), when its
# peer's process exits; the "Connection closed by remote peer" is only in NCCL's WARN lines.
_NCCL_SYSTEM_ERROR = (
    "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1191, unhandled "
    "system error, NCCL version 2.10.3\nncclSystemError: System call (e.g. socket, malloc) or "
    "external library call failed or device error. It can be also caused by unexpected exit "
    "of a remote peer, you can check NCCL warnings for failure reason and see if there is "
    "connection closure by a peer."
)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("RuntimeError", _NCCL_SYSTEM_ERROR),
        ("RuntimeError", "NCCL error: unhandled system error, NCCL version 2.10.3"),
        # The store's host (rank 0 under srun, or a torch that connects once) had gone.
        ("RuntimeError", "Connection refused"),
        (
            "torch.distributed.DistNetworkError",
            "The client socket has failed to connect to [localhost]:29500 (errno: 111 - "
            "Connection refused).",
        ),
    ],
    ids=["nccl-2.10", "nccl-watchdog", "refused", "store-refused"],
)
@pytest.mark.parametrize("code", [0, 1, -9])
def test_a_rank_that_died_is_blamed_over_the_system_error_or_refusal_it_causes(
    kind: str, message: str, code: int
) -> None:
    # Rank 0 dies; rank 1's error comes in before the launcher sees rank 0 gone. It was
    # taken for rank 1's own: the launcher did not wait for rank 0, and rank 1 was blamed
    # over a rank 0 that left through its own exit path.
    group = _make_group(2)
    f = Failure(1, 11, kind, message, "tb1", time=100.2)
    group.problems.append(Problem(1, f.time, summarize(f), f.traceback))
    assert group._only_lost_peers()
    group.problems.append(group._no_report(0, code, 100.5))
    assert group._message().startswith("rank 0 of 2 "), group._message()


@pytest.mark.parametrize(
    "message", [_NCCL_SYSTEM_ERROR, "Connection refused"], ids=["nccl-2.10", "refused"]
)
def test_a_system_error_or_refusal_with_no_death_before_it_is_the_ranks_own(
    message: str,
) -> None:
    group = _make_group(3)
    f = Failure(1, 11, "RuntimeError", message, "tb1", time=99.0)
    group.problems.append(Problem(1, f.time, summarize(f), f.traceback))
    # Rank 0 exits (having caught the broken collective) more than the slack later, and
    # rank 2 reports a lost peer: rank 1's error came first.
    lost = Failure(2, 12, "RuntimeError", "Connection closed by peer", "tb2", time=99.5)
    group.problems.append(Problem(2, lost.time, summarize(lost), "tb2"))
    group.problems.append(group._no_report(0, 1, 100.5))
    assert group._message().startswith("rank 1 of 3 raised RuntimeError: "), group._message()


@pytest.mark.parametrize(
    ("records", "first"),
    [
        # (rank, exit code, seen at; or rank, an error, raised at), in the order they arrived
        # The watchdog aborts rank 1 before the launcher sees rank 0's SIGKILL, or together.
        ([(1, -6, 100.3), (0, -9, 100.5)], 0),
        ([(1, -6, 100.5), (2, -6, 100.5), (0, -9, 100.5)], 0),
        # Or after rank 0 raised, or left through its own exit path.
        ([(0, "bad batch", 100.0), (1, -6, 100.3)], 0),
        ([(1, -6, 100.3), (0, 1, 100.6)], 0),
        # A rank aborted well before any other failure crashed of its own accord.
        ([(1, -6, 100.3), (0, -9, 101.5)], 1),
        ([(1, -6, 100.3), (0, "bad batch", 101.0)], 1),
        # gloo's SIGABRT on a size mismatch: the peer only loses its connection.
        ([(0, "Connection closed by peer", 100.2), (1, -6, 100.3)], 1),
    ],
)
def test_a_rank_the_nccl_watchdog_aborted_does_not_take_the_blame_from_the_first_failure(
    records: list[tuple[int, int | str, float]], first: int
) -> None:
    group = _make_group(3)
    for rank, what, at in records:
        if isinstance(what, int):
            group.problems.append(group._no_report(rank, what, at))
        else:
            f = Failure(rank, 10 + rank, "RuntimeError", what, f"tb{rank}", time=at)
            group.problems.append(Problem(rank, at, summarize(f), f.traceback))
    assert group._message().startswith(f"rank {first} of 3 "), group._message()


def test_the_launcher_waits_for_the_rank_whose_loss_a_sigabrt_may_be() -> None:
    # A rank SIGABRT ended is seen first: the launcher gives a rank that died the slack to
    # be seen gone, as it does after a lost-peer error.
    group = _make_group(2)
    group.problems.append(group._no_report(1, -6, 100.3))
    assert group._only_lost_peers()
    group.problems.append(group._no_report(0, -9, 100.5))
    assert not group._only_lost_peers()


@pytest.mark.timeout(60)
def test_a_raising_rank_is_blamed_over_a_peer_that_then_exits_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A busy launcher wakes up only once both ranks are gone: rank 1's report and rank 0's
    # os._exit(0) (it caught the broken all_reduce) are read in one go.
    real_wait = _group.wait

    def wake_once_all_exited(waitables: list[Any], timeout: float | None = None) -> Any:
        sentinels = [w for w in waitables if isinstance(w, int)]
        deadline = time.monotonic() + 30
        while sentinels and time.monotonic() < deadline:
            done = real_wait(sentinels, deadline - time.monotonic())
            sentinels = [s for s in sentinels if s not in done]
        return real_wait(waitables, timeout)

    monkeypatch.setattr(_group, "wait", wake_once_all_exited)
    with pytest.raises(LaunchError) as info:
        launch_fork(workers.raise_then_peers_exit_cleanly, 1, timeout=LONG)
    text = str(info.value)
    assert text.startswith("rank 1 of 2 raised ValueError: its own failure"), text
    assert "  rank 0 exited with code 0 without returning from main" in text, text


class _Running:
    """A process that has not exited (as far as its exit status says)."""

    exitcode = None


def test_waiting_for_a_lost_peer_ends_once_its_result_has_arrived() -> None:
    # Rank 1 returned (its result is in the pipe) but has not exited yet: the wait for the
    # peer that left polled exit statuses only, so the result was read only by the stop.
    group = _group.Group(_SpawnContext(), _make_group(2).spec, "", SignalGuard())  # type: ignore[arg-type]
    victim = Failure(0, 10, "RuntimeError", "Connection closed by peer", "tb0", time=100.0)
    group.problems.append(Problem(0, victim.time, summarize(victim), "tb0"))
    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.send_bytes(pickle.dumps(("loaded", 1, None)))
    writer.send_bytes(pickle.dumps(("ok", 1, "left")))
    group.readers, group.running = {1: reader}, {1: _Running()}  # type: ignore[dict-item]
    try:
        group._await_lost_peer()
        assert group.results == {1: "left"}
        assert 1 in group.loaded and 1 not in group.readers
    finally:
        reader.close()
        writer.close()


class _Clock:
    """``time`` for the group: it moves only when the group sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 100.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _ExitsLater:
    """A process whose exit status reads ``code`` from its ``polls``-th read on."""

    def __init__(self, code: int, polls: int) -> None:
        self.code, self.polls, self.reads = code, polls, 0

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return self.code if self.reads >= self.polls else None

    def join(self, timeout: float | None = None) -> None:
        pass


def _exited_first(monkeypatch: pytest.MonkeyPatch, first: Any, other: Any) -> tuple[Any, Any]:
    """A group of 2 whose rank 0 (main loaded) was just seen gone, ``first`` its problem
    (an exit code, or a Failure); rank 1 is ``other``. The group and its clock."""
    clock = _Clock()
    monkeypatch.setattr(_group, "time", clock)
    group = _group.Group(None, _make_group(2).spec, "", SignalGuard())  # type: ignore[arg-type]
    group.loaded = {0, 1}
    if isinstance(first, Failure):
        group.problems.append(Problem(0, first.time, summarize(first), first.traceback))
    else:
        group.problems.append(group._no_report(0, first, clock.time()))
    group.running = {1: other}
    return group, clock


@pytest.mark.parametrize("code", [0, 1])
def test_a_rank_killed_by_a_signal_is_blamed_when_seen_a_wakeup_after_the_exit_it_caused(
    code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 is SIGKILLed; rank 0 catches its broken collective and calls os._exit, and the
    # launcher sees rank 0 gone one wake-up before rank 1: it stopped at once and blamed
    # rank 0, with rank 1's SIGKILL read as the stop's own doing.
    killed = _ExitsLater(-9, polls=3)
    group, clock = _exited_first(monkeypatch, code, killed)
    group._await_lost_peer()
    assert not group.running and clock.now < DEATH_SLACK_S
    text = group._message()
    assert text.startswith("rank 1 of 2 died from signal SIGKILL"), text
    assert f"  rank 0 exited with code {code} without" in text, text


def test_the_wait_after_an_exit_is_bounded_and_none_follows_an_error_of_a_ranks_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nobody else dies: the exit is blamed once the slack has passed.
    group, clock = _exited_first(monkeypatch, 3, _Running())
    group._await_lost_peer()
    assert DEATH_SLACK_S <= clock.now < DEATH_SLACK_S + 0.1
    assert group._message().startswith("rank 0 of 2 exited with code 3"), group._message()
    # An error of a rank's own is reported at once: no rank is polled, no time passes.
    own = Failure(0, 10, "ValueError", "bad batch", "tb0", time=100.0)
    quiet = _ExitsLater(-9, polls=1)
    group, clock = _exited_first(monkeypatch, own, quiet)
    group._await_lost_peer()
    assert clock.now == 0.0 and quiet.reads == 0
    # Nor does the launcher wait once no rank is left running.
    group, clock = _exited_first(monkeypatch, 1, _Running())
    group.running = {}
    group._await_lost_peer()
    assert clock.now == 0.0


def _make_group(n: int = 3) -> _group.Group:
    spec = WorkerSpec(
        workers.add, (), {}, "gloo", n, "127.0.0.1", 1, "p/", LONG, None, os.getpid(), False
    )
    return _group.Group(None, spec, "", None)  # type: ignore[arg-type]


class _Unstartable:
    """A process whose start fails the way ``fork``/``spawn`` can: with ``error``."""

    pid = None

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def start(self) -> None:
        raise self.error


class _RecordingContext:
    """A multiprocessing context that records the pipes it hands out; no process starts."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.pipes: list[tuple[Any, Any]] = []

    def get_start_method(self) -> str:
        return "fork"

    def Pipe(self, duplex: bool = True) -> tuple[Any, Any]:
        ends = multiprocessing.Pipe(duplex=duplex)
        self.pipes.append(ends)
        return ends

    def Process(self, **kwargs: Any) -> _Unstartable:
        return _Unstartable(self.error)


def test_the_exit_grace_warning_names_a_rank_that_called_sys_exit_as_such(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # It said "ranks [0, 1] returned from main" of a rank whose main called sys.exit(0).
    monkeypatch.setattr(_group, "EXIT_GRACE_S", 0.0)
    group = _make_group(2)
    group.results = {0: 3, 1: None}
    group.exit_calls = {1: "sys.exit(0)"}
    group.running = {0: object(), 1: object()}  # type: ignore[dict-item]
    with caplog.at_level("WARNING", logger="trainperf.ddp"):
        group._watch()
    assert "rank 0 returned from main and rank 1 called sys.exit(0) in main, but" in caplog.text


@pytest.mark.parametrize(
    ("error", "raised", "match"),
    [
        (OSError(errno.EAGAIN, "Resource temporarily unavailable"), OSError, "temporarily"),
        (pickle.PicklingError("no pickling"), ValueError, r"cannot be pickled: no pickling"),
    ],
)
def test_a_failed_process_start_closes_both_ends_of_its_pipe(
    error: BaseException, raised: type[BaseException], match: str
) -> None:
    ctx = _RecordingContext(error)
    group = _group.Group(ctx, _make_group(2).spec, "", SignalGuard())  # type: ignore[arg-type]
    with pytest.raises(raised, match=match) as info:
        group.run()
    assert info.value is error or info.value.__cause__ is error
    assert len(ctx.pipes) == 1, "no later rank is started after a failure"
    reader, writer = ctx.pipes[0]
    assert reader.closed and writer.closed


def test_the_earliest_failure_is_blamed_whatever_order_reports_arrive_in() -> None:
    group = _make_group()
    victim = Failure(0, 11, "RuntimeError", "Connection closed by peer", "tb0", time=105.0)
    cause = Failure(2, 12, "ValueError", "bad batch\nmore", "tb2", time=100.0)
    for f in (victim, cause):  # the victim's report arrives first
        group.problems.append(Problem(f.rank, f.time, summarize(f), f.traceback))
    group.stopped = [1]
    text = group._message()
    assert text.splitlines()[0] == "rank 2 of 3 raised ValueError: bad batch"
    assert "Traceback from rank 2:\ntb2" in text
    assert "rank 0 raised RuntimeError: Connection closed by peer" in text
    assert "Stopped by the launcher: rank 1" in text


def test_each_rank_is_named_once_under_later_failures_or_under_stopped_by_the_launcher() -> None:
    # A rank that reported its failure and was still exiting when the stop began, and one
    # that reported while being stopped, were each listed under both headings.
    group = _make_group(4)
    cause = Failure(0, 10, "ValueError", "bad batch", "tb0", time=100.0)
    before = Failure(1, 11, "RuntimeError", "Connection closed by peer", "tb1", time=100.5)
    during = Failure(2, 12, "RuntimeError", "Connection reset by peer", "tb2", time=102.0)
    for f in (cause, before, during):
        group.problems.append(Problem(f.rank, f.time, summarize(f), f.traceback))
    group._stop_began = 101.0
    group.stopped = [1, 2, 3]
    group.stop_codes = {1: 1, 2: 1, 3: -15}
    text = group._message()
    later, _, stopped = text.partition("Stopped by the launcher:")
    assert "  rank 1 raised RuntimeError: Connection closed by peer" in later, text
    assert "rank 2" not in later and "rank 1" not in stopped, text
    assert stopped.splitlines()[0] == " ranks 2, 3", text
    assert (
        "  rank 2 raised RuntimeError: Connection reset by peer (exit code 1) while being stopped"
        in stopped
    ), text


class _SpawnContext:
    """Only what the group asks a spawn context about when judging an exit."""

    def get_start_method(self) -> str:
        return "spawn"


def test_exit_code_117_after_main_loaded_is_not_blamed_on_a_missing_main_guard() -> None:
    # 117 is what a worker that re-imported an unguarded script exits with, but a rank that
    # had loaded main and then called os._exit(117) itself imported nothing again.
    group = _group.Group(_SpawnContext(), _make_group(2).spec, "", SignalGuard())  # type: ignore[arg-type]
    group.loaded = {1}
    late = group._no_report(1, 117, time.time())
    assert late.summary.startswith("exited with code 117 without reporting an error"), late
    assert "__main__" not in late.summary + late.advice
    assert group.restartable
    group.stop_codes, group.stopped = {1: 117}, [1]
    assert group._ending(1) == (
        "exited with code 117 (os._exit(), or a crash in native code)",
        False,
    )
    # A rank that never loaded main: the missing guard, as before.
    early = group._no_report(0, 117, time.time())
    assert 'if __name__ == "__main__": guard' in early.summary
    assert not group.restartable
    group.stop_codes, group.stopped = {0: 117}, [0]
    assert group._ending(0) == ("exited: it too imported a script with no main guard", True)


def test_a_hang_in_a_restarted_group_names_its_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every other LaunchError of a group with restarts says which attempt failed.
    from trainperf.ddp._detector import HangDetector
    from trainperf.ddp._hang import diagnose
    from trainperf.ddp._hang_report import HangReport
    from trainperf.ddp._hang_view import RankView

    views = (RankView(0, "running", "running"), RankView(1, "running", "running"))
    report = HangReport(2.0, 2.5, 2, diagnose(list(views)), views)
    detector = HangDetector(2, 2.0)
    try:
        group = _group.Group(
            _SpawnContext(),  # type: ignore[arg-type]
            _make_group(2).spec,
            " (attempt 2 of 3)",
            SignalGuard(),
            detector=detector,
        )
        monkeypatch.setattr(group, "_start", lambda: None)
        monkeypatch.setattr(group, "_watch", lambda: setattr(group, "hang", report))
        with pytest.raises(HangError, match=r"^no progress on any of 2 ranks \(attempt 2 of 3\) "):
            group.run()
    finally:
        detector.close()
