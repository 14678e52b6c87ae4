"""trainperf.loader._cached: tune_loader's cache path.

A second call returns at once; cache=False; entries that are malformed, no longer fit or
come from a forced fallback are not used; the entry format stays readable.
"""

from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from tests.loader._fakes import tune_for_cache as tune
from trainperf.limits import HostLimits, host_limits
from trainperf.loader import CandidateResult, cache_file
from trainperf.loader import _cache as loader_cache
from trainperf.loader import _cached as tune_cached
from trainperf.loader import _tune as tune_mod
from trainperf.loader import _tune_prepare as tune_prepare
from trainperf.loader import _tune_setup as tune_setup
from trainperf.loader import _tune_stale as tune_stale
from trainperf.loader._cache import write_entry
from trainperf.loader._cached import REPORT_KEYS


@pytest.mark.slow  # about 2 s: a search with one worker
def test_second_call_is_a_cache_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    first = tune(shuffle=True, max_workers=1)
    assert not first.from_cache
    assert cache_file().exists()

    def no_measuring(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cache hit must not measure anything")

    monkeypatch.setattr(tune_prepare, "measure", no_measuring)
    second = tune(shuffle=True, max_workers=1)
    assert second.from_cache
    assert second.best_kwargs == first.best_kwargs
    assert second.samples_per_s == first.samples_per_s
    assert [c.num_workers for c in second.candidates] == [c.num_workers for c in first.candidates]
    assert any("cache" in n for n in second.notes)
    assert "from cache" in str(second)


def idle_step(batch: Any) -> None:
    """A training step that does nothing: the main process only takes batches."""


@pytest.mark.slow
def test_cache_hit_keeps_the_measured_main_process_share() -> None:
    first = tune(step_fn=idle_step)
    assert first.main_cores < 0.5 and first.worker_cpus == first.cpus
    second = tune(step_fn=idle_step)
    assert second.from_cache
    assert (second.main_cores, second.worker_cpus) == (first.main_cores, first.worker_cpus)
    third = tune()  # no step_fn: another key, and one core kept again
    assert not third.from_cache
    assert third.main_cores == 1.0 and third.worker_cpus == max(1, third.cpus - 1)


@pytest.mark.slow  # about 2-4 s: three tuning runs
def test_cache_false_neither_reads_nor_writes() -> None:
    tune()
    assert not tune(cache=False).from_cache
    path = cache_file()
    path.unlink()
    tune(cache=False)
    assert not path.exists()


@pytest.mark.slow
def test_malformed_entry_is_ignored() -> None:
    tune()
    data = json.loads(cache_file().read_text())
    for entry in data["entries"].values():
        entry["candidates"] = [{"no such field": 1}]
    cache_file().write_text(json.dumps(data))
    assert not tune().from_cache


@pytest.mark.slow  # about 3 s: three tuning runs with max_workers=0
@pytest.mark.parametrize(
    ("where", "field", "value"),
    [
        ("candidate", "samples_per_s", "fast"),
        ("candidate", "status", 3),
        ("entry", "baseline_samples_per_s", [1]),
        ("user_setting", "kept", "yes"),
        # JSON's Infinity and NaN parse as floats: before, int(inf) raised OverflowError out
        # of tune_loader, and a NaN figure made report.to_dict() invalid JSON.
        ("entry", "worker_cpus", float("inf")),
        ("entry", "main_cores", float("inf")),
        ("entry", "samples_per_s", float("nan")),
        ("candidate", "spread", float("inf")),
    ],
)
def test_an_entry_whose_figures_have_the_wrong_types_is_re_tuned(
    where: str, field: str, value: Any
) -> None:
    # Before: the hit was used, and print(report) raised "Unknown format code 'f' for
    # object of type 'str'" (or formatted nonsense) in the caller's script.
    tune()
    data = json.loads(cache_file().read_text())
    for entry in data["entries"].values():
        user = {"given": {}, "num_workers": 0, "prefetch_factor": None, "pin_memory": False}
        user |= {"kept": True, "samples_per_s": 1.0, "verdict": "kept"}
        entry["user_setting"] = user
        target = {"candidate": entry["candidates"][0], "entry": entry, "user_setting": user}
        target[where][field] = value
    cache_file().write_text(json.dumps(data))
    report = tune()
    assert not report.from_cache
    assert "the entry is malformed" in " | ".join(report.notes)
    assert str(report)  # the table a person reads, from the re-tuned figures


@pytest.mark.slow
def test_cached_choice_that_no_longer_fits_memory_is_re_tuned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tune()
    data = json.loads(cache_file().read_text())
    for entry in data["entries"].values():
        entry["memory_needed"] = 10**15  # as if measured on a much bigger host
    cache_file().write_text(json.dumps(data))
    assert not tune().from_cache


def edit_entry(**changes: Any) -> None:
    """Change the one stored entry by hand, as a user editing loader.json would."""
    data = json.loads(cache_file().read_text())
    (entry,) = data["entries"].values()
    for name, value in changes.items():
        if name in ("memory_needed", "shm_needed"):
            entry[name] = value
        else:
            entry["best"][name] = value
    cache_file().write_text(json.dumps(data))


@pytest.mark.slow
def test_a_re_tune_says_why_the_cached_choice_no_longer_fits_memory() -> None:
    tune()
    edit_entry(memory_needed=10**15)
    report = tune()
    assert not report.from_cache
    assert any(
        n.startswith("the cached settings were not used (they need 909.5 TiB of memory")
        and n.endswith("): tuned again")
        for n in report.notes
    ), report.notes


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        # A hand-edited worker count far beyond what this host (and this call) would try.
        (
            {"num_workers": 100000, "prefetch_factor": 2},
            "num_workers=100000 is above max_workers=0",
        ),
        ({"num_workers": -1}, "num_workers=-1 is not an int >= 0"),
        ({"num_workers": "4"}, "num_workers='4' is not an int >= 0"),
        ({"num_workers": True}, "num_workers=True is not an int >= 0"),
        ({"num_workers": 2.5}, "num_workers=2.5 is not an int >= 0"),
        ({"prefetch_factor": 0}, "prefetch_factor=0 is not None or an int >= 1"),
        ({"prefetch_factor": "2"}, "prefetch_factor='2' is not None or an int >= 1"),
        ({"pin_memory": "yes"}, "pin_memory='yes' is not a bool"),
        ({"pin_memory": 1}, "pin_memory=1 is not a bool"),
        ({"persistent_workers": None}, "persistent_workers=None is not a bool"),
        ({"memory_needed": -5}, "memory_needed=-5 is not an int >= 0"),
        ({"shm_needed": "0"}, "shm_needed='0' is not an int >= 0"),
    ],
)
@pytest.mark.slow
def test_a_hand_edited_entry_is_checked_and_re_tuned_with_a_note(
    changes: dict[str, Any], why: str
) -> None:
    tune()
    edit_entry(**changes)
    report = tune()
    assert not report.from_cache and report.num_workers == 0  # max_workers=0: measured again
    assert f"the cached settings were not used ({why}" in " | ".join(report.notes)
    assert any(n.endswith("tuned again") for n in report.notes)
    assert tune().from_cache  # the re-tuned entry replaced the edited one


