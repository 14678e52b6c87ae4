"""trainperf.checkpoint._write: atomic saves under faults (pickling errors, full disk, failed
fsync, no permission, interrupts, kill -9) never leave a partial file."""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._common import assert_old_intact, temps
from trainperf.checkpoint import load_checkpoint, save_checkpoint
from trainperf.errors import CheckpointCorruptError, CheckpointError


def test_save_to_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"is a directory; give a file path such as"):
        save_checkpoint({"x": 1}, tmp_path)


def test_save_onto_a_named_pipe_is_a_clear_error(tmp_path: Path) -> None:
    # It replaced the pipe with a regular file (and, as root, a device such as /dev/null).
    fifo = tmp_path / "ck.pt"
    os.mkfifo(fifo)
    with pytest.raises(
        CheckpointError,
        match=r"could not save checkpoint .*ck\.pt: .*ck\.pt is a named pipe \(FIFO\), not a "
        r"regular file, so it is not replaced: save to a regular file's path",
    ):
        save_checkpoint({"x": 1}, fifo)
    assert fifo.is_fifo()


def test_a_path_under_a_directory_that_cannot_be_searched_gets_the_write_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Path.is_dir() raised stat's bare PermissionError (Python < 3.14; root never sees it),
    # so the user got no CheckpointError and no "pick a writable directory".
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path).startswith(str(locked)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(
        CheckpointError,
        match=r"could not save checkpoint .*ck\.pt: Permission denied \(no permission to "
        r"write there: pick a writable directory\)",
    ):
        save_checkpoint({"x": 1}, locked / "ck.pt")


class Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("refuses to be pickled")


@pytest.mark.parametrize(
    ("bad", "cause"),
    [
        ({"f": lambda: 0}, (AttributeError, pickle.PicklingError)),
        ({"u": Unpicklable()}, RuntimeError),
    ],
)
def test_save_that_fails_while_pickling_keeps_old_file(
    old: Path, bad: dict[str, Any], cause: Any
) -> None:
    with pytest.raises(CheckpointError, match=r"could not be serialised.*previous file") as info:
        save_checkpoint({"w": torch.randn(1000), **bad}, old)
    assert isinstance(info.value.__cause__, cause)
    assert info.value.path == old
    assert_old_intact(old)


def test_full_disk_during_fsync_keeps_old_file(old: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(CheckpointError, match=r"No space left on device \(the disk is full") as e:
        save_checkpoint({"gen": 1, "w": torch.randn(100)}, old)
    assert isinstance(e.value.__cause__, OSError)
    monkeypatch.undo()
    assert_old_intact(old)


def test_full_disk_mid_write_keeps_old_file(old: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = torch.save

    class FullDisk:
        """A file whose disk fills up after 4 kB, as the kernel reports it: ENOSPC."""

        def __init__(self, f: Any) -> None:
            self.f, self.n = f, 0

        def write(self, b: bytes) -> int:
            self.n += len(b)
            if self.n > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return int(self.f.write(b))

        def flush(self) -> None:
            self.f.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f, **kw: real_save(obj, FullDisk(f), **kw))
    with pytest.raises(CheckpointError, match=r"No space left on device \(the disk is full"):
        save_checkpoint({"gen": 1, "w": torch.randn(100_000)}, old)
    monkeypatch.undo()
    assert_old_intact(old)


def test_failed_directory_fsync_is_reported(old: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointError, match=r"saved checkpoint .* could not flush its directory"):
        save_checkpoint({"gen": 1}, old)
    monkeypatch.undo()
    # The rename had happened: the new file is there, complete.
    assert load_checkpoint(old) == {"gen": 1}
    assert temps(old.parent) == []


def test_permission_error_names_the_fix(old: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "replace", denied)
    with pytest.raises(CheckpointError, match=r"Permission denied \(no permission.*writable"):
        save_checkpoint({"gen": 1}, old)
    monkeypatch.undo()
    assert_old_intact(old)


def test_a_write_protected_checkpoint_is_not_replaced(old: Path) -> None:
    old.chmod(0o444)  # "never overwrite my best model"
    with pytest.raises(
        CheckpointError,
        match=r"could not save checkpoint .*ckpt\.pt: .*write-protected.*chmod u\+w .*ckpt\.pt.*"
        r"or save to another path; .*unchanged",
    ) as info:
        save_checkpoint({"gen": 1}, old)
    assert isinstance(info.value.__cause__, PermissionError)
    assert_old_intact(old)
    assert stat.S_IMODE(old.stat().st_mode) == 0o444


def test_keyboard_interrupt_propagates_and_removes_temp(
    old: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(obj: Any, f: Any, **kw: Any) -> None:
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"gen": 1}, old)
    monkeypatch.undo()
    assert_old_intact(old)


# A writer process that is SIGKILLed mid-save. "mid-write": the disk stalls after ~60 MB of a
# 200 MB checkpoint. "before-rename": all bytes written, the fsync (a slow disk) never returns.
KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from trainperf.checkpoint import save_checkpoint

    mode, path = sys.argv[1], sys.argv[2]
    if mode == "mid-write":
        real_save = torch.save

        class StallingFile:
            def __init__(self, f):
                self.f, self.n = f, 0

            def write(self, b):
                n = self.f.write(b)
                self.n += len(b)
                if self.n > 50_000_000:
                    self.f.flush()
                    time.sleep(120)
                return n

            def flush(self):
                self.f.flush()

        torch.save = lambda obj, f, **kw: real_save(obj, StallingFile(f), **kw)
    else:
        os.fsync = lambda fd: time.sleep(120)
    big = {"gen": 1, **{f"w{i}": torch.ones(5_000_000) for i in range(10)}}
    save_checkpoint(big, path)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "min_size"), [("mid-write", 40e6), ("before-rename", 199e6)])
