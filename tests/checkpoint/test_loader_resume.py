"""trainperf.checkpoint: exact resume for samplers that draw lazily from a shared generator,
and for loaders with persistent workers restored after an end-of-epoch checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from trainperf.checkpoint import Checkpointer

_DATA = list(range(100))


def _lazy_loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    sampler = RandomSampler(_DATA, replacement=True, num_samples=100, generator=g)
    return DataLoader(_DATA, batch_size=4, sampler=sampler)


def _batches(loader: DataLoader[Any]) -> list[list[int]]:
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("k", [8, 16])
def test_a_lazily_drawing_sampler_resumes_without_repeats(tmp_path: Path, k: int) -> None:
    # RandomSampler(replacement=True) draws 32 indices at a time from its generator: K=8 and
    # K=16 batches of 4 end exactly on such a draw.
    torch.manual_seed(1)
    straight = _lazy_loader()
    Checkpointer(tmp_path / "ref").restore({"loader": straight})
    reference = _batches(straight)
    torch.manual_seed(1)
    first = _lazy_loader()
    ck = Checkpointer(tmp_path / "run")
    ck.restore({"loader": first})
    got = []
    for i, batch in enumerate(first):
        got.append(batch.tolist())
        if i + 1 == k:
            ck.save({"loader": first}, step=k)
            break
    resumed = _lazy_loader()
    assert Checkpointer(tmp_path / "run").restore({"loader": resumed}) == k
    got += _batches(resumed)
    assert got == reference


def _persistent_loader() -> DataLoader[Any]:
    return DataLoader(
        list(range(40)), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
    )


def _epochs(loader: DataLoader[Any], n: int) -> list[list[list[int]]]:
    return [_batches(loader) for _ in range(n)]


@pytest.mark.slow
def test_persistent_workers_resume_exactly_after_an_end_of_epoch_checkpoint(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataLoader's worker-count advice on a small host
        torch.manual_seed(1)
        straight = _persistent_loader()
        Checkpointer(tmp_path / "ref").restore({"loader": straight})
        reference = _epochs(straight, 3)
        torch.manual_seed(1)
        first = _persistent_loader()
        ck = Checkpointer(tmp_path / "run")
        ck.restore({"loader": first})
        got = _epochs(first, 1)
        ck.save({"loader": first}, step=1)  # the usual end-of-epoch checkpoint
        torch.manual_seed(99)  # a fresh process: the restore must set what matters
        resumed = _persistent_loader()
        assert Checkpointer(tmp_path / "run").restore({"loader": resumed}) == 1
        got += _epochs(resumed, 2)
        del straight, first, resumed  # their persistent workers end with them
    assert got == reference
