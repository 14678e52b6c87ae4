"""The adaptive loader: order kept whatever it changes, workers added to a waiting loop,
fewer when the usable CPUs halve, old pools shut down, every change recorded."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import logging
import multiprocessing
import pickle
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import trainperf.loader._adapt as adapt
import trainperf.loader._adapt_pool as adapt_pool
import trainperf.loader._adapt_retune as adapt_retune
import trainperf.loader._adapt_rules as _adapt_rules
import trainperf.loader._adapt_timed as adapt_timed
from tests.loader._fakes import quick
from trainperf.limits import HostLimits, usable_cpus
from trainperf.loader import AdaptiveDataLoader, CandidateResult, TuningChange, autotune_loader
from trainperf.loader._adapt import memory_rules
from trainperf.loader._adapt_measure import cpu_mark, host_busy
from trainperf.loader._adapt_retune import decide_change
from trainperf.loader._adapt_rules import Change, EpochFigures
from trainperf.loader._search import adaptive_max_workers, default_max_workers


class Latency(Dataset[int]):
    """I/O latency: 4 ms per sample, almost no CPU."""

    def __init__(self, n: int = 48) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(0.004)
        return i


def _epochs(loader: Any, epochs: int) -> list[list[int]]:
    return [[int(x) for b in loader for x in b] for _ in range(epochs)]


def _scripted(
    monkeypatch: pytest.MonkeyPatch, settings: list[tuple[int, int | None] | None]
) -> None:
    """Replace the rules by a script: epoch k+1 runs with ``settings[k]`` (None: no change)."""
    script: Iterator[tuple[int, int | None] | None] = iter(settings)

    def decide(f: EpochFigures, **kw: Any) -> Change | None:
        step = next(script)
        return None if step is None else Change(step[0], step[1], "input-bound", "scripted")

    monkeypatch.setattr(adapt_retune, "decide", decide)


def _seeded(own: bool) -> torch.Generator | None:
    if own:
        return torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("persistent", "own"), [(False, True), (False, False), (True, True), (True, False)]
)
def test_sample_order_is_the_fixed_loaders_whatever_changes(
    monkeypatch: pytest.MonkeyPatch, persistent: bool, own: bool
) -> None:
    # None: an epoch that keeps its pool (no new iterator, so no draw from the generator).
    plan: list[tuple[int, int | None] | None] = [(2, 2), None, (1, 3), (0, None), (2, 2)]
    _scripted(monkeypatch, plan)
    start = 2 if persistent else 0
    kw: dict[str, Any] = {"batch_size": 5, "shuffle": True, "persistent_workers": persistent}
    ds = Latency(24)
    fixed = DataLoader(ds, num_workers=start, generator=_seeded(own), **kw)
    expected = _epochs(fixed, 6)
    loader = AdaptiveDataLoader(ds, num_workers=start, generator=_seeded(own), **kw)
    try:
        got = _epochs(loader, 6)
    finally:
        for done in (loader, fixed):  # persistent pools live until shut down or collected
            if done._iterator is not None:
                done._iterator._shutdown_workers()  # type: ignore[attr-defined]
    assert got == expected
    assert [c.new for c in loader.tuning_history] == [p for p in plan if p is not None]
    # The workers it started were kept between epochs, unless persistent_workers=False.
    assert loader.persistent_workers == persistent
    assert len({tuple(e) for e in got}) > 1  # the shuffle did shuffle


def test_order_kept_with_the_global_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [(0, None), (0, None)])
    torch.manual_seed(3)
    expected = _epochs(DataLoader(range(20), batch_size=4, shuffle=True), 3)
    torch.manual_seed(3)
    assert _epochs(AdaptiveDataLoader(range(20), batch_size=4, shuffle=True), 3) == expected


@pytest.mark.slow
def test_a_waiting_loop_gets_workers_after_the_first_epoch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = AdaptiveDataLoader(Latency(), batch_size=4, max_workers=4)
    with caplog.at_level(logging.INFO, logger="trainperf.loader"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning-free path: no DataLoader warning either
        try:
            first = _epochs(loader, 1)
            assert loader.num_workers == 0
            second = _epochs(loader, 1)
        finally:
            loader.close()
    assert first == second == [list(range(48))]
    assert loader.num_workers > 0
    (change,) = loader.tuning_history
    assert change.reason == "input-bound" and change.epoch == 1
    assert change.old == (0, None) and change.new == (loader.num_workers, 2)
    assert change.figures.wait_share > 0.5 and change.figures.batches == 12
    assert f"workers=0 prefetch=- → workers={loader.num_workers} prefetch=2" in str(change)
    assert "samples/s" in str(change)
    assert [r.getMessage() for r in caplog.records] == [f"loader retuned: {change}"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_halved_usable_cpus_mean_fewer_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = {"now": 8}
    monkeypatch.setattr(adapt, "usable_cpus", lambda *a, **kw: cpus["now"])
    monkeypatch.setattr(adapt_timed, "usable_cpus", lambda *a, **kw: cpus["now"])
    # Busy workers (a core each) without burning this machine's two cores on it, and a
    # host whose other load is not counted: the rule under test is the CPUs' change.
    monkeypatch.setattr(adapt_timed.Workers, "cores", lambda self: float(len(self.procs)))
    monkeypatch.setattr(adapt_timed, "cpu_mark", lambda: None)
    loader = AdaptiveDataLoader(Latency(24), batch_size=4, num_workers=6, max_workers=6)

    def epoch() -> list[int]:  # a step that sleeps: it leaves its core to the workers
        return [x for b in loader for x in b.tolist() if time.sleep(0.002) is None]

    try:
        assert epoch() == list(range(24))
        assert loader.num_workers == 6 and loader.tuning_history == []
        cpus["now"] = 4
        epoch()
        epoch()
    finally:
        loader.close()
    change = loader.tuning_history[0]
    assert change.reason == "cpus" and change.old == (6, 2) and change.new == (4, 2)
    assert "usable CPUs 8 → 4" in change.why
    assert loader.num_workers == 4


@pytest.mark.slow
def test_a_persistent_pool_is_shut_down_before_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [(1, 2), (1, 2)])
    loader = AdaptiveDataLoader(Latency(16), batch_size=4, num_workers=2, persistent_workers=True)
    for _ in loader:
        pass
    old = [w.pid for w in loader._iterator._workers]  # type: ignore[union-attr]
    assert len(old) == 2 and all(psutil.pid_exists(p) for p in old)
    it = iter(loader)
    gone = [not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie" for p in old]
    assert gone == [True, True]
    assert len(it._timed.it._workers) == 1  # type: ignore[attr-defined]
    for _ in it:
        pass
    loader.close()
    assert loader._iterator is None


def _worker_pids(loader: AdaptiveDataLoader) -> list[int]:
    """The pids of the workers of the loader's current epoch."""
    assert loader._current is not None
    return [w.pid for w in loader._current.it._workers]


