"""trainperf.checkpoint._checkpointer_wait: waiting for a Checkpointer's background write
before the next save, however that wait ends."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import trainperf.checkpoint._checkpointer as checkpointer_module
import trainperf.checkpoint._checkpointer_wait as wait_module
import trainperf.checkpoint._wait_notice as notice_module
import trainperf.checkpoint._writer as writer_module
import trainperf.checkpoint._writer_fork as fork_module
from tests.checkpoint._common import held_thread_writes
from trainperf import Checkpointer, load_checkpoint
from trainperf.checkpoint._writer_fork import fork_writes
from trainperf.errors import CheckpointError


def test_a_wait_cut_short_by_ctrl_c_still_holds_the_next_save_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread writer (a GPU state's path) writes from staging buffers that the next save
    # refills: a second write must not start while the first still reads them.
    release = held_thread_writes(monkeypatch)
    real_finish = wait_module._finish
    interrupts = [KeyboardInterrupt()]

    def interrupted(pending: Any) -> None:
        if interrupts:  # Ctrl-C while the next save waits for step 1's write
            raise interrupts.pop()
        real_finish(pending)

    monkeypatch.setattr(wait_module, "_finish", interrupted)
    ckpt = Checkpointer(tmp_path, keep=5)
    w = torch.full((1024,), 1.0)
    state = {"w": w}
    first = ckpt.save(state, step=1, blocking=False)
    w.fill_(2.0)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(state, step=2, blocking=False)
    threading.Timer(0.2, release.set).start()
    ckpt.save(state, step=2, blocking=False)  # the notebook goes on: waits for step 1
    assert first.done()
    w.fill_(3.0)
    ckpt.wait()
    assert ckpt.steps() == [1, 2]
    for step, value in ((1, 1.0), (2, 2.0)):
        saved = load_checkpoint(tmp_path / f"step-{step:09d}.pt")["w"]
        assert torch.equal(saved, torch.full((1024,), value)), (step, saved[:3])


@pytest.mark.parametrize("spelling", ["the same", "through ..", "through a symlink"])
def test_restore_through_a_new_checkpointer_waits_for_the_write_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    # A notebook cell run again, or a resume through a new object, while the previous
    # object's background save still writes: resuming from the step before it would lose
    # the steps since (and a later restore would jump to the step that landed meanwhile).
    # The new object may name the directory otherwise: it is the same one.
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "link").symlink_to(directory, target_is_directory=True)
    again = {
        "the same": directory,
        "through ..": tmp_path / "runs" / ".." / "ckpt",
        "through a symlink": tmp_path / "link",
    }[spelling]
    release = held_thread_writes(monkeypatch)
    first = Checkpointer(directory, keep=5)
    first.save({"w": torch.zeros(4)}, step=1, blocking=False)
    release.set()
    first.wait()
    release.clear()
    first.save({"w": torch.ones(4)}, step=2, blocking=False)  # held until released
    threading.Timer(0.2, release.set).start()
    state = {"w": torch.full((4,), 7.0)}
    assert Checkpointer(again, keep=5).restore(state) == 2
    assert torch.equal(state["w"], torch.ones(4))
    first.wait()  # its own write, reported to it as usual


@pytest.mark.parametrize("through", ["itself", "a new checkpointer"])
def test_latest_right_after_a_background_save_names_that_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through: str
) -> None:
    # latest() did not wait for the write in flight (restore() does): right after
    # save(step=2, blocking=False) it named step 1 (or None before the first file landed),
    # so a loop that logged or copied latest() took the step before the one it just saved.
    release = held_thread_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, keep=5)
    release.set()
    ckpt.save({"w": torch.zeros(4)}, step=1)
    release.clear()
    ckpt.save({"w": torch.ones(4)}, step=2, blocking=False)  # held until released
    threading.Timer(0.2, release.set).start()
    reader = ckpt if through == "itself" else Checkpointer(tmp_path, keep=5)
    assert reader.latest() == tmp_path / "step-000000002.pt"
    ckpt.wait()


def test_latest_leaves_a_failed_background_write_to_the_next_save_or_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # latest() is a question about the directory: it waits for the write, names the newest
    # good file, and leaves the failure for wait() to raise (not swallowed on the way).
    release = held_thread_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, keep=5)
    release.set()
    ckpt.save({"w": torch.zeros(4)}, step=1)
    release.clear()

    def full(*args: Any, **kwargs: Any) -> None:
        release.wait(timeout=60)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "write_now", full)
    handle = ckpt.save({"w": torch.ones(4)}, step=2, blocking=False)
    threading.Timer(0.2, release.set).start()
    assert ckpt.latest() == tmp_path / "step-000000001.pt"
    assert handle.done()
    with pytest.raises(CheckpointError, match=r"background save of step 2 failed.*No space"):
        ckpt.wait()


def _still_waiting(err: str) -> list[str]:
    return [line for line in err.splitlines() if "still waiting" in line]


def test_a_wait_for_a_stuck_background_write_says_so_on_stderr_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A SIGSTOPped writer or a hung NFS mount made wait() (and latest, restore, the next
    # save) wait in silence forever. It still waits without bound (a big save may be slow),
    # but says so once per interval: the step, the file, the writer, how long, what to check.
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 0.05)
    monkeypatch.setattr(notice_module, "NOTICE_EVERY_S", 0.05)
    release = held_thread_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, keep=5)
    handle = ckpt.save({"w": torch.ones(4)}, step=2, blocking=False)  # held: a stuck writer
    threading.Timer(0.6, release.set).start()
    ckpt.wait()
    assert handle.done() and ckpt.steps() == [2]
    lines = _still_waiting(capsys.readouterr().err)
    assert len(lines) >= 2, lines  # the first notice, then again at each interval
    first = lines[0]
    assert first.startswith("trainperf: still waiting")
    assert f"step 2 to {tmp_path / 'step-000000002.pt'}" in first
    assert "writer thread" in first and "native id" in first
    assert f"ls -l {tmp_path}/.step-000000002.pt.tmp-*" in first
    assert "responsive" in first and "still waits" in first


@pytest.mark.parametrize("method", ["wait", "latest", "restore", "save"])
def test_every_wait_for_a_stuck_forked_writer_names_its_pid(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    method: str,
) -> None:
    # A fake forked writer that blocks until an Event is set (its handle's own).
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 0.05)
    monkeypatch.setattr(notice_module, "NOTICE_EVERY_S", 10.0)
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save({"w": torch.ones(4)}, step=1)
    stuck = writer_module.SaveHandle(3, tmp_path / "step-000000003.pt", "process")
    stuck._pid = 4242
    stuck._track()
    ckpt._pending = stuck
    threading.Timer(0.4, stuck._finish, args=(None, [])).start()
    state = {"w": torch.zeros(4)}
    if method == "wait":
        ckpt.wait()
    elif method == "latest":
        assert ckpt.latest() == tmp_path / "step-000000001.pt"
    elif method == "restore":
        assert ckpt.restore(state) == 1
    else:
        ckpt.save(state, step=4)
    (line,) = _still_waiting(capsys.readouterr().err)  # once per interval, not busy
    assert "step 3" in line and "writer process (pid 4242)" in line
    assert "ps -o pid,stat,etime -p 4242" in line and "kill -CONT 4242" in line


@pytest.mark.skipif(not fork_writes(), reason="needs the forked writer (Linux)")
def test_a_forked_writers_pid_is_known_to_the_wait_that_names_it(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=5)
    handle = ckpt.save({"w": torch.ones(4)}, step=1, blocking=False)
    ckpt.wait()
    assert handle.writer == "process"
    assert isinstance(handle._pid, int) and handle._pid > 0


@pytest.fixture
def usr1_handler() -> Iterator[list[Callable[[], Any]]]:
    """SIGUSR1 runs the callable the test puts in the list; the previous handler put back."""
    calls: list[Callable[[], Any]] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls[0]())
    yield calls
    signal.signal(signal.SIGUSR1, previous)


def _signal_while_starting(monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """Send SIGUSR1 while ``save(blocking=False)`` starts its ``writer``: before the writer
    thread exists, or after the fork and before the reaper thread that finishes the handle.
    A wait for that write there used to hang for good: it fails the test instead."""

    def hung(pending: Any, waited_s: float) -> str:
        raise AssertionError(f"waited {waited_s:.1f} s for a write that cannot start yet")

    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 0.3)
    monkeypatch.setattr(notice_module, "still_waiting", hung)
    if writer == "thread":
        monkeypatch.setattr(checkpointer_module, "fork_writes", lambda: False)
        module, name = writer_module, "_refused"
    else:
        module, name = fork_module, "_exit_watch"
    real = getattr(module, name)

    def signalled(*args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before this returns
        return real(*args)

    monkeypatch.setattr(module, name, signalled)


_WRITERS = [
    "thread",
    pytest.param(
        "process",
        marks=pytest.mark.skipif(not fork_writes(), reason="needs the forked writer (Linux)"),
    ),
]


@pytest.mark.parametrize("writer", _WRITERS)
def test_latest_in_a_signal_handler_while_a_save_starts_names_the_older_step(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    usr1_handler: list[Callable[[], Any]],
    writer: str,
) -> None:
    # A SLURM USR1 handler that logs ckpt.latest() landed while save(blocking=False) was
    # starting its writer: latest() waited for a write whose writer could start (or be
    # reaped) only once the handler returned, so the run hung for good.
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save({"w": torch.ones(4)}, step=1)
    seen: list[Path | None] = []
    usr1_handler.append(lambda: seen.append(ckpt.latest()))
    _signal_while_starting(monkeypatch, writer)
    handle = ckpt.save({"w": torch.full((4,), 2.0)}, step=2, blocking=False)
    assert seen == [tmp_path / "step-000000001.pt"]  # the write had not started
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 60.0)  # the real write may be slow
    ckpt.wait()
    assert handle.writer == writer and ckpt.steps() == [1, 2]
    assert ckpt.latest() == tmp_path / "step-000000002.pt"


@pytest.mark.parametrize("writer", _WRITERS)
@pytest.mark.parametrize("method", ["save", "wait", "restore"])
def test_a_wait_in_a_signal_handler_while_a_save_starts_raises_instead_of_hanging(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    usr1_handler: list[Callable[[], Any]],
    writer: str,
    method: str,
) -> None:
    # save, wait and restore wait for this Checkpointer's own write in flight, and cannot
    # skip it (the next write would refill the buffers it reads): in that window they say
    # why rather than hang.
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save({"w": torch.ones(4)}, step=1)
    calls = {
        "save": lambda: ckpt.save({"w": torch.zeros(4)}, step=3),
        "wait": ckpt.wait,
        "restore": lambda: ckpt.restore({"w": torch.zeros(4)}),
    }
    raised: list[BaseException] = []

    def handler() -> None:
        try:
            calls[method]()
        except RuntimeError as e:
            raised.append(e)

    usr1_handler.append(handler)
    _signal_while_starting(monkeypatch, writer)
    ckpt.save({"w": torch.full((4,), 2.0)}, step=2, blocking=False)
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 60.0)  # the real write may be slow
    (error,) = raised
    assert type(error) is RuntimeError
    assert re.search(
        r"while its save of step 2 .*step-000000002\.pt.* is starting its background "
        r"writer.*signal handler.*would hang.*set a flag",
        str(error),
    ), error
    ckpt.wait()  # the save the handler interrupted goes on, untouched
    assert ckpt.steps() == [1, 2]
    assert torch.equal(load_checkpoint(tmp_path / "step-000000002.pt")["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize("writer", _WRITERS)
def test_a_with_block_left_on_an_exception_in_a_signal_handler_while_a_save_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    usr1_handler: list[Callable[[], Any]],
    writer: str,
) -> None:
    # __exit__ left on an exception waited for the write without settle()'s check: in a
    # handler that landed while save(blocking=False) started its writer, it hung for good.
    # An exception is already on its way, so the wait is skipped (raising would replace it);
    # the write goes on, still pending, and keeps the directory's claim.
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save({"w": torch.ones(4)}, step=1)
    raised: list[BaseException] = []

    def handler() -> None:
        try:
            with ckpt:
                raise ValueError("stop requested")
        except ValueError as e:
            raised.append(e)
            assert ckpt._claim._fd is not None  # the write still starting keeps the claim

    usr1_handler.append(handler)
    _signal_while_starting(monkeypatch, writer)
    ckpt.save({"w": torch.full((4,), 2.0)}, step=2, blocking=False)
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 60.0)  # the real write may be slow
    assert [str(e) for e in raised] == ["stop requested"]  # the block's own, not replaced
    ckpt.wait()
    assert ckpt.steps() == [1, 2]
    assert torch.equal(load_checkpoint(tmp_path / "step-000000002.pt")["w"], torch.full((4,), 2.0))


class _BrokenStderr(io.TextIOBase):
    """stderr whose reader has gone (``python train.py 2>&1 | tee log``, tee killed)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("error", ["broken pipe", "closed"])
