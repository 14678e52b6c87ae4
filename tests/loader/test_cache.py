"""trainperf.loader._cache: a second call returns at once; cache=False; corrupt file rewritten."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from trainperf.limits import HostLimits, host_limits
from trainperf.loader import _tune as tune_mod
from trainperf.loader import cache_file, tune_loader
from trainperf.loader._cache import key_fields, make_key, read_entry, write_entry


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class Slowish(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.0005)
        return torch.zeros(3, 8, 8), i % 10


def tune(ds: Any = None, **kw: Any) -> Any:
    # max_workers=0 keeps most of these fast: the cache stores whatever was chosen.
    kw = {"device": "cpu", "max_workers": 0, "budget_s": 8.0, "progress": False, **kw}
    return tune_loader(Slowish() if ds is None else ds, 8, **kw)


def test_cache_file_follows_xdg_and_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_file() == tmp_path / "cache" / "trainperf" / "loader.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_file() == tmp_path / "home" / ".cache" / "trainperf" / "loader.json"


def test_second_call_is_a_cache_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    first = tune(shuffle=True, max_workers=1)
    assert not first.from_cache
    assert cache_file().exists()

    def no_measuring(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cache hit must not measure anything")

    monkeypatch.setattr(tune_mod, "measure", no_measuring)
    second = tune(shuffle=True, max_workers=1)
    assert second.from_cache
    assert second.best_kwargs == first.best_kwargs
    assert second.samples_per_s == first.samples_per_s
    assert [c.num_workers for c in second.candidates] == [c.num_workers for c in first.candidates]
    assert any("cache" in n for n in second.notes)
    assert "from cache" in str(second)


def idle_step(batch: Any) -> None:
    """A training step that does nothing: the main process only takes batches."""


def test_cache_hit_keeps_the_measured_main_process_share() -> None:
    first = tune(step_fn=idle_step)
    assert first.main_cores < 0.5 and first.worker_cpus == first.cpus
    second = tune(step_fn=idle_step)
    assert second.from_cache
    assert (second.main_cores, second.worker_cpus) == (first.main_cores, first.worker_cpus)
    third = tune()  # no step_fn: another key, and one core kept again
    assert not third.from_cache
    assert third.main_cores == 1.0 and third.worker_cpus == max(1, third.cpus - 1)


def test_key_depends_on_batch_size_dataset_and_loader_arguments() -> None:
    tune()
    assert not tune(shuffle=True).from_cache  # a loader argument differs
    ds = TensorDataset(torch.zeros(96, 3, 8, 8))
    assert not tune(ds).from_cache  # another dataset type and sample
    assert not tune_loader(
        Slowish(), 4, device="cpu", max_workers=0, budget_s=5, progress=False
    ).from_cache
    assert tune().from_cache


def test_cache_false_neither_reads_nor_writes() -> None:
    tune()
    assert not tune(cache=False).from_cache
    path = cache_file()
    path.unlink()
    tune(cache=False)
    assert not path.exists()


def test_corrupt_cache_file_is_ignored_and_rewritten() -> None:
    path = cache_file()
    path.parent.mkdir(parents=True)
    path.write_text('{"version": 1, "entries": {"x": ')
    report = tune()
    assert not report.from_cache
    data = json.loads(path.read_text())
    assert data["version"] == 1 and len(data["entries"]) == 1
    assert tune().from_cache


def test_malformed_entry_is_ignored() -> None:
    tune()
    data = json.loads(cache_file().read_text())
    for entry in data["entries"].values():
        entry["candidates"] = [{"no such field": 1}]
    cache_file().write_text(json.dumps(data))
    assert not tune().from_cache


def test_cached_choice_that_no_longer_fits_memory_is_re_tuned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tune()
    data = json.loads(cache_file().read_text())
    for entry in data["entries"].values():
        entry["memory_needed"] = 10**15  # as if measured on a much bigger host
    cache_file().write_text(json.dumps(data))
    assert not tune().from_cache


def test_unwritable_cache_is_a_note_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where a directory must be
    report = tune()
    assert any("could not be cached" in n for n in report.notes)
    with pytest.raises(OSError):
        write_entry("k", {}, cache_file())


class FailsInWorkers(Dataset[torch.Tensor]):
    """Loads in the main process, raises in every worker (a dataset not yet fixed)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("fails in a worker")
        return torch.zeros(4)


