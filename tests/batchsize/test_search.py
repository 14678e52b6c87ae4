"""The search rules, each on its own, and the search driven by synthetic curves."""

from __future__ import annotations

import math

from tests.batchsize._fakes import Curve
from trainperf.batchsize import BatchSizeCandidate
from trainperf.batchsize._search import (
    Search,
    SizeSpace,
    choose,
    growth_factor,
    needs_confirming,
    predicted_peak,
    probe_cost,
    refinement_targets,
    rising,
    skip_reason,
)


def ok(n: int, rate: float, spread: float = 0.01, peak: int | None = None) -> BatchSizeCandidate:
    return BatchSizeCandidate(n, "ok", samples_per_s=rate, spread=spread, peak_memory=peak)


def search(curve: Curve, space: SizeSpace, **kw: object) -> Search:
    kw.setdefault("time_left", lambda: math.inf)
    kw.setdefault("usable", lambda: None)
    return Search(space, curve, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- sizes


def test_sizes_without_a_global_batch_are_every_integer_in_range() -> None:
    s = SizeSpace(3, 100)
    assert (s.first(), s.up(3), s.up(3, 4), s.up(60), s.up(100)) == (3, 6, 12, 100, None)
    assert (s.between(3, 6), s.between(4, 5), s.between(64, 100)) == (4, None, 82)
    assert SizeSpace(1, None).up(1 << 20) == 1 << 21  # no bound but memory


def test_sizes_with_a_global_batch_are_the_divisors_of_the_per_rank_batch() -> None:
    s = SizeSpace(1, 40, per_rank=96)
    assert [n for n in range(1, 100) if s.allowed(n)] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert (s.up(16), s.up(32), s.between(8, 16), s.between(16, 32)) == (32, None, 12, 24)
    assert SizeSpace(5, None, per_rank=7).first() == 7
    assert SizeSpace(8, None, per_rank=7).first() is None


# --------------------------------------------------------------------------- rules


def test_rising_needs_more_than_the_spread_and_at_least_one_percent() -> None:
    base = ok(64, 1000.0, spread=0.001)
    assert rising(base, ok(128, 1011.0, spread=0.001))
    assert not rising(base, ok(128, 1009.0, spread=0.001))  # under the 1 % floor
    assert not rising(base, ok(128, 1080.0, spread=0.10))  # inside the new size's spread
    assert not rising(base, BatchSizeCandidate(128, "oom"))


def test_growth_factor_is_four_only_while_throughput_scales_with_the_size() -> None:
    one = ok(1, 100.0)
    assert growth_factor(one, ok(2, 175.0)) == 4  # 2 ** 0.8 = 1.74
    assert growth_factor(one, ok(2, 170.0)) == 2
    assert growth_factor(ok(4, 100.0), ok(16, 300.0)) == 2  # 16 ** 0.8 / 4 ** 0.8 = 3.03
    assert growth_factor(ok(4, 100.0), BatchSizeCandidate(16, "oom")) == 2


def test_predicted_peak_follows_the_two_largest_measured_sizes() -> None:
    m = [ok(8, 1.0, peak=900), ok(16, 1.0, peak=1000), ok(32, 1.0, peak=1200)]
    assert predicted_peak(m, 64, 800) == 1600.0  # 12.5 bytes per sample from 16 to 32
    assert predicted_peak(m[:1], 16, 800) == 1000.0  # one point: proportional over 800
    assert predicted_peak([], 16, 800) is None
    # A peak that fell (noise) is not extrapolated downwards.
    assert predicted_peak([ok(8, 1.0, peak=1000), ok(16, 1.0, peak=990)], 64, 0) == 990.0


def test_probe_cost_grows_with_the_step_time_and_the_windows() -> None:
    last = ok(100, 1000.0)  # 0.1 s per step
    assert probe_cost(last, 1000, warmup_steps=2, min_windows=2, window_s=0.25) == 4.0
    assert probe_cost(last, 100, warmup_steps=2, min_windows=2, window_s=0.25) == 0.7
    assert probe_cost(None, 100, warmup_steps=2, min_windows=2, window_s=0.25) == 0.0


def test_skip_reason_names_the_memory_or_the_budget() -> None:
    assert "past the" in (skip_reason(8, 2e9, 1e9, 0.0, 10.0) or "")
    assert "left of the budget" in (skip_reason(8, None, None, 11.0, 10.0) or "")
    assert skip_reason(8, 1e9, 2e9, 1.0, 10.0) is None


def test_choose_takes_the_fastest_within_the_headroom_and_never_an_unrun_size() -> None:
    rs = [
        ok(32, 900.0),
        BatchSizeCandidate(64, "over-headroom", samples_per_s=2000.0),
        BatchSizeCandidate(128, "skipped"),
        BatchSizeCandidate(256, "oom"),
        ok(48, 950.0),
    ]
    assert choose(rs) is rs[4]
    assert choose(rs[1:4]) is None
    assert choose([ok(8, 5.0), ok(4, 5.0)]).batch_size == 4  # type: ignore[union-attr]


def test_refinement_targets_the_midpoints_of_wide_enough_gaps() -> None:
    rs = [ok(64, 800.0), ok(128, 1000.0), BatchSizeCandidate(256, "oom")]
    assert refinement_targets(rs, SizeSpace(1, 1024), rs[1]) == [96, 192]
    close = [ok(100, 800.0), ok(112, 1000.0), ok(128, 900.0)]  # 12 % and 14 % apart
    assert refinement_targets(close, SizeSpace(1, 1024), close[1]) == []
    assert refinement_targets(rs[1:], SizeSpace(1, 1024), rs[1]) == [192]  # no lower neighbour


def test_needs_confirming_only_an_unsettled_measurement() -> None:
    assert needs_confirming(ok(8, 1.0, spread=0.2), 0.05)
    assert not needs_confirming(ok(8, 1.0, spread=0.04), 0.05)
    assert not needs_confirming(BatchSizeCandidate(8, "oom"), 0.05)


# --------------------------------------------------------------------------- the search


def test_search_finds_the_plateau_without_a_sweep() -> None:
    # Throughput rises until about 96, then falls (the working set leaves the cache).
    curve = Curve(
        overhead=0.01, per_sample=0.0001, bump=lambda n: 1.0 if n <= 96 else (96 / n) ** 0.5
    )
    s = search(curve, SizeSpace(1, 4096))
    best = s.run()
    assert best is not None
    sweep = [n for k in range(13) for n in (2**k, 3 * 2**k // 2) if 1 <= n <= 4096]
    best_in_sweep = max(sweep, key=curve.rate)
    assert curve.rate(best.batch_size) >= 0.97 * curve.rate(best_in_sweep)
    assert len(curve.probed) < len(set(sweep)) / 2
    assert max(curve.probed) <= 256  # growth stopped one step after the peak
    assert any("growth stopped" in note for note in s.notes)


def test_a_size_that_runs_out_of_memory_is_never_chosen_nor_any_untested_one() -> None:
    for oom_above in (1, 5, 37, 100, 300):
        curve = Curve(oom_above=oom_above)  # throughput keeps rising with the size
        s = search(curve, SizeSpace(1, 1024))
        best = s.run()
        assert best is not None and best.batch_size <= oom_above
        assert best.batch_size in curve.probed and best.status == "ok"
        assert any(c.status == "oom" for c in s.results)


def test_the_first_size_running_out_of_memory_leaves_no_choice() -> None:
    s = search(Curve(oom_above=3), SizeSpace(4, 64))
    assert s.run() is None
    assert [c.status for c in s.results] == ["oom"]


def test_a_size_predicted_past_the_headroom_is_skipped_not_run() -> None:
    curve = Curve(fixed=1000, per_sample_bytes=10)  # 1000 + 10 n bytes
    s = search(curve, SizeSpace(1, 4096), usable=lambda: 3000.0, baseline=1000)
    best = s.run()
    assert best is not None and best.peak_memory is not None and best.peak_memory <= 3000
    assert max(curve.probed) <= 200  # 200 is where 1000 + 10 n reaches 3000
    skipped = [c for c in s.results if c.status == "skipped"]
    assert skipped and all("predicted peak" in (c.reason or "") for c in skipped)
    assert all(c.batch_size not in curve.probed for c in skipped)


def test_the_budget_skips_sizes_that_would_not_finish_but_runs_the_first() -> None:
    curve = Curve()
    s = search(curve, SizeSpace(1, 1024), time_left=lambda: 0.0)
    best = s.run()
    assert curve.probed == [1] and best is not None and best.batch_size == 1
    assert s.results[1].status == "skipped" and "budget" in (s.results[1].reason or "")


def test_with_a_global_batch_only_divisors_are_probed() -> None:
    curve = Curve()
    s = search(curve, SizeSpace(1, None, per_rank=96))
    best = s.run()
    assert best is not None and 96 % best.batch_size == 0
    assert all(96 % n == 0 for n in curve.probed)


def test_an_unsettled_best_is_measured_again_and_the_second_run_counts() -> None:
    runs: dict[int, int] = {}

    def probe(n: int) -> BatchSizeCandidate:
        runs[n] = runs.get(n, 0) + 1
        # 64's first run is a lucky outlier with a wide spread; its second is ordinary.
        if n == 64 and runs[n] == 1:
            return ok(64, 5000.0, spread=0.4)
        return ok(n, min(n, 48) * 10.0, spread=0.01)

    s = Search(SizeSpace(1, 64), probe, time_left=lambda: math.inf, usable=lambda: None)
    best = s.run()
    assert runs[64] == 2
    assert best is not None and best.batch_size != 64
    again = next(c for c in s.results if c.batch_size == 64)
    assert again.samples_per_s == 480.0 and "measured twice" in (again.reason or "")


def test_refinement_moves_to_a_faster_midpoint_and_refines_around_it() -> None:
    # A fast size between two powers of two (say, where a kernel fits the cache).
    curve = Curve(overhead=0.05, per_sample=0.001, bump=lambda n: 1.5 if n == 384 else 1.0)
    s = search(curve, SizeSpace(1, 512))
    best = s.run()
    assert best is not None and best.batch_size == 384
    assert {320, 448} <= set(curve.probed)  # the new best's neighbours were refined
    assert len(curve.probed) == len(set(curve.probed))  # no size run twice


def test_a_failing_size_above_the_best_is_approached_by_halving_the_gap() -> None:
    # Throughput rises with the size; memory runs out above 24.
    curve = Curve(overhead=0.05, per_sample=0.0001, oom_above=24)
    s = search(curve, SizeSpace(1, 1024))
    best = s.run()
    assert best is not None and 20 <= best.batch_size <= 24  # 25 % of the limit at most
    ooms = [c.batch_size for c in s.results if c.status == "oom"]
    assert len(ooms) >= 2 and ooms[1] < ooms[0]  # the failing bound came down


def test_growth_does_not_stop_on_an_unsettled_measurement() -> None:
    runs: dict[int, int] = {}

    def probe(n: int) -> BatchSizeCandidate:
        runs[n] = runs.get(n, 0) + 1
        # 32's first run was slowed by another process (wide spread); its second is not.
        if n == 32 and runs[n] == 1:
            return ok(32, 100.0, spread=0.5)
        return ok(n, min(n, 128) * 10.0, spread=0.01)

    s = Search(SizeSpace(1, 512), probe, time_left=lambda: math.inf, usable=lambda: None)
    best = s.run()
    assert runs[32] == 2 and 128 in runs
    assert best is not None and best.batch_size == 128


def test_a_lucky_best_is_measured_again_before_it_stops_the_growth() -> None:
    runs: dict[int, int] = {}

    def probe(n: int) -> BatchSizeCandidate:
        runs[n] = runs.get(n, 0) + 1
        if n == 2 and runs[n] == 1:  # a lucky first run of 2 would stop the growth at 8
            return ok(2, 1000.0, spread=0.3)
        return ok(n, min(n, 64) * 10.0, spread=0.01)

    s = Search(SizeSpace(1, 256), probe, time_left=lambda: math.inf, usable=lambda: None)
    best = s.run()
    assert runs[2] == 2 and best is not None and best.batch_size == 64
