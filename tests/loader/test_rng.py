"""trainperf.loader._rng: tuning leaves every random number generator as it found it.

A seeded run trains the same without trainperf, with a fresh tuning and with an answer from
the cache; the global generators (python, numpy, torch, CUDA), the generators the caller
hands in and those the dataset owns are restored whatever the tuner measured.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import (
    ConcatDataset,
    DataLoader,
    Dataset,
    RandomSampler,
    Subset,
    TensorDataset,
)

from trainperf.loader import autotune_loader, tune_loader
from trainperf.loader._rng import dataset_generators, preserved_generators, preserved_rng


class Augments(Dataset[torch.Tensor]):
    """Draws from python's, numpy's and torch's global generators in every sample, the way
    random augmentations do when the loader runs in the main process."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), random.random() + float(np.random.rand())) + torch.rand(2)


def global_states() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_states(before: tuple[Any, Any, torch.Tensor]) -> None:
    py, numpy_state, cpu = global_states()
    assert py == before[0], "python's random state changed"
    assert numpy_state[0] == before[1][0] and np.array_equal(numpy_state[1], before[1][1])
    assert numpy_state[2:] == before[1][2:], "numpy's global state changed"
    assert torch.equal(cpu, before[2]), "torch's CPU generator changed"


def quick(**kw: Any) -> dict[str, Any]:
    return {"device": "cpu", "max_workers": 0, "budget_s": 5.0, "progress": False, **kw}


def test_tuning_and_a_cache_hit_leave_the_global_generators_as_they_were() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    before = global_states()
    fresh = tune_loader(Augments(), 4, **quick(shuffle=True))
    assert not fresh.from_cache and fresh.candidates[0].ok
    assert_same_states(before)
    hit = tune_loader(Augments(), 4, **quick(shuffle=True))
    assert hit.from_cache
    assert_same_states(before)


@pytest.mark.slow
def test_generators_the_caller_hands_in_are_restored() -> None:
    loader_gen = torch.Generator().manual_seed(3)
    sampler_gen = torch.Generator().manual_seed(4)
    sampler = RandomSampler(range(32), generator=sampler_gen)
    states = loader_gen.get_state(), sampler_gen.get_state()
    tune_loader(Augments(), 4, **quick(sampler=sampler, generator=loader_gen, cache=False))
    assert torch.equal(loader_gen.get_state(), states[0])
    assert torch.equal(sampler_gen.get_state(), states[1])


@pytest.mark.slow
def test_generators_are_restored_when_tuning_raises() -> None:
    torch.manual_seed(5)
    before = global_states()
    with pytest.raises(RuntimeError, match="step_fn"):
        tune_loader(Augments(), 4, **quick(cache=False, step_fn=lambda b: 1 / 0))
    assert_same_states(before)


def test_preserved_rng_restores_what_the_block_drew() -> None:
    torch.manual_seed(0)
    before = global_states()
    gen = torch.Generator().manual_seed(2)
    gen_state = gen.get_state()
    with preserved_rng([gen]):
        random.random(), np.random.rand(), torch.rand(3), torch.rand(1, generator=gen)
    assert_same_states(before)
    assert torch.equal(gen.get_state(), gen_state)


def seeded_losses(how: str) -> list[float]:
    """A seeded training run: the model is built after the loader, as scripts do."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    if how == "plain":
        loader: DataLoader[Any] = DataLoader(data, batch_size=8, shuffle=True)
    else:
        loader = autotune_loader(data, 8, **quick(shuffle=True, cache=how != "no cache"))
        assert loader.tuning_report.from_cache is (how == "from cache")
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(nn.functional.dropout(x, 0.2)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # about 3 s: five short training runs, three of them tuned
def test_a_seeded_run_trains_the_same_with_tuning_from_the_cache_and_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = seeded_losses("plain")
    assert seeded_losses("plain") == plain  # the run is deterministic at all
    assert seeded_losses("no cache") == plain
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    assert seeded_losses("tuned, cached") == plain  # measured, then stored
    assert seeded_losses("from cache") == plain


@pytest.mark.requires_cuda
def test_the_cuda_generators_are_restored() -> None:
    torch.manual_seed(0)
    torch.cuda.init()
    before = torch.cuda.get_rng_state_all()

    def step(batch: Any) -> None:
        torch.rand(4, device="cuda")

    tune_loader(Augments(), 4, **quick(device="cuda", cache=False, step_fn=step))
    after = torch.cuda.get_rng_state_all()
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


class _EpochShuffle(torch.utils.data.Sampler[int]):
    """Reshuffles each epoch by counting its own iter() calls (a common pattern)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.epoch)
        self.epoch += 1
        return iter(torch.randperm(self.n, generator=g).tolist())


