"""trainperf.loader._iterable: an IterableDataset that does not shard across workers (#20.7).

Without ``get_worker_info()`` sharding every worker replays the whole stream: with 8
workers an epoch of 2,000 samples yields 16,000. The tuner finds it on a short probe and
keeps ``num_workers=0`` with a warning that shows the fix; a stream that shards keeps its
workers.
"""

from __future__ import annotations

import itertools
import random
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tests.loader._fakes import quick
from trainperf.limits import HostLimits
from trainperf.loader import CandidateResult, TuningReport, tune_loader
from trainperf.loader._cached import cache_entry, cache_misfit
from trainperf.loader._iterable import (
    SHARDING_EXAMPLE,
    ShardCheck,
    check_sharding,
    duplicated,
    fingerprint,
)

N = 64


class Replaying(IterableDataset[torch.Tensor]):
    """Not worker-aware: every worker yields all N samples."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s

    def samples(self) -> Iterator[torch.Tensor]:
        for i in range(N):
            if self.sleep_s:
                time.sleep(self.sleep_s)
            yield torch.full((4,), float(i))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.samples()


class Sharded(Replaying):
    """The fix the warning shows: each worker yields (and reads) its share."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        n, i = (1, 0) if info is None else (info.num_workers, info.id)
        for x in itertools.islice(range(N), i, None, n):
            if self.sleep_s:
                time.sleep(self.sleep_s)  # reading only this worker's samples
            yield torch.full((4,), float(x))


class Augmenting(Replaying):
    """Not worker-aware, and every sample gets noise from the global generators (which
    torch seeds differently in each worker)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for x in self.samples():
            yield x + torch.rand(4) + random.random() + float(np.random.rand())


class OwnGenerator(Replaying):
    """Not worker-aware, shuffling with a generator of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in self.rng.permutation(N):
            yield torch.full((4,), float(i))


class Constant(IterableDataset[torch.Tensor]):
    """A synthetic stream: every sample alike, so content cannot tell."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.zeros(4) for _ in range(N))


class ShardedByInit(IterableDataset[int]):
    """Sharded the other way torch documents: ``worker_init_fn`` sets each copy's range."""

    def __init__(self) -> None:
        self.start, self.end = 0, N

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


