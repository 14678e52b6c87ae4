"""Tests for trainperf.checkpoint: atomic saves under faults, safe and diagnosable loads,
prefix handling for DataParallel / DDP / torch.compile, and the GPU-saved fixtures."""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
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
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainperf._utils.imports
from trainperf.checkpoint import (
    LoadResult,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
    strip_prefix,
    unwrap_model,
)
from trainperf.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DeviceError,
    NotACheckpointError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gpu_checkpoints"
GPU_FILES = ["cuda_state_dict.pt", "cuda_ddp_state_dict.pt", "cuda_compiled_state_dict.pt"]


class Net(nn.Module):
    """The architecture the GPU fixtures were saved from."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def temps(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if ".tmp-" in p.name)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        # On a GPU machine DataParallel moves the module to cuda:0; compare values on the CPU.
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """A checkpoint already on disk that failed saves must leave alone."""
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"gen": 0, "w": torch.arange(4.0)}, path)
    return path


def assert_old_intact(path: Path) -> None:
    loaded = load_checkpoint(path)
    assert loaded["gen"] == 0 and torch.equal(loaded["w"], torch.arange(4.0))
    assert temps(path.parent) == []


# --------------------------------------------------------------------------- save


def test_save_round_trip_accepts_str_and_pathlike_and_returns_path(tmp_path: Path) -> None:
    obj = {"step": 3, "w": torch.randn(3, 2), "names": ["a", "b"]}
    for target in (str(tmp_path / "a.pt"), tmp_path / "b.pt"):
        out = save_checkpoint(obj, target)
        assert out == Path(target) and isinstance(out, Path)
        loaded = load_checkpoint(out)
        assert loaded["step"] == 3 and loaded["names"] == ["a", "b"]
        assert torch.equal(loaded["w"], obj["w"])
    assert temps(tmp_path) == []


def test_save_replaces_existing_file(old: Path) -> None:
    save_checkpoint({"gen": 1}, old)
    assert load_checkpoint(old) == {"gen": 1}
    assert temps(old.parent) == []


def test_save_creates_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "exp1" / "last.pt"
    save_checkpoint({"x": 1}, path)
    assert load_checkpoint(path) == {"x": 1}


def test_save_to_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"is a directory; give a file path such as"):
        save_checkpoint({"x": 1}, tmp_path)


def test_save_module_saves_unwrapped_state_dict(tmp_path: Path) -> None:
    net = Net()
    for i, wrapped in enumerate(
        [net, nn.DataParallel(net), torch.compile(net), nn.DataParallel(torch.compile(net))]
    ):
        path = save_checkpoint(wrapped, tmp_path / f"m{i}.pt")
        # weights_only=True loads it: a state dict, not a pickled module.
        loaded = load_checkpoint(path)
        assert_same(loaded, net.state_dict())
        assert loaded._metadata[""] == net.state_dict()._metadata[""]


def test_save_dict_of_modules_optimizer_and_prefixed_state_dicts(tmp_path: Path) -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    obj = collections.OrderedDict(
        model=nn.DataParallel(net),
        ema=nn.DataParallel(torch.compile(net)).state_dict(),
        optimizer=opt,
        epoch=7,
    )
    path = save_checkpoint(obj, tmp_path / "all.pt")
    loaded = load_checkpoint(path)
    assert isinstance(loaded, collections.OrderedDict)
    assert list(loaded) == ["model", "ema", "optimizer", "epoch"]
    assert_same(loaded["model"], net.state_dict())
    assert_same(loaded["ema"], net.state_dict())
    assert loaded["ema"]._metadata["bn"] == {"version": 2}
    assert loaded["optimizer"]["param_groups"][0]["momentum"] == 0.9
    assert loaded["epoch"] == 7
    assert isinstance(obj["model"], nn.DataParallel)  # the caller's dict is not modified


def test_save_strips_prefixes_of_a_top_level_state_dict(tmp_path: Path) -> None:
    sd = nn.DataParallel(Net()).state_dict()
    loaded = load_checkpoint(save_checkpoint(sd, tmp_path / "s.pt"))
    assert list(loaded) == [k.removeprefix("module.") for k in sd]


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
    assert leftover.name.startswith(".ckpt.pt.tmp-") and leftover.name.split("-")[-2] == str(
        proc.pid
    )
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
    # Named as save_checkpoint names them: .NAME.tmp-HOST-PID-RANDOM (HOST sanitised).
    host_pid = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) + f"-{os.getppid()}"
    live = tmp_path / f".c.pt.tmp-{host_pid}-0123abcd"
    other_host = tmp_path / ".c.pt.tmp-elsewhere-999999999-0123abcd"
    live.write_bytes(b"in progress")
    other_host.write_bytes(b"in progress")
    save_checkpoint({"x": 1}, path)
    assert live.exists() and other_host.exists()


# ---------------------------------------------------------------------- distributed


def test_save_under_one_rank_gloo_group_unwraps_ddp(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        net = Net()
        ddp = nn.parallel.DistributedDataParallel(net)
        path = save_checkpoint({"model": ddp}, tmp_path / "ddp.pt")
        assert_same(load_checkpoint(path)["model"], net.state_dict())
        fresh = nn.parallel.DistributedDataParallel(Net())
        assert load_state_dict(fresh, ddp.state_dict()).complete
        assert_same(unwrap_model(fresh).state_dict(), net.state_dict())
    finally:
        dist.destroy_process_group()


TWO_RANKS = textwrap.dedent(
    """
    import json, sys, datetime, torch, torch.distributed as dist
    from pathlib import Path
    from trainperf.checkpoint import save_checkpoint, load_checkpoint
    from trainperf.errors import CheckpointError

    rank, tmp = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", init_method=(tmp / "store").as_uri(), rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    out = {}
    try:
        # Rank 1's object cannot be pickled: if rank 1 tried to write, it would raise.
        good = {"w": torch.full((3,), 7.0)} if rank == 0 else {"f": lambda: 0}
        save_checkpoint(good, tmp / "dist.pt")
        out["exists_on_return"] = (tmp / "dist.pt").exists()
        out["loaded"] = load_checkpoint(tmp / "dist.pt")["w"].tolist()
        bad = {"f": lambda: 0} if rank == 0 else {"w": torch.ones(1)}
        try:
            save_checkpoint(bad, tmp / "bad.pt")
            out["bad"] = "returned"
        except CheckpointError as e:
            out["bad"] = str(e)
        out["bad_exists"] = (tmp / "bad.pt").exists()
        save_checkpoint({"rank": rank}, tmp / f"own{rank}.pt", distributed=False)
    finally:
        dist.destroy_process_group()
    (tmp / f"result{rank}.json").write_text(json.dumps(out))
    """
)


def test_two_ranks_only_rank0_writes_and_failures_reach_every_rank(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(rank), str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    try:
        errs = [p.communicate(timeout=60)[1].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], errs
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2))
    assert r0["exists_on_return"] and r1["exists_on_return"]
    assert r0["loaded"] == r1["loaded"] == [7.0, 7.0, 7.0]
    assert "could not be serialised" in r0["bad"]
    assert r1["bad"].startswith("rank 0 could not save checkpoint") and "lambda" in r1["bad"]
    assert not r0["bad_exists"] and not r1["bad_exists"]
    assert load_checkpoint(tmp_path / "own1.pt") == {"rank": 1}
    assert temps(tmp_path) == []


# ---------------------------------------------------------------------------- load


@pytest.mark.parametrize("name", GPU_FILES)
@pytest.mark.parametrize("device", ["cpu", "auto", torch.device("cpu")])
def test_gpu_saved_fixtures_load_on_cpu(name: str, device: Any) -> None:
    from trainperf.device import best_device

    # "auto" is the CPU on a machine without a GPU, which is where these tests run in CI.
    want = best_device().type if device == "auto" else "cpu"
    sd = load_checkpoint(FIXTURES / name, device)
    assert len(sd) == 9
    assert all(t.device.type == want for t in sd.values())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", GPU_FILES)
def test_gpu_saved_fixtures_load_on_cuda(name: str) -> None:
    sd = load_checkpoint(FIXTURES / name, "cuda:0")
    assert all(t.device == torch.device("cuda", 0) for t in sd.values())


@pytest.mark.requires_cuda
def test_cuda_round_trips(tmp_path: Path) -> None:
    net = Net().cuda()
    path = save_checkpoint({"model": nn.DataParallel(net)}, tmp_path / "gpu.pt")
    on_cpu = load_checkpoint(path, "cpu")["model"]
    assert all(t.device.type == "cpu" for t in on_cpu.values())
    on_gpu = load_checkpoint(path, "auto")["model"]
    assert all(t.device.type == "cuda" for t in on_gpu.values())
    assert load_state_dict(torch.compile(Net()), on_gpu).complete
    n = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=rf"only {n} GPU\(s\)"):
        load_checkpoint(path, f"cuda:{n}")
    if trainperf._utils.imports.is_available("safetensors"):
        st = save_checkpoint(net, tmp_path / "gpu.safetensors")
        for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
            loaded = load_checkpoint(st, device)
            assert all(t.device.type == "cuda" for t in loaded.values())


def test_auto_uses_best_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainperf.device

    calls = []

    def fake_best() -> torch.device:
        calls.append(1)
        return torch.device("cpu")

    monkeypatch.setattr(trainperf.device, "best_device", fake_best)
    load_checkpoint(FIXTURES / GPU_FILES[0], "auto")
    assert calls == [1]


def test_cuda_without_cuda_fails_before_reading(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for device in ("cuda", "cuda:1", torch.device("cuda", 0), 0):
        with pytest.raises(DeviceError, match=r"needs CUDA.*device='cpu'"):
            load_checkpoint(tmp_path / "does-not-exist.pt", device)


def test_cuda_index_beyond_visible_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match=r"'cuda:3'.*only 2 GPU\(s\).*cuda:0 to cuda:1"):
        load_checkpoint(tmp_path / "does-not-exist.pt", "cuda:3")


@pytest.mark.parametrize("device", ["gpu", "CPU", "cuda:x", "cuda:", ""])
def test_bad_device_string(device: Any) -> None:
    with pytest.raises(ValueError, match=r"invalid device .*expected 'auto', 'cpu', 'cuda'"):
        load_checkpoint(FIXTURES / GPU_FILES[0], device)


def test_meta_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device 'meta' is not supported here.*'mps'"):
        load_checkpoint(FIXTURES / GPU_FILES[0], "meta")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"nope\.pt does not exist") as info:
        load_checkpoint(tmp_path / "nope.pt")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.path == tmp_path / "nope.pt"


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpointError, match=r"is a directory.*give the checkpoint file"):
        load_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match=r"torch\.distributed\.checkpoint"):
        load_checkpoint(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "e.pt").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match=r"e\.pt is empty \(0 bytes\)"):
        load_checkpoint(tmp_path / "e.pt")


@pytest.fixture
def good_bytes(tmp_path: Path) -> bytes:
    save_checkpoint({"w": torch.randn(100_000), "b": torch.randn(10)}, tmp_path / "good.pt")
    return (tmp_path / "good.pt").read_bytes()


def test_truncated_file(tmp_path: Path, good_bytes: bytes) -> None:
    (tmp_path / "t.pt").write_bytes(good_bytes[: len(good_bytes) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"t\.pt is truncated.*cut short") as info:
        load_checkpoint(tmp_path / "t.pt")
    assert isinstance(info.value.__cause__, zipfile.BadZipFile)


def test_flipped_bytes_in_tensor_data_fail_the_crc(tmp_path: Path, good_bytes: bytes) -> None:
    data = bytearray(good_bytes)
    mid = len(data) // 2  # inside the 400 kB tensor record
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    (tmp_path / "f.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"damaged \(Bad CRC-32.*bytes were changed"):
        load_checkpoint(tmp_path / "f.pt")


def test_zeroed_central_directory(tmp_path: Path, good_bytes: bytes) -> None:
    data = bytearray(good_bytes)
    start, end = data.find(b"PK\x01\x02"), data.rfind(b"PK\x05\x06")
    data[start:end] = bytes(end - start)  # keep the end record, zero the directory
    (tmp_path / "z.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"z\.pt is damaged"):
        load_checkpoint(tmp_path / "z.pt")


def test_files_saved_without_crc_still_load(tmp_path: Path) -> None:
    config = pytest.importorskip("torch.utils.serialization").config
    if not hasattr(config.save, "compute_crc32"):
        pytest.skip("this torch always writes CRC-32s")
    # Not monkeypatch: torch's config proxies do not survive its setattr/undo round trip.
    with config.patch({"save.compute_crc32": False}):
        torch.save({"w": torch.ones(3)}, tmp_path / "nocrc.pt")
    with zipfile.ZipFile(tmp_path / "nocrc.pt") as zf:
        assert {i.CRC for i in zf.infolist()} == {0}
    assert torch.equal(load_checkpoint(tmp_path / "nocrc.pt")["w"], torch.ones(3))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"hello, this is a log file\n", "a text file"),
        (b'  {"lr": 0.1, "epochs": 3}', "JSON text"),
        (b"\x89PNG\r\n\x1a\n" + bytes(range(200)), "a PNG image"),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\n", "git lfs pull"),
        (b"<!DOCTYPE html><html>Access denied</html>", "HTML"),
        (b"\x93NUMPY\x01\x00v\x00{'descr'", "numpy.load"),
        (bytes([0xFE, 0xFE, 0x01, 0x9C]) * 8, "unrecognised binary data"),
    ],
)
def test_not_a_checkpoint(tmp_path: Path, content: bytes, match: str) -> None:
    (tmp_path / "x.pt").write_bytes(content)
    with pytest.raises(NotACheckpointError, match=rf"x\.pt is not a checkpoint: .*{match}"):
        load_checkpoint(tmp_path / "x.pt")


def test_plain_pickle_and_other_zip_are_not_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "p.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with pytest.raises(NotACheckpointError, match=r"Python pickle but not a torch\.save file"):
        load_checkpoint(tmp_path / "p.pkl")
    with zipfile.ZipFile(tmp_path / "docs.zip", "w") as zf:
        zf.writestr("readme.txt", "hi")
    with pytest.raises(NotACheckpointError, match=r"zip archive but not one torch\.save"):
        load_checkpoint(tmp_path / "docs.zip")


def test_legacy_format_loads_and_truncation_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(1000.0)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(1000.0))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"damaged or truncated.*EOF"):
        load_checkpoint(path)


class Payload:
    """Unpickling this would create the marker file: what a malicious checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Payload(marker)}, path)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"weights_only=True refuses.*system.*arbitrary code.*add_safe_globals"
        r".*weights_only=False \(only for files you trust\)",
    ) as info:
        load_checkpoint(path)
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()


