"""trainperf.loader._cache: the file's place, its keys, atomic writes, corrupt files."""

from __future__ import annotations

import doctest
import errno
import fcntl
import json
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, TensorDataset, random_split

from tests.loader._fakes import Slowish
from tests.loader._fakes import tune_for_cache as tune
from trainperf._utils.atomic import temp_name
from trainperf.loader import cache_file, tune_loader
from trainperf.loader._cache import key_fields, make_key, read_entry, write_entry


def test_cache_file_follows_xdg_and_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_file() == tmp_path / "cache" / "trainperf" / "loader.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_file() == tmp_path / "home" / ".cache" / "trainperf" / "loader.json"


def test_cache_files_example_leaves_the_environment_as_it_found_it() -> None:
    # The doctest runs in the same process as every other doctest and test: a variable it
    # set and left would move their cache to /tmp/xdg.
    before = dict(os.environ)
    (example,) = doctest.DocTestFinder().find(cache_file)
    runner = doctest.DocTestRunner()
    runner.run(example, out=lambda _: None)
    assert runner.summarize(verbose=False) == (0, len(example.examples))
    assert dict(os.environ) == before


@pytest.mark.slow  # about 3-4 s: five tuning runs
def test_key_depends_on_batch_size_dataset_and_loader_arguments() -> None:
    tune()
    assert not tune(shuffle=True).from_cache  # a loader argument differs
    ds = TensorDataset(torch.zeros(96, 3, 8, 8))
    assert not tune(ds).from_cache  # another dataset type and sample
    assert not tune_loader(
        Slowish(), 4, device="cpu", max_workers=0, budget_s=5, progress=False
    ).from_cache
    assert tune().from_cache


class _Other(Dataset[torch.Tensor]):
    """Another dataset of the same length and samples as a TensorDataset of zeros."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(4)


def test_the_key_holds_the_datasets_a_subset_or_concat_wraps() -> None:
    def fields(ds: Any) -> dict[str, Any]:
        return key_fields(ds, 4, cpus=2, device_type="cpu", max_workers=8, epochs_hint=None,
                          step_fn=None, loader_kwargs={})  # fmt: skip

    plain = TensorDataset(torch.zeros(96, 4))
    a, _ = random_split(plain, [48, 48])
    b, _ = random_split(_Other(), [48, 48])
    assert fields(a)["dataset"] != fields(b)["dataset"]  # both Subsets: their data differs
    assert make_key(fields(a)) != make_key(fields(b))
    concat = fields(ConcatDataset([plain, _Other()]))["dataset"]
    assert concat[1] == [fields(plain)["dataset"], fields(_Other())["dataset"]]


def test_corrupt_cache_file_is_ignored_and_rewritten() -> None:
    path = cache_file()
    path.parent.mkdir(parents=True)
    path.write_text('{"version": 1, "entries": {"x": ')
    report = tune()
    assert not report.from_cache
    data = json.loads(path.read_text())
    assert data["version"] == 1 and len(data["entries"]) == 1
    assert tune().from_cache


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


def test_write_entry_is_atomic_and_removes_stale_temps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "new" / "dir" / "loader.json"
    write_entry("k", {"num_workers": 1}, p)  # missing directories are created
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    # Slot 0: a live writer (it holds the lock); slots 1 and 2: killed writers' (no lock).
    live = temp_name(p, host, 0)
    live.write_text("another process is still writing")
    stale = [temp_name(p, host, 1), temp_name(p, host, 2)]
    for s in stale:
        s.write_text("half a file from a killed writer")
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: conflicts even in this process
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_IFMT(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        write_entry("j", {"num_workers": 2}, p)
    finally:
        os.close(holder)
    monkeypatch.undo()
    assert synced == [stat.S_IFREG, stat.S_IFDIR]  # the file, then its directory entry
    assert not any(s.exists() for s in stale)
    assert live.read_text() == "another process is still writing"
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


def test_numpy_numbers_hit_the_entry_of_the_python_ones() -> None:
    # Before: np.int64(8) failed in DataLoader; a NumPy max_workers made a key json.dumps
    # refused. The same numbers are the same call, whichever type holds them.
    assert not tune().from_cache
    again = tune_loader(
        Slowish(),
        np.int64(8),
        device="cpu",
        max_workers=np.int64(0),
        budget_s=np.float64(8.0),
        progress=False,
    )
    assert again.from_cache
    assert (type(again.batch_size), type(again.max_workers)) == (int, int)
