"""A fake NCCL process group of two ranks on a fake host of GPUs, for checking on CPU which
GPU the checkpoint package's collectives run on (``_rank_gpu``), and :func:`map_locations`,
which records the device each load asked ``torch.load`` for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch


class FakeNccl:
    """Rank ``rank`` of 2 under NCCL on a host of ``gpus`` GPUs, whose current device starts
    at ``current``; ``used`` collects the current device at each object collective."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        *,
        rank: int = 1,
        gpus: int = 2,
        current: int = 0,
        backend: str = "nccl",
        bound: int | None = None,
    ) -> None:
        self.current = current
        self.used: list[int] = []
        dist = torch.distributed
        bound_device = None if bound is None else torch.device("cuda", bound)
        for name, value in {
            "is_initialized": lambda: True,
            "get_rank": lambda: rank,
            "get_world_size": lambda: 2,
            "get_backend": lambda group=None: backend,
            "group": SimpleNamespace(WORLD=SimpleNamespace(bound_device_id=bound_device)),
            "all_gather_object": self._all_gather_object,
            "broadcast_object_list": self._broadcast_object_list,
            "all_reduce": self._all_reduce,
        }.items():
            monkeypatch.setattr(dist, name, value)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device", self._device)
        # A switch that is never put back (set_device) shows in `current` after the call.
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)

    def _set_device(self, device: torch.device | int) -> None:
        self.current = device if isinstance(device, int) else int(device.index or 0)

    @contextlib.contextmanager
    def _device(self, device: torch.device | int) -> Iterator[None]:
        before = self.current
        self.current = device if isinstance(device, int) else int(device.index or 0)
        try:
            yield
        finally:
            self.current = before

    def _all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
        self.used.append(self.current)
        out[:] = [obj] * len(out)

    def _broadcast_object_list(self, objects: list[Any], src: int = 0, group: Any = None) -> None:
        self.used.append(self.current)

    def _all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        self.used.append(tensor.device.index)


def map_locations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Where each ``torch.load`` was asked to map the file's tensors (``(file name,
    map_location)``); the load itself maps onto the CPU, there being no GPU here."""
    asked: list[tuple[str, Any]] = []
    real_load = torch.load

    def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
        asked.append((Path(f).name if isinstance(f, (str, Path)) else "", map_location))
        return real_load(f, map_location="cpu", **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return asked
