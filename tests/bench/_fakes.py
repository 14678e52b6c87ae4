"""Shared by the bench tests: GPUs faked on a CPU-only machine, for the bf16 checks."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch


def fake_volta(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> None:
    """cuda:0 is a Volta (7.0, no bf16); ``module``'s ``resolve_device`` returns it.

    The bf16 checks run before anything touches the (absent) GPU.
    """
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(module, "resolve_device", lambda device: cuda0)


def fake_mixed_host(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> None:
    """A mixed host: the current device (cuda:0) is a Hopper, cuda:1 a Volta, and
    ``module``'s ``resolve_device`` returns cuda:1."""
    capabilities = {0: (9, 0), 1: (7, 0)}
    cuda1 = torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: capabilities[device.index]
    )
    monkeypatch.setattr(module, "resolve_device", lambda device: cuda1)


class FakeBatches:
    """``bench_model``'s batches, none of which runs a model: each advances a fake clock (the
    run's ``_clock``) by the next of ``seconds`` (the last one repeated), and the batches
    and CUDA synchronisations are recorded in order (``"b"``, ``"s"``) in ``events``. Past
    ``max_batches`` a batch fails the test (a run the limit did not stop would go on)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, *seconds: float, max_batches: int | None = None
    ) -> None:
        model = importlib.import_module("trainperf.bench._model")
        run = importlib.import_module("trainperf.bench._model_run")
        self.seconds = list(seconds)
        self.now = 0.0
        self.events: list[str] = []
        self.max_batches = max_batches
        monkeypatch.setattr(run, "_clock", lambda: self.now)
        monkeypatch.setattr(run, "synchronize", lambda device: self.events.append("s"))
        monkeypatch.setattr(model, "_batch_runner", lambda *args, **kwargs: self.batch)

    def batch(self) -> None:
        ran = self.events.count("b")
        if self.max_batches is not None and ran >= self.max_batches:
            pytest.fail(f"ran more than {self.max_batches} batches: the limit did not stop it")
        self.now += self.seconds[min(ran, len(self.seconds) - 1)]
        self.events.append("b")

    @property
    def ran(self) -> int:
        """Batches run so far."""
        return self.events.count("b")


class FakeCopies:
    """``bench_h2d`` on a CPU-only host: cuda:0 is there, its buffers are small CPU tensors,
    and a pageable copy takes ``pageable`` seconds, a pinned one ``pinned`` (nothing is
    copied), but for the first of each kind, the untimed warm-up, which takes 10 times as
    long (so that a rate or an estimate that took it in is off); ``copies`` records
    ``"pageable"`` or ``"pinned"`` for each, in order."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, module: ModuleType, pageable: float, pinned: float
    ) -> None:
        self.buffers = (torch.zeros(2 * 2**20, dtype=torch.uint8),
                        torch.zeros(2 * 2**20, dtype=torch.uint8),
                        torch.zeros(2 * 2**20, dtype=torch.uint8))  # fmt: skip
        self.copies: list[str] = []
        self.warmed_up: set[str] = set()
        self.times = {"pageable": pageable, "pinned": pinned}
        cuda0 = torch.device("cuda", 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(module, "resolve_device", lambda device, allowed: cuda0)
        monkeypatch.setattr(module, "gpu_name", lambda device: "NVIDIA H200")
        monkeypatch.setattr(module, "_buffers", lambda size_bytes, device: self.buffers)
        monkeypatch.setattr(module, "_seconds_per_copy", self.copy)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> float:
        kind = "pinned" if src is self.buffers[1] else "pageable"
        warm_up = kind not in self.warmed_up
        self.warmed_up.add(kind)
        self.copies.append(kind)
        return self.times[kind] * (10 if warm_up else 1)