def test_a_fallback_forced_by_failing_workers_is_not_cached() -> None:
    with pytest.warns(RuntimeWarning, match="falls back to num_workers=0"):
        first = tune(FailsInWorkers(), max_workers=2, cache=True)
    assert first.num_workers == 0 and any("not cached" in n for n in first.notes)
    with pytest.warns(RuntimeWarning, match="falls back to num_workers=0"):
        second = tune(FailsInWorkers(), max_workers=2, cache=True)
    assert not second.from_cache  # tuned again: the warning is not lost behind a cache hit


def test_lambdas_nested_functions_and_partials_get_their_own_keys() -> None:
    import functools

    def key(step_fn: Any) -> str:
        fields = key_fields(
            Slowish(), 8, cpus=2, device_type="cpu", max_workers=4, epochs_hint=None,
            step_fn=step_fn, loader_kwargs={},
        )  # fmt: skip
        return make_key(fields)

    def heavy(batch: Any) -> None:
        sum(range(10**5))

    def light(batch: Any) -> None:
        return None

    idle, busy = (lambda batch: None), (lambda batch: sum(range(10**5)))
    keys = {key(idle), key(busy), key(heavy), key(light)}
    keys |= {key(functools.partial(heavy)), key(functools.partial(light))}
    assert len(keys) == 6  # every one of them a different step, so a different cache entry
    assert key(idle) == key(idle)  # and the same step keeps its key


def test_key_fields_and_first_sample_failure() -> None:
    fields = key_fields(
        Slowish(),
        8,
        cpus=2,
        device_type="cpu",
        max_workers=4,
        epochs_hint=3,
        step_fn=len,
        loader_kwargs={"collate_fn": len, "generator": object()},
    )
    assert fields["sample"] == ["tuple", [["tensor", [3, 8, 8], "torch.float32"], "int"]]
    assert fields["loader"] == {"collate_fn": "builtins.len"}  # generator is not part of it
    assert fields["step_fn"] == "builtins.len"
    assert make_key(fields) == make_key(dict(fields))

    class Broken(Dataset[int]):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> int:
            raise OSError("disk gone")

    with pytest.raises(RuntimeError, match=r"first sample.*disk gone"):
        tune_loader(Broken(), 1, device="cpu", progress=False)


def test_read_entry_of_wrong_version(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"version": 999, "entries": {"k": {"a": 1}}}))
    assert read_entry("k", p) is None
    write_entry("k", {"a": 2}, p)
    assert read_entry("k", p) == {"a": 2, "created": pytest.approx(time.time(), abs=60)}


def test_limits_in_report_are_current_on_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    tune()
    real = host_limits()
    fake = HostLimits(**{**real.__dict__, "shm_free": real.shm_free})
    monkeypatch.setattr(tune_mod, "host_limits", lambda: fake)
    assert tune().limits is fake


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_write_entry_is_atomic_and_removes_stale_temps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "new" / "dir" / "loader.json"
    write_entry("k", {"num_workers": 1}, p)  # missing directories are created
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    stale = p.parent / f".loader.json.tmp-{host}-{_dead_pid()}-0123abcd"
    stale.write_text("half a file from a killed writer")
    live = p.parent / f".loader.json.tmp-{host}-{os.getppid()}-0123abcd"
    live.write_text("another process is still writing")
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_IFMT(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_entry("j", {"num_workers": 2}, p)
    monkeypatch.undo()
    assert synced == [stat.S_IFREG, stat.S_IFDIR]  # the file, then its directory entry
    assert not stale.exists() and live.exists()
    assert read_entry("j", p)["num_workers"] == 2  # type: ignore[index]
    assert read_entry("k", p)["num_workers"] == 1  # type: ignore[index]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "loader.json"
    write_entry("k", {"num_workers": 1}, p)
    before = p.read_bytes()

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left on device"):
        write_entry("j", {"num_workers": 2}, p)
    monkeypatch.undo()
    assert p.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == ["loader.json"]


def test_write_entry_to_a_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory, not a file name"):
        write_entry("k", {}, tmp_path)
