"""The search rules, each on its own, and the search driven by synthetic curves."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tests.batchsize._fakes import Curve
from trainperf.batchsize import BatchSizeCandidate
from trainperf.batchsize._compare import AlternationOOM, Comparison, rescaled, round_order
from trainperf.batchsize._search import (
    Search,
    SizeSpace,
    choose,
    growth_factor,
    looks_flat,
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
    # A fast size between two sizes of the growth (say, where a kernel fits the cache);
    # throughput grows in proportion to the size, so the growth quadruples: 128, then 512.
    curve = Curve(overhead=1.0, per_sample=0.0001, bump=lambda n: 2.0 if n == 320 else 1.0)
    s = search(curve, SizeSpace(1, 512))
    best = s.run()
    assert best is not None and best.batch_size == 320
    assert {224, 416} <= set(curve.probed)  # the new best's neighbours were refined
    assert len(curve.probed) == len(set(curve.probed))  # no size run twice
    # ... but no finer than the grid of powers of two and midpoints (1.5 apart at most):
    assert not {c for c in curve.probed if 224 < c < 320 or 320 < c < 416}


def test_refinement_between_sizes_that_ran_stops_at_the_grid_of_the_sweep() -> None:
    rs = [ok(32, 900.0), ok(48, 1000.0), ok(64, 950.0)]  # 1.5 and 1.33 apart
    assert refinement_targets(rs, SizeSpace(1, 1024), rs[1]) == []
    failing = [ok(32, 900.0), ok(48, 1000.0), BatchSizeCandidate(64, "oom")]
    assert refinement_targets(failing, SizeSpace(1, 1024), failing[1]) == [56]


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


# --------------------------------------------------------------------------- a drifting host


class DriftingHost:
    """Probes and alternating windows on a host whose load changes between probes: each
    probe, and each window of a comparison, runs at the load of its moment (one tick each);
    ``busy`` ticks run at a third of the speed. Within one probe the windows agree (small
    spread): only measurements taken at different moments disagree."""

    def __init__(self, curve: Curve, busy: set[int]) -> None:
        self.curve = curve
        self.busy = busy
        self.tick = 0
        self.compared: list[tuple[int, ...]] = []

    def _now(self, n: int) -> float:
        load = 3.0 if self.tick in self.busy else 1.0
        self.tick += 1
        return self.curve.rate(n) / load

    def probe(self, n: int) -> BatchSizeCandidate:
        self.curve.probed.append(n)
        return ok(n, self._now(n), spread=0.01)

    def compare(self, sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        self.compared.append(order)
        done = []
        for r in range(rounds):
            row = {n: self._now(n) for n in round_order(order, r)}
            done.append(tuple(row[n] for n in order))
        return Comparison(order, tuple(done))


def drifting(compare: bool) -> tuple[DriftingHost, BatchSizeCandidate | None]:
    # Throughput rises all the way (16 % from 128 to 256, the top); the host is busy while
    # the fourth and fifth probes run (32 and 64, after 1, 2 and 8).
    host = DriftingHost(Curve(overhead=0.05, per_sample=0.001), busy={3, 4})
    s = Search(
        SizeSpace(1, 256), host.probe, time_left=lambda: math.inf, usable=lambda: None,
        compare=host.compare if compare else None,
    )  # fmt: skip
    return host, s.run()


def test_a_busy_moment_stops_the_growth_when_probes_are_compared_across_time() -> None:
    # What the search did before sizes were alternated: the slow-looking 32 stops it.
    host, best = drifting(compare=False)
    assert best is not None and max(host.curve.probed) <= 64
    assert host.curve.rate(best.batch_size) < 0.9 * host.curve.rate(256)


def test_alternating_windows_see_through_the_busy_moment() -> None:
    host, best = drifting(compare=True)
    assert best is not None
    sweep = [n for k in range(9) for n in (2**k, 3 * 2**k // 2) if 1 <= n <= 256]
    best_in_sweep = max(sweep, key=host.curve.rate)
    assert host.curve.rate(best.batch_size) >= 0.97 * host.curve.rate(best_in_sweep)
    assert host.compared  # the growth's stop and the final choice were alternated
    assert len(set(host.curve.probed)) <= len(set(sweep)) / 2


def test_the_final_choice_is_the_fastest_in_alternation_not_the_luckiest_probe() -> None:
    # 48 is truly fastest; 64's probe ran on a quiet host and 48's on a busy one.
    rates = {16: 800.0, 32: 950.0, 48: 1000.0, 64: 990.0}
    busy_probe = {48}

    def probe(n: int) -> BatchSizeCandidate:
        return ok(n, rates[n] / (1.2 if n in busy_probe else 1.0))

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        return Comparison(order, tuple(tuple(rates[n] for n in order) for _ in range(rounds)))

    s = Search(SizeSpace(1, 64, per_rank=192), probe, time_left=lambda: math.inf,
               usable=lambda: None, compare=compare)  # fmt: skip
    s.results = [probe(n) for n in (16, 32, 48, 64)]
    assert choose(s.results).batch_size == 64  # type: ignore[union-attr]
    assert s.final()
    best = choose(s.results)
    assert best is not None and best.batch_size == 48
    assert "alternated with 64" in (best.reason or "")
    assert any("alternated for 3 rounds" in note for note in s.notes)


def test_the_final_alternation_does_not_measure_again_a_pair_the_growth_alternated() -> None:
    # The growth stopped at 128 after alternating it with 64; refinement added 96. At the
    # end only 96 is alternated with 64: 128's figure from the growth's rounds stands.
    truth = {32: 100.0, 64: 110.0, 96: 117.0, 128: 108.0}
    compared: list[tuple[int, ...]] = []

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        compared.append(order)
        return Comparison(order, tuple(tuple(truth[n] for n in order) for _ in range(rounds)))

    s = Search(SizeSpace(1, 512), Curve(), time_left=lambda: math.inf, usable=lambda: None,
               compare=compare)  # fmt: skip
    s.results = [ok(32, 100.0), ok(64, 110.0), ok(128, 90.0)]
    assert s._alternate(s.results[1:]) is not None  # what the growth's stop did
    s._replace(s.results[2], rescaled(s.results[2], s.comparisons[0], s.results[1]))
    s.results.append(ok(96, 101.0))
    assert s.final()
    assert compared == [(64, 128), (64, 96)]
    best = choose(s.results)
    assert best is not None and best.batch_size == 96
    figures = {c.batch_size: round(c.samples_per_s or 0.0, 1) for c in s.results}
    assert figures == {32: 100.0, 64: 110.0, 96: 117.0, 128: 108.0}
    # Each shortlisted size alternated with the fastest already, in two alternations:
    # nothing is measured again.
    compared.clear()
    s = Search(SizeSpace(1, 512), Curve(), time_left=lambda: math.inf, usable=lambda: None,
               compare=compare)  # fmt: skip
    s.results = [ok(32, 50.0), ok(64, 110.0), ok(128, 108.0), ok(96, 107.0)]
    s.comparisons = [Comparison((64, 128), ((110.0, 108.0),)), Comparison((64, 96), ((1.0, 1.0),))]
    assert s.final() and compared == []


def test_a_size_measured_again_after_an_alternation_is_alternated_again_at_the_end() -> None:
    # Its new figure is on no alternation's scale: the final alternation must not trust it.
    truth = {64: 110.0, 128: 100.0}
    compared: list[tuple[int, ...]] = []

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        compared.append(order)
        return Comparison(order, tuple(tuple(truth[n] for n in order) for _ in range(rounds)))

    def probe(n: int) -> BatchSizeCandidate:
        return ok(n, 115.0 if n == 128 else truth[n])  # 128's second probe: a lucky one

    s = Search(SizeSpace(1, 512), probe, time_left=lambda: math.inf, usable=lambda: None,
               compare=compare)  # fmt: skip
    s.results = [ok(64, 110.0), ok(128, 104.0, spread=0.3)]
    assert s._alternate(s.results) is not None
    s._replace(s.results[1], rescaled(s.results[1], s.comparisons[0], s.results[0]))
    s._measure_again(s.results[1])
    compared.clear()
    assert s.final() and compared == [(128, 64)]
    best = choose(s.results)
    assert best is not None and best.batch_size == 64


def test_no_time_for_alternation_falls_back_to_the_probes() -> None:
    calls: list[object] = []

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        calls.append(sizes)
        raise AssertionError("not called without time")

    s = Search(SizeSpace(1, 64), Curve(), time_left=lambda: 0.0, usable=lambda: None,
               compare=compare)  # fmt: skip
    s.results = [ok(32, 100.0), ok(64, 99.0)]
    assert not s.final() and not calls
    assert any("no time left to measure 32, 64 in alternation" in n for n in s.notes)


def test_only_a_flat_looking_figure_is_alternated_before_the_growth_goes_on() -> None:
    best = ok(64, 1000.0, spread=0.3)
    assert looks_flat(best, ok(128, 1009.0, spread=0.3))  # under the 1 % floor
    assert looks_flat(best, ok(128, 700.0, spread=0.3))
    assert not looks_flat(best, ok(128, 1200.0, spread=0.3))  # up, if within the spread
    compared: list[tuple[int, ...]] = []

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        compared.append(order)
        return Comparison(order, tuple(tuple(min(n, 64) * 10.0 for n in order) for _ in "abc"))

    # Each size's figure is 10 % up, inside a 30 % spread: the growth goes on without a
    # second look until the figures flatten at 64.
    probe = Curve(
        overhead=0.0, per_sample=0.1, spread=0.3, bump=lambda n: 1.1 ** math.log2(min(n, 64))
    )
    s = Search(SizeSpace(1, 256), probe, time_left=lambda: math.inf, usable=lambda: None,
               compare=compare)  # fmt: skip
    best_found = s.run()
    assert best_found is not None and best_found.batch_size == 64
    assert compared[0] == (64, 128)  # the first alternation: where the figure went flat


def test_no_alternation_stops_a_growth_that_reached_the_top() -> None:
    compared: list[tuple[int, ...]] = []

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        compared.append(order)
        return Comparison(order, tuple(tuple(float(n) for n in order) for _ in "abc"))

    def probe(n: int) -> BatchSizeCandidate:  # rising, but 64's own figure looks slower
        return ok(n, 600.0 if n == 64 else 20.0 * n)

    s = Search(SizeSpace(1, 64), probe, time_left=lambda: math.inf, usable=lambda: None,
               compare=compare)  # fmt: skip
    s.grow()
    assert [c.batch_size for c in s.results][-1] == 64 and not compared
    assert s.notes[-1] == "growth reached the largest allowed size"
    s.refine()
    assert s.final() and compared  # the fastest are alternated at the end instead


def test_a_lucky_outlier_with_a_wide_spread_is_alternated_with_the_runners_up() -> None:
    # 1024's one figure is an outlier (55 % spread), half again above every other size:
    # the final alternation still takes the runners-up, and 512 (truly fastest) wins there.
    truth = {256: 2700.0, 512: 3100.0, 1024: 3000.0, 2048: 2400.0}

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        return Comparison(order, tuple(tuple(truth[n] for n in order) for _ in range(rounds)))

    s = Search(SizeSpace(1, 2048), Curve(), time_left=lambda: math.inf, usable=lambda: None,
               compare=compare)  # fmt: skip
    s.results = [ok(256, 2700.0), ok(512, 3100.0), ok(1024, 4700.0, spread=0.55),
                 ok(2048, 2400.0)]  # fmt: skip
    assert s.final()
    assert s.compared == [frozenset({1024, 512, 256})]
    best = choose(s.results)
    assert best is not None and best.batch_size == 512


def test_a_stop_on_rounds_that_disagree_waits_for_more_rounds() -> None:
    # 8 is 10 % faster than 4; the first three rounds are noisy (median 1.0, ratios from
    # 0.9 to 1.3), the next three are clear.
    calls: list[tuple[int, ...]] = []
    noisy = ((100.0, 100.0), (100.0, 130.0), (100.0, 90.0))
    clear = ((100.0, 110.0), (100.0, 111.0), (100.0, 109.0))

    def compare(sizes: Sequence[BatchSizeCandidate], rounds: int) -> Comparison:
        order = tuple(c.batch_size for c in sizes)
        calls.append(order)
        if order == (4, 8):
            return Comparison(order, noisy if calls.count(order) == 1 else clear)
        return Comparison(order, tuple(tuple(float(min(n, 8)) for n in order) for _ in "abc"))

    def probe(n: int) -> BatchSizeCandidate:
        return ok(n, {1: 10.0, 2: 15.0, 4: 22.0}.get(n, 22.0))  # 8 and up look flat

    s = Search(SizeSpace(1, 64), probe, time_left=lambda: math.inf, usable=lambda: None,
               compare=compare)  # fmt: skip
    s.grow()
    assert calls[:2] == [(4, 8), (4, 8)]
    probed = [c.batch_size for c in s.results]
    assert 16 in probed  # the growth went on past 8
    eight = next(c for c in s.results if c.batch_size == 8)
    assert "(6 rounds)" in (eight.reason or "")


# --------------------------------------------------------------------------- OOM in alternation


class OomInAlternation:
    """A host where ``fails`` runs out of memory whenever it is measured in alternation
    (its probe alone fitted), and every other size runs at ``rates``."""

    def __init__(self, rates: dict[int, float], fails: int) -> None:
        self.rates = rates
        self.fails = fails
        self.compared: list[tuple[int, ...]] = []

    def probe(self, n: int) -> BatchSizeCandidate:
        return ok(n, self.rates[n])

    def compare(
        self, sizes: Sequence[BatchSizeCandidate], rounds: int
    ) -> Comparison | AlternationOOM:
        order = tuple(c.batch_size for c in sizes)
        self.compared.append(order)
        if self.fails in order:
            return AlternationOOM(self.fails, "CUDA out of memory. Tried to allocate 2.0 GiB")
        return Comparison(order, tuple(tuple(self.rates[n] for n in order) for _ in range(rounds)))


def oom_marked(s: Search, n: int) -> bool:
    (c,) = [c for c in s.results if c.batch_size == n]
    return c.status == "oom" and c.reason == "CUDA out of memory. Tried to allocate 2.0 GiB"


def test_a_size_out_of_memory_in_the_growths_alternation_stops_it_and_is_never_chosen() -> None:
    # 128's probe looks flat against 32 (and is the fastest by it): the two are alternated,
    # and 128 runs out of memory there.
    rates = {n: 10.0 * min(n, 32) for n in range(1, 257)}
    rates[128] = 321.0
    host = OomInAlternation(rates, fails=128)
    s = Search(SizeSpace(1, 256), host.probe, time_left=lambda: math.inf,
               usable=lambda: None, compare=host.compare)  # fmt: skip
    best = s.run()
    assert host.compared[0] == (32, 128)
    assert best is not None and best.batch_size != 128 and best.ok
    assert oom_marked(s, 128)
    assert max(c.batch_size for c in s.results) == 128  # the growth stopped there
    assert "growth stopped at 128: oom (CUDA out of memory. Tried to allocate 2.0 GiB)" in s.notes
    assert any(n.startswith("128 ran out of memory while measured in alternation with 32 (")
               for n in s.notes)  # fmt: skip


def test_a_size_out_of_memory_in_the_final_alternation_is_never_chosen() -> None:
    # 64, the fastest by its probe, fails when the fastest sizes are alternated at the end.
    rates = {16: 800.0, 32: 950.0, 48: 1000.0, 64: 1010.0}
    host = OomInAlternation(rates, fails=64)
    s = Search(SizeSpace(1, 64, per_rank=192), host.probe, time_left=lambda: math.inf,
               usable=lambda: None, compare=host.compare)  # fmt: skip
    s.results = [host.probe(n) for n in (16, 32, 48, 64)]
    assert not s.final()  # no comparison came of it
    assert host.compared == [(64, 48, 32)]
    assert oom_marked(s, 64)
    s.confirm()
    best = choose(s.results)
    assert best is not None and best.batch_size == 48
    assert any("64 ran out of memory while measured in alternation with 48, 32" in n
               for n in s.notes)  # fmt: skip


def test_the_best_out_of_memory_in_the_growths_alternation_stops_it_too() -> None:
    rates = {n: 10.0 * min(n, 32) for n in range(1, 257)}
    host = OomInAlternation(rates, fails=32)
    s = Search(SizeSpace(1, 256), host.probe, time_left=lambda: math.inf,
               usable=lambda: None, compare=host.compare)  # fmt: skip
    s.grow()
    assert oom_marked(s, 32) and [c.batch_size for c in s.results][-1] == 128
    assert s.notes[-1] == "growth stopped at 128: 32 CUDA out of memory. Tried to allocate 2.0 GiB"
    assert choose(s.results).batch_size == 128  # type: ignore[union-attr]
