"""trainperf.checkpoint._formats: recognising a file from its first bytes, naming why it does
not load (truncated, damaged, not a checkpoint, unsafe pickle)."""

from __future__ import annotations

import dataclasses
import errno
import importlib
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint._common import FIXTURES, GPU_FILES, as_if_from_newer_torch
from trainperf.checkpoint import load_checkpoint, save_checkpoint
from trainperf.errors import (
    CheckpointCorruptError,
    CheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
)


@pytest.fixture
def good_bytes(tmp_path: Path) -> bytes:
    save_checkpoint({"w": torch.randn(100_000), "b": torch.randn(10)}, tmp_path / "good.pt")
    return (tmp_path / "good.pt").read_bytes()


def test_truncated_file(tmp_path: Path, good_bytes: bytes) -> None:
    (tmp_path / "t.pt").write_bytes(good_bytes[: len(good_bytes) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"t\.pt is truncated.*cut short") as info:
        load_checkpoint(tmp_path / "t.pt")
    assert isinstance(info.value.__cause__, zipfile.BadZipFile)


@pytest.mark.parametrize("cut", [1, 10, 19, 21, 22, 100])
def test_a_file_cut_inside_its_end_record_is_truncated(
    tmp_path: Path, good_bytes: bytes, cut: int
) -> None:
    (tmp_path / "t.pt").write_bytes(good_bytes[:-cut])  # the last 22 bytes are the end record
    with pytest.raises(CheckpointCorruptError, match=r"t\.pt is truncated.*cut short"):
        load_checkpoint(tmp_path / "t.pt")


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


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning")
def test_a_torchscript_file_is_not_a_checkpoint_and_names_torch_jit_load(tmp_path: Path) -> None:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "net.pt")
    with pytest.raises(NotACheckpointError, match=r"net\.pt is a TorchScript .*torch\.jit\.load\("):
        load_checkpoint(tmp_path / "net.pt")
    weights = torch.jit.load(tmp_path / "net.pt").state_dict()  # what the message says works
    assert set(weights) == {"weight", "bias"}


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


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_file_pickled_with_protocol_4_names_the_protocol_not_an_allow_list(
    tmp_path: Path, zip_format: bool
) -> None:
    path = tmp_path / "p4.pt"
    torch.save(
        {"w": torch.ones(3)}, path, pickle_protocol=4, _use_new_zipfile_serialization=zip_format
    )
    with pytest.raises(UnsafeCheckpointError, match=r"pickle_protocol=4") as refused:
        load_checkpoint(path)
    assert "add_safe_globals" not in str(refused.value)
    assert torch.equal(load_checkpoint(path, weights_only=False)["w"], torch.ones(3))


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


@pytest.mark.timeout(20)
def test_a_named_pipe_is_not_a_checkpoint_and_does_not_hang(tmp_path: Path) -> None:
    # open() of a FIFO waits for a writer: load_checkpoint hung for good.
    os.mkfifo(tmp_path / "c.pt")
    with pytest.raises(NotACheckpointError, match=r"c\.pt is a named pipe \(FIFO\), not a"):
        load_checkpoint(tmp_path / "c.pt")


def test_a_file_from_a_newer_torch_says_to_upgrade_not_that_it_is_damaged(
    tmp_path: Path,
) -> None:
    # It said "damaged or truncated ...; re-copy it or use an earlier checkpoint".
    path = save_checkpoint({"w": torch.ones(3)}, tmp_path / "c.pt")
    as_if_from_newer_torch(path)
    with pytest.raises(
        CheckpointError,
        match=r"c\.pt was saved by a newer PyTorch: it is file format version 99, and torch "
        r"\S+ here reads versions up to \d+\. The file is not damaged: load it with a newer "
        r"torch \(pip install -U torch\)",
    ) as info:
        load_checkpoint(path)
    assert not isinstance(info.value, CheckpointCorruptError)


def test_an_io_error_while_checking_the_crcs_is_not_called_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # EIO in the CRC pass read as "bytes were changed after saving (bad disk or transfer)".
    path = save_checkpoint({"w": torch.ones(1000)}, tmp_path / "c.pt")

    def eio(*args: Any, **kwargs: Any) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(zipfile.ZipExtFile, "read", eio)
    with pytest.raises(
        OSError, match=r"cannot read checkpoint .*c\.pt: Input/output error.*may be fine"
    ) as info:
        load_checkpoint(path)
    assert info.value.errno == errno.EIO and not isinstance(info.value, CheckpointError)


def test_an_io_error_inside_torch_load_is_not_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_checkpoint({"w": torch.ones(1000)}, tmp_path / "c.pt")

    def emfile(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))

    monkeypatch.setattr(torch, "load", emfile)
    with pytest.raises(
        OSError, match=r"cannot read checkpoint .*c\.pt: Too many open files.*ulimit -n"
    ):
        load_checkpoint(path)


