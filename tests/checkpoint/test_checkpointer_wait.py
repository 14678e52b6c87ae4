"""trainperf.checkpoint._checkpointer_wait: waiting for a Checkpointer's background write
before the next save, however that wait ends."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import trainperf.checkpoint._checkpointer_wait as wait_module
import trainperf.checkpoint._writer as writer_module
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
    monkeypatch.setattr(wait_module, "_FIRST_NOTICE_S", 0.05, raising=False)
    monkeypatch.setattr(wait_module, "_NOTICE_EVERY_S", 0.05, raising=False)
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
    monkeypatch.setattr(wait_module, "_FIRST_NOTICE_S", 0.05, raising=False)
    monkeypatch.setattr(wait_module, "_NOTICE_EVERY_S", 10.0, raising=False)
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