def _stopped(pids: list[int], within_s: float = 10.0) -> bool:
    """Whether every process of ``pids`` has exited (or is a zombie) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        running = [p for p in pids if psutil.pid_exists(p)]
        with contextlib.suppress(psutil.NoSuchProcess):
            running = [p for p in running if psutil.Process(p).status() != "zombie"]
        if not running or time.monotonic() > deadline:
            return not running
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["break", "del"])
def test_an_abandoned_epochs_workers_stop_once_its_iterator_is_let_go_of(how: str) -> None:
    # They ran on until the next iter(loader): the loader held the epoch's iterator. A
    # plain DataLoader's stop as soon as its iterator is dropped.
    loader = AdaptiveDataLoader(Latency(64), batch_size=4, num_workers=2)
    try:
        if how == "break":
            for i, _ in enumerate(loader):
                if i == 1:
                    old = _worker_pids(loader)
                    break
        else:
            it = iter(loader)
            next(it)
            old = _worker_pids(loader)
            del it
        assert len(old) == 2
        gc.collect()
        assert _stopped(old)
        # Nothing else is lost: the next epoch is whole, with new workers.
        assert [x for b in loader for x in b.tolist()] == list(range(64))
        assert len(loader.tuning_history) <= 1 and loader._epoch == 2
    finally:
        loader.close()


def test_a_persistent_pool_outlives_a_dropped_iterator_as_torchs_does() -> None:
    loader = AdaptiveDataLoader(Latency(16), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        it = iter(loader)
        next(it)
        pids = _worker_pids(loader)
        del it
        gc.collect()
        assert all(psutil.pid_exists(p) for p in pids)
        assert [w.pid for w in loader._iterator._workers] == pids  # type: ignore[union-attr]
    finally:
        loader.close()
    assert _stopped(pids)


@pytest.mark.parametrize("workers", [0, 2])
def test_two_iterators_at_once_raise_rather_than_split_or_lose_the_epoch(workers: int) -> None:
    # They shared one sampler (without workers each got every other batch) or the first
    # lost its workers (with them it ended at once, empty): silently short epochs.
    loader = AdaptiveDataLoader(list(range(16)), batch_size=4, num_workers=workers)
    with pytest.raises(RuntimeError, match=r"stopped before its epoch ended, by a newer iter"):
        for _a, _b in zip(loader, loader, strict=True):
            pass
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_peek_then_a_full_epoch_still_works(workers: int) -> None:
    loader = AdaptiveDataLoader(list(range(16)), batch_size=4, num_workers=workers)
    first = next(iter(loader))  # the peek's iterator is never used again
    assert first.tolist() == [0, 1, 2, 3]
    assert [x for b in loader for x in b.tolist()] == list(range(16))
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_used_after_close_raises_and_the_next_epoch_is_whole(workers: int) -> None:
    loader = AdaptiveDataLoader(list(range(16)), batch_size=4, num_workers=workers)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match=r"by close\(\).*once the loop is done"):
        next(it)
    assert [x for b in loader for x in b.tolist()] == list(range(16))
    loader.close()


def test_a_finished_epochs_iterator_stays_finished_after_close() -> None:
    loader = AdaptiveDataLoader(list(range(8)), batch_size=4)
    it = iter(loader)
    assert len(list(it)) == 2
    loader.close()
    assert list(it) == []


def _alive_children() -> set[int]:
    children = psutil.Process().children(recursive=True)
    return {c.pid for c in children if c.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.slow  # two workers start and stop: about a second
def test_a_loader_let_go_of_after_a_full_epoch_stops_its_workers_at_once() -> None:
    before = _alive_children()
    gc_was = gc.isenabled()
    gc.disable()  # freed by its reference count, as a plain DataLoader is
    try:
        loader = AdaptiveDataLoader(range(16), batch_size=4, num_workers=2, persistent_workers=True)
        assert [len(b) for b in loader] == [4, 4, 4, 4]
        assert _alive_children() - before  # the persistent pool
        del loader
        deadline = time.monotonic() + 10
        while _alive_children() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive_children() - before  # it was a cycle: alive until gc.collect()
    finally:
        if gc_was:
            gc.enable()


def test_a_loader_let_go_of_after_a_break_stops_its_persistent_workers_at_once() -> None:
    # The epoch's timing state, kept by the loader for the next iter(), held the loader
    # in turn: after a break that cycle kept the persistent pool alive until the cyclic GC
    # ran (a plain DataLoader's workers stop as soon as the loader is let go of).
    before = _alive_children()
    gc_was = gc.isenabled()
    gc.disable()  # freed by its reference count, as a plain DataLoader is
    try:
        loader = AdaptiveDataLoader(range(16), batch_size=4, num_workers=2, persistent_workers=True)
        for i, _ in enumerate(loader):
            if i == 1:
                break
        assert _alive_children() - before  # the persistent pool
        del loader
        deadline = time.monotonic() + 10
        while _alive_children() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive_children() - before
    finally:
        if gc_was:
            gc.enable()


def test_change_record_protocol() -> None:
    from trainperf.loader._adapt_rules import figures

    change = TuningChange(2, 1.7e9, (4, 2), (2, 2), "cpus", "usable CPUs 8 → 4", figures())
    d = json.loads(json.dumps(change.to_dict()))
    assert d["old"] == [4, 2] and d["reason"] == "cpus" and d["figures"]["cpus"] == 4
    assert str(change).startswith("epoch 2: workers=4 prefetch=2 → workers=2 prefetch=2 (cpus:")


def _limits(memory: int, shm: int | None) -> HostLimits:
    return HostLimits(4, 4, None, 4, 64 << 30, None, memory, shm, shm)


def test_memory_rule_is_the_tuners() -> None:
    loader = AdaptiveDataLoader(range(8), batch_size=4)
    # Nothing measured: a worker is assumed to copy the whole main process.
    rss = psutil.Process().memory_info().rss
    assert loader.fits(1, 2, _limits(64 << 30, None))
    assert not loader.fits(4, 2, _limits(int(4 * rss), None))
    # Measured by the tuner: 100 MiB a worker, 10 MiB batches; /dev/shm binds.
    measured = CandidateResult(1, 2, False, "ok", 1.0, worker_uss=100 << 20, batch_bytes=10 << 20)
    rules = memory_rules([measured], 8, rss, "fork")
    tuned = AdaptiveDataLoader(range(8), batch_size=4, tuner=rules)
    assert tuned.fits(8, 2, _limits(64 << 30, 1 << 30))
    assert not tuned.fits(8, 2, _limits(64 << 30, 100 << 20))  # 18 batches of 10 MiB


def test_under_ddp_the_limits_now_are_this_ranks_share(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 training processes on the host each start workers: 18 batches of 10 MiB in flight
    # fit 512 MiB of free /dev/shm, not the quarter of it that is this rank's.
    measured = CandidateResult(1, 2, False, "ok", 1.0, worker_uss=100 << 20, batch_bytes=10 << 20)
    tuned = AdaptiveDataLoader(
        range(8), batch_size=4, tuner=memory_rules([measured], 8, 1 << 30, "fork")
    )
    monkeypatch.setattr(adapt_pool, "host_limits", lambda: _limits(64 << 30, 512 << 20))
    assert tuned.fits(8, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert not tuned.fits(8, 2)


def test_without_a_tuning_the_batches_seen_bind_dev_shm() -> None:
    loader = AdaptiveDataLoader(TensorDataset(torch.zeros(8, 1 << 18)), batch_size=4)  # 4 MiB
    assert loader.fits(4, 2, _limits(64 << 30, 20 << 20))  # nothing seen yet
    assert sum(b[0].shape[0] for b in loader) == 8
    assert loader.fits(1, 2, _limits(64 << 30, 20 << 20))  # 4 batches in flight: 16 MiB
    assert not loader.fits(4, 2, _limits(64 << 30, 20 << 20))  # 10 batches: 40 MiB


def test_the_memory_rules_measure_nothing() -> None:
    with pytest.raises(RuntimeError, match="measures while it is iterated"):
        memory_rules([], 2, 0, "fork").measure(1, 2, False)


def test_host_busy_between_marks() -> None:
    assert host_busy(None, {0: (1.0, 1.0)}) is None
    assert host_busy({0: (0.0, 1.0)}, {0: (0.0, 1.0)}) is None  # no time passed
    assert host_busy({0: (0.0, 1.0), 1: (0.0, 1.0)}, {0: (2.0, 3.0)}) == 1.0
    before = cpu_mark()
    spin = time.perf_counter() + 0.1
    while time.perf_counter() < spin:
        pass
    busy = host_busy(before, cpu_mark())
    assert busy is not None and 0.0 < busy <= 1.0  # this process was busy meanwhile


@pytest.mark.slow
def test_autotune_loader_adapt_returns_an_adaptive_loader() -> None:
    loader = autotune_loader(Latency(16), 4, adapt=True, **quick(max_workers=0, budget_s=5.0))
    assert isinstance(loader, AdaptiveDataLoader)
    assert loader.num_workers == 0 and loader.tuning_report.num_workers == 0
    assert sorted(x for b in loader for x in b.tolist()) == list(range(16))
    plain = autotune_loader(Latency(16), 4, **quick(max_workers=0, budget_s=5.0))
    assert not isinstance(plain, AdaptiveDataLoader)


class _EpochStream(torch.utils.data.Dataset[int]):
    """A dataset that reshuffles by epoch through set_epoch(), as Hugging Face's do."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return (i + self.epoch) % 16


