"""What the watch reads besides the clock (``monitor/_probe.py``): CPU demand, the loader's
settings, the loop's setup."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.monitor._fakes import cpu_work
from trainperf.monitor import LoopSetup
from trainperf.monitor._probe import (
    CpuClock,
    batch_size,
    loader_facts,
    loop_setup,
    shared_leading,
)

HAS_SCHEDSTAT = Path("/proc/thread-self/schedstat").exists()


def test_the_clock_counts_cpu_work_and_not_sleep() -> None:
    clock = CpuClock()
    try:
        start, _ = clock.read()
        time.sleep(0.05)
        slept, _ = clock.read()
        cpu_work(0.1)
        worked, _ = clock.read()
    finally:
        clock.close()
    # Sleeping demands (almost) no CPU; 100 ms of CPU work demands at least that (running,
    # plus any wait for a CPU on a crowded host). The kernel adds run time at scheduler
    # ticks, so a reading may lag by a tick (up to 10 ms).
    assert slept - start < 0.02
    assert worked - slept >= 0.09


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="needs Linux's /proc/thread-self/schedstat")
def test_the_clock_reads_the_wait_for_a_cpu_from_schedstat() -> None:
    clock = CpuClock()
    try:
        demand, delay = clock.read()
        run, wait, _ = Path("/proc/thread-self/schedstat").read_text().split()
    finally:
        clock.close()
    assert not math.isnan(delay) and delay >= 0
    assert demand == pytest.approx((int(run) + int(wait)) / 1e9, abs=0.05)


def test_without_schedstat_the_clock_uses_cpu_time_and_knows_no_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_proc(*args: object, **kwargs: object) -> int:
        raise FileNotFoundError("no /proc here")

    monkeypatch.setattr(os, "open", no_proc)
    clock = CpuClock()
    before = time.thread_time()
    demand, delay = clock.read()
    assert math.isnan(delay)
    assert before <= demand <= time.thread_time()


def test_a_reading_from_another_thread_reopens_and_counts_a_generation() -> None:
    clock = CpuClock()
    try:
        clock.read()
        first = clock.generation
        other: list[int] = []
        thread = threading.Thread(target=lambda: (clock.read(), other.append(clock.generation)))
        thread.start()
        thread.join(timeout=10)
        assert other == [first + 1]
        clock.read()  # back on this thread: reopened again
        assert clock.generation == first + 2
    finally:
        clock.close()
    clock.close()  # closing twice is harmless


def test_batch_size_reads_the_first_tensor() -> None:
    assert batch_size(torch.zeros(5, 2)) == 5
    assert batch_size({"x": torch.zeros(3, 1), "y": torch.zeros(3)}) == 3
    assert batch_size([(torch.zeros(4, 2), 1)]) == 1  # one (tensor, label) sample
    assert batch_size(torch.tensor(1.0)) is None
    assert batch_size([[[torch.zeros(2)]]]) == 1  # a list of one per-sample item
    assert batch_size("opaque") is None


def test_batch_size_reads_the_first_numpy_array_as_a_tensor() -> None:
    # Before: None for every NumPy batch, so w.iter() counted no samples.
    assert batch_size(np.zeros((5, 2))) == 5
    assert batch_size({"x": np.zeros((3, 1)), "y": np.zeros(3)}) == 3
    assert batch_size([(np.zeros((4, 2)), 1)]) == 1  # one (array, label) sample
    assert batch_size(np.zeros(())) is None


def test_batch_size_counts_per_sample_items_as_batchsize_does() -> None:
    # Before: the first array's leading size, the image's H (224) or C (3), not the samples.
    hwc = [(np.zeros((224, 224, 3), np.uint8), 1) for _ in range(8)]  # collate_fn=list
    assert batch_size(hwc) == 8
    assert batch_size(tuple(zip(*hwc, strict=True))) == 8  # detection's collate
    chw = [(torch.zeros(3, 16, 16), 1) for _ in range(8)]
    assert batch_size(chw) == 8
    assert batch_size(tuple(zip(*chw, strict=True))) == 8
    # default_collate's list for tuple samples: [x, y], n samples each, however alike.
    assert batch_size([torch.zeros(6, 3), torch.zeros(6, 1)]) == 6
    assert batch_size([torch.zeros(6, 3, 8, 8), torch.zeros(6, 3, 8, 8)]) == 6
    assert batch_size([torch.zeros(5), torch.zeros(7), torch.zeros(2)]) == 3  # token ids
    assert batch_size(([torch.zeros(6, 8), torch.zeros(6, 8)], torch.zeros(6))) == 6  # views


def test_batch_size_reads_a_short_list_by_the_full_batches_per_sample_size() -> None:
    # Before: no way to say so; 5 CHW images of an 8-batch loader's last batch counted 3.
    chw = [torch.zeros(3, 16, 16)] * 5
    assert batch_size(chw, 8) == 3  # alone it reads as [x, y, z] fields of 3 samples
    assert batch_size(chw, 8, sample_leading=3) == 5
    assert batch_size([torch.zeros(4, 3), torch.zeros(4)], 8, sample_leading=3) == 4
    assert shared_leading(chw) == 3 and shared_leading([torch.zeros(2), 1]) is None


@pytest.mark.parametrize(
    ("batch", "full", "expected"),
    [
        ([torch.zeros(224, 224, 3, dtype=torch.uint8)] * 8, 8, 8),  # HWC images
        ([torch.zeros(3, 16, 16)] * 8, 8, 8),  # CHW images
        ([torch.zeros(512, dtype=torch.long)] * 4, 4, 4),  # fixed-length token ids
        ([torch.zeros(6, 3), torch.zeros(6, 1)], 8, 6),  # default_collate's [x, y], short
        ([torch.zeros(8, 3, 8, 8), torch.zeros(8, 3, 8, 8)], 8, 8),  # two views
    ],
    ids=["hwc", "chw", "tokens", "x-y-fields", "two-views"],
)
def test_batch_size_counts_a_loaders_list_of_per_sample_tensors(
    batch: list[torch.Tensor], full: int, expected: int
) -> None:
    # Before: the tensors' shared leading size (224, 3, 512), read as the batch's fields.
    assert batch_size(batch, full) == expected


def test_loader_facts_read_a_dataloader_and_nothing_else() -> None:
    data = TensorDataset(torch.zeros(16, 2))
    assert loader_facts(DataLoader(data, batch_size=4)) == {
        "num_workers": 0, "prefetch_factor": None, "batch_size": 4,
    }  # fmt: skip
    workers = loader_facts(DataLoader(data, batch_size=8, num_workers=2, prefetch_factor=3))
    assert workers == {"num_workers": 2, "prefetch_factor": 3, "batch_size": 8}
    assert loader_facts([torch.zeros(2)]) == {}
    assert loader_facts(iter(range(3))) == {}


def test_loader_facts_read_numpy_settings_as_python_ints() -> None:
    np = pytest.importorskip("numpy")
    data = TensorDataset(torch.zeros(16, 2))
    loader = DataLoader(data, batch_size=8, num_workers=np.int64(2), prefetch_factor=np.int32(3))
    facts = loader_facts(loader)
    assert facts == {"num_workers": 2, "prefetch_factor": 3, "batch_size": 8}
    assert all(type(value) is int for value in facts.values())  # JSON-safe, not np.int64


def test_loader_facts_do_not_count_bools_or_floats_as_settings() -> None:
    np = pytest.importorskip("numpy")
    loader = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=4)
    loader.tuning_report = _Report()  # type: ignore[attr-defined]
    loader.tuning_report.num_workers = np.bool_(True)  # type: ignore[attr-defined]
    loader.tuning_report.worker_cpus = np.float64(5.0)  # type: ignore[attr-defined]
    loader.tuning_report.samples_per_s = np.float32(1234.5)  # type: ignore[attr-defined]
    facts = loader_facts(loader)
    assert facts["tuned_num_workers"] is None and facts["tuned_worker_cpus"] is None
    assert facts["tuned_samples_per_s"] == 1234.5
    assert type(facts["tuned_samples_per_s"]) is float


class _Report:
    """What loader_facts reads of a TuningReport."""

    num_workers = 3
    worker_cpus = 5
    max_workers = 24
    samples_per_s = 1234.5


def test_loader_facts_bring_what_the_tuner_measured() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=4)
    loader.tuning_report = _Report()  # type: ignore[attr-defined]
    facts = loader_facts(loader)
    assert facts["tuned_num_workers"] == 3 and facts["tuned_worker_cpus"] == 5
    assert facts["tuned_max_workers"] == 24 and facts["tuned_samples_per_s"] == 1234.5


def test_loop_setup_reads_threads_and_cpus_without_cuda() -> None:
    setup = loop_setup({"num_workers": 2, "batch_size": 8}, None)
    assert setup.num_workers == 2 and setup.batch_size == 8
    assert setup.torch_threads == torch.get_num_threads()
    assert setup.host_cpus == os.cpu_count()
    assert setup.gpu_name is None and setup.gpu_capability is None
    assert isinstance(setup.cpu_native_bf16, bool)
    assert LoopSetup().to_dict()["num_workers"] is None


def test_a_loaders_ready_made_batches_count_what_they_hold() -> None:
    # DataLoader(batch_size=1, collate_fn=lambda x: x[0]) over a dataset of whole batches:
    # counted with the loader's batch size as a cap, each batch of 64 read 1.
    assert batch_size(torch.zeros(64, 3), 1) == 64
    assert batch_size([torch.zeros(16, 3), torch.zeros(16, 3)], 8) == 16  # two views, 2B