@dataclasses.dataclass
class RunConfig:
    lr: float


def test_trusted_classes_load_by_explicit_opt_in(tmp_path: Path) -> None:
    path = tmp_path / "trusted.pt"
    torch.save({"config": RunConfig(0.1), "w": torch.ones(1)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"RunConfig"):
        load_checkpoint(path)
    with torch.serialization.safe_globals([RunConfig]):
        assert load_checkpoint(path)["config"] == RunConfig(0.1)
    assert load_checkpoint(path, weights_only=False)["config"] == RunConfig(0.1)


def test_other_load_failures_are_checkpoint_errors(tmp_path: Path) -> None:
    module = tmp_path / "gone_module.py"
    module.write_text("class Thing:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import gone_module

        torch.save({"t": gone_module.Thing()}, tmp_path / "t.pt")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gone_module", None)
    module.unlink()
    with pytest.raises(CheckpointError, match=r"could not load.*No module named 'gone_module'"):
        load_checkpoint(tmp_path / "t.pt", weights_only=False)


def test_out_of_memory_is_not_rewrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(*args: Any, **kwargs: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "load", oom)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        load_checkpoint(FIXTURES / GPU_FILES[0])


# --------------------------------------------------------------------- safetensors


def test_safetensors_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    sd = {"a": torch.randn(3, 4), "b": torch.arange(5), "t": torch.randn(4, 3).t()}
    path = save_checkpoint(sd, tmp_path / "w.safetensors")
    assert path.read_bytes()[8:9] == b"{"
    loaded = load_checkpoint(path)
    assert_same(dict(sorted(loaded.items())), sd)  # safetensors stores keys sorted
    net = Net()
    loaded = load_checkpoint(save_checkpoint(nn.DataParallel(net), tmp_path / "m.safetensors"))
    assert load_state_dict(Net(), loaded).complete
    assert set(loaded) == set(net.state_dict())
    # The content decides the reader, not the name.
    (tmp_path / "m.safetensors").rename(tmp_path / "m.bin")
    assert set(load_checkpoint(tmp_path / "m.bin")) == set(net.state_dict())
    assert temps(tmp_path) == []


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"model": {"w": torch.ones(1)}}, r"key 'model' \(dict\) is not a tensor"),
        ({"w": torch.ones(1), "epoch": 3}, r"key 'epoch' \(int\) is not a tensor"),
        ([torch.ones(1)], r"the whole object is not a tensor \(list given\)"),
    ],
)
def test_safetensors_needs_a_flat_tensor_dict(tmp_path: Path, obj: Any, match: str) -> None:
    pytest.importorskip("safetensors")
    with pytest.raises(ValueError, match=match + r".*everything else .* to a \.pt file"):
        save_checkpoint(obj, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_safetensors_with_tied_weights_names_them_and_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    net = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    net[1].weight = net[0].weight  # tied input and output embeddings
    with pytest.raises(
        ValueError, match=r"share memory .*\['0\.weight', '1\.weight'\].*save to a \.pt file"
    ):
        save_checkpoint(net.state_dict(), tmp_path / "tied.safetensors")
    assert list(tmp_path.iterdir()) == []
    untied = {k: v.clone() for k, v in net.state_dict().items()}
    assert save_checkpoint(untied, tmp_path / "tied.safetensors").exists()


def test_truncated_safetensors(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    path = save_checkpoint({"w": torch.randn(1000)}, tmp_path / "w.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointCorruptError, match=r"safetensors checkpoint .* truncated"):
        load_checkpoint(path)


def test_missing_safetensors_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("safetensors")
    path = save_checkpoint({"w": torch.ones(1)}, tmp_path / "w.safetensors")
    monkeypatch.setattr(trainperf._utils.imports, "is_available", lambda name: False)
    with pytest.raises(ModuleNotFoundError, match=r"save_checkpoint.*trainperf\[safetensors\]"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "v.safetensors")
    with pytest.raises(ModuleNotFoundError, match=r"load_checkpoint.*trainperf\[safetensors\]"):
        load_checkpoint(path)


# -------------------------------------------------------------------- strip_prefix


def test_strip_prefix_any_combination_and_order() -> None:
    sd = {
        "module._orig_mod.a": 1,
        "_orig_mod.module.b": 2,
        "module.module.c": 3,
        "d": 4,
        "modules.e": 5,
    }
    out = strip_prefix(sd)
    assert out == {"a": 1, "b": 2, "c": 3, "d": 4, "modules.e": 5}
    assert list(sd) == [
        "module._orig_mod.a",
        "_orig_mod.module.b",
        "module.module.c",
        "d",
        "modules.e",
    ]
    assert strip_prefix({"backbone.x": 1}, "backbone.") == {"x": 1}
    assert strip_prefix({"module.": 1}) == {"module.": 1}  # nothing would be left
    assert strip_prefix({"module": 1, "_orig_mod": 2}) == {"module": 1, "_orig_mod": 2}


def test_strip_prefix_keeps_type_and_metadata() -> None:
    sd = load_checkpoint(FIXTURES / "cuda_ddp_state_dict.pt")
    out = strip_prefix(sd)
    assert type(out) is collections.OrderedDict
    assert list(out) == list(Net().state_dict())
    assert dict(out._metadata) == {
        "": {"version": 1},
        "conv": {"version": 1},
        "bn": {"version": 2},
        "fc": {"version": 1},
    }
    assert "module" in sd._metadata  # the input is untouched


def test_strip_prefix_collision() -> None:
    with pytest.raises(ValueError, match=r"'fc.w' and 'module.fc.w' both become 'fc.w'"):
        strip_prefix({"fc.w": 1, "module.fc.w": 2})


@pytest.mark.parametrize("prefixes", [("",), (), ("module.", "")])
def test_strip_prefix_rejects_empty_prefixes(prefixes: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="prefixes must be non-empty strings"):
        strip_prefix({"a": 1}, prefixes)


# ------------------------------------------------------------------ load_state_dict


def wrappings(net: nn.Module) -> dict[str, nn.Module]:
    return {
        "plain": net,
        "dataparallel": nn.DataParallel(net),
        "compiled": torch.compile(net),
        "compiled-dataparallel": torch.compile(nn.DataParallel(net)),
        "dataparallel-compiled": nn.DataParallel(torch.compile(net)),
    }


@pytest.mark.parametrize("name", GPU_FILES)
@pytest.mark.parametrize(
    "wrap", ["plain", "dataparallel", "compiled", "compiled-dataparallel", "dataparallel-compiled"]
)
def test_fixtures_load_into_any_wrapping(name: str, wrap: str) -> None:
    sd = load_checkpoint(FIXTURES / name)
    net = Net()
    model = wrappings(net)[wrap]
    result = load_state_dict(model, sd)
    assert result == LoadResult() and result.complete
    assert_same(net.state_dict(), strip_prefix(sd))
    assert unwrap_model(model) is net


def test_unwrap_model() -> None:
    net = Net()
    for wrapped in wrappings(net).values():
        assert unwrap_model(wrapped) is net
    with pytest.raises(TypeError, match=r"unwrap_model expects an nn\.Module, got dict"):
        unwrap_model({})  # type: ignore[arg-type]


def test_submodule_really_named_module_is_not_overstripped() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    src = Holder()
    for sd in (src.state_dict(), nn.DataParallel(src).state_dict()):
        dst = Holder()
        assert load_state_dict(dst, sd).complete
        assert torch.equal(dst.module.weight.cpu(), src.module.weight.cpu())


def test_mismatch_reports_missing_unexpected_and_shapes_together() -> None:
    sd = strip_prefix(load_checkpoint(FIXTURES / "cuda_ddp_state_dict.pt"))
    sd["extra.weight"] = torch.ones(1)
    del sd["bn.running_var"]
    model = nn.DataParallel(Net(classes=5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictMismatchError) as info:
        load_state_dict(model, sd)
    err = info.value
    assert err.missing == ["bn.running_var"]
    assert err.unexpected == ["extra.weight"]
    assert err.mismatched == [("fc.weight", (10, 8), (5, 8)), ("fc.bias", (10,), (5,))]
    text = str(err)
    assert "does not fit Net" in text
    assert "1 missing key(s) (in the model, not the state dict): bn.running_var" in text
    assert "1 unexpected key(s) (in the state dict, not the model): extra.weight" in text
    assert "2 shape mismatch(es): fc.weight checkpoint (10, 8) vs model (5, 8)" in text
    assert "strict=False" in text
    assert_same(model.state_dict(), before)  # nothing was loaded


def test_mismatch_lists_at_most_ten_names() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(12)])
    with pytest.raises(StateDictMismatchError, match=r"24 missing key\(s\).*\.\.\.and 14 more"):
        load_state_dict(model, {})


def test_whole_checkpoint_passed_as_state_dict_gets_a_hint() -> None:
    ckpt = {"model": Net().state_dict(), "epoch": 1}
    with pytest.raises(StateDictMismatchError, match=r"looks like a whole checkpoint.*\['model'\]"):
        load_state_dict(Net(), ckpt)


def test_strict_false_loads_what_fits() -> None:
    src = load_checkpoint(FIXTURES / "cuda_compiled_state_dict.pt")
    src["extra.weight"] = torch.ones(1)
    del src["_orig_mod.bn.running_var"]
    net = Net(classes=5)
    fc_before = net.fc.weight.clone()
    result = load_state_dict(torch.compile(net), src, strict=False)
    assert result == LoadResult(
        missing=("bn.running_var",),
        unexpected=("extra.weight",),
        mismatched=(("fc.weight", (10, 8), (5, 8)), ("fc.bias", (10,), (5,))),
    )
    assert not result.complete
    assert torch.equal(net.conv.weight, src["_orig_mod.conv.weight"])
    assert torch.equal(net.fc.weight, fc_before)
    with pytest.raises(AttributeError):
        result.missing = ()  # type: ignore[misc]


def test_load_state_dict_needs_a_mapping() -> None:
    with pytest.raises(TypeError, match=r"state_dict must be a mapping.*got list"):
        load_state_dict(Net(), [1, 2])  # type: ignore[arg-type]
