"""trainperf.device._seed: seed_everything and worker_init_fn."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainperf.device._seed as seed_mod
from trainperf.device import seed_everything, worker_init_fn

# --------------------------------------------------------------------------- seeds


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    random.setstate(rng[0])
    np.random.set_state(rng[1])
    torch.set_rng_state(rng[2])


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_reproduces_draws(restore_determinism: None) -> None:
    import os

    assert seed_everything(123) == 123
    first = draws()
    seed_everything(123)
    assert draws() == first
    seed_everything(124)
    assert draws() != first
    assert os.environ["PYTHONHASHSEED"] == "124"
    assert seed_everything(np.int64(5)) == 5  # type: ignore[arg-type]
    assert seed_everything(2**32 - 1) == 2**32 - 1


def test_seed_everything_deterministic(restore_determinism: None) -> None:
    import os

    torch.use_deterministic_algorithms(False)
    seed_everything(0)  # deterministic=False leaves the settings alone
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ or os.environ["CUBLAS_WORKSPACE_CONFIG"]
    seed_everything(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_seed_everything_range(seed: int) -> None:
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32 - 1\]"):
        seed_everything(seed)


@pytest.mark.parametrize("seed", [1.5, "1", True, None])
def test_seed_everything_type(seed: Any) -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        seed_everything(seed)


@pytest.mark.parametrize(
    "seed",
    [torch.tensor(True), torch.tensor(False), np.True_],
    ids=["tensor-True", "tensor-False", "np.True_"],
)
def test_seed_everything_refuses_a_bool_tensor_or_numpy_bool(
    seed: Any, restore_determinism: None
) -> None:
    # Before: torch.tensor(True) was taken as seed 1 (operator.index reads a bool tensor
    # as an int), while True itself was refused.
    with pytest.raises(TypeError, match=r"seed must be an int, got .*(True|False)"):
        seed_everything(seed)


class WorkerDraws(Dataset[tuple[int, int, int, float]]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int, int, float]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return info.id, torch.initial_seed(), int(np.random.randint(2**31)), random.random()


def run_loader(seed: int) -> list[tuple[int, int, int, float]]:
    loader = DataLoader(
        WorkerDraws(),
        batch_size=None,
        num_workers=2,
        worker_init_fn=worker_init_fn,
        generator=torch.Generator().manual_seed(seed),
    )
    return [tuple(int(v) if i < 3 else float(v) for i, v in enumerate(item)) for item in loader]  # type: ignore[misc]


def test_worker_init_fn_gives_distinct_reproducible_worker_seeds() -> None:
    first = run_loader(0)
    assert run_loader(0) == first
    assert run_loader(1) != first
    by_worker: dict[int, tuple[int, int]] = {}
    for wid, seed, draw, _ in first:
        by_worker.setdefault(wid, (seed, draw))  # each worker's first item
    assert set(by_worker) == {0, 1}
    assert by_worker[0][1] != by_worker[1][1]  # distinct NumPy streams
    for wid, (seed, draw) in by_worker.items():
        # The worker's first NumPy draw is the one worker_init_fn's seeding gives.
        expected = np.random.RandomState(seed_mod._worker_seed_state(seed)).randint(2**31)
        assert draw == expected, wid
        assert next(r for w, _, _, r in first if w == wid) == random.Random(seed).random()


def test_worker_init_fn_gives_each_rank_s_workers_their_own_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: every rank seeds its loader's generator alike, so worker k of every rank drew
    # the same torch, NumPy and random values (the same augmentations on every rank).
    rank0 = run_loader(0)
    monkeypatch.setenv("RANK", "0")
    assert run_loader(0) == rank0  # rank 0 draws as a run without DDP always did
    monkeypatch.setenv("RANK", "1")
    rank1 = run_loader(0)
    assert run_loader(0) == rank1  # reproducible
    firsts = {}
    for run, items in (("rank0", rank0), ("rank1", rank1)):
        for wid, seed, draw, r in items:
            firsts.setdefault((run, wid), (seed, draw, r))
    for wid in (0, 1):
        torch_0, numpy_0, random_0 = firsts[("rank0", wid)]
        torch_1, numpy_1, random_1 = firsts[("rank1", wid)]
        assert torch_0 != torch_1 and numpy_0 != numpy_1 and random_0 != random_1, wid
    assert firsts[("rank1", 0)] != firsts[("rank1", 1)]


def test_worker_init_fn_outside_a_worker_leaves_torch_alone_on_any_rank(
    monkeypatch: pytest.MonkeyPatch, restore_determinism: None
) -> None:
    # Before: on a rank other than 0 it reseeded the main process's torch generators.
    monkeypatch.setenv("RANK", "1")
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    worker_init_fn(0)
    assert torch.equal(torch.rand(1), expected)


def test_worker_init_fn_outside_a_worker(restore_determinism: None) -> None:
    torch.manual_seed(11)
    worker_init_fn(0)
    a = draws()[:2]
    worker_init_fn(1)
    b = draws()[:2]
    worker_init_fn(0)
    assert draws()[:2] == a != b
    with pytest.raises(ValueError, match="worker_id must be an int >= 0, got -1"):
        worker_init_fn(-1)


@pytest.mark.parametrize("initial_seed", [11, 2**64 - 1])
def test_worker_init_fn_takes_a_numpy_worker_id(
    initial_seed: int, restore_determinism: None
) -> None:
    # Before: the NumPy id reached random.seed (TypeError), or overflowed when added to a
    # 64-bit initial seed (OverflowError).
    torch.manual_seed(initial_seed)
    worker_init_fn(1)
    expected = draws()[:2]
    torch.manual_seed(initial_seed)
    worker_init_fn(np.int64(1))
    assert draws()[:2] == expected


def _first_draws(context: str) -> dict[int, tuple[int, int, float]]:
    """Each worker's first torch seed, NumPy draw and ``random`` draw."""
    loader = DataLoader(
        WorkerDraws(), batch_size=None, num_workers=1, worker_init_fn=worker_init_fn,
        generator=torch.Generator().manual_seed(0), multiprocessing_context=context,
    )  # fmt: skip
    firsts: dict[int, tuple[int, int, float]] = {}
    for wid, seed, draw, r in loader:
        firsts.setdefault(int(wid), (int(seed), int(draw), float(r)))
    return firsts


