"""trainperf.loader._user: the caller's own num_workers (and friends) as one candidate.

The verdict rules on synthetic measurements (kept as the fastest or on a tie, replaced by a
faster or an equally fast smaller pool, not measured because a limit refuses it, failed),
then end to end: ``num_workers`` in the loader arguments is accepted, measured, reported and
part of the cache key.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.loader._fakes import Waits, quick, tune_for_cache
from trainperf.loader import CandidateResult, UserSetting, autotune_loader, tune_loader
from trainperf.loader import _tune_prepare as tune_prepare
from trainperf.loader._search import Search
from trainperf.loader._user import judge, user_config


def rates(table: dict[int, float], fail: dict[int, str] | None = None) -> Any:
    """A fake ``measure``: ``table[n]`` samples/s, or a crash for the counts in ``fail``."""

    def measure(n: int, pf: int | None, pin: bool) -> CandidateResult:
        if fail and n in fail:
            return CandidateResult(n, pf, pin, "failed", fault="crash", reason=fail[n])
        return CandidateResult(
            n, pf, pin, "ok", samples_per_s=table.get(n, 100.0), worker_cpu=0.1 * n
        )

    return measure


def ok(n: int, rate: float) -> CandidateResult:
    return CandidateResult(n, 2, False, "ok", samples_per_s=rate, worker_cpu=0.1 * n)


def searched(
    user: tuple[int, int | None, bool], table: dict[int, float], **kw: Any
) -> tuple[Search, CandidateResult]:
    s = Search(
        measure=kw.pop("measure", rates(table)),
        out_of_time=lambda: False,
        worker_cpus=kw.pop("worker_cpus", 4),
        max_workers=kw.pop("max_workers", 8),
        memory_available=64 << 30,
        shm_free=None,
        start_method="fork",
        user=user,
        **kw,
    )
    base = CandidateResult(0, None, False, "ok", samples_per_s=table[0], main_cpu=1.0)
    return s, s.run(base)


def test_user_config_fills_in_dataloaders_defaults() -> None:
    assert user_config({"shuffle": True}) is None
    assert user_config({"num_workers": 2}) == (2, 2, False)
    assert user_config({"num_workers": 2, "prefetch_factor": 8, "pin_memory": True}) == (2, 8, True)
    assert user_config({"num_workers": 0, "pin_memory": True}) == (0, None, True)


def test_the_callers_setting_is_measured_first_and_kept_when_fastest() -> None:
    s, choice = searched((3, 2, False), {0: 100.0, 1: 150.0, 2: 200.0, 3: 400.0, 4: 300.0})
    assert (s.results[1].num_workers, s.results[1].prefetch_factor) == (3, 2)  # right after 0
    verdict = judge(s, choice, (3, 2, False), {"num_workers": 3})
    assert verdict.kept and verdict.samples_per_s == 400.0
    assert "the fastest" in verdict.verdict
    assert str(verdict).startswith("your setting num_workers=3: kept: ")


def test_a_faster_configuration_replaces_it_and_says_by_how_much() -> None:
    s, choice = searched((1, 2, False), {0: 100.0, 1: 110.0, 2: 200.0, 3: 300.0, 4: 440.0})
    verdict = judge(s, choice, (1, 2, False), {"num_workers": 1})
    assert not verdict.kept and choice.num_workers > 1
    assert verdict.samples_per_s == 110.0
    assert f"{s.objective(choice) / 110.0:.2f}x" in verdict.verdict
    assert "replaced" in str(verdict) and choice.label() in verdict.verdict


def test_as_fast_with_fewer_workers_replaces_it_too() -> None:
    s, _ = searched((0, None, False), {0: 100.0}, max_workers=0)
    s.results += [ok(4, 303.0), ok(2, 300.0)]  # the caller's 4, then 2 within 2 % of it
    choice = s.choose()
    verdict = judge(s, choice, (4, 2, False), {"num_workers": 4})
    assert not verdict.kept and choice.num_workers == 2
    assert "within 2 %" in verdict.verdict and "fewer workers" in verdict.verdict


def test_a_setting_the_cpu_limit_refuses_is_not_measured_and_says_why() -> None:
    # Each worker keeps a core busy; 8 workers cannot fit in the 2 cores left for them.
    def measure(n: int, pf: int | None, pin: bool) -> CandidateResult:
        return CandidateResult(n, pf, pin, "ok", samples_per_s=100.0 * (1 + n), worker_cpu=n)

    s, choice = searched((8, 2, False), {0: 100.0}, measure=measure, worker_cpus=2)
    mine = next(c for c in s.results if c.num_workers == 8)
    assert mine.status == "skipped" and mine.fault == "cpu"
    verdict = judge(s, choice, (8, 2, False), {"num_workers": 8})
    assert not verdict.kept and verdict.samples_per_s is None
    assert verdict.verdict.startswith("not measured: 8 workers would keep about")
    assert f"chosen instead: {choice.label()}" in verdict.verdict


def test_a_setting_above_max_workers_is_not_measured_and_says_how_to_have_it_measured() -> None:
    s, choice = searched((6, 2, False), {0: 100.0}, max_workers=2)
    assert all(c.num_workers <= 2 for c in s.results)
    verdict = judge(s, choice, (6, 2, False), {"num_workers": 6})
    assert not verdict.kept
    assert "num_workers=6 is above max_workers=2" in verdict.verdict
    assert "max_workers=6" in verdict.verdict


def test_a_setting_whose_workers_crash_is_reported_as_failed() -> None:
    crash = rates({0: 100.0}, fail={2: "a worker died"})
    s, choice = searched((2, 2, False), {0: 100.0}, measure=crash)
    verdict = judge(s, choice, (2, 2, False), {"num_workers": 2})
    assert not verdict.kept and verdict.verdict.startswith("failed (crash): a worker died")


def test_num_workers_zero_is_the_baseline() -> None:
    s, choice = searched((0, None, False), {0: 100.0, 1: 100.5, 2: 100.0})
    verdict = judge(s, choice, (0, None, False), {"num_workers": 0})
    assert verdict.kept and choice.num_workers == 0
    assert sum(c.num_workers == 0 for c in s.results) == 1  # measured once


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow  # about 3 s: a search with workers
def test_num_workers_in_the_loader_arguments_is_measured_and_judged() -> None:
    loader = autotune_loader(Waits(), 8, **quick(max_workers=2, num_workers=1, pin_memory=False))
    report = loader.tuning_report
    mine = report.user_setting
    assert isinstance(mine, UserSetting)
    assert (mine.num_workers, mine.prefetch_factor, mine.pin_memory) == (1, 2, False)
    assert mine.given == {"num_workers": 1, "pin_memory": False}
    assert any((c.num_workers, c.prefetch_factor) == (1, 2) and c.ok for c in report.candidates)
    assert mine.kept == (report.best_kwargs["num_workers"] == 1)
    assert "your setting num_workers=1, pin_memory=False: " in str(report)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["user_setting"]["kept"] is mine.kept and data["user_setting"]["verdict"]
    assert loader.num_workers == report.num_workers


@pytest.mark.slow
def test_num_workers_above_max_workers_is_accepted_and_not_measured() -> None:
    report = tune_loader(Waits(), 8, **quick(max_workers=0, num_workers=3))
    assert report.num_workers == 0 and [c.num_workers for c in report.candidates] == [0]
    assert report.user_setting is not None and not report.user_setting.kept
    assert "num_workers=3 is above max_workers=0" in str(report)


@pytest.mark.slow
def test_the_callers_setting_is_part_of_the_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    first = tune_for_cache(num_workers=0)
    assert first.user_setting is not None and first.user_setting.kept
    assert not tune_for_cache().from_cache  # no setting of the caller's: another key
    assert not tune_for_cache(num_workers=2).from_cache  # another setting: another key

    def no_measuring(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cache hit must not measure anything")

    monkeypatch.setattr(tune_prepare, "measure", no_measuring)
    hit = tune_for_cache(num_workers=0)
    assert hit.from_cache and hit.user_setting == first.user_setting