@pytest.mark.slow  # about 6 s: two searches with up to two workers
def test_an_entry_above_max_workers_is_re_tuned_but_within_it_is_a_hit() -> None:
    tune(max_workers=2)
    edit_entry(num_workers=2, prefetch_factor=2, persistent_workers=False)
    hit = tune(max_workers=2)
    assert hit.from_cache and hit.num_workers == 2  # a setting this call could choose: kept
    edit_entry(num_workers=3)
    miss = tune(max_workers=2)
    assert not miss.from_cache and miss.num_workers <= 2
    assert any("num_workers=3 is above max_workers=2" in n for n in miss.notes)


@pytest.mark.slow
def test_unwritable_cache_is_a_note_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where a directory must be
    report = tune()
    assert any("could not be cached" in n for n in report.notes)
    with pytest.raises(OSError):
        write_entry("k", {}, cache_file())


class FailsInWorkers(Dataset[torch.Tensor]):
    """Loads in the main process, raises in every worker (a dataset not yet fixed)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("fails in a worker")
        return torch.zeros(4)


@pytest.mark.slow  # about 3-4 s: workers fail twice
def test_a_fallback_forced_by_failing_workers_is_not_cached() -> None:
    with pytest.warns(RuntimeWarning, match="falls back to num_workers=0"):
        first = tune(FailsInWorkers(), max_workers=2, cache=True)
    assert first.num_workers == 0 and any("not cached" in n for n in first.notes)
    with pytest.warns(RuntimeWarning, match="falls back to num_workers=0"):
        second = tune(FailsInWorkers(), max_workers=2, cache=True)
    assert not second.from_cache  # tuned again: the warning is not lost behind a cache hit


def test_limits_in_report_are_current_on_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    tune()
    real = host_limits()
    fake = HostLimits(**{**real.__dict__, "shm_free": real.shm_free})
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake)
    assert tune().limits is fake


# --------------------------------------------------------------------------- entry format


def stored_entry() -> dict[str, Any]:
    entries = json.loads(cache_file().read_text())["entries"]
    assert len(entries) == 1
    return dict(next(iter(entries.values())))


def test_the_entry_holds_the_reports_own_serialisation() -> None:
    report = tune()
    entry = stored_entry()
    assert set(entry) == {
        "best",
        "memory_needed",
        "shm_needed",
        "sharding_checked",
        "budget_s",
        "created",
        *REPORT_KEYS,
    }
    assert entry["budget_s"] == report.budget_s
    data = report.to_dict()
    assert {k: entry[k] for k in REPORT_KEYS} == {k: data[k] for k in REPORT_KEYS}
    fields = {f.name for f in dataclasses.fields(CandidateResult)}
    assert all(set(c) == fields for c in entry["candidates"])
    assert entry["best"] == {
        "num_workers": 0,
        "prefetch_factor": None,
        "pin_memory": False,
        "persistent_workers": False,
    }


def test_an_entry_in_the_earlier_format_is_still_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    tune()
    key = next(iter(json.loads(cache_file().read_text())["entries"]))
    # An entry as the tuner wrote it before TuningReport.to_dict existed (candidates written
    # by dataclasses.asdict; no main_cores or worker_cpus before step_fn was measured).
    old = {
        "best": {
            "num_workers": 0,
            "prefetch_factor": None,
            "pin_memory": False,
            "persistent_workers": False,
        },
        "samples_per_s": 1234.5,
        "baseline_samples_per_s": 1234.5,
        "step_samples_per_s": None,
        "memory_needed": 0,
        "shm_needed": 0,
        "candidates": [dataclasses.asdict(CandidateResult(0, None, False, "ok", 1234.5, 0.01))],
        "notes": ["an old note"],
    }
    cache_file().write_text(json.dumps({"version": 1, "entries": {key: old}}))

    def no_measuring(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cache hit must not measure anything")

    monkeypatch.setattr(tune_prepare, "measure", no_measuring)
    hit = tune()
    assert hit.from_cache and hit.samples_per_s == 1234.5
    assert hit.candidates == (CandidateResult(0, None, False, "ok", 1234.5, 0.01),)
    assert (hit.main_cores, hit.worker_cpus) == (1.0, max(1, hit.cpus - 1))
    assert hit.notes[0] == "an old note" and "settings from the cache" in hit.notes[1]


class _Configurable(Dataset[torch.Tensor]):
    """Its cost is a setting (a transform, augmentation): the key cannot see it."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        return torch.zeros(4)


