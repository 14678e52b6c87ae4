"""trainperf._utils.cache: the tuners' shared JSON store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainperf._utils import cache
from trainperf._utils.cache import cache_dir, make_key, read_entry, sample_signature, write_entry


def test_cache_dir_follows_xdg_then_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "trainperf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "trainperf"
    # The XDG spec: a relative path is invalid and ignored (it was used, so the cache moved
    # with the working directory).
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_dir() == tmp_path / "home" / ".cache" / "trainperf"


def test_two_files_in_one_directory_keep_their_own_entries(tmp_path: Path) -> None:
    a, b = tmp_path / "loader.json", tmp_path / "batch_size.json"
    write_entry("k", {"x": 1}, a)
    write_entry("k", {"x": 2}, b)
    assert read_entry("k", a)["x"] == 1  # type: ignore[index]
    assert read_entry("k", b)["x"] == 2  # type: ignore[index]
    assert read_entry("other", a) is None


def test_a_corrupt_or_foreign_file_reads_as_empty_and_is_replaced(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    # A file nested past the JSON reader's recursion limit raised RecursionError, which broke
    # reading and writing the cache for good.
    nested = "[" * 100_000 + "]" * 100_000
    for text in (
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"version": 2, "entries": {}}),
        nested,
    ):
        p.write_text(text)
        assert read_entry("k", p) is None
    write_entry("k", {"x": 3}, p)
    data = json.loads(p.read_text())
    assert data["version"] == 1 and set(data["entries"]) == {"k"}


def test_the_oldest_entries_go_past_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache, "MAX_ENTRIES", 3)
    p = tmp_path / "c.json"
    for i in range(5):
        write_entry(f"k{i}", {"i": i}, p)
    kept = json.loads(p.read_text())["entries"]
    assert sorted(kept) == ["k2", "k3", "k4"]


def test_keys_are_stable_and_depend_on_every_field() -> None:
    key = make_key({"a": 1, "b": [2, 3]})
    assert key == make_key({"b": [2, 3], "a": 1}) and len(key) == 32
    assert key != make_key({"a": 1, "b": [3, 2]})


def test_sample_signature_describes_shapes_and_types_not_values() -> None:
    one = {"x": torch.zeros(2, 3), "y": np.zeros(4, dtype=np.int64), "id": "a"}
    other = {"x": torch.ones(2, 3), "y": np.ones(4, dtype=np.int64), "id": "b"}
    assert sample_signature(one) == sample_signature(other)
    assert sample_signature(one) == {
        "x": ["tensor", [2, 3], "torch.float32"],
        "y": ["ndarray", [4], "int64"],
        "id": "str",
    }
    assert sample_signature(torch.zeros(2, 4)) != sample_signature(torch.zeros(2, 3))


def test_concurrent_writers_keep_each_other_s_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: each writer read the file, added its entry and replaced the file, so one
    # that read before the other wrote dropped the other's entry (two ranks, two jobs).
    import threading

    path = tmp_path / "c.json"
    read_done, go_on = threading.Event(), threading.Event()
    load = cache._load

    def slow_load(p: Path) -> dict[str, object]:
        entries = load(p)
        if threading.current_thread().name == "first":
            read_done.set()
            go_on.wait(10)
        return entries

    monkeypatch.setattr(cache, "_load", slow_load)
    first = threading.Thread(target=write_entry, args=("a", {"x": 1}, path), name="first")
    first.start()
    assert read_done.wait(10)
    second = threading.Thread(target=write_entry, args=("b", {"x": 2}, path), name="second")
    second.start()
    second.join(0.5)  # it waits for the lock the first writer holds
    go_on.set()
    first.join(10)
    second.join(10)
    assert read_entry("a", path) is not None and read_entry("b", path) is not None


def test_a_cache_file_a_umask_made_read_only_is_still_updated(tmp_path: Path) -> None:
    # A umask without the owner's write bit makes the first write's file 0o444: the
    # write-protection refusal meant for checkpoints must not stop every later entry.
    import os

    path = tmp_path / "c.json"
    write_entry("a", {"x": 1}, path)
    os.chmod(path, 0o444)
    write_entry("b", {"x": 2}, path)
    assert read_entry("a", path) is not None and read_entry("b", path) is not None


def test_a_cache_directory_under_a_file_is_named_by_the_atomic_write(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match=str(blocker)):
        write_entry("k", {}, blocker / "trainperf" / "c.json")


def test_the_lock_is_released_even_if_a_process_forked_while_it_was_held(tmp_path: Path) -> None:
    import fcntl
    import os
    import signal

    path = tmp_path / "c.json"
    with cache._locked(path):
        child = os.fork()
        if child == 0:  # holds a copy of the lock's descriptor for a while
            signal.pause()
            os._exit(0)
    try:
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
        finally:
            os.close(fd)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
