"""trainperf.ddp.launch when things go wrong: report the first failure, stop the rest, never hang.

Every test ends in bounded time (pytest-timeout) and the root conftest fails any test that
leaves a child process alive. Most launches use ``start_method="fork"`` (no interpreter
start-up per rank); the spawn path is covered by test_ddp.py and the Ctrl-C test.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest

import trainperf.ddp as ddp
from tests.ddp import _workers as workers
from tests.ddp._distributed import fast_start_method
from trainperf.ddp import _env, _group
from trainperf.ddp._procs import SignalGuard
from trainperf.ddp._worker import Failure, WorkerSpec
from trainperf.errors import LaunchError

SCRIPT = Path(__file__).parent / "_script.py"
LONG = timedelta(minutes=30)  # the default: a test that waits for it would time out


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in _env.TORCHRUN_VARS or name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def _launch_fork(main: Any, *args: Any, nprocs: int = 2, **kw: Any) -> Any:
    return ddp.launch(
        main, *args, nprocs=nprocs, backend="gloo", start_method=fast_start_method(), **kw
    )


@pytest.mark.timeout(60)
def test_a_raising_rank_is_named_with_its_own_traceback_and_the_others_are_stopped() -> None:
    # Rank 1 raises while ranks 0, 2, 3 wait in a collective with a 30-minute timeout.
    with pytest.raises(LaunchError) as info:
        _launch_fork(workers.raise_on_rank, 1, 0.3, nprocs=4, timeout=LONG)
    text = str(info.value)
    assert text.startswith("rank 1 of 4 raised ValueError: deliberate failure on rank 1")
    assert "Traceback from rank 1:" in text
    assert 'raise ValueError(f"deliberate failure on rank {bad_rank}")' in text
    assert "_workers.py" in text and "in raise_on_rank" in text
    assert "_worker.py" not in text  # the launcher's own frames are trimmed
    # The victims either were stopped or failed after it; none is blamed.
    assert not text.startswith(("rank 0", "rank 2", "rank 3"))


@pytest.mark.timeout(60)
def test_an_escalation_to_sigkill_stops_a_rank_that_ignores_sigterm() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 raised ValueError: deliberate") as info:
        _launch_fork(workers.raise_while_peer_ignores_sigterm, 1, timeout=LONG)
    assert "Stopped by the launcher: rank 0" in str(info.value)
    # Bounded by the SIGTERM grace period, not by the 120 s the rank would sleep.
    assert time.monotonic() - start < 60


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("main", "args", "match"),
    [
        (workers.exit_on_rank, (1, 3), r"^rank 1 of 2 exited with code 3 without reporting"),
        (
            workers.signal_on_rank,
            (1, signal.SIGKILL),
            r"^rank 1 of 2 died from signal SIGKILL .*out-of-memory killer",
        ),
        (
            workers.signal_on_rank,
            (0, signal.SIGSEGV),
            r"^rank 0 of 2 died from signal SIGSEGV .*crash in native code",
        ),
        (workers.sys_exit_on_rank, (1, 4), r"^rank 1 of 2 called sys\.exit\(4\)"),
        (workers.unpicklable_result, (), r"^rank 0 of 2 raised TypeError: main returned a value"),
    ],
)
def test_exit_codes_and_signals_are_named(main: Any, args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        _launch_fork(main, *args, timeout=LONG)


@pytest.mark.timeout(60)
def test_sys_exit_zero_counts_as_returning_none() -> None:
    assert ddp.launch_all(
        workers.sys_exit_on_rank, 1, 0, nprocs=2, backend="gloo", start_method=fast_start_method()
    ) == [0, None]


@pytest.mark.timeout(60)
def test_a_rank_stuck_in_a_collective_fails_within_the_timeout() -> None:
    # Rank 1 stays alive but never joins: rank 0 must give up after `timeout`, not hang.
    with pytest.raises(LaunchError, match=r"^rank 0 of 2 raised RuntimeError: .*[Tt]imed out"):
        _launch_fork(workers.stuck_on_rank, 1, timeout=timedelta(seconds=3))


@pytest.mark.timeout(60)
def test_a_peer_that_left_is_reported_without_waiting_for_the_timeout() -> None:
    with pytest.raises(LaunchError) as info:
        _launch_fork(workers.return_early_on_rank, 1, timeout=LONG)
    text = str(info.value)
    assert text.startswith("rank 0 of 2 raised RuntimeError")
    assert "Already returned from main: rank 1 (a collective that not every rank calls" in text


@pytest.mark.timeout(60)
def test_max_restarts_reruns_the_whole_group(tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    assert _launch_fork(workers.fail_first_attempt, str(marker), max_restarts=1, timeout=LONG) == 2
    assert marker.exists()

    with pytest.raises(LaunchError, match=r"^rank [01] of 2 \(attempt 3 of 3\) raised KeyError"):
        _launch_fork(workers.always_fail, max_restarts=2)
    with pytest.raises(LaunchError, match=r"^rank [01] of 2 raised KeyError: 'always'"):
        _launch_fork(workers.always_fail)


@pytest.mark.timeout(60)
def test_the_spawn_path_reports_failures_too() -> None:
    with pytest.raises(LaunchError, match=r"^rank 1 of 2 raised ValueError: deliberate"):
        ddp.launch(workers.raise_on_rank, 1, nprocs=2, backend="gloo", timeout=LONG)


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

    def Pipe(self, duplex: bool = True) -> tuple[Any, Any]:
        ends = multiprocessing.Pipe(duplex=duplex)
        self.pipes.append(ends)
        return ends

    def Process(self, **kwargs: Any) -> _Unstartable:
        return _Unstartable(self.error)


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
        group.problems.append(_group._Problem(f.rank, f.time, _group._summary(f), f.traceback))
    group.stopped = [1]
    text = group._message()
    assert text.splitlines()[0] == "rank 2 of 3 raised ValueError: bad batch"
    assert "Traceback from rank 2:\ntb2" in text
    assert "rank 0 raised RuntimeError: Connection closed by peer" in text
    assert "Stopped by the launcher: rank 1" in text


def _wait_for(paths: list[Path], proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            out, _ = proc.communicate()
            pytest.fail(f"the launcher exited early ({proc.returncode}):\n{out}")
        if time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"workers never reported their pids:\n{out}")
        time.sleep(0.1)


def _gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sig", "start_method", "codes"),
    [
        (signal.SIGINT, "spawn", {130, -signal.SIGINT}),
        (signal.SIGTERM, "fork", {143}),
        (signal.SIGKILL, "fork", {-signal.SIGKILL}),
    ],
)
def test_signals_to_the_launcher_leave_no_worker_or_dataloader_worker(
    tmp_path: Path, sig: int, start_method: str, codes: set[int]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "hang", str(tmp_path), start_method],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    pids: list[int] = []
    try:
        _wait_for([tmp_path / "pids0.json", tmp_path / "pids1.json"], proc, timeout=90)
        for r in (0, 1):
            record = json.loads((tmp_path / f"pids{r}.json").read_text())
            pids += [record["rank"], *record["loader"]]
        assert len(pids) == 6  # 2 ranks with 2 DataLoader workers each
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode in codes, out
        # SIGKILL gives the launcher no chance to clean up: the parent-death signal must.
        assert _gone(pids, timeout=15) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _gone(pids, timeout=0):
            os.kill(pid, signal.SIGKILL)