def split_range(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    ds = info.dataset
    per = (ds.end - ds.start) // info.num_workers
    ds.start, ds.end = ds.start + worker_id * per, ds.start + (worker_id + 1) * per


def epoch_samples(report: TuningReport, dataset: Any) -> int:
    loader = DataLoader(dataset, **report.best_kwargs)
    return sum(len(b) for b in loader)


# ------------------------------------------------------------------ the decision rule


def test_duplicated_needs_agreeing_varied_items() -> None:
    assert duplicated(list("abcd"), list("abcd")) is True
    assert duplicated(list("abcdef"), list("abcd")) is True  # compared where both reached
    assert duplicated(list("ab"), list("ac")) is False
    assert duplicated(list("a"), list("b"), enough=4) is False  # one differing item is enough
    assert duplicated(list("abc"), list("abc")) is None  # fewer than enough
    assert duplicated(list("aaaa"), list("aaaa")) is None  # a constant stream
    assert duplicated([], list("abcd")) is None
    assert duplicated(list("ab"), list("ab"), enough=2) is True


def test_fingerprint_follows_content_not_identity() -> None:
    a = {"x": torch.arange(6).reshape(2, 3), "y": np.ones(3), "name": "a.jpg", "i": [1, 2]}
    b = {"x": torch.arange(6).reshape(2, 3), "y": np.ones(3), "name": "a.jpg", "i": [1, 2]}
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(torch.zeros(2)) != fingerprint(torch.zeros(2, 1))  # shape counts
    assert fingerprint(torch.zeros(2)) != fingerprint(torch.zeros(2, dtype=torch.float64))
    assert fingerprint(torch.zeros(3, dtype=torch.bfloat16)) == fingerprint(
        torch.zeros(3, dtype=torch.bfloat16)
    )
    # Other objects by their pickled state.
    assert fingerprint(Replaying(0.5)) == fingerprint(Replaying(0.5))
    assert fingerprint(Replaying(0.5)) != fingerprint(Replaying(0.25))


# ------------------------------------------------------------------ the probe


@pytest.mark.slow  # about 1 s: four probes with two workers each
@pytest.mark.parametrize(
    ("make", "expected"),
    [(Replaying, True), (Augmenting, True), (OwnGenerator, True), (Sharded, False)],
    ids=["replaying", "augmenting", "own-generator", "sharded"],
)
def test_check_sharding_tells_a_replaying_stream_from_a_sharded_one(
    make: Any, expected: bool
) -> None:
    check = check_sharding(make(), {}, time.perf_counter() + 30)
    assert check.duplicated is expected, check
    assert check.why is None


@pytest.mark.slow  # about 0.5 s each
def test_sharding_by_worker_init_fn_counts_and_a_constant_stream_is_undecided() -> None:
    by_init = {"worker_init_fn": split_range}
    check = check_sharding(ShardedByInit(), by_init, time.perf_counter() + 30)
    assert check.duplicated is False
    check = check_sharding(Constant(), {}, time.perf_counter() + 30)
    assert check.duplicated is None and check.why == "its first items are all alike"


@pytest.mark.slow  # about 0.5 s
def test_the_probe_disturbs_neither_the_dataset_nor_any_generator() -> None:
    ds = OwnGenerator()
    before = ds.rng.bit_generator.state
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert check_sharding(ds, {}, time.perf_counter() + 30).duplicated is True
    assert ds.rng.bit_generator.state == before  # the workers shuffled copies
    assert random.getstate() == states[0]
    assert (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


def test_no_time_left_is_undecided_without_starting_workers() -> None:
    check = check_sharding(Replaying(), {}, time.perf_counter())
    assert check == ShardCheck(None, 0, "the time budget ran out first", 0.0)


# ------------------------------------------------------------------ end to end


@pytest.mark.slow  # about 2 s: the baseline and the probe
def test_a_replaying_stream_keeps_zero_workers_with_a_warning_showing_the_fix() -> None:
    ds = Replaying(sleep_s=0.002)  # workers would look 2x-4x faster
    with pytest.warns(RuntimeWarning, match="does not shard its stream") as caught:
        report = tune_loader(ds, 4, **quick(max_workers=4, cache=True))
    message = str(caught[0].message)
    assert SHARDING_EXAMPLE in message and "get_worker_info()" in message
    assert caught[0].filename == __file__  # it names the caller's line
    assert report.num_workers == 0
    assert epoch_samples(report, ds) == N  # not N per worker
    (row,) = [c for c in report.candidates if c.num_workers > 0]
    assert (row.status, row.fault) == ("failed", "unsharded")
    assert "Replaying is an IterableDataset that does not shard" in str(report)
    # Not cached: the next call checks again, and sees a fixed dataset.
    assert any(n.startswith("not cached") for n in report.notes)


@pytest.mark.slow  # about 2 s
def test_the_callers_num_workers_on_a_replaying_stream_is_replaced_and_said_why() -> None:
    with pytest.warns(RuntimeWarning, match="does not shard"):
        report = tune_loader(Replaying(), 4, **quick(max_workers=4, num_workers=3))
    assert report.num_workers == 0
    assert report.user_setting is not None and not report.user_setting.kept
    assert "not measured: Replaying is an IterableDataset" in report.user_setting.verdict


@pytest.mark.slow  # about 4-6 s: a real search with workers
def test_a_sharded_stream_still_gets_workers() -> None:
    ds = Sharded(sleep_s=0.01)  # I/O-bound: workers overlap their waits
    # 20 s: a loaded host took more than 6.9 s to start a worker and deliver one batch.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        report = tune_loader(ds, 4, **quick(max_workers=2, budget_s=20.0))
    assert report.num_workers >= 1, str(report)
    assert all(c.fault != "unsharded" for c in report.candidates)
    assert epoch_samples(report, ds) == N


@pytest.mark.slow  # about 1 s
def test_a_constant_stream_is_measured_as_before_with_a_note() -> None:
    report = tune_loader(Constant(), 4, **quick(max_workers=1))
    assert any("could not tell whether the IterableDataset shards" in n for n in report.notes)
    assert all(c.fault != "unsharded" for c in report.candidates)


def test_an_iterable_datasets_workers_cached_before_the_check_are_not_trusted() -> None:
    limits = HostLimits(4, 4, None, 4, 2**33, None, 2**32, None, None)
    two = CandidateResult(2, 2, False, "ok", samples_per_s=200.0)
    report = TuningReport(
        {"num_workers": 2}, 200.0, 100.0, None, (two,), 1.0, 5.0, limits, 4, 3, 8, "cpu", 32
    )
    best = {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}
    entry = cache_entry(report, best, 0, 0)
    common = {"max_workers": 8, "cpus": 4}
    assert cache_misfit(entry, limits, common, iterable=True) is None
    del entry["sharding_checked"]  # an entry written before the check existed
    why = cache_misfit(entry, limits, common, iterable=True)
    assert why is not None and "before tune_loader checked that an IterableDataset" in why
    assert cache_misfit(entry, limits, common) is None  # a map-style dataset: nothing to check
    entry["best"] = {**best, "num_workers": 0, "prefetch_factor": None}
    assert cache_misfit(entry, limits, common, iterable=True) is None  # no workers: fine


# ------------------------------------------------------------------ the adaptive loader


def _epoch_values(loader: Any) -> list[int]:
    return [int(x) for b in loader for x in b[:, 0].tolist()]


@pytest.mark.slow  # about 2 s: two epochs waiting on I/O and the probe
def test_the_adaptive_loader_keeps_a_replaying_stream_at_zero_workers() -> None:
    from trainperf.loader import AdaptiveDataLoader

    loader = AdaptiveDataLoader(Replaying(sleep_s=0.003), batch_size=4, max_workers=4)
    try:
        first = _epoch_values(loader)  # waits for data: the rules would add workers
        with pytest.warns(RuntimeWarning, match="AdaptiveDataLoader keeps num_workers=0"):
            second = _epoch_values(loader)
        third = _epoch_values(loader)  # checked once: no second warning, no workers
    finally:
        loader.close()
    assert first == second == third == list(range(N))
    assert loader.num_workers == 0 and loader.tuning_history == []


@pytest.mark.slow  # about 2 s: three epochs waiting on I/O
def test_the_adaptive_loader_probes_a_stream_only_when_the_probes_workers_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainperf.loader import AdaptiveDataLoader, _adapt_retune

    # Memory for one worker, not for the probe's two: no probe (and no increase) yet.
    monkeypatch.setattr(AdaptiveDataLoader, "fits", lambda self, n, pf, limits=None: n <= 1)
    probed: list[int] = []
    monkeypatch.setattr(_adapt_retune, "check_sharding", lambda *a, **k: probed.append(1))
    loader = AdaptiveDataLoader(Replaying(sleep_s=0.003), batch_size=4, max_workers=4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            epochs = [_epoch_values(loader) for _ in range(3)]
    finally:
        loader.close()
    assert probed == [] and loader.num_workers == 0 and loader.tuning_history == []
    assert epochs == [list(range(N))] * 3


@pytest.mark.slow  # about 3 s
def test_autotune_loader_adapt_keeps_the_tuners_refusal_of_a_replaying_stream() -> None:
    from trainperf.loader import AdaptiveDataLoader, autotune_loader

    ds = Replaying(sleep_s=0.003)
    with pytest.warns(RuntimeWarning, match="tune_loader keeps num_workers=0"):
        loader = autotune_loader(ds, 4, adapt=True, **quick(max_workers=4, budget_s=5.0))
    assert isinstance(loader, AdaptiveDataLoader) and loader._max_workers == 0
    try:
        assert [_epoch_values(loader) for _ in range(2)] == [list(range(N))] * 2
    finally:
        loader.close()
    assert loader.num_workers == 0


@pytest.mark.slow  # about 3 s
def test_the_adaptive_loader_gives_a_sharded_stream_workers() -> None:
    from trainperf.loader import AdaptiveDataLoader

    loader = AdaptiveDataLoader(Sharded(sleep_s=0.003), batch_size=4, max_workers=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            epochs = [sorted(_epoch_values(loader)) for _ in range(2)]
    finally:
        loader.close()
    assert epochs == [list(range(N))] * 2
    assert loader.num_workers > 0 and loader.tuning_history


class _FailsInWorkers(Replaying):
    """Reads fine in the main process; every worker raises."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        if get_worker_info() is not None:
            raise OSError("no handle to the stream in a worker")
        return self.samples()


@pytest.mark.slow  # about 2 s
def test_the_adaptive_loader_adds_no_workers_when_the_probe_cannot_tell() -> None:
    from trainperf.loader import AdaptiveDataLoader

    loader = AdaptiveDataLoader(_FailsInWorkers(sleep_s=0.003), batch_size=4, max_workers=4)
    try:
        first = _epoch_values(loader)
        with pytest.warns(RuntimeWarning, match=r"could not tell whether _FailsInWorkers"):
            second = _epoch_values(loader)
    finally:
        loader.close()
    assert first == second == list(range(N))
    assert loader.num_workers == 0 and loader.tuning_history == []


def test_a_sharded_stream_with_drop_last_keeps_the_callers_workers_and_says_why() -> None:
    # Before: workers each dropped their own last partial batch: with 8 workers an epoch
    # of 300 samples in batches of 16 lost 32 more samples than the caller's loader.
    ds = Sharded(sleep_s=0.01)  # I/O-bound: without drop_last it would get workers
    report = tune_loader(ds, 5, **quick(max_workers=2, drop_last=True))
    assert report.num_workers == 0 and report.max_workers == 0
    kept_note = "num_workers kept at your 0: with drop_last=True"
    assert any(n.startswith(kept_note) for n in report.notes)
    kept = tune_loader(ds, 5, **quick(max_workers=2, drop_last=True, num_workers=1))
    assert kept.num_workers <= 1


def test_tail_batches_bounds_only_an_iterable_dataset_with_drop_last() -> None:
    from trainperf.loader._iterable import tail_batches

    assert tail_batches(list(range(8)), {"drop_last": True}) == (None, None)
    assert tail_batches(Sharded(), {"drop_last": True, "num_workers": 3})[0] == 3
    cap, note = tail_batches(Sharded(), {})
    assert cap is None and note is not None and "partial batch" in note
