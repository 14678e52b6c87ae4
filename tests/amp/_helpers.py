"""Shared by the amp tests: a faked GPU, small models, and the fp16-on-the-CPU skip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainperf.amp import _precision

CPU_FP16 = _precision.autocast_supports("cpu", torch.float16)


needs_cpu_fp16 = pytest.mark.skipif(
    not CPU_FP16, reason="this torch has no fp16 autocast on the CPU (GradScaler tests need it)"
)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(_precision, "cuda_capability", lambda device: capability)
    # resolve_device checks that a CUDA device exists before the policy asks about it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def small_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


class TinyViT(nn.Module):
    """ViT-shaped: a patch-embedding Conv2d, then transformer blocks (Linear layers)."""

    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=8, stride=8)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(tokens).mean(1))
