"""Steps, batches and synthetic measurements the batch-size tuner's tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainperf.batchsize import BatchSizeCandidate
from trainperf.batchsize._probe_rules import ProbePolicy
from trainperf.loader import WindowPolicy

QUICK = ProbePolicy(
    windows=WindowPolicy(min_window_batches=1, min_window_s=0.02, min_windows=2, max_windows=3)
)
"""The default rules with short windows, for tests of behaviour rather than speed."""


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(16, 1))  # fmt: skip


def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch of ``n`` samples (random: the tuner must restore the RNG)."""
    return torch.randn(n, 8), torch.randn(n, 1)


class Trainer:
    """``step(batch)`` of an Adam-trained small model; raises ``torch.OutOfMemoryError``
    after the forward pass for batches above ``oom_above`` (the simulated device's memory),
    and ``error`` (when set) for batches of ``error_at``.

    ``sleep_s`` adds a fixed wait per step (a GPU's launch latency, say): throughput then
    grows with the batch however busy this host is, so the growth reaches the sizes a test
    is about instead of stopping where the noise of a loaded host flattens the curve."""

    def __init__(
        self,
        oom_above: int | None = None,
        error_at: int | None = None,
        error: BaseException | None = None,
        sleep_s: float = 0.0,
    ) -> None:
        self.model = small_model()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.oom_above = oom_above
        self.error_at = error_at
        self.error = error
        self.sleep_s = sleep_s
        self.sizes: list[int] = []  # the batch size of every step run

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        n = len(x)
        self.sizes.append(n)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        self.model.train()
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        if self.oom_above is not None and n > self.oom_above:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {n} MiB (simulated above {self.oom_above})"
            )
        if self.error_at is not None and n == self.error_at and self.error is not None:
            raise self.error
        loss.backward()
        self.opt.step()
        return float(loss.detach())


class MeanOnFirstForward(nn.Module):
    """A persistent buffer registered as None and set by the first forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("mean", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            self.mean = x.mean(0).detach()
        return self.lin(x - self.mean)


@dataclass
class Curve:
    """A synthetic ``probe`` for :class:`~trainperf.batchsize._search.Search`.

    Throughput ``n / (overhead + n * per_sample)`` (rising, then flat) times ``bump(n)``;
    peak memory ``fixed + n * per_sample_bytes``; sizes above ``oom_above`` run out of
    memory. Every size probed is recorded, in order.
    """

    overhead: float = 0.01
    per_sample: float = 0.001
    fixed: int = 1000
    per_sample_bytes: int = 10
    oom_above: int | None = None
    spread: float = 0.01
    bump: Callable[[int], float] = lambda n: 1.0
    probed: list[int] = field(default_factory=list)

    def rate(self, n: int) -> float:
        return n / (self.overhead + n * self.per_sample) * self.bump(n)

    def __call__(self, n: int) -> BatchSizeCandidate:
        self.probed.append(n)
        peak = self.fixed + n * self.per_sample_bytes
        if self.oom_above is not None and n > self.oom_above:
            return BatchSizeCandidate(n, "oom", peak_memory=peak, reason="simulated")
        return BatchSizeCandidate(n, "ok", samples_per_s=self.rate(n), spread=self.spread,
                                  peak_memory=peak)  # fmt: skip


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Deep copies of everything tuning must leave as it was."""
    import copy

    return {
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "modes": [m.training for m in model.modules()],
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-exact equality of two :func:`state_of` results."""
    return _equal(a, b)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