@pytest.mark.slow
def test_an_adaptive_loader_over_a_dataset_with_set_epoch_does_not_keep_its_workers() -> None:
    # Before: the workers it starts were kept between epochs, each with its own copy of the
    # dataset, which the caller's dataset.set_epoch(e) never reached.
    quiet = quick(max_workers=0, budget_s=3.0)
    assert not autotune_loader(_EpochStream(), 4, adapt=True, **quiet)._keep_workers
    kept = autotune_loader(_EpochStream(), 4, adapt=True, persistent_workers=True, **quiet)
    assert kept._keep_workers  # asked for: kept
    assert autotune_loader(Latency(16), 4, adapt=True, **quiet)._keep_workers


@pytest.mark.slow  # a worker pool started: about a second
def test_an_adaptive_loader_built_directly_over_a_set_epoch_dataset_reaches_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: built directly (not by autotune_loader), it kept the workers it added between
    # epochs, so dataset.set_epoch(e) never reached them: epoch 3 repeated epoch 2's
    # samples, where the plain DataLoader with the same arguments follows set_epoch.
    _scripted(monkeypatch, [(2, 2), None, None])
    ds = _EpochStream()
    loader = AdaptiveDataLoader(ds, batch_size=4)
    firsts = []
    try:
        for epoch in range(3):
            ds.set_epoch(epoch)
            epoch_batches = [b.tolist() for b in loader]  # a whole epoch
            firsts.append(epoch_batches[0][0])
    finally:
        loader.close()
    assert loader.num_workers == 2  # epochs 2 and 3 ran in workers
    assert firsts == [0, 1, 2]  # each epoch as set_epoch made it
    asked = AdaptiveDataLoader(ds, batch_size=4, persistent_workers=True, num_workers=1)
    assert asked._keep_workers  # asked for: kept