def test_a_hit_for_a_dataset_that_now_loads_far_slower_is_tuned_again() -> None:
    # Before: the entry of the cheap dataset was reused for one a hundred times as costly,
    # with the old samples/s in the report.
    assert not tune(_Configurable(0.0)).from_cache
    assert tune(_Configurable(0.0)).from_cache  # the same cost: a hit
    report = tune(_Configurable(0.01))
    assert not report.from_cache
    assert report.notes[0].startswith("the cached settings were not used (the main process now")


@pytest.mark.parametrize(
    ("now", "then", "tuned_again"),
    [
        # A near-free dataset on a busy 2-core host: 0.05 ms a batch of 8 on the check,
        # 0.27 ms in the tuning's windows. Before: a 5x "change", the hit thrown away.
        (150_000.0, 30_000.0, False),
        (30_000.0, 150_000.0, False),
        (100.0, 100_000.0, True),  # 80 ms a batch now: a heavier transform
        (100_000.0, 100.0, True),
        (800.0, 200.0, True),  # 4x faster: 10 ms a batch against 40 ms
        (500.0, 200.0, False),  # within 3x
    ],
)
def test_a_hit_is_tuned_again_only_for_a_change_beyond_a_busy_hosts_noise(
    monkeypatch: pytest.MonkeyPatch, now: float, then: float, tuned_again: bool
) -> None:
    monkeypatch.setattr(tune_stale, "_main_process_rate", lambda *args: now)
    call = SimpleNamespace(
        dataset=_Configurable(0.0),
        setup=SimpleNamespace(batch_size=8, budget_s=30.0),
        loader_kwargs={},
        started=0.0,
    )
    why = tune_stale._changed_since(call, then, 30.0)  # type: ignore[arg-type]
    assert (why is not None) == tuned_again
    if tuned_again:
        assert f"now loads {now:,.0f} samples/s, {then:,.0f} when" in (why or "")


