"""trainperf.loader._autotune: the loader autotune_loader returns, and workers that die
with their parent (issue 20.3).

A training process killed with SIGKILL (the out-of-memory killer, ``kill -9``, a
scheduler's hard stop) cannot stop its DataLoader workers; they would live on with ppid 1,
holding memory and shared memory. Every loader the tuner builds ties its workers' lives to
the process that iterates it.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainperf.loader._autotune as autotune
from trainperf import DieWithParent
from trainperf.limits import HostLimits
from trainperf.loader import (
    AdaptiveDataLoader,
    CandidateResult,
    TunedDataLoader,
    TuningReport,
    autotune_loader,
)
from trainperf.loader._faults import budget_cut_reason

ORPHANS = Path(__file__).with_name("_orphans.py")


def record(worker_id: int) -> None:
    """A caller's worker_init_fn (module level: picklable)."""


def test_the_tuned_loader_wraps_the_callers_worker_init_fn() -> None:
    loader = TunedDataLoader(range(8), batch_size=2, num_workers=2, worker_init_fn=record)
    init = loader.worker_init_fn
    assert isinstance(init, DieWithParent) and init.user_fn is record
    assert pickle.loads(pickle.dumps(init)).user_fn is record  # spawn sends it to workers
    # Without workers there is nothing to wrap.
    assert TunedDataLoader(range(8), worker_init_fn=record).worker_init_fn is record
    assert TunedDataLoader(range(8)).worker_init_fn is None


@pytest.mark.parametrize("cls", [TunedDataLoader, AdaptiveDataLoader])
def test_a_tuned_loader_built_directly_names_a_bad_worker_count(cls: type) -> None:
    # DataLoader's own: TypeError: '<' not supported between instances of 'str' and 'int'.
    with pytest.raises(ValueError, match=r"num_workers must be an int >= 0, got '2'"):
        cls(range(8), batch_size=4, num_workers="2")
    with pytest.raises(ValueError, match=r"prefetch_factor must be None or an int >= 1, got 0"):
        cls(range(8), 4, False, None, None, 2, prefetch_factor=0)  # num_workers by position


@pytest.mark.slow  # about 1 s: two workers started
def test_the_tuned_loaders_workers_run_the_callers_worker_init_fn() -> None:
    seen = []
    loader = TunedDataLoader(
        range(4), batch_size=2, num_workers=2, worker_init_fn=record, persistent_workers=False
    )
    for batch in loader:
        seen.extend(batch.tolist())
    assert sorted(seen) == [0, 1, 2, 3]