@pytest.mark.slow  # about 3 s: one short tuning run
def test_without_a_callers_bound_the_adaptive_loader_may_go_past_the_tuners() -> None:
    # The tuner tries up to four workers per CPU in its budget; the adaptive loader, which
    # tries each count while training and goes back when it does not pay, up to eight.
    loader = autotune_loader(
        TensorDataset(torch.zeros(64, 2)), 8, adapt=True, **quick(budget_s=3.0)
    )
    report = loader.tuning_report
    assert isinstance(loader, AdaptiveDataLoader)
    assert report.max_workers == default_max_workers(report.cpus)
    assert loader._max_workers == adaptive_max_workers(report.cpus) == 2 * report.max_workers
    assert AdaptiveDataLoader(range(8), batch_size=4)._max_workers == adaptive_max_workers(
        usable_cpus()
    )


@pytest.mark.slow
def test_keep_workers_false_restarts_them_each_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [(2, 2), (2, 2)])
    loader = AdaptiveDataLoader(Latency(8), batch_size=4, keep_workers=False)
    assert _epochs(loader, 3) == [list(range(8))] * 3
    assert loader.num_workers == 2 and not loader.persistent_workers
    assert loader._iterator is None


def test_persistent_workers_false_given_directly_means_fresh_workers_each_epoch() -> None:
    assert (
        AdaptiveDataLoader(range(8), batch_size=4, persistent_workers=False)._keep_workers is False
    )
    assert AdaptiveDataLoader(range(8), batch_size=4)._keep_workers is True
    kept = AdaptiveDataLoader(range(8), batch_size=4, persistent_workers=False, keep_workers=True)
    assert kept._keep_workers is True  # asked for by name


def test_a_timeout_given_without_workers_waits_for_the_ones_it_adds() -> None:
    loader = AdaptiveDataLoader(range(8), batch_size=4, timeout=5.0)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # it raised at iter()
    assert loader.timeout == 0 and loader._timeout_kept == 5.0


@pytest.mark.slow
def test_autotune_loader_keeps_a_timeout_however_many_workers_it_chooses() -> None:
    for adaptive in (False, True):
        loader = autotune_loader(
            Latency(8), 4, adapt=adaptive, timeout=5.0, **quick(max_workers=0, budget_s=5.0)
        )
        assert loader.num_workers == 0 and len(list(loader)) == 2  # it raised at iter()
        assert getattr(loader, "_timeout_kept", None) == (5.0 if adaptive else None)
        assert any("timeout dropped" in n for n in loader.tuning_report.notes)


class FailsInWorkers(torch.utils.data.Dataset[int]):
    """Loads in the main process; raises in a worker (a handle that does not survive a fork)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if torch.utils.data.get_worker_info() is not None:
            raise OSError("handle not valid after fork")
        return i


@pytest.mark.slow
def test_the_adaptive_loader_never_adds_a_worker_count_the_tuner_saw_fail() -> None:
    loader = autotune_loader(FailsInWorkers(), 4, adapt=True, **quick(budget_s=5.0))
    assert [c.fault for c in loader.tuning_report.candidates if c.num_workers == 1] == ["error"]
    assert loader.num_workers == 0 and loader._max_workers == 0  # it added 2 mid-epoch: raised


@pytest.mark.slow
def test_autotune_loader_keeps_the_callers_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = autotune_loader(
        Latency(16), 4, adapt=True, persistent_workers=False, **quick(max_workers=0, budget_s=5.0)
    )
    assert isinstance(loader, AdaptiveDataLoader)
    assert loader._max_workers == 0 and loader._keep_workers is False
    _epochs(loader, 2)  # waits for data, but max_workers=0 holds
    assert loader.num_workers == 0 and loader.tuning_history == []


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_full_host_and_a_slowed_step_mean_fewer_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A CPU hog lands: the CPUs read full and the step takes much longer.
    monkeypatch.setattr(adapt, "usable_cpus", lambda *a, **kw: 4)
    monkeypatch.setattr(adapt_timed, "usable_cpus", lambda *a, **kw: 4)
    monkeypatch.setattr(adapt_timed.Workers, "cores", lambda self: float(len(self.procs)))
    monkeypatch.setattr(adapt_timed, "host_busy", lambda before, after: 1.0)
    # On a loaded host the loop's own __next__ waits for a core, not for data: 4-9 % of
    # the step beside two CPU hogs on two cores, and over the 10 % that makes a loop
    # input-bound (which keeps its workers) in one CI run. The threshold itself is
    # test_adapt_rules' subject; this test is the live loader applying the rule.
    monkeypatch.setattr(_adapt_rules, "INPUT_BOUND_SHARE", 0.3)
    # Batches that cost the workers nothing, from workers started once: the loop does not
    # wait for data (a loop that waits keeps its workers: see test_adapt_rules).
    # Epochs long enough that the workers' start-up waits stay under a tenth of the loop's
    # time on a loaded host (at 12 batches of 20 ms they came close to it).
    loader = AdaptiveDataLoader(
        range(96), batch_size=4, num_workers=4, max_workers=4, persistent_workers=True
    )

    def epoch(step_s: float) -> None:
        for _ in loader:
            time.sleep(step_s)

    try:
        # 15 times as long: on a loaded host the 4 ms sleep overshoots (it measured 20 ms and
        # more there, and a 30 ms step was then not "slowed").
        epoch(0.004)
        epoch(0.06)
        assert loader.tuning_history == []  # full, but the first epoch's step is the fastest
        epoch(0.06)
    finally:
        loader.close()
    (change,) = loader.tuning_history
    assert change.reason == "oversubscribed" and change.old == (4, 2)
    assert change.new[0] < 4 and change.epoch == 2
    assert loader.num_workers == change.new[0]


def test_max_workers_is_checked() -> None:
    with pytest.raises(ValueError, match="max_workers"):
        AdaptiveDataLoader(range(4), max_workers=-1)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((), {"num_workers": "2"}, r"num_workers must be an int >= 0, got '2'"),
        ((), {"num_workers": 2.0}, r"num_workers must be an int >= 0, got 2.0 \(pass int"),
        ((2, False, None, None, "2"), {}, r"num_workers must be an int >= 0, got '2'"),
        ((), {"num_workers": "x", "multiprocessing_context": "fork"}, "num_workers must be"),
        ((), {"batch_size": "4"}, r"batch_size must be None or an int >= 1, got '4'"),
        ((), {"num_workers": 2, "prefetch_factor": "2"}, "prefetch_factor must be None or an"),
        ((), {"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor must be None or an"),
        ((), {"prefetch_factor": 2}, r"prefetch_factor=2 needs num_workers > 0"),
        ((), {"max_workers": "3"}, r"max_workers must be None or an int >= 0, got '3'"),
    ],
)
def test_bad_sizes_raise_the_tuners_errors_not_dataloaders_type_error(
    args: tuple[Any, ...], kwargs: dict[str, Any], match: str
) -> None:
    # DataLoader itself raises a bare TypeError ('<' not supported between 'str' and
    # 'int') for num_workers="2", and takes num_workers=2.0 or prefetch_factor=0 only to
    # fail later, in the training loop.
    with pytest.raises(ValueError, match=match):
        AdaptiveDataLoader(range(4), *args, **kwargs)


def test_batch_size_none_is_still_dataloaders_no_automatic_batching() -> None:
    loader = AdaptiveDataLoader(range(3), batch_size=None)
    assert [int(x) for x in loader] == [0, 1, 2]


def test_a_start_method_given_without_workers_is_checked_at_once() -> None:
    # DataLoader refuses any multiprocessing_context with num_workers=0; the adaptive
    # loader keeps it for the workers it adds, so a wrong one fails here, not mid-training.
    with pytest.raises(ValueError, match="multiprocessing_context='spwan' is neither"):
        AdaptiveDataLoader(range(4), batch_size=2, multiprocessing_context="spwan")
    loader = AdaptiveDataLoader(range(4), batch_size=2, multiprocessing_context="spawn")
    assert loader.num_workers == 0 and loader.multiprocessing_context is None
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    # With workers given (here by position) it is DataLoader's own, as always.
    loader = AdaptiveDataLoader(range(4), 2, False, None, None, 1, multiprocessing_context="spawn")
    assert loader.multiprocessing_context.get_start_method() == "spawn"


def test_a_start_method_given_by_position_without_workers_is_kept_as_by_name() -> None:
    # DataLoader's 12th parameter; given by position it was not set aside, and DataLoader
    # refused it ("can only be used with multi-process loading").
    position = (2, False, None, None, 0, None, False, False, 0, None, "spawn")
    loader = AdaptiveDataLoader(range(4), *position)
    assert loader.num_workers == 0 and loader.multiprocessing_context is None
    assert loader._worker_context == "spawn"
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="multiprocessing_context='spwan' is neither"):
        AdaptiveDataLoader(range(4), *position[:-1], "spwan")


class StartMethod(Dataset[tuple[int, str]]):
    """Each sample with the start method of the process that loaded it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, str]:
        return i, str(multiprocessing.get_start_method(allow_none=True))


