"""trainperf._utils.atomic: killed writers' temp files are removed, live writers' are kept,
and a save never lists its directory (so 200,000 unrelated files cost nothing)."""

from __future__ import annotations

import errno
import fcntl
import functools
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from trainperf._utils.atomic import remove_dead_temp, temp_name, write_atomically

HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())

# A writer that takes its temp file as write_atomically does, writes half, then waits to be
# killed; it prints the temp file's name once it is writing.
_KILLED_WRITER = """
import os, sys, time
from pathlib import Path
from trainperf._utils.atomic import write_atomically

def write(f):
    f.write(b"half of it")
    f.flush()
    print(os.readlink(f"/proc/self/fd/{f.fileno()}"), flush=True)
    time.sleep(120)

write_atomically(Path(sys.argv[1]), write)
"""

# Another process holding a slot's lock, as a live writer (another rank) does.
_LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def _put(path: Path, data: bytes) -> None:
    write_atomically(path, lambda f: f.write(data))


@contextmanager
def _live_writer(slot_file: Path) -> Iterator[None]:
    """A separate process holding the lock on ``slot_file`` until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(slot_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
        yield
    finally:
        proc.communicate(timeout=30)


def _slow_write(data: bytes, f: Any) -> None:
    f.write(data[: len(data) // 2])
    time.sleep(0.001)  # let the other writers in mid-file
    f.write(data[len(data) // 2 :])


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


@pytest.mark.slow  # about 3 s: the killed writer imports torch
def test_a_killed_writers_temp_file_is_removed_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    _put(path, b"old")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        temp = Path(proc.stdout.readline().decode().strip())
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    assert temp == temp_name(path, HOST, 0) and temp.read_bytes() == b"half of it"
    assert path.read_bytes() == b"old"
    _put(path, b"new")
    assert path.read_bytes() == b"new" and _temps(tmp_path) == []


def test_dead_writers_temp_files_go_and_a_live_writers_stays(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    live = temp_name(path, HOST, 0)
    live.write_bytes(b"rank 1, still writing")
    # Killed writers' temp files: no process holds their lock. Slot 3 lies past a gap.
    dead = [temp_name(path, HOST, 1), temp_name(path, HOST, 3)]
    for d in dead:
        d.write_bytes(b"half a file")
    other_host = temp_name(path, "elsewhere", 1)
    other_host.write_bytes(b"a writer on another host")
    with _live_writer(live):
        _put(path, b"mine")
        assert path.read_bytes() == b"mine"
        assert live.read_bytes() == b"rank 1, still writing"
        assert not any(d.exists() for d in dead)
        assert other_host.exists()  # its lock, if any, is on another host
    assert _temps(tmp_path) == sorted([live.name, other_host.name])


@pytest.mark.timeout(20)
@pytest.mark.parametrize("slot", [0, 1])
def test_a_named_pipe_with_a_temp_name_is_never_opened(tmp_path: Path, slot: int) -> None:
    # Opened write-only to take its lock, a named pipe waits for a reader: the save hung
    # (slot 0: taking the first slot; slot 1: removing dead writers' files above it), and
    # so did remove_dead_temp.
    path = tmp_path / "ckpt.pt"
    fifo = temp_name(path, HOST, slot)
    os.mkfifo(fifo)
    assert remove_dead_temp(fifo) is False and fifo.is_fifo()
    _put(path, b"mine")
    assert path.read_bytes() == b"mine" and fifo.is_fifo()  # not ours: left alone


def test_a_save_never_lists_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(50):
        (tmp_path / f"unrelated-{i}.bin").write_bytes(b"")
    stale = temp_name(tmp_path / "ckpt.pt", HOST, 2)
    stale.write_bytes(b"half a file")
    listings: list[str] = []

    def counting(name: str, real: Any) -> Any:
        def listing(*args: Any, **kwargs: Any) -> Any:
            listings.append(name)
            return real(*args, **kwargs)

        return listing

    monkeypatch.setattr(os, "scandir", counting("os.scandir", os.scandir))
    monkeypatch.setattr(os, "listdir", counting("os.listdir", os.listdir))
    monkeypatch.setattr(glob, "glob", counting("glob.glob", glob.glob))
    monkeypatch.setattr(glob, "iglob", counting("glob.iglob", glob.iglob))
    monkeypatch.setattr(Path, "iterdir", counting("Path.iterdir", Path.iterdir))
    monkeypatch.setattr(Path, "glob", counting("Path.glob", Path.glob))
    for step in range(5):
        _put(tmp_path / "ckpt.pt", b"step %d" % step)
        _put(tmp_path / "sub" / f"step{step}.pt", b"x")
    monkeypatch.undo()
    assert listings == []
    assert not stale.exists()  # found by name all the same
    assert (tmp_path / "ckpt.pt").read_bytes() == b"step 4" and _temps(tmp_path) == []


def test_concurrent_writers_of_one_path_take_separate_slots(tmp_path: Path) -> None:
    path = tmp_path / "shared.json"
    payloads = [bytes([65 + i]) * 100_000 for i in range(6)]
    errors: list[BaseException] = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(15):
                write_atomically(path, functools.partial(_slow_write, data))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert path.read_bytes() in payloads  # one writer's whole file, never a mix
    assert _temps(tmp_path) == []


def test_without_flock_the_temp_name_is_unique_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    seen: list[str] = []
    path = tmp_path / "c.pt"
    write_atomically(
        path,
        lambda f: (
            seen.append(Path(os.readlink(f"/proc/self/fd/{f.fileno()}")).name),
            f.write(b"ok"),
        ),
    )
    assert path.read_bytes() == b"ok" and _temps(tmp_path) == []
    assert re.fullmatch(rf"\.c\.pt\.tmp-{re.escape(HOST)}-{os.getpid()}-[0-9a-f]{{8}}", seen[0])


@pytest.mark.parametrize("locks", [True, False])
def test_a_name_as_long_as_a_path_component_may_be_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, locks: bool
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    if not locks:
        monkeypatch.setattr(fcntl, "flock", no_locks)
    seen: list[str] = []
    path = tmp_path / ("é" + "x" * 249 + ".pt")  # 255 bytes, as long as Linux allows
    for data in (b"one", b"two"):  # the second save finds the first one's slot by its name
        write_atomically(
            path,
            lambda f, d=data: (
                seen.append(Path(os.readlink(f"/proc/self/fd/{f.fileno()}")).name),
                f.write(d),
            ),
        )
    assert path.read_bytes() == b"two" and _temps(tmp_path) == []
    assert all(len(name.encode()) <= 255 for name in seen)
    assert temp_name(path, HOST, 0) != temp_name(tmp_path / ("é" + "x" * 248 + "y.pt"), HOST, 0)


def test_a_failed_write_removes_its_temp_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    _put(path, b"old")

    def fails(f: Any) -> None:
        f.write(b"partial")
        raise RuntimeError("serialising failed")

    with pytest.raises(RuntimeError, match="serialising failed"):
        write_atomically(path, fails)
    assert path.read_bytes() == b"old" and _temps(tmp_path) == []
    with pytest.raises(IsADirectoryError, match="is a directory, not a file name"):
        write_atomically(tmp_path, fails)


def test_a_slot_renamed_away_between_open_and_lock_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another writer finishes (renames its slot over the final name) after this one opened
    # the slot but before it locked it: this one must not write into what is now the final
    # file, but into a new slot file.
    path = tmp_path / "c.pt"
    path.write_bytes(b"older")
    slot = temp_name(path, HOST, 0)
    slot.write_bytes(b"the other writer's file")
    real_flock = fcntl.flock
    raced: list[int] = []

    def flock(fd: int, operation: int) -> None:
        if not raced:
            raced.append(fd)
            os.replace(slot, path)  # the other writer's rename, just now
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    _put(path, b"new")
    assert raced and path.read_bytes() == b"new" and _temps(tmp_path) == []


# --------------------------------------------------------------------- symbolic links


@pytest.mark.parametrize("absolute", [False, True])
def test_a_link_is_written_through_and_stays_a_link(tmp_path: Path, absolute: bool) -> None:
    target = tmp_path / "runs" / "step100.pt"
    _put(target, b"step 100")
    link = tmp_path / "latest.pt"
    link.symlink_to(target if absolute else Path("runs") / "step100.pt")
    written = write_atomically(link, lambda f: f.write(b"step 200"))
    assert written == (target if absolute else tmp_path / "runs" / "step100.pt")
    assert link.is_symlink() and os.readlink(link) == str(
        target if absolute else Path("runs", "step100.pt")
    )
    assert target.read_bytes() == b"step 200"  # what torch.save(obj, link) would have done
    assert _temps(tmp_path) == [] and _temps(target.parent) == []


def test_a_chain_of_links_is_followed_to_its_end(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    final = tmp_path / "real" / "c.pt"
    _put(final, b"old")
    (tmp_path / "b.pt").symlink_to("real/c.pt")
    (tmp_path / "a.pt").symlink_to("b.pt")
    assert write_atomically(tmp_path / "a.pt", lambda f: f.write(b"new")) == tmp_path / "real/c.pt"
    assert final.read_bytes() == b"new"
    assert (tmp_path / "a.pt").is_symlink() and (tmp_path / "b.pt").is_symlink()


def test_a_dangling_link_creates_its_target(tmp_path: Path) -> None:
    # As open(link, "wb") does, when the target's directory exists.
    (tmp_path / "later").mkdir()
    link = tmp_path / "latest.pt"
    link.symlink_to("later/step1.pt")
    write_atomically(link, lambda f: f.write(b"first"))
    assert link.is_symlink() and (tmp_path / "later" / "step1.pt").read_bytes() == b"first"


def test_a_dangling_link_never_creates_its_targets_directories(tmp_path: Path) -> None:
    # A link into a purged scratch directory: rebuilding /scratch/... would hide the loss.
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "scratch" / "run1" / "step1.pt")
    with pytest.raises(
        FileNotFoundError, match=r"latest\.pt is a symbolic link to .*/scratch/run1/step1\.pt"
    ) as info:
        write_atomically(link, lambda f: f.write(b"first"))
    assert "does not exist" in str(info.value) and info.value.errno == errno.ENOENT
    assert not (tmp_path / "scratch").exists() and link.is_symlink()
    assert _temps(tmp_path) == []


def test_a_loop_of_links_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "a.pt").symlink_to("b.pt")
    (tmp_path / "b.pt").symlink_to("a.pt")
    with pytest.raises(OSError, match=r"a\.pt is a symbolic link that leads to itself") as info:
        write_atomically(tmp_path / "a.pt", lambda f: f.write(b"x"))
    assert info.value.errno == errno.ELOOP
    assert (tmp_path / "a.pt").is_symlink() and _temps(tmp_path) == []


# ------------------------------------------------------------------- parent is a file


@pytest.mark.parametrize("below", ["ck.pt", "sub/ck.pt"])
def test_a_parent_that_is_a_file_is_named(tmp_path: Path, below: str) -> None:
    (tmp_path / "afile").write_bytes(b"not a directory")
    with pytest.raises(NotADirectoryError, match=r"/afile is a file, not a directory"):
        write_atomically(tmp_path / "afile" / below, lambda f: f.write(b"x"))
    assert (tmp_path / "afile").read_bytes() == b"not a directory"


def test_a_parent_that_is_a_dangling_link_is_named(tmp_path: Path) -> None:
    (tmp_path / "gone").symlink_to("nowhere")
    with pytest.raises(FileNotFoundError, match=r"/gone is a dangling symbolic link"):
        write_atomically(tmp_path / "gone" / "ck.pt", lambda f: f.write(b"x"))


# -------------------------------------------------------------- not a regular file


def test_a_named_pipe_at_the_path_is_not_replaced(tmp_path: Path) -> None:
    # The rename replaced it silently with a regular file (as root, a device node too:
    # write_atomically(Path("/dev/null"), ...) replaced /dev/null).
    fifo = tmp_path / "out.pt"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match=r"out\.pt is a named pipe \(FIFO\), not a regular"):
        write_atomically(fifo, lambda f: f.write(b"x"))
    (tmp_path / "link.pt").symlink_to("out.pt")
    with pytest.raises(FileExistsError, match=r"out\.pt \(the target of the link .*link\.pt\)"):
        write_atomically(tmp_path / "link.pt", lambda f: f.write(b"x"))
    assert fifo.is_fifo() and _temps(tmp_path) == []


# ---------------------------------------------------------------- write-protected target


def test_a_write_protected_file_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "best.pt"
    _put(path, b"keep me")
    path.chmod(0o444)  # refused by its mode bits, so even under root (which os.access lets by)
    with pytest.raises(PermissionError, match=r"best\.pt is write-protected.*chmod u\+w"):
        write_atomically(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"keep me" and _temps(tmp_path) == []


def test_a_link_to_a_write_protected_file_is_refused_by_the_targets_name(tmp_path: Path) -> None:
    target = tmp_path / "step100.pt"
    _put(target, b"keep me")
    target.chmod(0o444)
    (tmp_path / "latest.pt").symlink_to("step100.pt")
    with pytest.raises(
        PermissionError,
        match=r"step100\.pt \(the target of the link .*latest\.pt\) is write-protected",
    ):
        write_atomically(tmp_path / "latest.pt", lambda f: f.write(b"new"))
    assert target.read_bytes() == b"keep me"


def test_a_file_this_user_may_not_write_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "theirs.pt"
    _put(path, b"keep me")  # writable by its owner, but (as os.access says) not by this user
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: mode != os.W_OK)
    with pytest.raises(PermissionError, match=r"theirs\.pt is write-protected"):
        write_atomically(path, lambda f: f.write(b"new"))
    monkeypatch.undo()
    assert path.read_bytes() == b"keep me"
    write_atomically(path, lambda f: f.write(b"new"))  # an ordinary file is replaced as ever
    assert path.read_bytes() == b"new"
