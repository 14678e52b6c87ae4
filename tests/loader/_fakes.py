"""Datasets and helpers shared by the loader tuner's test files."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import Dataset

from trainperf.loader import CandidateResult, TuningReport, tune_loader
from trainperf.loader._search import Search


class Waits(Dataset[dict[str, Any]]):
    """Mostly waiting (2 ms per sample), so one worker overlaps well even on 2 cores."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(0.002)
        return {"x": torch.full((4,), float(i)), "i": i}


def collate_ids(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {"x": torch.stack([s["x"] for s in samples]), "ids": [s["i"] for s in samples]}


def quick(**kw: Any) -> dict[str, Any]:
    return {"device": "cpu", "budget_s": 10.0, "cache": False, "progress": False, **kw}


def tune_two_workers(dataset: Any, **kw: Any) -> TuningReport:
    """tune_loader with at most two workers, a 15 s budget, no cache and no bar."""
    kw = {
        "device": "cpu",
        "max_workers": 2,
        "budget_s": 15.0,
        "cache": False,
        "progress": False,
        **kw,
    }
    return tune_loader(dataset, 4, **kw)


def search_over(result: CandidateResult) -> Search:
    """A search that has measured ``result`` (and measures nothing more)."""
    s = Search(
        measure=lambda n, pf, pin: result,
        out_of_time=lambda: False,
        worker_cpus=1,
        max_workers=2,
        memory_available=64 << 30,
        shm_free=None,
        start_method="fork",
    )
    s.results = [result]
    return s


class Slowish(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.0005)
        return torch.zeros(3, 8, 8), i % 10


def tune_for_cache(ds: Any = None, **kw: Any) -> Any:
    # max_workers=0 keeps most of these fast: the cache stores whatever was chosen.
    kw = {"device": "cpu", "max_workers": 0, "budget_s": 8.0, "progress": False, **kw}
    return tune_loader(Slowish() if ds is None else ds, 8, **kw)
