"""Helpers shared by the checkpoint tests: the fixtures' model, temp-file and equality checks."""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainperf.checkpoint import load_checkpoint

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


def as_if_from_newer_torch(path: Path) -> None:
    """Rewrite the torch zip file ``path`` as a newer PyTorch would write it: a file format
    version (its ``version`` record) past what this torch reads."""
    with zipfile.ZipFile(path) as zf:
        records = [(info.filename, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            newer = name.count("/") == 1 and name.endswith("/version")
            zf.writestr(name, b"99\n" if newer else data)


def assert_old_intact(path: Path) -> None:
    loaded = load_checkpoint(path)
    assert loaded["gen"] == 0 and torch.equal(loaded["w"], torch.arange(4.0))
    assert temps(path.parent) == []


# ------------------------------------------------------------ files written by other tools
PEERS = Path(__file__).parents[1] / "fixtures" / "peers"


def tiny_mlp() -> nn.Module:
    """The network every peer fixture but transformers' holds (make_fixtures.TINY_MLP)."""
    torch.manual_seed(100)  # make_fixtures.FRESH_SEED: values unlike every fixture's
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def sha256(t: torch.Tensor) -> str:
    """MANIFEST.json's checksum recipe."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def manifest_tensors(fixture: str, name: str) -> dict[str, dict[str, Any]]:
    """MANIFEST's tensors of state dict ``name`` in ``fixture``, keyed as the model names them
    (the recorded key prefix removed)."""
    manifest = json.loads((PEERS / "MANIFEST.json").read_text())
    entry = manifest["fixtures"][fixture]["state_dicts"][name]
    prefix = entry["key_prefix"]
    return {k[len(prefix) :]: v for k, v in entry["tensors"].items() if k.startswith(prefix)}


def assert_manifest(tensors: Mapping[str, torch.Tensor], fixture: str, name: str) -> None:
    """``tensors`` are bit-identical to what MANIFEST records (keys, shapes, dtypes, bytes)."""
    want = manifest_tensors(fixture, name)
    assert sorted(tensors) == sorted(want)
    for key, spec in want.items():
        t = tensors[key]
        assert list(t.shape) == spec["shape"] and str(t.dtype) == f"torch.{spec['dtype']}", key
        assert sha256(t) == spec["sha256"], key


def held_thread_writes(monkeypatch: Any) -> Any:
    """Make Checkpointer's background saves use the thread writer and hold each write until
    the returned ``threading.Event`` is set (at most 60 s)."""
    import threading

    import trainperf.checkpoint._checkpointer as checkpointer_module
    import trainperf.checkpoint._writer as writer_module

    monkeypatch.setattr(checkpointer_module, "fork_writes", lambda: False)
    release = threading.Event()
    real = writer_module.write_now

    def held(payload: Any, path: Path, **kw: Any) -> None:
        release.wait(timeout=60)
        real(payload, path, **kw)

    monkeypatch.setattr(writer_module, "write_now", held)
    return release
