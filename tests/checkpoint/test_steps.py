"""trainperf.checkpoint._steps: step file names that sort, retention that never deletes the
newest, and dead writers' temp files removed by name and lock."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import torch

from trainperf._utils.atomic import temp_name
from trainperf.checkpoint._steps import (
    main_file,
    not_a_step_file,
    pinned,
    rank_file,
    remove_dead_temps,
    retire,
    steps_on_disk,
    this_host,
    to_retire,
)


def _step_file(directory: Path, step: int, **kw: object) -> Path:
    """A file of step ``step`` as Checkpointer.save writes it (the part retention reads)."""
    path = main_file(directory, step)
    torch.save({"w": torch.ones(2), "trainperf": {"step": step}}, path, **kw)  # type: ignore[arg-type]
    return path


def test_names_sort_by_step_as_ls_does(tmp_path: Path) -> None:
    steps = [7, 30, 100, 1_000_000, 5]
    names = [main_file(tmp_path, s).name for s in steps]
    names += [rank_file(tmp_path, s, 1).name for s in steps]
    by_name = sorted(names)
    assert by_name[:4] == [
        "step-000000005.pt",
        "step-000000005.rank-00001.pt",
        "step-000000007.pt",
        "step-000000007.rank-00001.pt",
    ]
    assert by_name[-2] == "step-001000000.pt"


def test_steps_on_disk_reads_only_main_files(tmp_path: Path) -> None:
    for s in (30, 10, 20):
        main_file(tmp_path, s).write_bytes(b"x")
    rank_file(tmp_path, 40, 1).write_bytes(b"x")  # a rank's part alone is no checkpoint
    (tmp_path / ".step-000000050.pt.tmp-host-0").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("mine")
    main_file(tmp_path, 12_345_678_901).write_bytes(b"x")  # past nine digits: still a step
    assert steps_on_disk(tmp_path) == [10, 20, 30, 12_345_678_901]
    assert steps_on_disk(tmp_path / "missing") == []


def test_to_retire_keeps_the_newest_and_the_one_just_written() -> None:
    assert to_retire([10, 20, 30], keep=3, protect=30) == []
    assert to_retire([10, 20, 30, 40], keep=2, protect=40) == [10, 20]
    # A run restarted from scratch writes step 20 beside an old step 300: 20 stays, and
    # nothing above the protected step is taken for "older".
    assert to_retire([10, 20, 300], keep=1, protect=20) == [10]


def test_retire_deletes_old_steps_with_their_rank_files(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        _step_file(tmp_path, s)
        rank_file(tmp_path, s, 1).write_bytes(b"r")
    rank_file(tmp_path, 5, 2).write_bytes(b"r")  # a rank's part whose main file never came
    rank_file(tmp_path, 40, 1).write_bytes(b"r")  # a rank ahead of rank 0's write: kept
    main_file(tmp_path, 25).write_bytes(b"not an archive")  # neither counted nor deleted
    (tmp_path / "mine.txt").write_text("not ours")
    assert retire(tmp_path, keep=2, protect=30) == []
    assert sorted(os.listdir(tmp_path)) == [
        "mine.txt",
        "step-000000020.pt",
        "step-000000020.rank-00001.pt",
        "step-000000025.pt",
        "step-000000030.pt",
        "step-000000030.rank-00001.pt",
        "step-000000040.rank-00001.pt",
    ]


def test_retire_keeps_a_write_protected_step_without_counting_it(tmp_path: Path) -> None:
    # chmod a-w is how a user keeps a step (a best model) that keep= would delete.
    for s in (10, 20, 30, 40):
        _step_file(tmp_path, s)
        rank_file(tmp_path, s, 1).write_bytes(b"r")
    main_file(tmp_path, 10).chmod(0o444)
    main_file(tmp_path, 30).chmod(0o444)
    assert retire(tmp_path, keep=1, protect=40) == []
    assert sorted(os.listdir(tmp_path)) == [
        "step-000000010.pt",
        "step-000000010.rank-00001.pt",
        "step-000000030.pt",
        "step-000000030.rank-00001.pt",
        "step-000000040.pt",
        "step-000000040.rank-00001.pt",
    ]
    assert pinned(main_file(tmp_path, 10)) and not pinned(main_file(tmp_path, 40))
    assert not pinned(main_file(tmp_path, 99))  # missing: not pinned


def test_dead_temps_go_live_and_other_hosts_stay(tmp_path: Path) -> None:
    host = this_host()
    final = main_file(tmp_path, 30)
    dead = temp_name(final, host, 0)
    dead.write_bytes(b"half of a killed save")
    live = temp_name(main_file(tmp_path, 40), host, 0)
    live.write_bytes(b"being written")
    elsewhere = temp_name(final, "otherhost", 0)
    elsewhere.write_bytes(b"another host's writer")
    fd = os.open(live, os.O_WRONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer holds its temp file's lock
        assert remove_dead_temps(tmp_path) == [dead.name]
    finally:
        os.close(fd)
    assert not dead.exists() and live.exists() and elsewhere.exists()


def test_retire_counts_and_deletes_only_files_restore_would_load(tmp_path: Path) -> None:
    # A foreign file above the real steps held a keep= place (so real step 20 went), and one
    # below them was deleted with its rank file: what a user saved must not be lost.
    for s in (10, 20, 30):
        _step_file(tmp_path, s)
    torch.save({"other": "run"}, main_file(tmp_path, 999))
    torch.save({"mine": 1}, main_file(tmp_path, 5))
    rank_file(tmp_path, 5, 1).write_bytes(b"r")
    assert retire(tmp_path, keep=2, protect=30) == []
    assert sorted(os.listdir(tmp_path)) == [
        "step-000000005.pt",
        "step-000000005.rank-00001.pt",
        "step-000000020.pt",
        "step-000000030.pt",
        "step-000000999.pt",
    ]


def test_names_with_extra_leading_zeros_are_not_step_files(tmp_path: Path) -> None:
    # step-0000000050.pt parsed as step 50, whose file is looked up as step-000000050.pt.
    odd = [tmp_path / "step-0000000050.pt", tmp_path / "step-000000060.rank-000001.pt"]
    for path in odd:
        torch.save({"w": torch.ones(1), "trainperf": {"step": 50}}, path)
    _step_file(tmp_path, 1_000_000_000)  # ten digits as main_file writes them: a step
    _step_file(tmp_path, 70)
    _step_file(tmp_path, 80)
    assert steps_on_disk(tmp_path) == [70, 80, 1_000_000_000]
    assert retire(tmp_path, keep=1, protect=80) == []
    assert all(path.exists() for path in odd)
    assert not main_file(tmp_path, 70).exists()


def test_a_step_file_is_what_restore_would_load(tmp_path: Path) -> None:
    assert not_a_step_file(_step_file(tmp_path, 10)) is None
    legacy = _step_file(tmp_path, 20, _use_new_zipfile_serialization=False)
    assert not_a_step_file(legacy) is None  # restore loads it too
    foreign = main_file(tmp_path, 30)
    torch.save({"step": 30}, foreign)
    assert "not written by Checkpointer.save" in (not_a_step_file(foreign) or "")
    cut = main_file(tmp_path, 40)
    cut.write_bytes(legacy.read_bytes()[:40])
    assert not_a_step_file(cut) is not None
    main_file(tmp_path, 50).write_bytes(b"not an archive")
    assert not_a_step_file(main_file(tmp_path, 50)) is not None


def test_a_step_file_under_another_steps_name_is_neither_counted_nor_deleted(
    tmp_path: Path,
) -> None:
    # A copy of step 10's file named step 40 held a keep= place as step 40, so the real
    # step 20 was deleted, and it would itself have been deleted as "step 40" later.
    for s in (10, 20, 30):
        _step_file(tmp_path, s)
    misnamed_copy = main_file(tmp_path, 40)
    misnamed_copy.write_bytes(main_file(tmp_path, 10).read_bytes())
    assert "holds step 10, but its name says step 40" in (not_a_step_file(misnamed_copy) or "")
    assert retire(tmp_path, keep=2, protect=30) == []
    assert steps_on_disk(tmp_path) == [20, 30, 40]
