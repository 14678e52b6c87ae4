"""Shared by the bench tests: GPUs faked on a CPU-only machine, for the bf16 checks."""

from __future__ import annotations

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