@pytest.mark.slow  # a spawned worker imports torch: a few seconds
def test_the_callers_start_method_is_kept_for_the_workers_it_adds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tuner keeps the main process (max_workers=0), so its settings drop the context;
    # the workers the adaptive loader adds later must still be spawned, as the caller said.
    loader = autotune_loader(
        StartMethod(), 4, adapt=True, multiprocessing_context="spawn",
        **quick(max_workers=0, budget_s=5.0),
    )  # fmt: skip
    assert isinstance(loader, AdaptiveDataLoader) and loader.num_workers == 0
    _scripted(monkeypatch, [(1, 2)])
    try:
        epochs = [[m for _, methods in loader for m in methods] for _ in range(2)]
    finally:
        loader.close()
    assert loader.num_workers == 1
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert epochs[1] == ["spawn"] * 8  # loaded in a spawned worker


def test_workers_that_did_not_raise_the_rate_are_not_added_again() -> None:
    # Any wait left (the main process's own cost per batch) read as "workers cannot keep
    # up": 0 -> 2 -> 3 -> 5 -> 7 -> 10 -> 14 workers at the same ~620 samples/s.
    from trainperf.loader._adapt_pool import _rank_limits
    from trainperf.loader._adapt_rules import figures

    loader = AdaptiveDataLoader(range(8), batch_size=4, max_workers=16)
    limits = _rank_limits()
    cpus = loader._cpus

    def measured(n: int, wait_s: float, step_s: float) -> Any:
        pf = 2 if n else None
        return figures(num_workers=n, prefetch_factor=pf, wait_s=wait_s, step_s=step_s,
                       cpus=cpus, host_busy=0.1, worker_cores=0.05 * n)  # fmt: skip

    first = decide_change(loader, measured(0, 3.0, 1.0), limits)
    assert first is not None and first.reason == "input-bound" and first.num_workers > 0
    n = first.num_workers
    # It paid: the loop waits less, still 20 % of the time.
    second = decide_change(loader, measured(n, 0.25, 1.0), limits)
    assert second is not None and second.reason == "input-bound"
    m = second.num_workers
    assert m > n
    # The same rate and wait share with more workers: back to the count that was as fast.
    back = decide_change(loader, measured(m, 0.25, 1.0), limits)
    assert back is not None and back.reason == "no-gain"
    assert (back.num_workers, back.prefetch_factor) == (n, 2)
    assert f"{m} workers gave" in back.why
    # Still waiting 20 %: no more workers than that count now.
    assert decide_change(loader, measured(n, 0.25, 1.0), limits) is None
    assert decide_change(loader, measured(n, 0.25, 1.0), limits) is None


