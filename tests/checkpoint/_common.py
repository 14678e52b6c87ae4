"""Helpers shared by the checkpoint tests: the fixtures' model, temp-file and equality checks."""

from __future__ import annotations

from pathlib import Path

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


def assert_old_intact(path: Path) -> None:
    loaded = load_checkpoint(path)
    assert loaded["gen"] == 0 and torch.equal(loaded["w"], torch.arange(4.0))
    assert temps(path.parent) == []
