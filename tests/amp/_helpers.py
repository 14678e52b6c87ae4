"""Shared by the amp tests: a faked GPU, small models, an optimizer that fails, and the
fp16-on-the-CPU skip."""

from __future__ import annotations

from typing import Any

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


class Flaky(torch.optim.SGD):
    """SGD whose first ``fails`` steps raise (a check in a custom optimizer, a step hook)."""

    def __init__(self, params: Any, lr: float, fails: int = 1) -> None:
        super().__init__(params, lr=lr)
        self.fails = fails

    def step(self, closure: Any = None) -> Any:
        if self.fails:
            self.fails -= 1
            raise OSError("the optimizer failed")
        return super().step(closure)


# --------------------------------------------------------------------------- TF32 settings

# torch >= 2.9 keeps TF32 as a tree of fp32_precision settings next to the legacy flags.
PRECISION_TREE = hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")

needs_precision_tree = pytest.mark.skipif(
    not PRECISION_TREE, reason="this torch has no per-backend fp32_precision API"
)

_LEGACY_READS = {
    "get_float32_matmul_precision()": torch.get_float32_matmul_precision,
    "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
}
_TREE = (
    "",
    "cuda.matmul",
    "cudnn",
    "cudnn.conv",
    "cudnn.rnn",
    "mkldnn.matmul",
    "mkldnn.conv",
    "mkldnn.rnn",
)


def tf32_reads() -> dict[str, object]:
    """Every TF32 setting as read through either torch API: its value, or "raises"."""
    reads: dict[str, object] = {}
    for name, read in _LEGACY_READS.items():
        try:
            reads[name] = read()
        except RuntimeError:  # the two APIs were mixed
            reads[name] = "raises"
    if PRECISION_TREE:
        for path in _TREE:
            backend: object = torch.backends
            for part in filter(None, path.split(".")):
                backend = getattr(backend, part)
            reads[f"{path or 'backends'}.fp32_precision"] = backend.fp32_precision  # type: ignore[attr-defined]
        # torch.backends.mkldnn.fp32_precision's setter writes the root, so go past it.
        reads["mkldnn.fp32_precision"] = torch._C._get_fp32_precision_getter("mkldnn", "all")
    return reads


def tf32_reads_as_parents_change() -> list[dict[str, object]]:
    """``tf32_reads()`` after each of several changes to the parent settings: it tells a
    setting that follows its parent ("none") from one set to the value it inherited.
    Leaves the parents changed."""
    views = [tf32_reads()]
    changes = [("generic", v) for v in ("ieee", "tf32", "bf16", "none")]
    changes += [("cuda", v) for v in ("ieee", "tf32", "none")]
    changes += [("mkldnn", v) for v in ("ieee", "bf16", "none")]
    for backend, value in changes:
        torch._C._set_fp32_precision_setter(backend, "all", value)
        views.append(tf32_reads())
    return views


def reset_tf32() -> None:
    """A known starting point: legacy "highest" and cuDNN TF32, every other setting "none"."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    if PRECISION_TREE:
        for backend, op in [("generic", "all"), ("cuda", "all"), ("mkldnn", "all")] + [
            ("mkldnn", op) for op in ("matmul", "conv", "rnn")
        ]:
            torch._C._set_fp32_precision_setter(backend, op, "none")
