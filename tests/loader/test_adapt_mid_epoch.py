"""Mid-epoch changes: whatever pools replace each other at batch boundaries, the samples
and their order are those of the plain DataLoader with the same seed."""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
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

import trainperf.loader._adapt_retune as adapt_retune
import trainperf.loader._adapt_timed as adapt_timed
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


def _force_changes(
    monkeypatch: pytest.MonkeyPatch, cycle: list[tuple[int, int | None]] = _CYCLE
) -> list[int]:
    """Check after every batch and change the setting at every check (to each of ``cycle``
    in turn); returns the list the checks' worker counts are appended to."""
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(adapt_timed, "_CHECK_BATCHES", 0)
    settings: Iterator[tuple[int, int | None]] = itertools.cycle(cycle)
    seen: list[int] = []

    def decide(f: EpochFigures, **kw: Any) -> Change | None:
        seen.append(f.num_workers)
        n, pf = next(settings)
        return Change(n, pf, "input-bound", "forced")

    monkeypatch.setattr(adapt_retune, "decide", decide)
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


class LongStream(IterableDataset[int]):
    """30 items, sharded across workers: with batch_size=4 and drop_last=True one worker
    drops 2 of them, three workers (10 items each) drop 6."""

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        return iter(range(30) if info is None else range(info.id, 30, info.num_workers))


def test_a_stream_with_drop_last_gets_no_more_workers_than_it_was_built_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: workers were added (each drops its own last partial batch), so an epoch gave
    # 24 samples where the loader as built (and autotune_loader's) gives 28.
    asked: list[int] = []

    def decide(f: EpochFigures, **kw: Any) -> Change | None:  # as the rules: within the bound
        asked.append(kw["max_workers"])
        n = min(3, kw["max_workers"])
        return None if n == f.num_workers else Change(n, 2, "input-bound", "forced")

    monkeypatch.setattr(adapt_retune, "decide", decide)
    plain = _epochs(DataLoader(LongStream(), batch_size=4, drop_last=True), 1)[0]
    loader = AdaptiveDataLoader(LongStream(), batch_size=4, drop_last=True)
    try:
        got = _epochs(loader, 3)
    finally:
        loader.close()
    assert len(plain) == 28
    assert [len(e) for e in got] == [28, 28, 28]
    assert asked and set(asked) == {0} and loader.tuning_history == []


def test_a_stream_with_drop_last_keeps_the_worker_count_it_was_built_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: only more workers were refused; fewer (3 -> 1) changed the samples an epoch
    # drops too, [24, 28, 28] where the loader as built gives 24.
    def decide(f: EpochFigures, **kw: Any) -> Change | None:
        return None if f.num_workers == 1 else Change(1, 2, "cpu-bound", "forced")

    monkeypatch.setattr(adapt_retune, "decide", decide)
    plain = _epochs(DataLoader(LongStream(), batch_size=4, drop_last=True, num_workers=3), 1)
    loader = AdaptiveDataLoader(LongStream(), batch_size=4, drop_last=True, num_workers=3)
    try:
        got = _epochs(loader, 3)
    finally:
        loader.close()
    assert [len(e) for e in got] == [len(plain[0])] * 3 and loader.tuning_history == []


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
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.3)
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
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.3)
    # Busy workers (a core each) without burning this machine's cores on it, and no other
    # load counted: the rule under test is the CPUs' change.
    monkeypatch.setattr(adapt_timed.Workers, "cores", lambda self: float(len(self.procs)))
    monkeypatch.setattr(adapt_timed, "cpu_mark", lambda: None)
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


def test_a_checkpoint_saved_after_a_pool_change_resumes_in_the_saved_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # A pool started at an epoch boundary (persistent_workers asked for, a seeded
    # generator) drew its base seed from the private generator by setting
    # loader.generator to it, and its first indices were pulled (where the Checkpointer
    # records the generator's state) before it was put back: the resume replayed the
    # private generator's state into the caller's and gave another order.
    from trainperf import Checkpointer

    _force_changes(monkeypatch, [(1, 2)])

    def build(cls: Any) -> Any:
        g = torch.Generator().manual_seed(3)
        return cls(Indices(), batch_size=4, shuffle=True, generator=g, num_workers=2,
                   persistent_workers=True)  # fmt: skip

    plain = build(DataLoader)
    try:
        expected = _epochs(plain, 3)
    finally:
        _close(plain)
    loader = build(AdaptiveDataLoader)
    state = {"loader": loader}
    Checkpointer(tmp_path).restore(state)
    try:
        got = _epochs(loader, 1)
        got.append([])
        for batch in loader:  # the change, 2 -> 1 worker, is made as this epoch starts
            got[1] += [int(x) for x in batch]
            if len(got[1]) == 12:
                Checkpointer(tmp_path).save(state, step=11)
                break
        assert [c.new for c in loader.tuning_history] == [(1, 2)]
    finally:
        loader.close()
    resumed = build(AdaptiveDataLoader)
    Checkpointer(tmp_path).restore({"loader": resumed})
    try:
        got[1] += _epochs(resumed, 1)[0]
        got += _epochs(resumed, 1)
    finally:
        resumed.close()
    assert got == expected


