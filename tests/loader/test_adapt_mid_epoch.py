"""Mid-epoch changes: whatever pools replace each other at batch boundaries, the samples
and their order are those of the plain DataLoader with the same seed."""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)

import trainperf.loader._adapt as adapt
from trainperf.loader import AdaptiveDataLoader
from trainperf.loader._adapt_rules import Change, EpochFigures


class Indices(Dataset[int]):
    """Each sample is its index; a little latency so that pools have batches in flight."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> int:
        time.sleep(0.001)
        return i


_CYCLE = [(2, 2), (0, None), (3, 1), (1, 3), (0, None), (2, 1)]


def _force_changes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Check after every batch and change the setting at every check; returns the list the
    checks' worker counts are appended to."""
    monkeypatch.setattr(adapt, "_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(adapt, "_CHECK_BATCHES", 0)
    settings: Iterator[tuple[int, int | None]] = itertools.cycle(_CYCLE)
    seen: list[int] = []

    def decide(f: EpochFigures, **kw: Any) -> Change | None:
        seen.append(f.num_workers)
        n, pf = next(settings)
        return Change(n, pf, "input-bound", "forced")

    monkeypatch.setattr(adapt, "decide", decide)
    return seen


def _epochs(loader: Any, epochs: int) -> list[list[int]]:
    return [[int(x) for b in loader for x in torch.as_tensor(b).reshape(-1)] for _ in range(epochs)]


def _close(*loaders: DataLoader) -> None:  # type: ignore[type-arg]
    for loader in loaders:
        if isinstance(loader, AdaptiveDataLoader):
            loader.close()
        elif loader._iterator is not None:
            loader._iterator._shutdown_workers()  # type: ignore[attr-defined]


def _seeded(own: bool) -> torch.Generator | None:
    if own:
        return torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    return None


@pytest.mark.slow  # a worker pool started at most batches: seconds
@pytest.mark.parametrize(
    ("start", "own", "drop_last", "persistent"),
    [
        (0, True, False, False),
        (2, False, True, True),
        (0, False, True, True),
        (2, True, False, False),
    ],
)
def test_sample_sequence_is_the_plain_loaders_with_changes_mid_epoch(
    monkeypatch: pytest.MonkeyPatch, start: int, own: bool, drop_last: bool, persistent: bool
) -> None:
    seen = _force_changes(monkeypatch)
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "drop_last": drop_last}
    kw["persistent_workers"] = persistent and start > 0
    plain = DataLoader(Indices(), num_workers=start, generator=_seeded(own), **kw)
    try:
        expected = _epochs(plain, 3)
    finally:
        _close(plain)
    loader = AdaptiveDataLoader(Indices(), num_workers=start, generator=_seeded(own), **kw)
    try:
        got = _epochs(loader, 3)
    finally:
        _close(loader)
    assert got == expected
    assert len({tuple(e) for e in got}) == 3  # the shuffle did shuffle
    assert all(len(e) == (28 if drop_last else 30) for e in got)
    mid = [c for c in loader.tuning_history if c.epoch_batch > 0]
    assert {c.epoch for c in mid} == {0, 1, 2}  # changes within every epoch
    # Both ways: a pool replaced by the main process and the main process by a pool.
    assert any(c.old[0] == 0 and c.new[0] > 0 for c in mid)
    assert any(c.old[0] > 0 and c.new[0] == 0 for c in mid)
    assert 0 in seen and any(n > 0 for n in seen)
    batches = [c.batch for c in loader.tuning_history]
    assert batches == sorted(batches) and batches[-1] > 10  # counted over the epochs


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["weighted", "replacement", "unbatched"])
def test_other_torch_samplers_keep_their_sequence(
    monkeypatch: pytest.MonkeyPatch, sampler: str
) -> None:
    _force_changes(monkeypatch)

    def kwargs() -> dict[str, Any]:
        torch.manual_seed(5)  # the samplers without a generator draw from the global one
        if sampler == "weighted":
            return {"batch_size": 3, "sampler": WeightedRandomSampler([1.0] * 30, 24)}
        if sampler == "replacement":
            return {"batch_size": 5, "sampler": RandomSampler(range(30), True, 40)}
        return {"batch_size": None, "shuffle": True}

    plain = DataLoader(Indices(), **kwargs())
    expected = _epochs(plain, 2)
    loader = AdaptiveDataLoader(Indices(), **kwargs())
    try:
        got = _epochs(loader, 2)
    finally:
        loader.close()
    assert got == expected
    assert any(c.epoch_batch > 0 for c in loader.tuning_history)


class Stream(IterableDataset[int]):
    """A stream sharded across workers (each yields every n-th item)."""

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        share = range(12) if info is None else range(info.id, 12, info.num_workers)
        return iter(share)