def test_a_long_wait_with_a_broken_stderr_still_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str
) -> None:
    # The "still waiting" notice raised BrokenPipeError (or ValueError: I/O operation on
    # closed file) out of save(): that save's state was never written.
    stderr: io.TextIOBase = _BrokenStderr()
    if error == "closed":
        stderr = io.StringIO()
        stderr.close()
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 0.05)
    release = held_thread_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save({"w": torch.ones(4)}, step=1, blocking=False)  # held: a slow write
    threading.Timer(0.4, release.set).start()
    monkeypatch.setattr(sys, "stderr", stderr)
    ckpt.save({"w": torch.full((4,), 2.0)}, step=2)
    monkeypatch.undo()
    assert ckpt.steps() == [1, 2] and ckpt._pending is None


def test_the_exit_hook_waits_with_a_broken_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "waiting for the background save ... before exiting" raised out of the exit hook,
    # which then neither waited for the write nor reported the failed ones.
    monkeypatch.setattr(wait_module, "_EXITED", [False])
    release = held_thread_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, keep=5)
    handle = ckpt.save({"w": torch.ones(4)}, step=1, blocking=False)
    threading.Timer(0.2, release.set).start()
    monkeypatch.setattr(sys, "stderr", _BrokenStderr())
    wait_module._wait_at_exit()
    assert handle.done() and ckpt.steps() == [1]
