"""trainperf.ddp._rundir: a run directory is removed only when its launcher is certainly gone."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from trainperf.ddp import _rundir
from trainperf.ddp._rundir import ORPHAN_AGE_S, Owner, process_start, remove_stale, stale

ME = Owner(10, 500, "boot-a", "pid:[1]", "node1", 2000.0)
BOOT = 1000.0  # this boot began at t=1000


def _judge(owner: Owner | None, start: int | None = None, age_s: float = 60.0) -> bool:
    return stale(owner, ME, lambda pid: start, boot_time=BOOT, age_s=age_s)


def test_a_launcher_of_this_namespace_is_gone_when_its_pid_is_or_was_reused() -> None:
    owner = dataclasses.replace(ME, pid=42, start=300)
    assert _judge(owner, start=None)  # no such process
    assert _judge(owner, start=301)  # the pid now belongs to a younger process
    assert not _judge(owner, start=300)  # alive


def test_what_cannot_be_seen_from_here_is_left_alone() -> None:
    assert not _judge(dataclasses.replace(ME, pid=42, pid_ns="pid:[2]"))  # another container
    assert not _judge(dataclasses.replace(ME, pid=42, host="node2"))  # another machine
    assert not _judge(dataclasses.replace(ME, pid=42, start=0))  # start time unknown
    assert not _judge(dataclasses.replace(ME, pid=42, boot_id=""))


def test_another_boot_id_is_stale_only_when_made_before_this_boot() -> None:
    earlier = dataclasses.replace(ME, boot_id="boot-0", created=BOOT - 5)
    assert _judge(earlier, start=500)  # an earlier boot of this host: long gone
    since = dataclasses.replace(ME, boot_id="boot-b", created=BOOT + 5)
    assert not _judge(since)  # made since this boot by another kernel: another machine


def test_a_directory_without_an_owner_record_goes_after_a_day() -> None:
    assert not _judge(None, age_s=3600.0)
    assert _judge(None, age_s=ORPHAN_AGE_S + 1)


def test_the_start_time_is_field_22_even_with_parentheses_in_the_name(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    fields = " ".join(str(i) for i in range(3, 53))  # fields 3.. as their own numbers
    (tmp_path / "77" / "stat").write_text(f"77 (a) b (c) {fields}\n")
    assert process_start(77, proc=str(tmp_path)) == 22
    assert process_start(78, proc=str(tmp_path)) is None
    assert process_start(os.getpid()) == process_start(os.getpid()) is not None


def test_only_this_user_s_real_directories_are_looked_at(tmp_path: Path) -> None:
    made = _rundir.create(str(tmp_path))
    record = json.loads((made / _rundir.OWNER_FILE).read_text())
    assert record["pid"] == os.getpid() and record["start"] == process_start(os.getpid())
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / _rundir.OWNER_FILE).write_text(json.dumps({**record, "pid": 2**22 + 1}))
    link = tmp_path / f"{_rundir.PREFIX}link"
    link.symlink_to(target)
    assert remove_stale(str(tmp_path)) == []  # ours is alive; a link is never followed
    assert made.exists() and link.exists() and target.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make another user's directory")
def test_another_user_s_directory_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / f"{_rundir.PREFIX}1-x"
    path.mkdir()
    record = {**dataclasses.asdict(_rundir.this_process()), "pid": 2**22 + 1}
    (path / _rundir.OWNER_FILE).write_text(json.dumps(record))
    os.chown(path, 12345, 12345)
    assert remove_stale(str(tmp_path)) == [] and path.exists()
    os.chown(path, 0, 0)
    assert remove_stale(str(tmp_path)) == [path] and not path.exists()


_HOLDER = """\
import json, sys, time
from pathlib import Path
from trainperf.ddp import _rundir
path = _rundir.create(sys.argv[1])
record = json.loads((path / _rundir.OWNER_FILE).read_text())
# As seen from another container on this kernel: its pid and pid namespace mean nothing here.
record.update(pid=2**22 + 1, pid_ns="pid:[999999]", host="another-container")
(path / _rundir.OWNER_FILE).write_text(json.dumps(record))  # same file: the lock stays
print(path, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_locked_directory_is_never_removed_and_an_unlocked_one_is(tmp_path: Path) -> None:
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        path = Path(holder.stdout.readline().strip())
        assert path.parent == tmp_path and path.is_dir()
        # Its lock is held: left alone, even though its record's pid does not exist.
        assert remove_stale(str(tmp_path)) == [] and path.exists()
        holder.kill()
        holder.wait(30)
        # Its holder died (another pid namespace, another host name, same kernel): removed.
        assert remove_stale(str(tmp_path)) == [path] and not path.exists()
    finally:
        holder.kill()
        holder.wait(30)
        if holder.stdout is not None:
            holder.stdout.close()


def test_a_held_lock_overrides_every_other_rule() -> None:
    # The pid is gone, and there is no record at all: a held lock still says alive.
    dead = dataclasses.replace(ME, pid=42, start=300, locked=True)
    assert not stale(dead, ME, lambda pid: None, boot_time=BOOT, age_s=60.0, unlocked=False)
    assert not stale(None, ME, lambda pid: None, boot_time=BOOT, age_s=1e9, unlocked=False)
    # A free lock on a record that says it was locked, from this kernel: gone, in any pid
    # namespace or under any host name. Not from another kernel (another boot id).
    other = dataclasses.replace(dead, pid_ns="pid:[2]", host="node2")
    assert stale(other, ME, lambda pid: 300, boot_time=BOOT, age_s=60.0)
    assert not stale(
        dataclasses.replace(other, boot_id="boot-b", created=BOOT + 5),
        ME,
        lambda pid: 300,
        boot_time=BOOT,
        age_s=60.0,
    )
    # An older record (no lock was ever held): the pid rules as before.
    assert not stale(
        dataclasses.replace(other, locked=False), ME, lambda pid: 300, boot_time=BOOT, age_s=60.0
    )


def test_create_locks_the_record_and_release_drops_the_lock(tmp_path: Path) -> None:
    made = _rundir.create(str(tmp_path))
    assert not _rundir._unlocked(made)  # held by this process (another open file)
    assert remove_stale(str(tmp_path)) == [] and made.exists()
    _rundir.release(made)
    assert _rundir._unlocked(made)
    assert remove_stale(str(tmp_path)) == [made] and not made.exists()
