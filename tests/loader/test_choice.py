"""trainperf.loader._choice: persistent_workers, best_kwargs, and which choices are cached."""

from __future__ import annotations

import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from trainperf.loader import CandidateResult
from trainperf.loader._choice import (
    best_settings,
    final_kwargs,
    forced_fallback,
    has_set_epoch,
    persistent_workers,
)


def test_persistent_workers_decision() -> None:
    c = CandidateResult(4, 2, False, "ok", samples_per_s=1000.0, startup_s=2.0)
    assert persistent_workers(c, None, 10_000, 10)[0] is True  # 2 s start-up vs 10 s epochs
    assert persistent_workers(c, 1, 10_000, 10)[0] is False  # one epoch: nothing to keep
    keep, why = persistent_workers(c, 5, 10_000_000, 10)  # 10,000 s epochs: start-up negligible
    assert keep is False and why is not None and "under 1 %" in why
    assert (
        persistent_workers(CandidateResult(0, None, False, "ok", samples_per_s=1.0), None, 10, 1)[0]
        is False
    )


def test_a_dataset_with_set_epoch_gets_no_persistent_workers_unless_asked() -> None:
    # Before: kept workers hold their own copy of the dataset, so the caller's
    # dataset.set_epoch(e) never reached them and every epoch shuffled alike.
    c = CandidateResult(4, 2, False, "ok", samples_per_s=1000.0, startup_s=2.0)
    keep, why = persistent_workers(c, None, 10_000, 10, set_epoch=True)
    assert keep is False and why is not None and "set_epoch()" in why
    notes: list[str] = []
    assert (
        best_settings(c, None, None, 10_000, 10, notes, set_epoch=True)["persistent_workers"]
        is False
    )
    assert notes and "set_epoch()" in notes[0]
    assert best_settings(c, True, None, 10_000, 10, [], set_epoch=True)["persistent_workers"]

    class Stream:
        def set_epoch(self, epoch: int) -> None:
            pass

    assert has_set_epoch(Stream()) and not has_set_epoch([1, 2])


def test_best_settings_keep_the_callers_persistent_workers() -> None:
    four = CandidateResult(4, 2, True, "ok", samples_per_s=1000.0, startup_s=2.0)
    notes: list[str] = []
    assert best_settings(four, False, None, 10_000, 10, notes) == {
        "num_workers": 4,
        "prefetch_factor": 2,
        "pin_memory": True,
        "persistent_workers": False,
    }
    assert notes == []  # the caller's choice needs no explanation
    assert best_settings(four, None, None, 10_000, 10, notes)["persistent_workers"] is True
    assert len(notes) == 1 and notes[0].startswith("persistent_workers=True: worker start-up")


def test_final_kwargs_with_workers_keep_the_callers_arguments() -> None:
    best = {"num_workers": 3, "prefetch_factor": 4, "pin_memory": True, "persistent_workers": True}
    notes: list[str] = []
    kw = final_kwargs({"shuffle": True, "multiprocessing_context": "spawn"}, 16, best, notes)
    assert kw == {
        "shuffle": True,
        "multiprocessing_context": "spawn",
        "batch_size": 16,
        "num_workers": 3,
        "pin_memory": True,
        "prefetch_factor": 4,
        "persistent_workers": True,
    }
    assert notes == []


def test_final_kwargs_without_workers_drop_what_dataloader_rejects() -> None:
    best = {"num_workers": 0, "prefetch_factor": None, "pin_memory": False}
    notes: list[str] = []
    kw = final_kwargs({"prefetch_factor": 2, "multiprocessing_context": "spawn"}, 8, best, notes)
    assert kw == {
        "batch_size": 8,
        "num_workers": 0,
        "pin_memory": False,
        "persistent_workers": False,
    }
    assert notes == ["multiprocessing_context dropped: it needs num_workers > 0"]


def test_forced_fallback() -> None:
    zero = CandidateResult(0, None, False, "ok", samples_per_s=100.0)
    two = CandidateResult(2, 2, False, "ok", samples_per_s=250.0)
    for fault in ("crash", "hang", "pickle", "error", "shm", "memory", "budget"):
        refused = CandidateResult(2, 2, False, "skipped", fault=fault)  # type: ignore[arg-type]
        assert forced_fallback(zero, [zero, refused]), fault
        assert not forced_fallback(two, [zero, refused, two]), fault  # workers were chosen
    too_few_cores = CandidateResult(2, 2, False, "skipped", fault="cpu")
    assert not forced_fallback(zero, [zero, too_few_cores])
    assert not forced_fallback(zero, [zero])


def test_a_dataset_wrapping_one_with_set_epoch_counts_as_having_it() -> None:
    # Before: only the outer dataset was looked at, so Subset(hf_stream) or
    # ConcatDataset([...]) got persistent workers that never saw inner.set_epoch(e).
    class Stream(Dataset[int]):
        def set_epoch(self, epoch: int) -> None:
            pass

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            return i

    assert has_set_epoch(Subset(Stream(), [0, 1]))
    assert has_set_epoch(ConcatDataset([TensorDataset(torch.zeros(2)), Stream()]))
    assert has_set_epoch(Subset(Subset(Stream(), [0, 1]), [0]))
    assert not has_set_epoch(Subset(TensorDataset(torch.zeros(2)), [0]))
