"""The adaptive loader over a dataset that blocks in worker processes: a pool it started
that gives no first batch is stopped, and the loop goes on with the previous setting.

Each case runs in a child process (this file run as a script), so that the test itself
cannot hang: without the bound, the child's loop would wait forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

_BOUND_S = 1.5  # the child's hang bound: its workers always block, so short is safe
_CHILD_LIMIT_S = 180.0  # torch's import and two pools on a loaded 2-core host fit well within


def _run_child(mode: str) -> dict[str, Any]:
    """Run this file as a script in its own session; kill the whole group if it overruns."""
    proc = subprocess.Popen(
        [sys.executable, __file__, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=_CHILD_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the loop hung: no result within {_CHILD_LIMIT_S:.0f} s ({mode})")
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.slow  # a child process that imports torch, and one bound's wait: seconds
@pytest.mark.parametrize("mode", ["mid-epoch", "epoch-boundary"])
def test_a_pool_that_blocks_is_given_up_and_the_epoch_goes_on_where_it_was(mode: str) -> None:
    got = _run_child(mode)
    assert got["epochs"] == got["expected"]  # nothing lost, nothing twice, the same order
    (hang,) = [c for c in got["history"] if c["reason"] == "hang"]
    assert hang["old"] == [2, 2] and hang["new"] == [0, None]
    assert hang["epoch_batch"] == (0 if mode == "epoch-boundary" else hang["epoch_batch"])
    assert got["num_workers"] == 0 and got["max_workers"] == 0  # 2 workers never again
    (warning,) = got["warnings"]
    assert "got no batch from worker 0 of the 2 it started within 1.5 s" in warning
    assert "blocks in worker processes" in warning and "Fix:" in warning
    assert got["children_left"] == []


@pytest.mark.slow  # a child process that imports torch, and one bound's wait: seconds
def test_a_pool_whose_second_worker_blocks_names_the_worker_it_waited_for() -> None:
    # Worker 0 delivered its first batch: the hang is worker 1's, and the record and the
    # warning name that worker, not the whole pool.
    got = _run_child("second-worker")
    assert got["epochs"] == got["expected"]
    (hang,) = [c for c in got["history"] if c["reason"] == "hang"]
    assert hang["old"] == [2, 2] and hang["new"] == [0, None]
    assert hang["why"] == "no batch from worker 1 of the 2 it started within 1.5 s"
    (warning,) = got["warnings"]
    assert "got no batch from worker 1 of the 2 it started within 1.5 s" in warning
    assert got["children_left"] == []


class _BlocksInWorkers(Dataset[int]):
    """Loads in the main process; blocks in a worker (a lock inherited across fork): in
    every worker, or in all but the first (``first_loads``)."""

    def __init__(self, first_loads: bool = False) -> None:
        self.first_loads = first_loads

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        info = torch.utils.data.get_worker_info()
        if info is not None and not (self.first_loads and info.id == 0):
            time.sleep(60)  # bounded, so that a worker left behind still ends
        return i


def _child(mode: str) -> None:
    """The loop, with checks after every batch (mid-epoch) or only at epoch boundaries,
    and rules that add two workers whenever ``max_workers`` allows."""
    import psutil
    from torch.utils.data import DataLoader

    import trainperf.loader._adapt_pool as adapt_pool
    import trainperf.loader._adapt_retune as adapt_retune
    import trainperf.loader._adapt_timed as adapt_timed
    from trainperf.loader import AdaptiveDataLoader
    from trainperf.loader._adapt_rules import Change, EpochFigures

    def decide(f: EpochFigures, **kw: Any) -> Change | None:
        n = min(2, kw["max_workers"])
        return Change(n, 2, "input-bound", "scripted") if n > f.num_workers else None

    adapt_retune.decide = decide  # type: ignore[attr-defined]
    adapt_pool.hang_timeout = lambda *a, **k: _BOUND_S  # type: ignore[attr-defined]
    adapt_timed._CHECK_BATCHES = 0
    adapt_timed._CHECK_EVERY_S = 0.0 if mode == "mid-epoch" else 1e9
    ds = _BlocksInWorkers(first_loads=mode == "second-worker")
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True}
    plain = DataLoader(ds, generator=torch.Generator().manual_seed(5), **kw)
    expected = [[int(x) for b in plain for x in b] for _ in range(2)]
    loader = AdaptiveDataLoader(ds, generator=torch.Generator().manual_seed(5), **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        epochs = [[int(x) for b in loader for x in b] for _ in range(2)]
    loader.close()
    children = psutil.Process().children(recursive=True)
    alive = [p.pid for p in children if p.status() != psutil.STATUS_ZOMBIE]
    result = {
        "epochs": epochs,
        "expected": expected,
        "history": [c.to_dict() | {"figures": None} for c in loader.tuning_history],
        "num_workers": loader.num_workers,
        "max_workers": loader._max_workers,
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
        "children_left": alive,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _child(sys.argv[1])


def test_the_first_batch_bound_allows_for_the_cost_per_worker_and_the_last_start_up() -> None:
    # Before: the loop's time per batch (divided by the workers sharing the load) and the
    # start-up averaged over the epoch kept the bound at its 10 s floor, so a pool that
    # needs longer to start was killed as hung, and the loader capped for good.
    from trainperf.loader._adapt import AdaptiveDataLoader
    from trainperf.loader._adapt_pool import hang_bound
    from trainperf.loader._adapt_rules import figures

    loader = AdaptiveDataLoader(range(64), batch_size=4, num_workers=0)
    slow_start = figures(num_workers=4, startup_s=15.0, batches=400, wait_s=1.0, step_s=40.0)
    assert hang_bound(loader, 6, slow_start) >= 45.0
    heavy = figures(num_workers=32, batches=101, wait_s=0.0, step_s=37.5, cpus=16)  # 12 s each
    assert hang_bound(loader, 40, heavy) >= 20 * 12.0
    quick = figures(num_workers=0, batches=101, wait_s=0.1, step_s=0.1)
    assert hang_bound(loader, 2, quick) == 10.0  # the floor


def test_the_first_batch_bound_counts_the_cores_the_step_keeps_as_the_tuner_does() -> None:
    # Before: every usable CPU counted as the new workers' (max(1, f.cpus)), where the
    # one-off tuner counts those left beside the main process's step: on 2 CPUs with a
    # step that keeps one busy, 4 new workers got half the tuner's bound (40 s, not 80 s).
    from trainperf.loader._adapt import AdaptiveDataLoader
    from trainperf.loader._adapt_pool import hang_bound
    from trainperf.loader._adapt_rules import figures
    from trainperf.loader._faults import hang_timeout

    loader = AdaptiveDataLoader(range(64), batch_size=4, multiprocessing_context="fork")
    # 1 s per batch in this process, half of it the step, on one of the two cores.
    f = figures(num_workers=0, batches=101, wait_s=50.0, step_s=50.0, step_cpu_s=50.0, cpus=2)
    assert f.step_cores == 1.0
    assert hang_bound(loader, 4, f) == 80.0  # 20 x 1 s x 4 workers on the 1 core left
    tuner = hang_timeout(
        4, user_timeout=0.0, start_method="fork", batch_s=1.0, cpus=2, main_cores=1.0
    )
    assert hang_bound(loader, 4, f) == tuner


class _Unpicklable(Dataset[int]):
    """Loads in the main process; holds a lambda, which ``spawn`` cannot send to workers."""

    def __init__(self) -> None:
        self.load = lambda i: i

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        return int(self.load(i))


class _DiesInWorkers(Dataset[int]):
    """Loads in the main process; a worker process dies on its first sample (``after_s``
    seconds into it)."""

    def __init__(self, after_s: float = 0.0) -> None:
        self.after_s = after_s

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(self.after_s)
            os._exit(3)
        return i


def _adds_two_workers(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Rules that add two workers whenever ``max_workers`` allows, checked after every
    batch (mid-epoch) or only at epoch boundaries."""
    import trainperf.loader._adapt_retune as adapt_retune
    import trainperf.loader._adapt_timed as adapt_timed
    from trainperf.loader._adapt_rules import Change, EpochFigures

    def decide(f: EpochFigures, **kw: Any) -> Change | None:
        n = min(2, kw["max_workers"])
        return Change(n, 2, "input-bound", "scripted") if n > f.num_workers else None

    monkeypatch.setattr(adapt_retune, "decide", decide)
    monkeypatch.setattr(adapt_timed, "_CHECK_BATCHES", 0)
    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.0 if mode == "mid-epoch" else 1e9)


