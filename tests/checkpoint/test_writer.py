"""trainperf.checkpoint._writer and its _writer_fork, _writer_snapshot and _writer_staging:
the memory rule, staging into reused buffers, the forked writer, and the handle that reports
a background write (its failure raised once)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import mmap
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainperf.checkpoint._wait_notice as notice_module
import trainperf.checkpoint._writer as writer_module
from trainperf import Checkpointer
from trainperf.checkpoint._writer import SaveHandle, drop_cached
from trainperf.checkpoint._writer_fork import _IOPRIO_SET, lower_priority, start_process
from trainperf.checkpoint._writer_snapshot import tensor_bytes
from trainperf.checkpoint._writer_staging import Staging, staging_fits
from trainperf.errors import CheckpointError

GiB = 1 << 30


def test_staging_fits_keeps_a_margin_free() -> None:
    # The margin is max(512 MiB, 5 % of total).
    assert staging_fits(GiB, 2 * GiB, 8 * GiB)
    assert not staging_fits(GiB, GiB + (511 << 20), 8 * GiB)
    assert staging_fits(GiB, GiB + (512 << 20), 8 * GiB)
    assert not staging_fits(GiB, GiB + (600 << 20), 100 * GiB)  # 5 GiB margin on 100 GiB
    assert staging_fits(0, 0, 0) is False  # nothing free at all: the margin cannot be kept


def test_tensor_bytes_counts_each_storage_once() -> None:
    w = torch.zeros(1000)
    payload = {"model": {"w": w, "tied": w, "view": w[:10]}, "opt": [torch.zeros(3, 2)]}
    assert tensor_bytes(payload) == (4000 + 24, True)


def test_staging_copies_and_reuses_its_buffers() -> None:
    staging = Staging()
    sd = collections.OrderedDict(w=torch.arange(6.0), b=torch.ones(2))
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    payload = {"model": sd, "step": 3, "pair": (torch.zeros(1), "x"), "tied": sd["w"]}
    assert staging.needed_bytes(payload) == (6 + 2 + 1) * 4  # the tied tensor once
    first = staging.stage(payload)
    sd["w"].add_(100)  # the training step changes the live tensor: the copy does not move
    assert first["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert first["model"]._metadata == {"": {"version": 1}} and first["pair"][1] == "x"
    assert type(first["model"]) is collections.OrderedDict and first["step"] == 3
    assert staging.needed_bytes(payload) == 0  # the buffers are there now
    second = staging.stage(payload)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # reused
    assert second["tied"] is second["model"]["w"]  # one buffer for the tied tensor
    assert second["model"]["w"].tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]


def test_a_failure_is_raised_once_chained_with_the_path(tmp_path: Path) -> None:
    handle = SaveHandle(7, tmp_path / "step-000000007.pt", "process")
    assert not handle.done() and handle.wait(timeout=0.01) is False
    cause = OSError(errno.ENOSPC, "No space left on device")
    handle._finish(("could not save checkpoint x: No space left on device", cause), [])
    with pytest.raises(CheckpointError, match=r"background save of step 7 failed: could not") as e:
        handle.wait()
    assert e.value.__cause__ is cause and e.value.path == tmp_path / "step-000000007.pt"
    assert handle.wait() is True  # raised once; the Checkpointer's next call does not repeat it
    assert "failed" in repr(handle)


@pytest.mark.parametrize("how", ["removed", "renamed"])
def test_a_background_save_whose_directory_went_away_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # The error read "No such file or directory; any previous file there is unchanged",
    # as if the step file were the problem: the directory itself was gone.
    import shutil

    from trainperf.checkpoint import _checkpointer, _writer
    from trainperf.checkpoint._write import write_checkpoint_file as real

    monkeypatch.setattr(_checkpointer, "fork_writes", lambda: False)  # the thread writer
    directory = tmp_path / "ckpt"

    def going_away(path: Path, write: Any, **kwargs: Any) -> None:
        def write_then_go(f: Any) -> None:
            write(f)
            if how == "removed":
                shutil.rmtree(directory)
            else:
                directory.rename(tmp_path / "moved")

        real(path, write_then_go, **kwargs)

    ckpt = Checkpointer(directory)
    monkeypatch.setattr(_writer, "write_checkpoint_file", going_away)
    handle = ckpt.save({"n": 1}, step=5, blocking=False)
    assert handle.writer == "thread"
    with pytest.raises(
        CheckpointError,
        match=r"background save of step 5 failed: the checkpoint directory .*ckpt no longer "
        r"exists \(removed or renamed while the save ran\); nothing was saved for step 5; "
        r"no older checkpoint was deleted$",
    ) as info:
        ckpt.wait()
    assert "unchanged" not in str(info.value)
    cause = info.value.__cause__  # the write's own error, its OSError chained
    assert cause is not None and isinstance(cause.__cause__, FileNotFoundError)
    monkeypatch.setattr(_writer, "write_checkpoint_file", real)
    assert ckpt.save({"n": 2}, step=6).path == directory / "step-000000006.pt"  # made again


def test_a_dangling_link_above_the_directory_is_named_not_called_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.path.isdir is False through a dangling link too: its precise message ("... is a
    # dangling symbolic link ... (fix or remove the link ...)") was replaced by "removed or
    # renamed while the save ran".
    import shutil

    from trainperf.checkpoint import _checkpointer

    monkeypatch.setattr(_checkpointer, "fork_writes", lambda: False)  # the thread writer
    (tmp_path / "scratch" / "ckpt").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "scratch")
    ckpt = Checkpointer(link / "ckpt")
    shutil.rmtree(tmp_path / "scratch")  # a scratch area purged between saves
    handle = ckpt.save({"n": 1}, step=2, blocking=False)
    assert handle.writer == "thread"
    with pytest.raises(CheckpointError, match=r"link is a dangling symbolic link .*fix or remove"):
        ckpt.wait()


def test_a_failure_naming_a_dangling_link_keeps_its_message(tmp_path: Path) -> None:
    # The link may be mended by the time the failure is read: its own words still hold.
    handle = SaveHandle(3, tmp_path / "gone" / "step-000000003.pt", "process")
    said = f"could not save checkpoint x: {tmp_path}/gone is a dangling symbolic link (to 'y')"
    handle._finish((said, FileNotFoundError(errno.ENOENT, said)), [])
    with pytest.raises(CheckpointError, match=r"failed: could not save .*dangling symbolic link"):
        handle.wait()


def test_a_failure_under_a_dangling_link_is_not_called_a_directory_gone(tmp_path: Path) -> None:
    # The target went while the write ran: the write's ENOENT does not name the link, but the
    # directory was not removed or renamed, so its words are kept.
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    handle = SaveHandle(4, tmp_path / "link" / "ckpt" / "step-000000004.pt", "thread")
    said = "could not save checkpoint x: No such file or directory"
    handle._finish((said, FileNotFoundError(errno.ENOENT, "No such file or directory")), [])
    with pytest.raises(CheckpointError, match=r"failed: could not save checkpoint x: No such"):
        handle.wait()


def test_a_directory_renamed_after_the_file_was_saved_is_not_called_unsaved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The flush of the directory fails after os.replace: the file is saved (in the renamed
    # directory), so "nothing was saved" would be wrong.
    from trainperf.checkpoint import _checkpointer, _write

    monkeypatch.setattr(_checkpointer, "fork_writes", lambda: False)  # the thread writer
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory)
    real = _write.fsync_dir

    def rename_then_flush(path: Any) -> None:
        if Path(path) == directory:
            directory.rename(tmp_path / "moved")
        real(path)

    monkeypatch.setattr(_write, "fsync_dir", rename_then_flush)
    assert ckpt.save({"n": 1}, step=5, blocking=False).writer == "thread"
    with pytest.raises(CheckpointError, match=r"failed: saved checkpoint .*could not flush") as e:
        ckpt.wait()
    assert "nothing was saved" not in str(e.value)
    assert (tmp_path / "moved" / "step-000000005.pt").is_file()


def _resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache: ``mincore`` on a mapping that is
    never touched (touching would read the pages in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
            assert rc == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def _page_cache_works(path: Path) -> bool:
    """Whether ``path``'s filesystem keeps written pages cached and drops them on request
    (not tmpfs, whose pages are the file)."""
    with path.open("wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    cached = _resident_pages(path) > 0
    drop_cached(path)
    return cached and _resident_pages(path) == 0


needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


@needs_linux
def test_drop_cached_evicts_a_written_files_pages(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    if _resident_pages(path) == 0:
        pytest.skip("this filesystem keeps no written pages in the page cache")
    with path.open("rb+") as f:
        os.fsync(f.fileno())  # clean pages: what the writer has after its fsync
    drop_cached(path)
    assert _resident_pages(path) == 0
    drop_cached(tmp_path / "missing.pt")  # best effort: nothing to drop is no error


@needs_linux
def test_the_forked_writer_leaves_no_checkpoint_in_the_page_cache(tmp_path: Path) -> None:
    if not _page_cache_works(tmp_path / "probe.bin"):
        pytest.skip("this filesystem does not drop cached pages on request")
    ckpt = Checkpointer(tmp_path / "ckpt")
    handle = ckpt.save({"w": torch.randn(1 << 20)}, step=1, blocking=False)  # 4 MiB
    ckpt.wait()
    assert handle.writer == "process" and handle.path is not None
    assert _resident_pages(handle.path) == 0


@needs_linux
def test_lower_priority_lowers_cpu_and_io_priority() -> None:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        try:
            before = os.nice(0)
            lower_priority()
            number = _IOPRIO_SET.get(os.uname().machine)
            ioprio = None
            if number is not None:  # ioprio_get is ioprio_set's number + 1 on these
                libc = ctypes.CDLL(None, use_errno=True)
                ioprio = libc.syscall(number + 1, 1, 0)
            policy = os.sched_getscheduler(0)
            own = os.getsid(0) == os.getpid()
            try:
                group = Path("/proc/self/autogroup").read_text()
            except OSError:
                group = ""
            out = [before, os.nice(0), ioprio, policy, own, group]
            os.write(write_fd, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        before, after, ioprio, policy, own_session, autogroup = json.loads(f.read())
    os.waitpid(pid, 0)
    assert after == min(before + 10, 19) and policy == os.SCHED_BATCH
    # Its own session: autogroup does not split the training process's CPU share with it.
    assert own_session
    if autogroup:  # "/autogroup-123 nice 10" where the kernel groups by session
        assert autogroup.split()[-1] == "10", autogroup
    if ioprio is not None and ioprio >= 0:  # -1: no ioprio_get here (seccomp)
        assert ioprio == (2 << 13) | 7  # best effort, its lowest level


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux)")
def test_a_copy_of_the_pipe_held_by_another_process_does_not_hold_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another thread forks (a DataLoader worker, a forked helper) between the writer's pipe
    # and the parent's closing its end: that process holds a copy of the write end, and a
    # reaper reading to end-of-file waited as long as it lived.
    real_fork, holders = os.fork, []

    def fork_and_leak() -> int:
        pid = real_fork()
        if pid != 0:
            other = real_fork()
            if other == 0:  # pragma: no cover - the holder only sleeps
                time.sleep(60)
                os._exit(0)
            holders.append(other)
        return pid

    monkeypatch.setattr(os, "fork", fork_and_leak)
    try:
        ckpt = Checkpointer(tmp_path)
        handle = ckpt.save({"w": torch.ones(4), "n": 1}, step=1, blocking=False)
        monkeypatch.undo()
        assert handle.writer == "process" and handle.wait(timeout=30)
        assert holders and Checkpointer(tmp_path).steps() == [1]
    finally:
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_killed_writer_process_leaves_no_temp_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its temp file stayed until the next Checkpointer of the directory was made: a run whose
    # writers the OOM killer kept killing filled the disk with them.
    real_write = writer_module.write_checkpoint_file

    def stalls(path: Path, body: Any, **options: Any) -> Any:
        def slow(f: Any) -> None:
            f.write(b"partial")
            f.flush()
            time.sleep(60)
            body(f)

        return real_write(path, slow, **options)

    monkeypatch.setattr(writer_module, "write_checkpoint_file", stalls)
    ckpt = Checkpointer(tmp_path)
    handle = ckpt.save({"w": torch.ones(4)}, step=1, blocking=False)
    assert handle.writer == "process" and handle._pid is not None
    temps = tmp_path.glob(".step-000000001.pt.tmp-*")
    deadline = time.monotonic() + 30
    while not any(temps) and time.monotonic() < deadline:
        time.sleep(0.01)
        temps = tmp_path.glob(".step-000000001.pt.tmp-*")
    os.kill(handle._pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match="killed by SIGKILL"):
        handle.wait(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_refused_fork_leaves_no_pipe_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused() -> int:
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fork", refused)
    handle = SaveHandle(1, tmp_path / "step-000000001.pt", "process")
    with pytest.raises(BlockingIOError):
        start_process({"n": 1}, tmp_path / "step-000000001.pt", list, handle)
    assert set(os.listdir("/proc/self/fd")) == before


def test_a_background_save_finishes_in_a_process_with_more_than_1024_files_open(
    tmp_path: Path,
) -> None:
    # The reaper waited with select(), which refuses fds from 1024 on: it died, and every
    # wait for the save (the next save's, the exit hook's) waited forever.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    handle = None
    try:
        ckpt = Checkpointer(tmp_path)
        handle = ckpt.save({"w": torch.ones(4), "n": 1}, step=1, blocking=False)
        assert handle.writer == "process" and handle.wait(timeout=30)
        assert ckpt.steps() == [1]
    finally:
        if handle is not None and not handle.done():  # or the exit hook waits for it
            handle._finish(("never reported", RuntimeError("never reported")), [])
            handle._reported = True
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    "value",
    [
        lambda x: x,
        {"w": torch.ones(2), "lock": threading.Lock()},
        [torch.ones(1), (i for i in range(2))],
    ],
    ids=["lambda", "lock-beside-tensors", "generator-in-a-list"],
)
def test_a_value_that_cannot_be_pickled_is_refused_by_its_key_before_anything_is_written(
    tmp_path: Path, value: object
) -> None:
    # It failed in torch.save with a raw pickling error naming no entry, and a background
    # save forked a writer that failed every time.
    ckpt = Checkpointer(tmp_path)
    refused = r"not saving .*step-000000001\.pt: state\['extra'\] holds a value that cannot be"
    with pytest.raises(CheckpointError, match=rf"{refused} pickled \(.*\); save what rebuilds"):
        ckpt.save({"model": nn.Linear(2, 2), "extra": value}, step=1)
    handle = ckpt.save({"model": nn.Linear(2, 2), "extra": value}, step=1, blocking=False)
    assert handle.done()  # refused before a writer started
    with pytest.raises(CheckpointError, match=refused):
        ckpt.wait()
    assert ckpt.steps() == []


def test_only_background_writers_that_started_are_counted(tmp_path: Path) -> None:
    from trainperf.checkpoint._writer import background_saves

    ckpt = Checkpointer(tmp_path)
    before = background_saves()
    ckpt.save({"n": 1}, step=1, blocking=False)
    ckpt.wait()
    ckpt.save({"n": 2}, step=2)  # blocking: not a background save
    refused = ckpt.save({"fn": lambda: 1}, step=3, blocking=False)  # refused before writing
    assert refused.done()
    with pytest.raises(CheckpointError, match="cannot be pickled"):
        ckpt.wait()
    assert background_saves() - before == 1


def _held_handle(tmp_path: Path) -> SaveHandle:
    """A background write that a thread (native id 777) holds until the test finishes it."""
    handle = SaveHandle(5, tmp_path / "step-000000005.pt", "thread")
    handle._thread_id = 777
    return handle


def _still_waiting(err: str) -> list[str]:
    return [line for line in err.splitlines() if "still waiting" in line]


def test_a_handle_wait_without_timeout_says_it_still_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # handle.wait() waited in silence for a stuck writer; the Checkpointer's waits say so.
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 0.05)
    monkeypatch.setattr(notice_module, "NOTICE_EVERY_S", 10.0)
    handle = _held_handle(tmp_path)
    threading.Timer(0.4, handle._finish, args=(None, [])).start()
    assert handle.wait() is True
    (line,) = _still_waiting(capsys.readouterr().err)  # once per interval, not busy
    assert line.startswith("trainperf: still waiting for the background save of step 5 to ")
    assert str(tmp_path / "step-000000005.pt") in line and "native id 777" in line


def test_a_handle_wait_with_a_timeout_says_it_still_waits_and_gives_up_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 0.05)
    monkeypatch.setattr(notice_module, "NOTICE_EVERY_S", 10.0)
    handle = _held_handle(tmp_path)
    assert handle.wait(timeout=0.3) is False
    assert not handle.done()
    (line,) = _still_waiting(capsys.readouterr().err)
    assert "step 5" in line
    handle._finish(None, [])
    assert handle.wait(timeout=0.3) is True


def test_a_handle_wait_tells_hang_detection_it_is_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Checkpointer's own waits told the DDP hang detection the rank was busy saving;
    # handle.wait() did not, and a rank blocked in it could be reported as hung.
    told: list[str] = []

    @contextlib.contextmanager
    def busy(what: str) -> Iterator[None]:
        told.append(what)
        yield

    monkeypatch.setitem(sys.modules, "trainperf.ddp._progress", types.SimpleNamespace(busy=busy))
    handle = _held_handle(tmp_path)
    handle._finish(None, [])
    assert handle.wait() is True
    assert told == [f"saving checkpoint {tmp_path / 'step-000000005.pt'}"]


def test_a_handle_wait_shorter_than_the_first_notice_prints_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 10.0)
    assert _held_handle(tmp_path).wait(timeout=0.1) is False
    assert _still_waiting(capsys.readouterr().err) == []


@pytest.mark.parametrize("done", [False, True], ids=["in-flight", "finished"])
def test_a_handle_wait_with_a_nan_timeout_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, done: bool
) -> None:
    # It waited forever (min(notice_at, nan) is notice_at; waited >= nan is never true);
    # threading.Event.wait(nan), which it replaced, does not wait.
    monkeypatch.setattr(notice_module, "FIRST_NOTICE_S", 0.05)
    handle = _held_handle(tmp_path)
    if done:
        handle._finish(None, [])
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(handle.wait(float("nan"))), daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    try:
        assert not waiter.is_alive() and result == [done]
    finally:
        handle._finish(None, [])  # lets a waiter that hung return