def test_a_deeper_prefetch_is_tried_once_at_the_worker_bound() -> None:
    from trainperf.loader._adapt_pool import _rank_limits
    from trainperf.loader._adapt_rules import figures

    loader = AdaptiveDataLoader(range(8), batch_size=4, num_workers=2, max_workers=2)
    limits = _rank_limits()

    cpus = loader._cpus

    def measured(pf: int, cpus: int = cpus) -> Any:
        return figures(num_workers=2, prefetch_factor=pf, wait_s=1.0, step_s=1.0,
                       cpus=cpus, host_busy=0.1, worker_cores=0.1)  # fmt: skip

    deeper = decide_change(loader, measured(2), limits)  # waiting half the time, no worker to add
    assert deeper is not None and deeper.reason == "prefetch"
    assert (deeper.num_workers, deeper.prefetch_factor) == (2, 4)
    back = decide_change(loader, measured(4), limits)  # the same rate and wait: back to 2
    assert back is not None and back.reason == "no-gain"
    assert (back.num_workers, back.prefetch_factor) == (2, 2)
    assert decide_change(loader, measured(2), limits) is None  # not tried again
    again = decide_change(loader, measured(2, cpus + 1), limits)  # the usable CPUs changed
    assert again is not None and again.reason == "prefetch"


def test_an_increase_that_gained_a_little_is_held() -> None:
    from trainperf.loader._adapt_pool import _rank_limits
    from trainperf.loader._adapt_rules import figures

    loader = AdaptiveDataLoader(range(8), batch_size=4, max_workers=16)
    limits = _rank_limits()
    cpus = loader._cpus
    kw: dict[str, Any] = {"cpus": cpus, "host_busy": 0.1, "prefetch_factor": 2}
    kw["worker_cores"] = 0.1  # the workers mostly wait (I/O): cores for many
    first = decide_change(loader, figures(num_workers=2, wait_s=0.4, step_s=1.0, **kw), limits)
    assert first is not None and first.reason == "input-bound"
    # 1 % faster, the same wait share: hold the count, add none.
    held = figures(num_workers=first.num_workers, wait_s=0.396, step_s=0.99, **kw)
    assert decide_change(loader, held, limits) is None
    assert decide_change(loader, held, limits) is None


@pytest.mark.parametrize("kept", [False, True])
def test_workers_restarted_each_short_epoch_for_no_gain_go_back(kept: bool) -> None:
    # A pool not kept between epochs (persistent_workers=False, a dataset with set_epoch)
    # starts again every epoch; its start-up was left out of the judgement, so on epochs
    # of a few batches 8 workers were kept at 0.22 s an epoch where the main process took
    # 0.15 s (5x slower on epochs of 2 batches).
    from trainperf.loader._adapt_pool import _rank_limits
    from trainperf.loader._adapt_rules import figures

    loader = AdaptiveDataLoader(range(64), batch_size=8, max_workers=8, keep_workers=kept)
    limits = _rank_limits()
    kw: dict[str, Any] = {"cpus": loader._cpus, "host_busy": 0.1, "batches": 8, "samples": 64}
    alone = figures(wait_s=0.112, step_s=0.007, startup_s=0.016, load_cpu_s=0.002, **kw)
    first = decide_change(loader, alone, limits, 8)
    assert first is not None and first.reason == "input-bound"
    loader.num_workers, loader.prefetch_factor = first.num_workers, 2  # as apply_change does
    object.__setattr__(loader, "persistent_workers", kept)  # DataLoader refuses it once built
    # Seven batches at once, after 0.3 s of starting the workers: the loop's own rate is
    # far higher, the epoch's far lower.
    pool = figures(num_workers=first.num_workers, prefetch_factor=2, wait_s=0.001,
                   step_s=0.007, startup_s=0.3, worker_cores=0.1, **kw)  # fmt: skip
    judged = decide_change(loader, pool, limits, 8)
    if kept:  # started once: its start-up is no cost of each epoch
        assert judged is None or judged.reason != "no-gain"
    else:
        assert judged is not None and judged.reason == "no-gain"
        assert (judged.num_workers, judged.prefetch_factor) == (0, None)
        assert "start-up included" in judged.why
    loader.close()


def test_an_epochs_figures_count_its_pools_start_and_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Starting the workers (in iter()) and stopping them (in the next() that ends the epoch)
    # were in no figure: a pool restarted every epoch looked free.
    from trainperf.loader._adapt import AdaptiveDataLoader as Adaptive

    real_start = Adaptive._start

    def slow_start(self: Any, scratch: bool) -> Any:
        time.sleep(0.2)  # forking the workers
        return _SlowStop(real_start(self, scratch))

    monkeypatch.setattr(Adaptive, "_start", slow_start)
    loader = AdaptiveDataLoader(range(8), batch_size=2)
    assert len(list(loader)) == 4
    final = loader._current.final  # type: ignore[union-attr]
    assert final is not None and final.startup_s >= 0.2 and final.wait_s >= 0.2
    loader.close()


class _SlowStop:
    """A DataLoader iterator whose last ``next()`` takes 0.2 s, as joining workers does."""

    def __init__(self, it: Any) -> None:
        self._it = it

    def __len__(self) -> int:
        return len(self._it)

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            time.sleep(0.2)
            raise


def test_repr_shows_the_settings_it_runs_with_now(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [(2, 3)])
    loader = AdaptiveDataLoader(list(range(8)), batch_size=4)
    assert repr(loader) == (
        "AdaptiveDataLoader(batch_size=4, num_workers=0, pin_memory=False, changes=0)"
    )
    _epochs(loader, 2)
    assert repr(loader) == (
        "AdaptiveDataLoader(batch_size=4, num_workers=2, prefetch_factor=3, pin_memory=False, "
        "persistent_workers=True, changes=1)"
    )
    loader.close()


def _tuned_report(best: dict[str, Any], given: dict[str, Any] | None) -> Any:
    """A tuning report that chose ``best`` (no run: the settings are what is tested)."""
    from trainperf.loader import TuningReport
    from trainperf.loader._report import UserSetting

    limits = HostLimits(2, 2, None, 2, 2**33, None, 2**32, None, None)
    user = None if given is None else UserSetting(given, 2, 2, False, True, None, "given")
    return TuningReport(
        best, None, None, None, (), 0.1, 1.0, limits, 2, 1, 2, "cpu", 4, user_setting=user
    )