@pytest.mark.parametrize("timeout", [0.0, 30.0])
@pytest.mark.parametrize("mode", ["mid-epoch", "epoch-boundary"])
def test_a_pool_that_cannot_start_is_given_up_and_the_epoch_goes_on_where_it_was(
    monkeypatch: pytest.MonkeyPatch, mode: str, timeout: float
) -> None:
    # Before: the spawn pickling error of the pool it started itself was raised in the
    # training loop, although the loader, built without workers, had been working.
    from torch.utils.data import DataLoader

    from trainperf.loader import AdaptiveDataLoader

    _adds_two_workers(monkeypatch, mode)
    ds = _Unpicklable()
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True}
    plain = DataLoader(ds, generator=torch.Generator().manual_seed(5), **kw)
    expected = [[int(x) for b in plain for x in b] for _ in range(2)]
    loader = AdaptiveDataLoader(
        ds,
        generator=torch.Generator().manual_seed(5),
        multiprocessing_context="spawn",
        timeout=timeout,
        **kw,
    )
    with pytest.warns(RuntimeWarning, match="cannot be pickled.*went back to num_workers=0"):
        epochs = [[int(x) for b in loader for x in b] for _ in range(2)]
        it = iter(loader)  # max_workers=0 now: no change, the length of the epoch
        assert len(it) == 6 and len(list(it)) == 6
    loader.close()
    assert epochs == expected  # nothing lost, nothing twice, the same order
    (failed,) = loader.tuning_history[1:]
    assert (failed.reason, failed.old, failed.new) == ("failed", (2, 2), (0, None))
    assert loader.num_workers == 0 and loader._max_workers == 0  # never tried again
    assert loader.timeout == 0 and loader._timeout_kept == timeout  # yours, for later