@pytest.mark.parametrize("kind", [torch.OutOfMemoryError, RuntimeError])
def test_gpu_out_of_memory_stays_one_and_names_the_file(
    monkeypatch: pytest.MonkeyPatch, kind: type[Exception]
) -> None:
    # A RuntimeError saying so (older torch, code that re-raises it) read as a damaged file;
    # torch.OutOfMemoryError went through bare, without the file or the fix.
    error = kind("CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 1.00 GiB total)")

    def oom(*args: Any, **kwargs: Any) -> None:
        raise error

    path = FIXTURES / GPU_FILES[0]
    monkeypatch.setattr(torch, "load", oom)
    with pytest.raises(
        torch.OutOfMemoryError,
        match=rf"out of GPU memory loading checkpoint .*{path.name} \(\d+ KiB\): allocating "
        r"64\.00 MiB for a tensor failed\. The file is not damaged: load it with "
        r"device='cpu'.*free GPU memory",
    ) as info:
        load_checkpoint(path)
    assert not isinstance(info.value, CheckpointError) and info.value.__cause__ is error


def allocation_fails(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 400000000 bytes. Error code 12 (Cannot allocate memory)"
    )


def no_memory(*args: Any, **kwargs: Any) -> None:
    raise MemoryError("Cannot allocate memory (os error 12)")


@pytest.mark.parametrize("fails", [allocation_fails, no_memory])
def test_running_out_of_host_memory_is_not_called_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: Any
) -> None:
    path = save_checkpoint({"w": torch.ones(1000)}, tmp_path / "c.pt")
    size = f"{path.stat().st_size / 1024:.0f} KiB"
    monkeypatch.setattr(torch, "load", fails)
    with pytest.raises(
        MemoryError,
        match=rf"not enough memory to load checkpoint .*c\.pt \({size}\).*not "
        r"damaged.*free memory.*device='cuda'.*mmap=True",
    ) as info:
        load_checkpoint(path)
    assert not isinstance(info.value, CheckpointError)
    assert isinstance(info.value.__cause__, (RuntimeError, MemoryError))


def _packed(compressor: str, data: bytes) -> bytes:
    if compressor == "zstd":
        if shutil.which("zstd") is None:
            pytest.skip("needs the zstd command")
        return subprocess.run(["zstd", "-qc"], input=data, capture_output=True, check=True).stdout
    module = {"gzip": "gzip", "bzip2": "bz2", "xz": "lzma"}[compressor]
    packed: bytes = importlib.import_module(module).compress(data)
    return packed


@pytest.mark.parametrize(
    ("compressor", "name", "command", "unpacked"),
    [
        ("gzip", "c.pt.z", "gzip -dc {} > {}.unpacked", "c.pt.z.unpacked"),
        ("bzip2", "c.pt.z", "bzip2 -dc {} > {}.unpacked", "c.pt.z.unpacked"),
        ("xz", "c.pt.z", "xz -dc {} > {}.unpacked", "c.pt.z.unpacked"),
        ("zstd", "c.pt", "zstd -dc {} > {}.unpacked", "c.pt.unpacked"),
        ("gzip", "c.pt.gz", "gunzip -k {}", "c.pt"),
        ("bzip2", "c.pt.bz2", "bunzip2 -k {}", "c.pt"),
        ("xz", "c.pt.xz", "unxz -k {}", "c.pt"),
        ("zstd", "c.pt.zst", "zstd -d {}", "c.pt"),
    ],
)
def test_a_compressed_checkpoint_says_how_to_decompress_it(
    tmp_path: Path, good_bytes: bytes, compressor: str, name: str, command: str, unpacked: str
) -> None:
    # It said "unxz -k c.pt.z" and "gunzip -k c.pt": both refuse a name without their
    # suffix ("unknown suffix"), as "zstd -d c.pt" does. The command given must work.
    path = tmp_path / "packed" / name
    path.parent.mkdir()
    path.write_bytes(_packed(compressor, good_bytes))
    fix = command.format(path, path)
    with pytest.raises(
        NotACheckpointError,
        match=rf"{re.escape(name)} .*{compressor}.*decompress it first \({re.escape(fix)}\)",
    ):
        load_checkpoint(path)
    if shutil.which(fix.split()[0]) is None:
        return
    subprocess.run(["sh", "-c", fix], check=True, capture_output=True)
    assert torch.equal(
        load_checkpoint(path.parent / unpacked)["b"], load_checkpoint(tmp_path / "good.pt")["b"]
    )


def test_a_tar_archive_is_named_not_text(tmp_path: Path, good_bytes: bytes) -> None:
    (tmp_path / "c.pt").write_bytes(good_bytes)
    with tarfile.open(tmp_path / "c.tar", "w") as tf:
        tf.add(tmp_path / "c.pt", "c.pt")
    with pytest.raises(NotACheckpointError, match=r"c\.tar .*a tar archive.*tar -xf"):
        load_checkpoint(tmp_path / "c.tar")


def test_binary_data_with_nul_bytes_is_not_called_text(tmp_path: Path) -> None:
    (tmp_path / "c.pt").write_bytes(b"abc\x00\x01\x02" * 20)
    with pytest.raises(NotACheckpointError, match=r"unrecognised binary data"):
        load_checkpoint(tmp_path / "c.pt")


def test_a_numpy_npz_archive_says_numpy_load(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    np.savez(tmp_path / "a.npz", x=np.ones(3))
    with pytest.raises(NotACheckpointError, match=r"a\.npz is a NumPy \.npz archive.*numpy\.load"):
        load_checkpoint(tmp_path / "a.npz")