@pytest.mark.slow  # two worker pools: about two seconds
@pytest.mark.parametrize(
    "given",
    [None, {"num_workers": 2}, {"persistent_workers": True}],
    ids=["nothing-given", "workers-given", "persistent-given"],
)
def test_persistent_workers_the_tuner_chose_keep_the_callers_order_every_epoch(
    monkeypatch: pytest.MonkeyPatch, given: dict[str, Any] | None
) -> None:
    # The caller passed neither persistent_workers nor (but in the last case) num_workers:
    # the tuner chose both; the epochs are those of the caller's own DataLoader.
    import trainperf.loader._autotune as autotune

    monkeypatch.setattr(adapt_retune, "decide", lambda f, **kw: None)
    if given is not None and given.get("persistent_workers"):
        given = {"num_workers": 2, **given}  # the caller's own persistent pool: kept
    plain = DataLoader(
        range(24),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        **(given or {}),
    )
    try:
        expected = _epochs(plain, 3)
    finally:
        if plain._iterator is not None:
            plain._iterator._shutdown_workers()  # type: ignore[attr-defined]
    kw: dict[str, Any] = {"shuffle": True, "generator": torch.Generator().manual_seed(3)}
    chosen = {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False}
    best = {"batch_size": 4, **kw, **chosen, "persistent_workers": True}
    report = _tuned_report(best, given)
    monkeypatch.setattr(autotune, "tune_loader", lambda *a, **k: report)
    loader = autotune_loader(range(24), 4, adapt=True, **quick(), **kw, **(given or {}))
    try:
        got = _epochs(loader, 3)
    finally:
        loader.close()
    assert loader.persistent_workers and loader.num_workers == 2
    assert got == expected
    assert len({tuple(e) for e in got}) == 3  # the shuffle did shuffle


@pytest.mark.slow  # two workers start and stop: about a second
@pytest.mark.parametrize("timeout", [0.0, 7.0])
def test_a_pool_it_starts_has_a_bound_for_each_workers_first_batch_unless_a_timeout_is_given(
    monkeypatch: pytest.MonkeyPatch, timeout: float
) -> None:
    _scripted(monkeypatch, [(2, 2)])
    monkeypatch.setattr(adapt_pool, "hang_timeout", lambda *a, **k: 42.0)
    loader = AdaptiveDataLoader(range(16), batch_size=4, timeout=timeout)
    try:
        _epochs(loader, 1)
        it = iter(loader)  # the scripted change: two workers
        assert loader.num_workers == 2
        timed = it._timed  # type: ignore[attr-defined]
        assert timed.it._timeout == (timeout or 42.0)  # yours keeps its meaning: it raises
        assert timed.trial is not None  # on trial: given up if it breaks first
        assert (timed.trial.timeout_s is None) == bool(timeout)
        assert next(it).tolist() == [0, 1, 2, 3]  # worker 0's first batch
        assert timed.trial is not None and timed.it._timeout == (timeout or 42.0)
        assert next(it).tolist() == [4, 5, 6, 7]  # worker 1's: each worker has delivered
        assert timed.trial is None and timed.it._timeout == timeout  # the pool works: no bound
        assert [b.tolist() for b in it] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    finally:
        loader.close()