def test_a_hit_does_not_repeat_the_overrun_note_of_the_call_that_stored_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: "tuning took 6.6 s, 0.6 s over budget_s=6" was stored in the entry and shown
    # by every later hit, which took 0.1 s and may have had budget_s=30.
    over = "tuning took 9.0 s, 6.0 s over budget_s=3: a test's overrun"
    monkeypatch.setattr(tune_mod, "overrun_note", lambda *args: over)
    first = tune()
    assert over in first.notes
    monkeypatch.setattr(tune_mod, "overrun_note", lambda *args: None)
    hit = tune()
    assert hit.from_cache
    assert over not in hit.notes
    stored = json.loads(cache_file().read_text())["entries"]
    assert all(over not in entry["notes"] for entry in stored.values())


def test_a_hits_elapsed_s_includes_the_check_that_the_dataset_has_not_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: elapsed_s was taken before the main process re-read a few batches, so a hit
    # that took seconds (slow batches) reported the 0.1 s of its key.
    tune()
    clock = SimpleNamespace(now=0.0)
    clock.perf_counter = lambda: clock.now

    def slow_check(*args: Any, **kwargs: Any) -> float | None:
        clock.now += 5.0  # the batches this check loads took 5 s
        return None

    for module in (tune_mod, tune_cached, tune_stale):
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(tune_stale, "_main_process_rate", slow_check)
    hit = tune()
    assert hit.from_cache
    assert hit.elapsed_s == pytest.approx(5.0)


class _Counted(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(4)


def test_the_check_of_a_hit_starts_no_batch_past_the_budget() -> None:
    # Before: up to three batches after the first were loaded whatever the budget, so a hit
    # with 0.4 s batches took 1.7 s of budget_s=0.5, past "budget_s plus one piece".
    ds = _Counted()
    assert tune_stale._main_process_rate(ds, 8, {}, deadline=0.0) is None
    assert ds.calls == 8  # the first batch only (start-up), no timed one
    ds = _Counted()
    rate = tune_stale._main_process_rate(ds, 8, {}, deadline=float("inf"))
    assert rate is not None and ds.calls == 32  # the first and three timed batches


def test_a_read_only_cache_says_how_to_cache_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the note quoted the OSError only, without the way out.
    def refused(*args: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(cache_file()))

    monkeypatch.setattr(loader_cache, "write_entry", refused)
    report = tune()
    note = next(n for n in report.notes if "could not be cached" in n)
    assert "Read-only file system" in note
    assert "XDG_CACHE_HOME" in note and "cache=False" in note


def _cut_short_by(budget_s: float | None) -> None:
    """Make the stored entry one of a search whose budget (``budget_s``; None: an entry
    that does not say) ran out before it measured one worker."""
    data = json.loads(cache_file().read_text())
    (entry,) = data["entries"].values()
    skipped = CandidateResult(
        1, 2, False, "skipped", fault="budget", reason="the time budget ran out"
    )
    entry["candidates"].append(skipped.to_dict())
    entry.pop("budget_s", None)
    if budget_s is not None:
        entry["budget_s"] = budget_s
    cache_file().write_text(json.dumps(data))


def test_a_search_the_budget_cut_short_is_reused_only_within_its_budget() -> None:
    # Before: the entry of a 3 s search that never reached a worker answered a 30 s call.
    tune()
    assert tune(budget_s=30.0).from_cache  # a search that ran to its end: any budget
    _cut_short_by(3.0)
    assert tune(budget_s=3.0).from_cache and tune(budget_s=2.0).from_cache
    again = tune(budget_s=8.0)
    assert not again.from_cache
    why = "its budget_s=3 ran out before the search ended, and this call's budget_s=8 is larger"
    assert any(why in n and n.endswith("tuned again") for n in again.notes), again.notes
    assert tune(budget_s=30.0).from_cache  # the new search ran to its end


def test_a_cut_short_entry_that_does_not_say_its_budget_is_tuned_again() -> None:
    tune()
    _cut_short_by(None)  # stored before entries kept their budget
    again = tune()
    assert not again.from_cache
    assert any("budget ran out before the search ended" in n for n in again.notes), again.notes
