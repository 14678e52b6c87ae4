"""trainperf.loader._memory: growth of forked workers over an epoch is projected.

A forked worker shares its parent's pages until it writes to them, and reading a Python
object writes its reference count: a dataset of many Python objects is copied into every
worker page by page as the epoch goes on, long after the few seconds the tuner measures.
Tensor buffers are never written and stay shared.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.loader._fakes import quick, search_over
from trainperf.loader import _memory as memory_mod
from trainperf.loader import measure, tune_loader
from trainperf.loader._memory import CollectFirst, project_worker_uss, projected_uss
from trainperf.loader._workers import WorkerProcesses, main_private_bytes

MiB = 1 << 20


# ------------------------------------------------------------------ the arithmetic


def test_growth_is_projected_over_every_sample_a_worker_loads() -> None:
    # 9 MiB grown over 2,000 samples; 1 MiB of it noise: 4 KiB per sample copied.
    got = project_worker_uss(20 * MiB, 9 * MiB, 2_000, 100_000, 4096 * MiB)
    assert got == 20 * MiB + 8 * MiB * 100_000 // 2_000


def test_projection_is_capped_at_the_parents_private_memory() -> None:
    assert project_worker_uss(20 * MiB, 9 * MiB, 2_000, 10**8, 300 * MiB) == 320 * MiB


def test_unknown_length_assumes_the_worst_once_growth_is_seen() -> None:
    assert project_worker_uss(20 * MiB, 9 * MiB, 2_000, None, 300 * MiB) == 320 * MiB
    assert project_worker_uss(20 * MiB, MiB // 2, 2_000, None, 300 * MiB) == 20 * MiB


@pytest.mark.parametrize(
    ("growth", "samples"),
    [(0, 2_000), (-3 * MiB, 2_000), (MiB, 2_000), (9 * MiB, 0)],
)
def test_noise_shrinkage_or_no_samples_keep_the_measured_size(growth: int, samples: int) -> None:
    assert project_worker_uss(20 * MiB, growth, samples, 10**6, 4096 * MiB) == 20 * MiB


def test_noise_allowance_is_a_parameter() -> None:
    # 3 MiB of growth is noise when two 2 MiB batches may sit in a worker's shared memory.
    assert project_worker_uss(20 * MiB, 3 * MiB, 100, 10**6, 4096 * MiB, noise=5 * MiB) == (
        20 * MiB
    )


def test_readings_use_the_smallest_growth_and_the_largest_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_mod, "main_private_bytes", lambda: 10_000 * MiB)
    first = (64, {1: 10 * MiB, 2: 4 * MiB, 3: 10 * MiB})  # worker 2 was still starting
    last = (4_064, {1: 15 * MiB, 2: 20 * MiB, 3: 16 * MiB, 4: 30 * MiB})
    got = projected_uss(first, last, num_workers=2, batch_bytes=0, samples_per_worker=10_000)
    # Growth 5 MiB (worker 1; 4 MiB beyond noise) over 2,000 samples per worker, projected
    # over 10,000 samples, on top of the largest worker (30 MiB).
    assert got == 30 * MiB + 4 * MiB * 10_000 // 2_000
    # Without a first reading, or with no worker read twice, the measured size stands.
    kw: dict[str, Any] = {"num_workers": 2, "batch_bytes": 0, "samples_per_worker": 10_000}
    assert projected_uss(None, last, **kw) == 30 * MiB
    assert projected_uss((0, {9: MiB}), last, **kw) == 30 * MiB
    assert projected_uss(first, (10, {}), **kw) is None


def test_batches_in_flight_count_as_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_mod, "main_private_bytes", lambda: 10_000 * MiB)
    first = (0, {1: 10 * MiB})
    last = (1_000, {1: 17 * MiB})  # 7 MiB: two 3 MiB batches held, plus churn
    kw: dict[str, Any] = {"num_workers": 1, "samples_per_worker": 10**6}
    assert projected_uss(first, last, batch_bytes=3 * MiB, **kw) == 17 * MiB
    assert projected_uss(first, last, batch_bytes=0, **kw) > 1000 * MiB


def test_collect_first_runs_the_callers_worker_init_fn_after_the_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    order: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda: order.append("collect"))
    CollectFirst(lambda worker_id: order.append(f"init {worker_id}"))(3)
    CollectFirst(None)(4)
    assert order == ["collect", "init 3", "collect"]


# ------------------------------------------------------------------ real workers


class FileList(Dataset[int]):
    """A list of file names, the classic case: reading a name writes its reference count,
    which copies the page it is on into the worker (strings are not garbage-collected
    containers, so nothing else touches them)."""

    def __init__(self, n: int = 400_000) -> None:
        self.files = [f"train/{i // 1000:04d}/image_{i:08d}.jpg" for i in range(n)]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> int:
        return len(self.files[i])


class Records(Dataset[int]):
    """Dicts and lists: containers, copied at a worker's first full garbage collection."""

    def __init__(self, n: int = 200_000) -> None:
        self.items = [{"id": i, "values": [i, i + 1, i + 2]} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> int:
        return int(self.items[i]["values"][0])


def uss_after_an_epoch(dataset: Any, batch_size: int) -> int:
    """The largest private memory a worker reaches over one shuffled epoch."""
    loader = DataLoader(
        dataset, batch_size=batch_size, num_workers=2, shuffle=True, persistent_workers=True
    )
    it = iter(loader)
    try:
        pids = [w.pid for w in it._workers]
        for _ in range(len(loader)):
            next(it)
        return max(int(psutil.Process(p).memory_full_info().uss) for p in pids)
    finally:
        it._shutdown_workers()


def measured(dataset: Any, batch_size: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """measure() with 2 workers; returns the result and the last raw USS reading."""
    readings: list[dict[int, int]] = []
    real = WorkerProcesses.uss_by_pid

    def spy(self: WorkerProcesses, limit: int = 8) -> dict[int, int]:
        got = real(self, limit)
        readings.append(got)
        return got

    monkeypatch.setattr(WorkerProcesses, "uss_by_pid", spy)
    r = measure(
        dataset,
        batch_size,
        {"shuffle": True},
        num_workers=2,
        prefetch_factor=2,
        pin_memory=False,
        deadline=time.perf_counter() + 20,
    )
    assert r.status == "ok", r.reason
    assert len(readings) == 2, "one reading after the first batch, one at the end"
    return r, max(readings[-1].values())


@pytest.mark.slow  # about 8 s each: a real epoch
@pytest.mark.parametrize("make", [FileList, Records], ids=["file-names", "records"])
def test_python_object_dataset_projects_memory_a_worker_really_reaches(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = make()
    r, end_of_window = measured(ds, 256, monkeypatch)
    assert r.worker_uss is not None
    reached = uss_after_an_epoch(ds, 256)
    assert r.worker_uss >= reached, (r.worker_uss // MiB, reached // MiB, end_of_window // MiB)
    assert search_over(r).worker_bytes() >= reached


class SlowFileList(FileList):
    def __getitem__(self, i: int) -> int:
        time.sleep(0.0002)
        return len(self.files[i])


@pytest.mark.slow  # about 5-6 s: a million file names
def test_growth_after_the_window_is_projected(monkeypatch: pytest.MonkeyPatch) -> None:
    # A few seconds read only a few thousand names of a million; the pages of the others
    # are copied later in the epoch, and the projection accounts for them.
    r, end_of_window = measured(SlowFileList(1_000_000), 256, monkeypatch)
    assert r.worker_uss is not None
    assert r.worker_uss >= 2 * end_of_window, (r.worker_uss // MiB, end_of_window // MiB)


@pytest.mark.slow  # about 3 s: a 256 MiB dataset
def test_tensor_dataset_projection_stays_small(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = torch.ones(1 << 21, 32)  # 256 MiB, all of it private to this process
    size = tensor.element_size() * tensor.numel()
    # The cap would not hide a wrong projection: the parent holds the whole tensor.
    assert main_private_bytes() > size
    r, end_of_window = measured(TensorDataset(tensor), 256, monkeypatch)
    assert r.worker_uss is not None
    # Indexing a tensor writes nothing in its buffer: the projection adds (almost) no growth to
    # what the window measured. (That reading itself depends on how big this test process is:
    # the worker's start-up garbage collection copies the parent's Python containers.)
    growth = r.worker_uss - end_of_window
    assert growth < size // 8, (r.worker_uss // MiB, end_of_window // MiB)


# ------------------------------------------ workers that each hold a lot (issue 20.2)

HOG = 200 * MiB


class Hog(Dataset[torch.Tensor]):
    """I/O-bound (10 ms a sample), and each worker holds 200 MiB of its own from its first
    sample on (a per-worker index, a decoder's buffers)."""

    def __init__(self) -> None:
        self.held: Any = None

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.held is None and torch.utils.data.get_worker_info() is not None:
            self.held = np.ones(HOG, dtype=np.uint8)  # every page written
        time.sleep(0.01)
        return torch.zeros(8)


@pytest.mark.slow  # about 5-8 s each: a real search with workers holding 200 MiB each
@pytest.mark.parametrize("ranks", [1, 4])
def test_workers_are_never_started_beyond_what_one_measured_worker_says_fits(
    monkeypatch: pytest.MonkeyPatch, ranks: int
) -> None:
    from tests.loader.test_search import fake_limits
    from trainperf.loader import _tune_prepare as tune_prepare
    from trainperf.loader import _tune_setup as tune_setup
    from trainperf.loader._search import safety_margin

    # 1.5 GiB available, about 1 GiB after the margin: the prior for a lean script (128 MiB
    # a forked worker) would start 6 of the 8 workers the CPUs ask for; 200 MiB each fit 4.
    # With 4 training processes on the host each starts its own workers: the host has 4
    # times as much (and 4 times the CPUs), and each rank gets the same share.
    available = 1536 * MiB
    room = available - safety_margin(available)
    host = fake_limits(
        memory_available=available * ranks, cpus=2 * ranks, cpus_host=2 * ranks,
        cpus_affinity=2 * ranks, shm_free=64 * 2**30 * ranks,
    )  # fmt: skip
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setattr(tune_setup, "host_limits", lambda: host)
    monkeypatch.setattr(tune_prepare, "main_rss", lambda: 100 * MiB)
    started: list[int] = []
    real = tune_prepare.measure

    def counting(*args: Any, **kwargs: Any) -> Any:
        started.append(kwargs["num_workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tune_prepare, "measure", counting)
    report = tune_loader(Hog(), 4, **quick(max_workers=8, budget_s=20.0))
    one = next(c for c in report.candidates if c.num_workers == 1)
    assert one.ok and one.worker_uss is not None and one.worker_uss >= HOG
    assert started[:2] == [0, 1], "one worker is measured before any pool"
    per_worker = 1.25 * max(c.worker_uss or 0 for c in report.candidates)
    fits = int(room // per_worker)
    assert 1 <= fits < 6
    # No pool larger than the measured memory allows was ever started...
    assert max(started) <= fits
    # ...and the larger counts considered are listed as skipped, with the figures.
    skipped = [c for c in report.candidates if c.status == "skipped" and c.fault == "memory"]
    assert 8 in {c.num_workers for c in skipped}
    text = str(report)
    for c in skipped:
        assert c.num_workers > fits
        line = next(ln for ln in text.splitlines() if ln.lstrip().startswith(f"{c.num_workers} "))
        assert re.search(
            rf"skipped \(memory\): {c.num_workers} workers \u00d7 0\.\d\d GiB \+ .* > "
            rf"{room / 2**30:.2f} GiB available",
            line,
        ), line
    assert ("this rank's share, 1/4 of what the host has free" in text) == (ranks == 4)