class Corrupt(Dataset[int]):
    """Sample 9 cannot be read: the loop catches the error and goes on."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> int:
        if i == 9:
            raise ValueError("corrupt sample 9")
        return i


def _going_on_after(
    loader: Any, error: type[Exception] = ValueError, mark: str = "ERR"
) -> list[int | str]:
    """The samples a loop that catches ``error`` and goes on gets, ``mark`` where it
    caught one."""
    out: list[int | str] = []
    it = iter(loader)
    while True:
        try:
            out += [int(x) for x in next(it)]
        except StopIteration:
            return out
        except error as e:
            assert error is not RuntimeError or "timed out" in str(e)
            out.append(mark)


@pytest.mark.slow  # worker pools started at most batches
@pytest.mark.parametrize("start", [0, 2])
def test_a_batch_that_failed_to_load_is_not_replayed_by_a_later_pool(
    monkeypatch: pytest.MonkeyPatch, start: int
) -> None:
    # The DataLoader uses the failed batch up; not counting it made the next pool replay
    # a delivered one (7, ERR, 10, 11, 10, 11, 12).
    _force_changes(monkeypatch)
    plain = DataLoader(Corrupt(), batch_size=2, num_workers=start)
    try:
        expected = _going_on_after(plain)
    finally:
        _close(plain)
    loader = AdaptiveDataLoader(Corrupt(), batch_size=2, num_workers=start)
    try:
        got = _going_on_after(loader)
    finally:
        loader.close()
    assert expected[7:11] == [7, "ERR", 10, 11]
    assert got == expected
    after = [c for c in loader.tuning_history if c.epoch_batch > 4]
    assert after  # pools changed after the error, mid-epoch


class SlowOnce(Dataset[int]):
    """Sample 9's first read takes longer than the loader's ``timeout``; later reads (by
    any worker: a marker file says so) are quick."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> int:
        if i == 9 and not self.marker.exists():
            time.sleep(1.5)  # a worker stopped meanwhile (a pool change) leaves no marker
            self.marker.touch()
        return i


def _retrying_timeouts(loader: Any) -> list[int | str]:
    return _going_on_after(loader, RuntimeError, "TIMEOUT")


def _timed_out_before_batch_four(got: list[int | str]) -> bool:
    """Samples 0-29 in order, with a timeout between 7 and 8 (a loaded host may add one
    while the workers start, too)."""
    return [x for x in got if x != "TIMEOUT"] == list(range(30)) and got[got.index(8) - 1] == (
        "TIMEOUT"
    )


def _changes_after_batch_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    """No change until the loop has batch 8, then one at every check: the first pool reads
    batch 4 and the loop waits for it (a change would shut that pool down, and a worker
    being shut down finishes its sample first)."""
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(adapt_timed, "_CHECK_BATCHES", 0)
    settings: Iterator[tuple[int, int | None]] = itertools.cycle([(2, 2), (3, 1), (1, 3)])

    def decide(f: EpochFigures, **kw: Any) -> Change | None:
        if _WATCHED[0]._yielded < 9:
            return None
        n, pf = next(settings)
        return Change(n, pf, "input-bound", "forced")

    monkeypatch.setattr(adapt_retune, "decide", decide)


_WATCHED: list[AdaptiveDataLoader] = []  # the loader _changes_after_batch_eight reads


def _timeouts(tmp_path: Path, name: str) -> tuple[list[int | str], AdaptiveDataLoader]:
    loader = AdaptiveDataLoader(SlowOnce(tmp_path / name), batch_size=2, num_workers=2, timeout=0.5)
    _WATCHED[:] = [loader]
    try:
        return _retrying_timeouts(loader), loader
    finally:
        loader.close()


@pytest.mark.slow  # waits for timeouts, worker pools started at most batches
def test_a_batch_that_timed_out_is_delivered_once_when_the_loop_retries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A timeout uses no batch up (the DataLoader waits for the same one on the next call):
    # counting each as used made the next pool skip as many batches.
    plain = DataLoader(SlowOnce(tmp_path / "plain"), batch_size=2, num_workers=2, timeout=0.5)
    try:
        expected = _retrying_timeouts(plain)
    finally:
        _close(plain)
    assert _timed_out_before_batch_four(expected)
    _changes_after_batch_eight(monkeypatch)
    got, loader = _timeouts(tmp_path, "adaptive")
    assert _timed_out_before_batch_four(got)  # 1.5 s against a 0.5 s timeout: one or more
    assert [x for x in got if x != "TIMEOUT"] == list(range(30))  # was: 14-17 skipped
    assert [c for c in loader.tuning_history if c.epoch_batch > 5]  # changes after it