@pytest.mark.slow  # about 5 s: a spawned worker imports torch
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the expected draws come from fork")
def test_spawned_workers_of_a_rank_without_rank_variable_draw_as_that_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: a rank set up with init_process_group(rank=...) and no RANK variable started
    # spawned workers that saw no process group and read rank 0, so every rank's workers drew
    # the same augmentations.
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    monkeypatch.delenv("RANK", raising=False)
    rank0 = _first_draws("fork")
    monkeypatch.setenv("RANK", "1")
    rank1 = _first_draws("fork")
    assert rank1 != rank0
    monkeypatch.delenv("RANK")
    dist.init_process_group("fake", rank=1, world_size=2, store=fake_pg.FakeStore())
    try:
        assert _first_draws("fork") == rank1  # a copy of the rank's group in the worker
        assert _first_draws("spawn") == rank1  # the rank recorded when pickled for it
    finally:
        dist.destroy_process_group()


def test_worker_init_fn_pickled_elsewhere_does_not_pass_on_that_rank(
    monkeypatch: pytest.MonkeyPatch, restore_determinism: None
) -> None:
    # A copy pickled by another process (a loader sent to a rank) is no record of this one's.
    import pickle

    monkeypatch.setenv("RANK", "3")
    elsewhere = pickle.loads(pickle.dumps(worker_init_fn))
    assert repr(elsewhere) == repr(worker_init_fn) == "<function trainperf.worker_init_fn>"
    monkeypatch.setenv("RANK", "1")
    assert elsewhere._rank_here() == 1  # pickled in this process, which is not a worker's parent


@pytest.mark.parametrize("seed", [1.0, np.float64(7.0), torch.tensor(3.0)])
def test_seed_everything_says_to_pass_int_seed_for_a_whole_float(
    seed: Any, restore_determinism: None
) -> None:
    # Before: "seed must be an int, got 1.0", without the fix worker_init_fn's error names.
    with pytest.raises(TypeError, match=r"seed must be an int, got .* \(pass int\(seed\)\)$"):
        seed_everything(seed)


@pytest.mark.parametrize(
    "seed", [torch.tensor([5]), torch.tensor([[5]]), np.array([5])], ids=["1-d", "2-d", "np-1-d"]
)
def test_seed_everything_refuses_a_tensor_that_is_not_0_dim(
    seed: Any, restore_determinism: None
) -> None:
    # Before: torch.tensor([5]) was taken as 5 (operator.index reads any one-element
    # integer tensor), while NumPy's np.array([5]) was refused without a fix.
    with pytest.raises(TypeError, match=r"seed must be an int, got .*\(pass seed\.item\(\)\)$"):
        seed_everything(seed)


def test_seed_everything_takes_a_0_dim_integer_tensor(restore_determinism: None) -> None:
    seed = seed_everything(torch.tensor(5))  # type: ignore[arg-type]
    assert seed == 5 and type(seed) is int


@pytest.mark.parametrize("seed", [1.5, "1", None, torch.tensor([1, 2])])
def test_seed_everything_suggests_no_fix_that_would_change_the_seed(seed: Any) -> None:
    with pytest.raises(TypeError, match=r"seed must be an int, got ") as caught:
        seed_everything(seed)
    assert "pass" not in str(caught.value)
