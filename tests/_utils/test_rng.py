"""trainperf._utils.rng: the generators a dataset owns, found and put back (shared by the
DataLoader tuner and ``tune_batch_size``; the loader's tests cover each kind)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset

from trainperf._utils import rng
from trainperf.loader import _rng as loader_rng


class _Owns(Dataset[float]):
    def __init__(self) -> None:
        self.torch_rng, self.numpy_rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
        self.python_rng = random.Random(0)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> float:
        return torch.rand(1, generator=self.torch_rng).item() + self.numpy_rng.random()


def test_the_generators_a_dataset_owns_come_back_and_the_loader_shares_the_helpers() -> None:
    ds = _Owns()
    found = rng.dataset_generators(ds)
    assert [type(g) for g in found] == [torch.Generator, np.random.Generator, random.Random]
    first = ds[0]
    with rng.preserved_generators(found):
        ds[0], ds[1], ds.python_rng.random()
    second = ds[1]  # drawn on from where the block found it
    again = _Owns()  # never inside such a block
    assert (again[0], again[1]) == (first, second)
    assert ds.python_rng.random() == again.python_rng.random()
    assert loader_rng.dataset_generators is rng.dataset_generators
    assert loader_rng.preserved_generators is rng.preserved_generators


class _Shard(Dataset[int]):
    def __init__(self, rng: object) -> None:
        self.rng, self.same = rng, rng

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        return 0


def test_each_generator_is_found_once_in_order_across_many_shards() -> None:
    own = [np.random.default_rng(i) for i in range(2000)]
    shared = random.Random(0)
    shards = [_Shard(g) for g in own] + [_Shard(shared), _Shard(shared)]
    found = rng.dataset_generators(Subset(ConcatDataset(shards), [0]))
    assert len(found) == len(own) + 1
    assert all(f is g for f, g in zip(found, [*own, shared], strict=True))