class Mine(SequentialSampler):
    """A custom sampler: its iteration might have side effects, so no mid-epoch change."""


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: AdaptiveDataLoader(Stream(), batch_size=2), "an IterableDataset"),
        (
            lambda: AdaptiveDataLoader(range(12), sampler=Mine(range(12))),
            r"custom sampler \(Mine\)",
        ),
        (lambda: AdaptiveDataLoader(range(12), mid_epoch=False), "mid_epoch=False"),
        (
            lambda: AdaptiveDataLoader(range(12), batch_sampler=[[0, 1], [2, 3]]),
            r"custom batch_sampler \(list\)",
        ),
    ],
)
def test_what_cannot_be_resumed_exactly_changes_at_epoch_boundaries_only(
    monkeypatch: pytest.MonkeyPatch, make: Any, why: str
) -> None:
    seen = _force_changes(monkeypatch)
    loader = make()
    try:
        first = _epochs(loader, 1)[0]
        assert seen == []  # never checked mid-epoch
        second = _epochs(loader, 1)[0]
    finally:
        loader.close()
    assert re.search(why, loader.epoch_boundaries_only or "")
    assert len(seen) == 1  # the one check at the epoch boundary
    # The same samples (a stream's order interleaves its workers', as in any DataLoader).
    assert sorted(first) == sorted(second) and len(first) > 0
    assert [c.epoch_batch for c in loader.tuning_history] == [0]


def test_a_mid_epoch_change_is_recorded_with_its_batch() -> None:
    from trainperf.loader import TuningChange
    from trainperf.loader._adapt_rules import figures

    change = TuningChange(1, 0.0, (0, None), (4, 2), "input-bound", "w", figures(), 57, 7)
    assert str(change).startswith("epoch 1, batch 7: workers=0 prefetch=- → workers=4")
    assert change.to_dict()["batch"] == 57 and change.to_dict()["epoch_batch"] == 7


class Latency(Dataset[int]):
    """I/O latency: 4 ms per sample, almost no CPU."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(0.004)
        return i


@pytest.mark.slow
def test_a_waiting_loop_gets_workers_within_its_first_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(adapt, "_CHECK_EVERY_S", 0.3)
    loader = AdaptiveDataLoader(Latency(400), batch_size=4, max_workers=4)
    try:
        got = [x for b in loader for x in b.tolist()]
    finally:
        loader.close()
    assert got == list(range(400))  # every sample once, in order, across the change
    change = loader.tuning_history[0]
    assert change.reason == "input-bound" and change.old == (0, None) and change.new[0] > 0
    assert change.epoch == 0 and 0 < change.epoch_batch < 100
    assert change.batch == change.epoch_batch  # the first epoch: both count from its start
    assert change.figures.wait_share > 0.5


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_fewer_usable_cpus_mid_epoch_mean_fewer_workers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The affinity is really changed: the loader reads it through trainperf.limits.
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs at least 2 usable CPUs to take some away")
    cpus = sorted(before)
    half = set(cpus[: len(cpus) // 2])
    monkeypatch.setattr(adapt, "_CHECK_EVERY_S", 0.3)
    # Busy workers (a core each) without burning this machine's cores on it, and no other
    # load counted: the rule under test is the CPUs' change.
    monkeypatch.setattr(adapt.Workers, "cores", lambda self: float(len(self.procs)))
    monkeypatch.setattr(adapt, "cpu_mark", lambda: None)
    n = len(cpus)
    loader = AdaptiveDataLoader(Latency(100_000), batch_size=2, num_workers=n, max_workers=n)
    deadline = time.monotonic() + 60.0
    try:
        with caplog.at_level(logging.INFO, logger="trainperf.loader"):
            for i, _ in enumerate(loader):
                if i == 20:
                    os.sched_setaffinity(0, half)
                if loader.tuning_history or time.monotonic() > deadline:
                    break
    finally:
        os.sched_setaffinity(0, before)
        loader.close()
    (change,) = loader.tuning_history
    assert change.reason == "cpus" and change.old == (n, 2) and change.new[0] < n
    assert change.epoch == 0 and change.epoch_batch > 20
    assert f"usable CPUs {n} → {len(half)}" in change.why
    assert [r.getMessage() for r in caplog.records] == [f"loader retuned: {change}"]


@pytest.mark.slow
def test_a_loader_a_checkpointer_tracks_changes_at_epoch_boundaries_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # The Checkpointer wraps the index sampler and counts each iterator's draws; a pool
    # replaced under it once scrambled the order and then hung starting the new pool.
    from trainperf import Checkpointer

    seen = _force_changes(monkeypatch)

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(3)

    expected = _epochs(DataLoader(Indices(), batch_size=4, shuffle=True, generator=gen()), 1)[0]
    loader = AdaptiveDataLoader(Indices(), batch_size=4, shuffle=True, generator=gen())
    assert loader.epoch_boundaries_only is None
    Checkpointer(tmp_path / "ckpt").restore({"loader": loader})
    assert "index sampler is wrapped" in (loader.epoch_boundaries_only or "")
    try:
        got = _epochs(loader, 1)[0]
    finally:
        loader.close()
    assert got == expected and seen == []