@pytest.mark.slow  # two forked workers start and die: about a second
@pytest.mark.parametrize("mode", ["mid-epoch", "epoch-boundary"])
def test_a_pool_whose_workers_die_before_a_batch_is_given_up(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Before: "DataLoader worker (pid(s) ...) exited unexpectedly" in the training loop.
    import psutil

    from trainperf.loader import AdaptiveDataLoader

    _adds_two_workers(monkeypatch, mode)
    loader = AdaptiveDataLoader(_DiesInWorkers(), batch_size=4, multiprocessing_context="fork")
    with pytest.warns(RuntimeWarning, match="a worker died.*went back to num_workers=0"):
        epochs = [[int(x) for b in loader for x in b] for _ in range(2)]
    loader.close()
    assert epochs == [list(range(24))] * 2
    assert [c.reason for c in loader.tuning_history[1:]] == ["failed"]
    children = psutil.Process().children(recursive=True)
    alive = [p for p in children if p.status() != psutil.STATUS_ZOMBIE]
    assert [p.pid for p in alive if "resource_tracker" not in " ".join(p.cmdline())] == []


def _until_a_worker_died(it: Any, within_s: float = 10.0) -> None:
    """Wait until a worker of the DataLoader iterator ``it`` has exited (without reaping
    it, and in no ``try`` that could swallow torch's SIGCHLD error)."""
    from trainperf.loader._workers import iterator_worker_pids

    pids = iterator_worker_pids(it) or []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if any(os.waitid(os.P_PID, p, os.WEXITED | os.WNOHANG | os.WNOWAIT) for p in pids):
            return
        time.sleep(0.01)


@pytest.mark.slow  # two forked workers start and die: about a second
@pytest.mark.parametrize("mode", ["mid-epoch", "epoch-boundary"])
def test_a_new_pool_whose_workers_die_outside_next_is_still_given_up(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Before: torch's SIGCHLD handler raised "DataLoader worker ... exited unexpectedly"
    # between the pool's start and the next() that judges it (here: held open until the
    # workers died), outside the trial's reach, and so in the training loop.
    import trainperf.loader._adapt as adapt
    import trainperf.loader._adapt_retune as adapt_retune
    from trainperf.loader import AdaptiveDataLoader

    _adds_two_workers(monkeypatch, mode)
    module = adapt_retune if mode == "mid-epoch" else adapt
    real_arm = module.arm

    def slow_arm(loader: Any, it: Any) -> Any:
        _until_a_worker_died(it)
        return real_arm(loader, it)

    monkeypatch.setattr(module, "arm", slow_arm)
    ds = _DiesInWorkers(after_s=0.3)  # once DataLoader has started the pool and returned
    loader = AdaptiveDataLoader(ds, batch_size=4, multiprocessing_context="fork")
    with pytest.warns(RuntimeWarning, match="a worker died.*went back to num_workers=0"):
        epochs = [[int(x) for b in loader for x in b] for _ in range(2)]
    loader.close()
    assert epochs == [list(range(24))] * 2
    assert [c.reason for c in loader.tuning_history[1:]] == ["failed"]


def failing_init(worker_id: int) -> None:
    """A caller's worker_init_fn that raises (module level: picklable)."""
    raise ValueError(f"no shard for worker {worker_id}")


@pytest.mark.slow  # two forked workers start: about a second
@pytest.mark.parametrize("mode", ["mid-epoch", "epoch-boundary"])
def test_a_worker_init_fn_that_raises_in_a_pool_it_started_says_so(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Before: torch's "Caught ValueError in DataLoader worker process 0", although the
    # loader, built with num_workers=0, had never run the function.
    from trainperf.loader import AdaptiveDataLoader

    _adds_two_workers(monkeypatch, mode)
    loader = AdaptiveDataLoader(
        range(24), batch_size=4, worker_init_fn=failing_init, multiprocessing_context="fork"
    )
    match = (
        r"worker_init_fn failing_init raised in a worker of the pool AdaptiveDataLoader "
        r"started itself \(num_workers=2; built with num_workers=0\): ValueError: no shard "
        r"for worker \d.*Fix: .*adapt=False.*max_workers=0"
    )
    try:
        with pytest.raises(RuntimeError, match=match) as caught:
            for _ in range(2):
                list(loader)
    finally:
        loader.close()
    assert "Caught" in str(caught.value.__cause__)  # torch's, with the worker's traceback
    assert loader.worker_init_fn.user_fn is failing_init  # the loader's own is untouched


def test_a_dataset_error_in_a_pool_it_started_is_still_torchs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainperf.loader import AdaptiveDataLoader

    _adds_two_workers(monkeypatch, "epoch-boundary")
    loader = AdaptiveDataLoader(
        FailsInWorkersAfterInit(), batch_size=4, multiprocessing_context="fork"
    )
    try:
        with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process"):
            for _ in range(2):
                list(loader)
    finally:
        loader.close()


class FailsInWorkersAfterInit(Dataset[int]):
    """Loads in the main process; raises KeyError in a worker (the dataset's own error)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        if torch.utils.data.get_worker_info() is not None:
            raise KeyError(i)
        return i


class _DiesInSecondWorker(Dataset[int]):
    """Loads in the main process and in worker 0; worker 1 dies on its first sample, half a
    second in: after worker 0's first batch came back."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 1:
            time.sleep(0.5)
            os._exit(3)
        return i


@pytest.mark.slow  # two forked workers start, one dies half a second in: about a second
@pytest.mark.parametrize("mode", ["mid-epoch", "epoch-boundary"])
def test_a_pool_whose_second_worker_dies_after_the_first_batch_is_given_up(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Before: the trial ended at the pool's first batch (worker 0's), so worker 1's death
    # on its first sample raised "DataLoader worker ... exited unexpectedly" in the loop.
    from trainperf.loader import AdaptiveDataLoader

    _adds_two_workers(monkeypatch, mode)
    kw: dict[str, Any] = {"batch_size": 4, "multiprocessing_context": "fork"}
    loader = AdaptiveDataLoader(_DiesInSecondWorker(), **kw)
    try:
        with pytest.warns(RuntimeWarning, match="a worker died.*went back to num_workers=0") as w:
            epochs = [[int(x) for b in loader for x in b] for _ in range(2)]
    finally:
        loader.close()
    assert epochs == [list(range(24))] * 2  # nothing lost, nothing twice, the same order
    (failed,) = loader.tuning_history[1:]
    assert (failed.reason, failed.old, failed.new) == ("failed", (2, 2), (0, None))
    assert failed.epoch_batch > 0  # given up where the epoch was, after worker 0's batch
    (text,) = [str(x.message) for x in w if x.category is RuntimeWarning]
    assert "worker 1 of the 2 it started failed before its first batch: a worker died" in text
    assert failed.why.startswith("worker 1 of the 2 it started failed before its first batch")
    assert loader.num_workers == 0 and loader._max_workers == 0