def test_a_sampler_that_keeps_state_across_epochs_starts_where_the_plain_loaders_does() -> None:
    # Before: the measurements iterated the caller's sampler itself, so its first real
    # epoch was its ninth or so.
    ds = TensorDataset(torch.arange(32.0))
    plain = [int(x) for (b,) in DataLoader(ds, batch_size=4, sampler=_EpochShuffle(32)) for x in b]
    sampler = _EpochShuffle(32)
    loader = autotune_loader(
        ds, 4, sampler=sampler, device="cpu", max_workers=0, budget_s=3, cache=False,
        progress=False,
    )  # fmt: skip
    assert sampler.epoch == 0 and loader.sampler is sampler
    assert [int(x) for (b,) in loader for x in b] == plain


class OwnGenerators(Dataset[torch.Tensor]):
    """Augments from generators of its own, one of each kind, as seeded datasets do."""

    def __init__(self) -> None:
        self.torch_rng = torch.Generator().manual_seed(1)
        self.numpy_rng = np.random.default_rng(2)
        self.legacy_rng = np.random.RandomState(3)
        self.python_rng = random.Random(4)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        drawn = [
            torch.rand(1, generator=self.torch_rng).item(),
            self.numpy_rng.random(),
            self.legacy_rng.rand(),
            self.python_rng.random(),
        ]
        return torch.tensor(drawn, dtype=torch.float64) + i


def _samples(dataset: Any) -> list[list[float]]:
    return [row.tolist() for b in DataLoader(dataset, batch_size=4) for row in b]


@pytest.mark.parametrize("wrap", ["none", "subset"])
def test_a_datasets_own_generators_give_the_same_samples_as_without_tuning(wrap: str) -> None:
    # Before: the num_workers=0 measurement loaded samples here and advanced them, so a
    # tuned run augmented differently from the same run untuned.
    def build() -> Any:
        ds = OwnGenerators()
        return Subset(ds, range(32)) if wrap == "subset" else ds

    tuned, untouched = build(), build()
    loader = autotune_loader(tuned, 4, **quick(cache=False, budget_s=3.0))
    assert loader.tuning_report.candidates[0].ok  # samples were loaded here
    assert [row.tolist() for b in loader for row in b] == _samples(untouched)


def test_a_datasets_own_generators_are_restored_when_tuning_raises() -> None:
    ds, untouched = OwnGenerators(), OwnGenerators()
    with pytest.raises(RuntimeError, match="step_fn"):
        tune_loader(ds, 4, **quick(cache=False, budget_s=3.0, step_fn=lambda b: 1 / 0))
    assert _samples(ds) == _samples(untouched)


def test_dataset_generators_finds_one_level_deep_through_wrappers() -> None:
    a, b = OwnGenerators(), OwnGenerators()
    b.again = b.torch_rng  # type: ignore[attr-defined]  # the same generator twice
    b.system = random.SystemRandom()  # type: ignore[attr-defined]  # no state to keep
    b.nested = {"rng": random.Random(0)}  # type: ignore[attr-defined]  # not one level deep
    found = dataset_generators(Subset(ConcatDataset([a, b]), [0]))
    kinds = ("torch_rng", "numpy_rng", "legacy_rng", "python_rng")
    assert [id(g) for g in found] == [id(getattr(d, k)) for d in (a, b) for k in kinds]
    assert dataset_generators(TensorDataset(torch.zeros(2))) == []


def test_preserved_generators_restores_each_kind_and_ignores_other_objects() -> None:
    ds = OwnGenerators()
    gens = dataset_generators(ds)
    with preserved_generators([*gens, "not a generator", None]):
        first = ds[0]
    assert torch.equal(ds[0], first)