def test_kill_9_mid_save_keeps_old_file(old: Path, mode: str, min_size: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, mode, str(old)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not [t for t in temps(old.parent) if t.stat().st_size >= min_size]:
            if proc.poll() is not None:
                pytest.fail(f"writer exited early: {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, "the writer never got going"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    # The final name still holds the complete old checkpoint.
    loaded = load_checkpoint(old)
    assert loaded["gen"] == 0 and torch.equal(loaded["w"], torch.arange(4.0))
    # The killed writer's temp file is the only other file, and it is named as documented.
    (leftover,) = temps(old.parent)
    # Named .NAME.tmp-HOST-SLOT: the first writer of a path takes slot 0.
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    assert leftover.name == f".ckpt.pt.tmp-{host}-0"
    assert sorted(p.name for p in old.parent.iterdir()) == sorted(["ckpt.pt", leftover.name])
    if mode == "mid-write":
        with pytest.raises(CheckpointCorruptError, match="truncated"):
            load_checkpoint(leftover)
    # The next save removes the dead writer's temp file.
    save_checkpoint({"gen": 2}, old)
    assert load_checkpoint(old) == {"gen": 2}
    assert temps(old.parent) == []


def test_save_keeps_temp_files_of_live_writers(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    # Named as save_checkpoint names them: .NAME.tmp-HOST-SLOT (HOST sanitised); a live
    # writer holds an exclusive flock on its temp file until its rename.
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    live = tmp_path / f".c.pt.tmp-{host}-0"
    other_host = tmp_path / ".c.pt.tmp-elsewhere-0"
    live.write_bytes(b"in progress")
    other_host.write_bytes(b"in progress")
    with live.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        save_checkpoint({"x": 1}, path)
        assert live.read_bytes() == b"in progress" and other_host.exists()


def test_save_writes_through_a_link_and_keeps_it(tmp_path: Path) -> None:
    step100 = save_checkpoint({"step": 100}, tmp_path / "step100.pt")
    (tmp_path / "latest.pt").symlink_to("step100.pt")
    assert save_checkpoint({"step": 200}, tmp_path / "latest.pt") == tmp_path / "latest.pt"
    assert (tmp_path / "latest.pt").is_symlink()
    assert load_checkpoint(step100) == {"step": 200} and temps(tmp_path) == []


def test_save_below_a_file_says_which_component_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("a log, not a directory")
    with pytest.raises(
        CheckpointError,
        match=r"could not save checkpoint .*/afile/ck\.pt: .*/afile is a file, not a directory "
        r"\(every path above the checkpoint must be a directory: rename or remove that file, "
        r"or save somewhere else\)$",
    ) as info:
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "afile" / "ck.pt")
    assert isinstance(info.value.__cause__, NotADirectoryError)


def test_save_to_a_loop_of_links_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a.pt").symlink_to("a.pt")
    with pytest.raises(CheckpointError, match=r"leads to itself .*\(point the link at a file"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "a.pt")