@pytest.mark.slow  # about 1 s: a tuning run
def test_autotune_loaders_report_and_the_cache_keep_the_callers_own_function() -> None:
    loader = autotune_loader(
        range(32), 4, device="cpu", max_workers=0, budget_s=5, progress=False, worker_init_fn=record
    )
    # num_workers=0: no worker to tie, and best_kwargs (which a DataLoader built elsewhere,
    # in another process, may use) never hold the wrapper.
    assert loader.tuning_report.best_kwargs["worker_init_fn"] is record
    assert loader.worker_init_fn is record
    from trainperf.loader._cache import key_fields

    kw = {"device_type": "cpu", "max_workers": 0, "epochs_hint": None, "step_fn": None}
    plain = key_fields(range(4), 4, cpus=2, loader_kwargs={"worker_init_fn": record}, **kw)
    wrapped = key_fields(
        range(4), 4, cpus=2, loader_kwargs={"worker_init_fn": DieWithParent(record)}, **kw
    )
    assert plain == wrapped  # the wrapper changes nothing the answer depends on


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_for_workers(where: Path, child: subprocess.Popen[str], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids = [int(p.name) for p in where.iterdir()]
        if len(pids) >= 2:
            return pids
        if child.poll() is not None:
            pytest.fail(f"the child exited early: {child.communicate()[0]}")
        time.sleep(0.05)
    pytest.fail("the workers did not start in time")


@pytest.mark.slow  # about 2-4 s each: a child process with torch and two workers
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["tuned", "measure", "sharding"])
def test_workers_die_when_their_parent_is_sigkilled(tmp_path: Path, mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    child = subprocess.Popen(
        [sys.executable, str(ORPHANS), mode, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    pids: list[int] = []
    try:
        pids = _wait_for_workers(tmp_path, child, timeout=90)
        assert all(psutil.Process(p).ppid() == child.pid for p in pids)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        end = time.monotonic() + 5.0  # they sleep 120 s: only the parent-death signal ends them
        while _alive(pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert _alive(pids) == [], f"{mode}: workers outlived their parent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in _alive(pids):
            os.kill(pid, signal.SIGKILL)


def test_a_plain_dataloader_gets_the_same_with_die_with_parent() -> None:
    # What docs/loader.md tells users to do for a DataLoader they build themselves.
    init = DieWithParent(record)
    loader = DataLoader(torch.arange(4), num_workers=2, worker_init_fn=init)
    assert loader.worker_init_fn is init and init.user_fn is record


def test_workers_the_tuner_made_persistent_keep_the_plain_loaders_shuffle_every_epoch() -> None:
    # Before: a reused pool skipped the draw a new pool makes from the generator, so from
    # the second epoch on the order was the plain loader's previous epoch's, shifted.
    from types import SimpleNamespace

    from trainperf.loader._autotune import _tuned

    def epochs(loader: Any) -> list[list[int]]:
        torch.manual_seed(7)
        return [[int(i) for b in loader for i in b] for _ in range(3)]

    data = list(range(24))
    plain = epochs(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    chosen = {"batch_size": 4, "shuffle": True, "num_workers": 1, "persistent_workers": True}
    report = SimpleNamespace(best_kwargs=chosen)
    assert epochs(_tuned(data, report, asked=None)) == plain  # type: ignore[arg-type]
    # Persistent workers the caller asked for behave as the plain loader with them does.
    asked = epochs(torch.utils.data.DataLoader(data, **{**chosen, "num_workers": 1}))
    assert epochs(_tuned(data, report, asked=True)) == asked  # type: ignore[arg-type]


def test_a_peek_or_zip_over_workers_the_tuner_made_persistent_gets_the_plain_batches() -> None:
    # Before: a new iter() reset the persistent pool under the loop still running over it,
    # so a peek (next(iter(loader))) inside the loop restarted the epoch (samples repeated,
    # silently) and zip(loader, loader) paired consecutive batches, where the caller's own
    # DataLoader (no persistent workers: the tuner chose them) starts a second pool.
    from types import SimpleNamespace

    from trainperf.loader._autotune import _tuned

    def run(loader: Any) -> list[list[int]]:
        torch.manual_seed(7)
        got = []
        for _ in range(2):
            for i, batch in enumerate(loader):
                got.append(batch.tolist())
                if i == 1:
                    got.append(next(iter(loader)).tolist())  # a peek, to log a batch
        got += [a.tolist() + b.tolist() for a, b in zip(loader, loader, strict=True)]
        return got

    data = list(range(12))
    plain = run(DataLoader(data, batch_size=3, shuffle=True, num_workers=1))
    chosen = {"batch_size": 3, "shuffle": True, "num_workers": 1, "persistent_workers": True}
    tuned = _tuned(data, SimpleNamespace(best_kwargs=chosen), asked=None)  # type: ignore[arg-type]
    try:
        assert run(tuned) == plain
        kept = tuned._iterator
        assert kept is not None and [len(b) for b in tuned] == [3] * 4
        assert tuned._iterator is kept  # a loop that holds nothing else reuses the pool
    finally:
        if tuned._iterator is not None:
            tuned._iterator._shutdown_workers()


def test_a_peeks_pool_ends_with_the_peek() -> None:
    # A peek's pool was kept as the loader's from then on: two pools (twice the workers, and
    # their shared memory) for the rest of the epoch.
    from types import SimpleNamespace

    from trainperf.loader._autotune import _tuned

    chosen = {"batch_size": 3, "shuffle": False, "num_workers": 1, "persistent_workers": True}
    tuned = _tuned(list(range(12)), SimpleNamespace(best_kwargs=chosen), asked=None)  # type: ignore[arg-type]
    try:
        for i, _ in enumerate(tuned):
            if i == 1:
                assert next(iter(tuned)).tolist() == [0, 1, 2]
            if i == 2:
                assert len(multiprocessing.active_children()) == 1
    finally:
        if tuned._iterator is not None:
            tuned._iterator._shutdown_workers()


def test_a_peek_at_an_epochs_last_batch_leaves_that_epoch_to_its_loop() -> None:
    # With the epoch's last batch handed out, torch's counters already say nothing more is
    # coming, before the loop has seen StopIteration: read as a finished epoch, a peek there
    # reset the pool under the loop, which went through the epoch again (7 batches of 4).
    from types import SimpleNamespace

    from trainperf.loader._autotune import _tuned

    chosen = {"batch_size": 3, "shuffle": False, "num_workers": 1, "persistent_workers": True}
    tuned = _tuned(list(range(12)), SimpleNamespace(best_kwargs=chosen), asked=None)  # type: ignore[arg-type]
    try:
        seen = []
        for batch in tuned:
            seen.append(batch.tolist())
            if len(seen) == 4:  # the last batch: peek (to log a fixed batch)
                assert next(iter(tuned)).tolist() == [0, 1, 2]
            assert len(seen) <= 4
        assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    finally:
        if tuned._iterator is not None:
            tuned._iterator._shutdown_workers()


class _HoldsIterators:
    """Lightning's ``_ModeIterator``: ``iter()`` keeps the loaders' iterators in an attribute,
    so the previous epoch's is still held while the next ``iter(loader)`` runs."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.iterators: list[Any] = []

    def __iter__(self) -> _HoldsIterators:
        self.iterators = [iter(self.loader)]
        return self

    def __next__(self) -> Any:
        return next(self.iterators[0])


def _reassigned(loader: Any) -> None:
    """Four epochs of the manual pattern ``it = iter(loader)`` after ``StopIteration``."""
    it = iter(loader)
    for _ in range(16):
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
            next(it)


@pytest.mark.parametrize(
    "epochs",
    [
        pytest.param(lambda loader: [list(h) for h in [_HoldsIterators(loader)] * 4], id="holder"),
        pytest.param(_reassigned, id="reassigned"),
    ],
)
def test_a_finished_epoch_still_held_reuses_the_tuners_persistent_pool(epochs: Any) -> None:
    # Before: an iterator still referenced when the next iter() ran counted as an epoch in
    # progress even once it had handed out its whole epoch, so these loops started a new
    # worker pool every other epoch (the idle one kept alive beside it).
    from types import SimpleNamespace

    from trainperf.loader._autotune import _tuned

    chosen = {"batch_size": 3, "shuffle": True, "num_workers": 1, "persistent_workers": True}
    tuned = _tuned(list(range(12)), SimpleNamespace(best_kwargs=chosen), asked=None)  # type: ignore[arg-type]
    started = []
    make = tuned._get_iterator

    def counted() -> Any:
        started.append(1)
        return make()

    tuned._get_iterator = counted  # type: ignore[method-assign]
    try:
        epochs(tuned)
        assert len(started) == 1
    finally:
        if tuned._iterator is not None:
            tuned._iterator._shutdown_workers()


@pytest.mark.parametrize("own_generator", [False, True])
def test_a_persistent_pool_asked_for_but_not_chosen_keeps_the_plain_loaders_shuffle(
    own_generator: bool,
) -> None:
    # Before: the caller's loader (persistent workers) draws its workers' base seed once,
    # the tuned one (num_workers=0) at every epoch, so from the second epoch on the
    # shuffle differed from the caller's own DataLoader with the same seed.
    kw: dict[str, Any] = {"shuffle": True, "num_workers": 1, "persistent_workers": True}

    def epochs(make: Any) -> list[list[int]]:
        torch.manual_seed(7)
        generator = torch.Generator().manual_seed(3) if own_generator else None
        loader = make(generator)
        try:
            return [[int(i) for b in loader for i in b] for _ in range(3)]
        finally:
            if loader._iterator is not None:
                loader._iterator._shutdown_workers()

    data = list(range(24))
    plain = epochs(lambda g: DataLoader(data, batch_size=4, generator=g, **kw))
    quick = {"device": "cpu", "budget_s": 5.0, "cache": False, "progress": False}
    tuned = epochs(lambda g: autotune_loader(data, 4, max_workers=0, generator=g, **quick, **kw))
    assert tuned == plain
    assert len({tuple(e) for e in plain}) == 3  # the shuffle did shuffle


def _suggested_workers() -> int:
    """The most workers torch's DataLoader takes without its "more workers than CPUs"
    warning (its own count: the CPUs this process may run on)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@pytest.mark.parametrize("adapt", [False, True], ids=["tuned", "adaptive"])
def test_a_measured_worker_count_above_the_cpus_brings_no_torch_warning(
    monkeypatch: pytest.MonkeyPatch, adapt: bool
) -> None:
    # The adaptive loader was built without the tuned loader's silencing: torch's "This
    # DataLoader will create N worker processes in total" came at build and at each pool.
    many = _suggested_workers() + 1
    best = {"batch_size": 4, "num_workers": many, "prefetch_factor": 2, "pin_memory": False}
    limits = HostLimits(2, 2, None, 2, 2**33, None, 2**32, None, None)
    report = TuningReport(best, None, None, None, (), 0.1, 1.0, limits, 2, 1, many, "cpu", 4)
    monkeypatch.setattr(autotune, "tune_loader", lambda *a, **k: report)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = autotune_loader(range(16), 4, adapt=adapt, progress=False, cache=False)
        loader.check_worker_number_rationality()  # what each pool it starts runs
    assert loader.num_workers == many
    assert [str(w.message) for w in caught if "worker processes in total" in str(w.message)] == []


def test_a_pool_the_budget_cut_short_does_not_cap_the_adaptive_loader() -> None:
    # Before: spawn workers too slow to start within a short budget_s were failed as a
    # "hang", read as the dataset's fault, and the adaptive loader got max_workers=0 for
    # good (an I/O-bound dataset never got the workers that made it 7x faster).
    zero = CandidateResult(0, None, False, "ok", samples_per_s=100.0)
    cut = CandidateResult(1, 2, False, "failed", fault="hang", reason=budget_cut_reason(1.3))
    hung = CandidateResult(4, 2, False, "failed", fault="hang", reason="no batch arrived")
    limits = HostLimits(2, 2, None, 2, 2**33, None, 2**32, None, None)

    def report(*candidates: CandidateResult) -> TuningReport:
        return TuningReport(
            {"num_workers": 0}, 100.0, 100.0, None, candidates, 1.0, 2.0, limits, 2, 1, 8, "cpu", 8
        )

    assert autotune._below_failures(report(zero, cut)) > 64
    assert autotune._below_failures(report(zero, cut, hung)) == 3


@pytest.mark.slow  # two pools of two workers: about a second
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_tuned_loader_copies_with_its_persistent_pool_live(how: str) -> None:
    # Before: a live persistent pool made copying raise NotImplementedError (the iterator's).
    loader = TunedDataLoader(
        range(12),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        num_workers=2,
        persistent_workers=True,
    )
    copied: Any = None
    try:
        first = [b.tolist() for b in loader]
        pool = loader._iterator
        assert pool is not None
        copied = copy.deepcopy(loader) if how == "deepcopy" else pickle.loads(pickle.dumps(loader))
        assert copied._iterator is None and loader._iterator is pool
        # The copy's epoch is the one the original gives next, from workers of its own.
        assert [b.tolist() for b in copied] == [b.tolist() for b in loader] != first
        assert copied._iterator is not pool
    finally:
        for each in (loader, copied):
            if each is not None and each._iterator is not None:
                each._iterator._shutdown_workers()  # type: ignore[union-attr]


@pytest.mark.parametrize("positional", [False, True], ids=["by-name", "by-position"])
def test_a_tuned_loader_takes_numpy_numbers_as_python_ones(positional: bool) -> None:
    # Before: check_sizes took np.int64(4), then DataLoader refused it ("batch_size should
    # be a positive integer value, but got batch_size=4").
    numbers = {"num_workers": np.int64(1), "prefetch_factor": np.int32(2), "timeout": np.float64(5)}
    if positional:
        loader = TunedDataLoader(range(8), np.int64(4), False, **numbers)
    else:
        loader = TunedDataLoader(range(8), batch_size=np.int64(4), shuffle=False, **numbers)
    got = {k: getattr(loader, k) for k in ("batch_size", *numbers)}
    assert got == {"batch_size": 4, "num_workers": 1, "prefetch_factor": 2, "timeout": 5.0}
    assert [type(v) for v in got.values()] == [int, int, int, float]
    assert isinstance(loader.worker_init_fn, DieWithParent)  # as for num_workers=1


@pytest.mark.parametrize("adapt", [False, True], ids=["tuned", "adaptive"])
def test_autotune_loader_takes_numpy_numbers_as_python_ones(adapt: bool) -> None:
    # Before: np.int64(8) failed in DataLoader; with adapt=True a NumPy max_workers and
    # timeout went on into the adaptive loader's bound and the timeout it keeps for later.
    loader = autotune_loader(
        TensorDataset(torch.zeros(32, 2)),
        np.int64(8),
        device="cpu",
        max_workers=np.int64(0),
        budget_s=np.float64(1.0),
        epochs_hint=np.int64(2),
        timeout=np.float64(5.0),
        cache=False,
        progress=False,
        adapt=adapt,
    )
    assert type(loader.batch_size) is int and len(list(loader)) == 4
    report = loader.tuning_report
    assert (type(report.batch_size), type(report.max_workers)) == (int, int)
    json.dumps(report.to_dict())
    if adapt:
        assert type(loader._max_workers) is int  # type: ignore[attr-defined]
        assert type(loader._timeout_kept) is float  # type: ignore[attr-defined]


def test_a_loop_that_reads_by_count_never_keeps_two_pools() -> None:
    # A pass read by count never raises StopIteration, so at the next iter() its iterator,
    # still held, reads as a pass in progress: the new pool used to start beside the old
    # one, which was reset again an epoch later (pools alternating, twice the workers).
    from types import SimpleNamespace

    from trainperf.loader._autotune import _tuned

    chosen = {"batch_size": 3, "shuffle": True, "num_workers": 1, "persistent_workers": True}
    tuned = _tuned(list(range(12)), SimpleNamespace(best_kwargs=chosen), asked=None)  # type: ignore[arg-type]
    try:
        it = None
        for _ in range(3):
            it = iter(tuned)
            assert it is tuned._iterator  # the pool kept is the one this pass reads
            assert len(multiprocessing.active_children()) == 1  # the old pool ended
            batches = [next(it) for _ in range(len(tuned))]
            assert sorted(int(i) for b in batches for i in b) == list(range(12))
    finally:
        del it
        if tuned._iterator is not None:
            tuned._iterator._shutdown_workers()