@pytest.mark.slow  # worker pools started at most batches
def test_a_loader_with_a_timeout_can_go_down_to_no_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # DataLoader refuses a timeout without workers (an AssertionError at the next batch):
    # the adaptive loader sets it aside while none run, and back once they do.
    _force_changes(monkeypatch)  # 0 workers among the settings
    got, loader = _timeouts(tmp_path, "adaptive")
    assert [x for x in got if x != "TIMEOUT"] == list(range(30))
    assert any(c.new[0] == 0 for c in loader.tuning_history)
    assert loader.timeout == (0 if loader.num_workers == 0 else 0.5)


class Augmented(Dataset[tuple[int, float]]):
    """Each sample is its index and a random draw (a random augmentation in a worker)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, float(torch.rand(()))


def _augmented(seed: int, adaptive: bool) -> tuple[list[int], list[float], list[int]]:
    torch.manual_seed(seed)
    kw: dict[str, Any] = {"batch_size": 1, "shuffle": True, "num_workers": 1}
    loader = (AdaptiveDataLoader if adaptive else DataLoader)(Augmented(), **kw)
    try:
        batches = list(loader)
    finally:
        _close(loader)
    history = getattr(loader, "tuning_history", [])
    starts = [c.epoch_batch for c in history if c.epoch_batch > 0]
    return [int(i) for i, _ in batches], [float(v) for _, v in batches], starts


@pytest.mark.slow  # a worker pool per few batches
def test_each_mid_epoch_pool_draws_new_worker_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pools in one epoch all used seed initial_seed() + epoch (0 + epoch without a
    # generator, whatever torch.manual_seed said): they replayed the same random streams.
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(adapt_timed, "_CHECK_BATCHES", 2)
    settings = itertools.cycle([(2, 2), (1, 2)])
    monkeypatch.setattr(
        adapt_retune, "decide", lambda f, **kw: Change(*next(settings), "cpus", "x")
    )
    plain_indices, _, _ = _augmented(5, adaptive=False)
    indices, values, starts = _augmented(5, adaptive=True)
    assert indices == plain_indices  # the sample sequence is untouched
    assert len(starts) >= 3
    assert len(set(values)) == len(values)  # no pool replays another's draws
    other_indices, other_values, other_starts = _augmented(6, adaptive=True)
    assert other_starts == starts and other_indices != indices
    assert values[starts[0] :] != other_values[starts[0] :]  # follows torch.manual_seed
    assert not set(values[starts[0] :]) & set(other_values[starts[0] :])


def test_a_wrapped_index_sampler_gets_the_real_sampler_and_keeps_nothing() -> None:
    # With the index sampler wrapped, nothing reported received batches to the plan:
    # it kept every item of the epoch (10,000 after one unbatched epoch).
    class Wrapped(AdaptiveDataLoader):
        @property
        def _index_sampler(self) -> Any:
            return AdaptiveDataLoader._index_sampler.__get__(self)  # type: ignore[attr-defined]

    loader = Wrapped(range(300), batch_size=None, max_workers=0)  # no pool to start
    assert "index sampler is wrapped" in (loader.epoch_boundaries_only or "")
    try:
        for _ in range(2):
            assert [int(x) for x in loader] == list(range(300))
    finally:
        loader.close()
    plan = loader._plan
    assert plan is None or len(plan._pending) == 0
    assert loader._index_sampler is loader._real_index_sampler


class SlowStart(Dataset[int]):
    """A first batch that takes long, as a new pool's start-up does (16 spawn workers:
    13 s on 2 cores), then quick ones."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> int:
        time.sleep(0.4 if i == 0 else 0.001)
        return i


def test_a_check_judges_the_window_after_its_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a check was due 2 s after the window began, start-up included, so a pool
    # slow to start was judged on the 4 batches after it (16 spawn workers "gave 99
    # samples/s" against 4,000) and the no-gain rule took them away for good.
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.2)
    running: list[float] = []

    def check(loader: Any, it: Any) -> None:
        running.append(time.perf_counter() - it.started - it.startup_s)
        it.new_window()

    monkeypatch.setattr(adapt_timed, "check", check)
    loader = AdaptiveDataLoader(SlowStart(), batch_size=1, max_workers=0)
    for _ in loader:
        pass
    assert running and min(running) >= 0.2