class _FirstBatchFailsInWorkers(Dataset[int]):
    """Loads in the main process; in a worker, the samples of the first batch raise."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if i < 4 and torch.utils.data.get_worker_info() is not None:
            raise KeyError(i)
        return i


@pytest.mark.slow  # two workers start and stop: about a second
def test_a_batch_that_fails_in_a_worker_counts_towards_the_trial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loop catches the dataset's error and goes on: worker 0 answered, so once worker
    # 1 has delivered too the pool has passed its trial and the bound is lifted.
    _scripted(monkeypatch, [(2, 2)])
    monkeypatch.setattr(adapt_pool, "hang_timeout", lambda *a, **k: 42.0)
    loader = AdaptiveDataLoader(_FirstBatchFailsInWorkers(), batch_size=4)
    try:
        _epochs(loader, 1)
        it = iter(loader)  # the scripted change: two workers
        timed = it._timed  # type: ignore[attr-defined]
        with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process 0"):
            next(it)
        assert timed.trial is not None and timed.delivered == 1
        assert next(it).tolist() == [4, 5, 6, 7]  # worker 1's: each worker has answered
        assert timed.trial is None and timed.it._timeout == 0  # the pool works: no bound
        assert [b.tolist() for b in it] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    finally:
        loader.close()


@pytest.mark.slow  # three workers start and stop: about a second
def test_a_trial_cut_short_by_the_epochs_end_leaves_the_kept_pool_no_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Three workers, two batches left in the epoch: worker 2 never delivers. The trial's
    # bound must not stay on the persistent pool into the next epoch, where it would
    # raise "DataLoader timed out" for a caller who gave no timeout.
    _scripted(monkeypatch, [(3, 2), None])
    monkeypatch.setattr(adapt_pool, "hang_timeout", lambda *a, **k: 42.0)
    loader = AdaptiveDataLoader(range(8), batch_size=4)
    try:
        assert _epochs(loader, 2) == [list(range(8))] * 2  # the second with three workers
        assert loader.num_workers == 3 and loader._iterator is not None
        assert loader._iterator._timeout == 0  # the caller's: none
        it = iter(loader)  # the same pool again, no change
        assert it._timed.trial is None and it._timed.it._timeout == 0  # type: ignore[attr-defined]
        assert [b.tolist() for b in it] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        loader.close()


@pytest.mark.slow  # three workers start and stop: about a second
@pytest.mark.parametrize("left_after", [1, 2])
def test_a_trial_left_by_a_break_leaves_the_kept_pool_no_bound(
    monkeypatch: pytest.MonkeyPatch, left_after: int
) -> None:
    # A loop left (a capped number of steps) before each of the three workers delivered
    # ends the trial: the persistent pool kept for the next epoch, where no trial ends it,
    # must not keep the trial's bound and raise "DataLoader timed out" for a caller who
    # gave no timeout.
    _scripted(monkeypatch, [(3, 2), None])
    monkeypatch.setattr(adapt_pool, "hang_timeout", lambda *a, **k: 42.0)
    loader = AdaptiveDataLoader(range(24), batch_size=4)
    try:
        _epochs(loader, 1)
        for i, _ in enumerate(loader):  # the three new workers, on trial
            if i + 1 == left_after:
                break
        assert loader.num_workers == 3 and loader._iterator is not None
        it = iter(loader)  # the same pool again, no change
        timed = it._timed
        assert timed.it is loader._iterator  # kept, not restarted
        assert timed.trial is None and timed.it._timeout == 0  # the caller's: none
        assert [int(x) for b in it for x in b] == list(range(24))
    finally:
        loader.close()


@pytest.mark.slow  # two workers start and stop: about a second
def test_without_an_epoch_plan_the_trial_ends_at_the_first_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pool given up after it delivered would start the epoch again from the sampler and
    # repeat those batches: without a plan, the trial ends at the pool's first batch.
    _scripted(monkeypatch, [(2, 2)])
    loader = AdaptiveDataLoader(range(16), batch_size=4, mid_epoch=False)
    try:
        _epochs(loader, 1)
        it = iter(loader)
        timed = it._timed  # type: ignore[attr-defined]
        assert timed.plan is None and timed.trial is not None
        assert next(it).tolist() == [0, 1, 2, 3]
        assert timed.trial is None and timed.it._timeout == 0
    finally:
        loader.close()


def _copied(how: str, loader: Any) -> Any:
    if how == "deepcopy":
        return copy.deepcopy(loader)
    return pickle.loads(pickle.dumps(loader))


def _shuffled(cls: Any = AdaptiveDataLoader, **kw: Any) -> Any:
    return cls(
        range(12), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3), **kw
    )


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_an_adaptive_loader_copies_at_any_time_as_a_plain_dataloader_does(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # Before: its psutil.Process and its memory rules' lambda made every copy raise
    # "cannot pickle '_thread.RLock' object".
    monkeypatch.setattr(adapt_retune, "decide", lambda f, **kw: None)
    # A tuning run's rules hold its clock (a lambda, here) and measurer: not kept.
    rules = dataclasses.replace(memory_rules([], 4, 2**30, "fork"), out_of_time=lambda: False)
    loader = _shuffled(tuner=rules)
    plain = _shuffled(DataLoader)
    assert _epochs(_copied(how, loader), 2) == _epochs(_copied(how, plain), 2)  # fresh
    it, plain_it = iter(loader), iter(plain)
    assert next(it).tolist() == next(plain_it).tolist()
    mid = _copied(how, loader)  # mid-epoch: the copy has no epoch in progress
    assert mid._current is None and mid._iterator is None
    # Its epochs are a plain DataLoader copy's at the same point (the generator's state).
    assert _epochs(mid, 2) == _epochs(_copied(how, plain), 2)
    # The original's epoch goes on untouched, and so do the epochs after it.
    assert [b.tolist() for b in it] == [b.tolist() for b in plain_it]
    assert _epochs(loader, 2) == _epochs(plain, 2)


@pytest.mark.slow  # a tuning run: a second or two
def test_the_loader_autotune_loader_adapts_with_copies() -> None:
    loader = autotune_loader(range(12), 4, adapt=True, **quick(max_workers=0))
    assert isinstance(loader, AdaptiveDataLoader)
    copied = copy.deepcopy(loader)
    assert copied.tuning_report == loader.tuning_report
    assert _epochs(pickle.loads(pickle.dumps(loader)), 1) == [list(range(12))]


@pytest.mark.slow  # two pools of two workers: about a second
def test_a_copy_of_an_adaptive_loader_leaves_its_persistent_pool_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(adapt_retune, "decide", lambda f, **kw: None)
    loader = _shuffled(num_workers=2, persistent_workers=True)
    copied: Any = None
    try:
        _epochs(loader, 1)
        pool = loader._iterator
        assert pool is not None  # live workers, which a plain DataLoader refuses to copy
        copied = copy.deepcopy(loader)
        assert copied._iterator is None and copied.num_workers == 2
        assert _epochs(copied, 1) == _epochs(loader, 1)
        assert loader._iterator is pool and copied._iterator is not pool
    finally:
        loader.close()
        if copied is not None:
            copied.close()


def test_an_adaptive_loader_takes_numpy_numbers_as_python_ones() -> None:
    # Before: np.int64(4) passed its checks and then DataLoader refused it, and a NumPy
    # max_workers stayed the bound it adapts within.
    loader = AdaptiveDataLoader(
        range(8), batch_size=np.int64(4), max_workers=np.int64(2), timeout=np.int64(3)
    )
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (loader.batch_size, loader._max_workers, loader._timeout_kept) == (4, 2, 3)
    assert [type(loader.batch_size), type(loader._max_workers)] == [int, int]
    assert type(loader._timeout_kept) is int


def _no_pinning_warnings(loader: Any, epochs: int) -> int:
    """How many of torch's "pin_memory ... but no accelerator" warnings ``epochs`` epochs
    of ``loader`` give under an "always" filter."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _epochs(loader, epochs)
    return sum("'pin_memory' argument is set as true" in str(w.message) for w in seen)


def test_the_pools_it_starts_do_not_repeat_torchs_pin_memory_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: every iterator it started (each change, mid-epoch too) warned again: 42 times
    # in two short epochs.
    plain = DataLoader(range(16), batch_size=2, pin_memory=True)
    if _no_pinning_warnings(plain, 2) != 2:
        pytest.skip("this torch pins for an accelerator here, or says nothing without one")
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(adapt_timed, "_CHECK_BATCHES", 0)
    monkeypatch.setattr(
        adapt_retune, "decide", lambda f, **kw: Change(0, None, "input-bound", "forced")
    )
    loader = AdaptiveDataLoader(range(16), batch_size=2, pin_memory=True)
    assert _no_pinning_warnings(loader, 2) == 1  # its first iterator's, the loader as built
    assert len(loader.tuning_history) > 4
