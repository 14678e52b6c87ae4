"""trainperf.loader._search: prediction and climb, driven by synthetic measurements.

A synthetic pool delivers ``min(n, saturation) * per_worker`` samples/s and each worker
demands ``demand`` cores, so every decision (CPU cap, memory cap, step_fn cap, climb
direction, fallback) is checked exactly, without timing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from tests.loader._fakes import search_over, tune_two_workers
from trainperf.limits import HostLimits
from trainperf.loader import CandidateResult
from trainperf.loader import _tune_setup as tune_setup
from trainperf.loader._search import (
    GAIN,
    Search,
    adaptive_max_workers,
    default_max_workers,
    safety_margin,
)

GiB = 1 << 30
MiB = 1 << 20


class Pool:
    """Synthetic measurements: throughput, CPU demand and memory of ``n`` workers."""

    def __init__(
        self,
        rate: Callable[[int, int | None], float],
        *,
        demand: float = 1.0,
        main_demand: float | None = None,
        uss: int = 50 * MiB,
        batch_bytes: int = MiB,
        fail: dict[int, tuple[str, str]] | None = None,
    ) -> None:
        self.rate = rate
        self.demand = demand
        self.main_demand = demand if main_demand is None else main_demand
        self.uss = uss
        self.batch_bytes = batch_bytes
        self.fail = fail or {}
        self.calls: list[tuple[int, int | None, bool]] = []

    def baseline(self) -> CandidateResult:
        return self(0, None, False)

    def __call__(self, n: int, pf: int | None, pin: bool) -> CandidateResult:
        self.calls.append((n, pf, pin))
        if n in self.fail:
            fault, reason = self.fail[n]
            return CandidateResult(n, pf, pin, "failed", fault=fault, reason=reason)  # type: ignore[arg-type]
        return CandidateResult(
            n,
            pf,
            pin,
            "ok",
            samples_per_s=self.rate(n, pf),
            spread=0.01,
            windows=2,
            batches=10,
            startup_s=0.1,
            worker_uss=self.uss if n else None,
            worker_cpu=n * self.demand if n else None,
            main_cpu=self.main_demand,
            batch_bytes=self.batch_bytes,
        )


def linear(per_worker: float = 150.0, saturation: int = 1000) -> Callable[[int, int | None], float]:
    """100 samples/s in the main process; each worker (no torch threads to share, no
    Python overhead of the training loop) delivers ``per_worker`` up to ``saturation``."""

    def rate(n: int, pf: int | None) -> float:
        return 100.0 if n == 0 else per_worker * min(n, saturation)

    return rate


def search(pool: Pool, **kw: Any) -> Search:
    args: dict[str, Any] = {
        "measure": pool,
        "out_of_time": lambda: False,
        "worker_cpus": 3,
        "max_workers": 12,
        "memory_available": 64 * GiB,
        "shm_free": 64 * GiB,
        "start_method": "fork",
    }
    args.update(kw)
    return Search(**args)


def workers_tried(s: Search) -> list[int]:
    return [c.num_workers for c in s.results if c.status != "skipped"]


def test_cpu_bound_pool_stops_at_the_cores_left_for_workers() -> None:
    pool = Pool(linear(), demand=1.0)
    s = search(pool, worker_cpus=3)
    choice = s.run(pool.baseline())
    assert choice.num_workers == 3
    cpu_skips = [c for c in s.results if c.fault == "cpu"]
    assert [c.num_workers for c in cpu_skips] == [4]
    assert "3 are left for workers (one kept for the main process)" in (cpu_skips[0].reason or "")
    assert max(workers_tried(s)) == 3


def test_cpu_skip_names_a_measured_main_process_share() -> None:
    pool = Pool(linear(), demand=1.0)
    s = search(pool, worker_cpus=2, main_cores=0.03, step_samples_per_s=1e9)
    s.run(pool.baseline())
    cpu_skips = [c for c in s.results if c.fault == "cpu"]
    assert cpu_skips and "0.03 kept for the main process, as step_fn measured" in (
        cpu_skips[0].reason or ""
    )


def test_cpu_skip_on_one_cpu_says_the_workers_share_the_main_process_core() -> None:
    pool = Pool(linear(), demand=1.0)
    s = search(pool, worker_cpus=1, main_cores=1.0, cpus=1)
    s.run(pool.baseline())
    cpu_skips = [c for c in s.results if c.fault == "cpu"]
    assert cpu_skips and (cpu_skips[0].reason or "").endswith(
        "only 1 is left for workers (shared with the main process)"
    )


def test_io_bound_pool_goes_past_the_core_count() -> None:
    pool = Pool(linear(), demand=0.05)
    s = search(pool, worker_cpus=1, max_workers=8)
    choice = s.run(pool.baseline())
    assert choice.num_workers == 8
    assert workers_tried(s) == [0, 8, 6]  # predicted straight to the cap, one step down


def test_plateau_picks_the_fewest_workers_that_reach_it() -> None:
    pool = Pool(linear(saturation=2), demand=1.0)
    s = search(pool, worker_cpus=7)
    choice = s.run(pool.baseline())
    # 7 predicted; 9 is over the CPU budget; stepping down by 2 keeps the plateau to 3.
    assert workers_tried(s) == [0, 7, 5, 3, 1]
    assert choice.num_workers == 3
    assert choice.samples_per_s == pytest.approx(300)


def test_climbs_while_each_step_pays() -> None:
    # The main process looks partly I/O-bound (0.3 cores) and workers turn out to demand
    # less (0.1): the prediction is low and the climb goes up until throughput saturates.
    pool = Pool(linear(saturation=9), demand=0.1, main_demand=0.3)
    s = search(pool, worker_cpus=1, max_workers=16)
    choice = s.run(pool.baseline())
    assert workers_tried(s) == [0, 5, 6, 7, 8, 9, 10]  # 5 = floor(1.5 / 0.3), steps of 1
    assert choice.num_workers == 9


def test_workers_that_do_not_beat_the_main_process_are_not_chosen() -> None:
    def rate(n: int, pf: int | None) -> float:
        return 1000.0 if n == 0 else 950.0  # inter-process copies cost more than they save

    pool = Pool(rate, demand=1.0)
    s = search(pool, worker_cpus=7)
    assert s.run(pool.baseline()).num_workers == 0
    assert workers_tried(s) == [0, 7, 3]  # the half-size pool is tried once (contention)


def test_near_ties_prefer_num_workers_zero() -> None:
    pool = Pool(lambda n, pf: 1000.0 if n == 0 else 1010.0, demand=1.0)
    assert search(pool, worker_cpus=1).run(pool.baseline()).num_workers == 0


def test_step_fn_caps_the_workers() -> None:
    pool = Pool(linear(), demand=0.05)
    s = search(pool, worker_cpus=15, max_workers=64, step_samples_per_s=400.0)
    choice = s.run(pool.baseline())
    # ceil(1.1 * 400 / 100) = 5 predicted; 3 workers (450/s) already outrun a 400/s step,
    # and more would only burn CPU.
    assert workers_tried(s)[1] == 5
    assert max(workers_tried(s)) == 5
    assert choice.num_workers == 3
    assert s.objective(choice) == pytest.approx(400.0)


def test_step_fn_makes_overlap_count() -> None:
    # One worker is no faster than the main process, but it overlaps with the step.
    pool = Pool(lambda n, pf: 100.0, demand=1.0)
    s = search(pool, worker_cpus=1, step_samples_per_s=100.0)
    choice = s.run(pool.baseline())
    assert choice.num_workers == 1
    assert s.objective(pool.baseline()) == pytest.approx(50.0)
    assert s.objective(choice) == pytest.approx(100.0)


def test_measured_worker_memory_caps_the_climb() -> None:
    pool = Pool(linear(), demand=0.05, uss=1 * GiB, batch_bytes=MiB)
    s = search(pool, worker_cpus=1, max_workers=16, memory_available=12 * GiB, main_rss=1 * GiB)
    choice = s.run(pool.baseline())
    room = 12 * GiB - safety_margin(12 * GiB)
    # Before a worker is measured, each may copy the whole main process (1 GiB): the
    # first probe is sized for that worst case, not for 16 workers.
    first = workers_tried(s)[1]
    assert first * GiB + (first * 2 + 2) * MiB <= room
    # Measured 1 GiB per worker (+25 % for growth) then caps the climb and the choice.
    assert any(c.fault == "memory" for c in s.results)
    assert s.memory_needed(choice.num_workers, 2, False) <= room
    assert 0 < choice.num_workers < first


def test_memory_prediction_counts_workers_and_batches_in_flight() -> None:
    pool = Pool(linear(), batch_bytes=10 * MiB)
    s = search(pool, start_method="spawn")
    s.results = [pool.baseline()]
    # Before any worker is measured: the spawn prior (768 MiB) per worker.
    assert s.memory_needed(4, 2, False) == 4 * 768 * MiB + (4 * 2 + 2) * 10 * MiB
    assert s.memory_needed(4, 2, True) == 4 * 768 * MiB + 2 * (4 * 2 + 2) * 10 * MiB
    assert s.shm_needed(4, 4) == (4 * 4 + 2) * 10 * MiB
    assert s.shm_needed(0, None) == 0


def test_fatal_fault_stops_the_search_and_warns() -> None:
    pool = Pool(linear(), fail={3: ("crash", "a worker died (boom); run with num_workers=0")})
    s = search(pool)
    with pytest.warns(RuntimeWarning, match="boom"):
        choice = s.run(pool.baseline())
    assert choice.num_workers == 0
    assert workers_tried(s) == [0, 3]
    assert s.broken is not None and s.broken.fault == "crash"


def test_shm_failure_retries_with_fewer_workers() -> None:
    pool = Pool(linear(), demand=1.0, fail={3: ("shm", "/dev/shm full"), 7: ("shm", "full")})
    s = search(pool, worker_cpus=7)
    choice = s.run(pool.baseline())
    # /dev/shm failures are not fatal: halve until it fits, then climb back to the edge.
    assert workers_tried(s) == [0, 7, 3, 1, 2]
    assert choice.num_workers == 2
    assert s.broken is None


def test_budget_exhausted_after_the_baseline() -> None:
    pool = Pool(linear())
    s = search(pool, out_of_time=lambda: True)
    choice = s.run(pool.baseline())
    assert choice.num_workers == 0
    assert [(c.status, c.fault) for c in s.results[1:]] == [("skipped", "budget")]
    assert len(pool.calls) == 1


def test_max_workers_zero_measures_only_the_baseline() -> None:
    pool = Pool(linear())
    s = search(pool, max_workers=0)
    assert s.run(pool.baseline()).num_workers == 0
    assert len(s.results) == 1


def test_prefetch_and_pin_are_refined_at_the_chosen_count() -> None:
    def rate(n: int, pf: int | None) -> float:
        # Workers idle waiting on in-order delivery: half speed unless prefetch is deep.
        return 100.0 if n == 0 else 50.0 * n * (2 if pf == 4 else 1)

    pool = Pool(rate, demand=1.0)
    s = search(pool, worker_cpus=3, pin_options=(True, False))
    choice = s.run(pool.baseline())
    assert (choice.num_workers, choice.prefetch_factor, choice.pin_memory) == (3, 4, True)
    assert (3, 4, False) in pool.calls


def test_climb_continues_only_while_a_step_up_pays_gain() -> None:
    def rates(gain_per_worker: float) -> Callable[[int, int | None], float]:
        # Linear to 4 workers (200/s), then each extra worker adds gain_per_worker.
        return lambda n, pf: 100.0 if n == 0 else (
            50.0 * n if n <= 4 else 200.0 * (1 + gain_per_worker) ** (n - 4)
        )  # fmt: skip

    tried = {}
    for label, g in (("below", GAIN / 3), ("above", 2 * GAIN)):
        pool = Pool(rates(g), demand=1.0)
        # step_fn at 300/s predicts 4 workers (ceil(1.1 * 300 / 100)); the CPUs allow 7.
        s = search(pool, worker_cpus=7, step_samples_per_s=300.0)
        s.run(pool.baseline())
        tried[label] = workers_tried(s)
    assert tried["below"][:3] == [0, 4, 5] and 6 not in tried["below"]  # 5 did not pay GAIN
    assert tried["above"][:5] == [0, 4, 5, 6, 7]  # every step paid, up to the CPU cap


def test_default_max_workers_and_margin() -> None:
    assert default_max_workers(1) == 4
    assert default_max_workers(2) == 8
    assert default_max_workers(100) == 64
    assert [adaptive_max_workers(n) for n in (1, 2, 7, 8, 100)] == [8, 16, 56, 64, 64]
    assert safety_margin(100 * GiB) == 10 * GiB


def test_search_plans_with_the_projection_and_a_margin() -> None:
    measured_pool = CandidateResult(2, 2, False, "ok", samples_per_s=1.0, worker_uss=400 * MiB)
    assert search_over(measured_pool).worker_bytes() == 500 * MiB


# ------------------------------------------------------------- predicted limits, end to end


def fake_limits(**over: Any) -> HostLimits:
    base = {
        "cpus_host": 2,
        "cpus_affinity": 2,
        "cpu_quota": None,
        "cpus": 2,
        "memory_total": 16 * GiB,
        "memory_limit": None,
        "memory_available": 8 * GiB,
        "shm_total": 64 * GiB,
        "shm_free": 64 * GiB,
    }
    base.update(over)
    return HostLimits(**base)


class BigSamples(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(64 * 1024)  # 256 KiB


@pytest.mark.slow  # about 2 s: a tuning run
def test_too_small_shm_is_predicted_and_never_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake_limits(shm_free=2 << 20))
    with pytest.warns(RuntimeWarning, match="shm-size"):
        report = tune_two_workers(BigSamples())
    assert report.best_kwargs["num_workers"] == 0
    assert all(c.status == "skipped" and c.fault == "shm" for c in report.candidates[1:])
    assert report.limits.shm_free == 2 << 20


@pytest.mark.slow
def test_memory_limit_is_never_approached(monkeypatch: pytest.MonkeyPatch) -> None:
    # 600 MiB available: after the 512 MiB safety margin, not even one forked worker
    # (128 MiB assumed) plus its batches fits.
    monkeypatch.setattr(tune_setup, "host_limits", lambda: fake_limits(memory_available=600 << 20))
    with pytest.warns(RuntimeWarning, match="memory"):
        report = tune_two_workers(BigSamples())
    assert report.best_kwargs["num_workers"] == 0
    skipped = [c for c in report.candidates if c.status == "skipped"]
    assert skipped and all(c.fault == "memory" for c in skipped)
    assert "GiB" in (skipped[0].reason or "")


# ------------------------------------------------- one worker measured first (issue 20.2)


def test_one_worker_is_measured_before_a_pool_and_the_pool_fits_what_it_measured() -> None:
    # Each worker holds 2 GiB; 6 GiB available. The prior (128 MiB a forked worker) would
    # start 8 workers; one worker measured first caps the pool at what really fits.
    pool = Pool(linear(), demand=0.05, uss=2 * GiB, batch_bytes=MiB)
    s = search(pool, worker_cpus=1, max_workers=8, memory_available=6 * GiB, probe_first=True)
    choice = s.run(pool.baseline())
    room = 6 * GiB - safety_margin(6 * GiB)  # 5.4 GiB
    assert workers_tried(s)[:2] == [0, 1]  # the probe: one worker, before any pool
    assert all(s.memory_needed(n, 2, False) <= room for n in workers_tried(s))
    assert max(workers_tried(s)) == 2  # 2 x 2.5 GiB fits 5.4 GiB, 3 do not
    assert choice.num_workers == 2
    # The 8 the CPUs asked for is listed, with the figures, not dropped silently.
    eight = s.find(8, 2, False)
    assert eight is not None and (eight.status, eight.fault) == ("skipped", "memory")
    assert (eight.reason or "").startswith("8 workers \u00d7 2.50 GiB + ")
    assert "> 5.40 GiB available (per worker: measured" in (eight.reason or "")
    three = s.find(3, 2, False)  # the climb's next step: skipped the same way
    assert three is not None and (three.reason or "").startswith("3 workers \u00d7 2.50 GiB")


def test_without_the_probe_the_first_pool_is_sized_by_the_prior() -> None:
    # What the probe prevents: the same pool started at once at the CPUs' count.
    pool = Pool(linear(), demand=0.05, uss=2 * GiB, batch_bytes=MiB)
    s = search(pool, worker_cpus=1, max_workers=8, memory_available=6 * GiB)
    s.run(pool.baseline())
    assert workers_tried(s)[1] == 8


def test_no_probe_when_a_worker_was_measured_or_the_first_pool_has_one() -> None:
    pool = Pool(linear(), demand=0.05)
    s = search(pool, worker_cpus=1, max_workers=8, probe_first=True, user=(3, 2, False))
    s.run(pool.baseline())
    assert workers_tried(s)[:3] == [0, 3, 8]  # the caller's 3 workers measured memory
    pool = Pool(linear(), demand=1.0)
    s = search(pool, worker_cpus=1, probe_first=True)
    s.run(pool.baseline())
    assert workers_tried(s) == [0, 1]


def test_a_probe_that_fails_starts_no_pool() -> None:
    pool = Pool(linear(), demand=0.05, fail={1: ("memory", "a worker was killed by SIGKILL")})
    s = search(pool, worker_cpus=1, max_workers=8, probe_first=True)
    with pytest.warns(RuntimeWarning, match="SIGKILL"):
        choice = s.run(pool.baseline())
    assert choice.num_workers == 0 and workers_tried(s) == [0, 1]


def test_the_first_count_lowered_for_the_prior_is_listed_too() -> None:
    # Before any worker is measured (no probe): 1 GiB assumed per worker (the main process).
    pool = Pool(linear(), demand=0.05, uss=10 * MiB)
    s = search(pool, worker_cpus=1, max_workers=16, memory_available=6 * GiB, main_rss=GiB)
    s.run(pool.baseline())
    sixteen = s.find(16, 2, False)
    assert sixteen is not None and sixteen.status == "skipped"
    assert "16 workers \u00d7 1.00 GiB" in (sixteen.reason or "")
    assert "assumed: no worker measured yet" in (sixteen.reason or "")


def test_a_sigkilled_pool_is_retried_smaller() -> None:
    pool = Pool(linear(), demand=0.05, fail={8: ("memory", "killed by SIGKILL")})
    s = search(pool, worker_cpus=1, max_workers=8)
    choice = s.run(pool.baseline())
    assert workers_tried(s)[:3] == [0, 8, 4]  # halved, not given up
    assert choice.num_workers >= 4 and s.broken is None


def test_a_faster_pool_refused_for_memory_is_noted() -> None:
    # The 4-worker pool ran and measured 3 GiB per worker: that estimate refuses the faster
    # pool, and a note says why it was not chosen.
    def measure(n: int, pf: int | None, pin: bool) -> CandidateResult:
        uss = 3 * GiB if n >= 4 else 100 * MiB
        rate = 100.0 if n == 0 else 150.0 * n
        return CandidateResult(
            n, pf, pin, "ok", samples_per_s=rate, worker_uss=uss if n else None,
            worker_cpu=0.05 * n if n else None, main_cpu=0.05, batch_bytes=MiB,
        )  # fmt: skip

    s = search(measure, worker_cpus=1, max_workers=4, memory_available=8 * GiB)
    choice = s.run(measure(0, None, False))
    assert choice.num_workers < 4
    assert any(n.startswith("workers=4 prefetch=2 pin=no ran, but is not chosen: 4 workers \u00d7 ")
               for n in s.notes)  # fmt: skip


# --------------------------------------------- every worker count refused (issue 20.7)


def test_a_refusal_measures_no_worker_configuration() -> None:
    pool = Pool(linear(), demand=0.05)
    refused = CandidateResult(2, 2, False, "failed", fault="unsharded", reason="replays")
    s = search(pool, max_workers=8, refused=refused, user=(4, 2, False), probe_first=True)
    choice = s.run(pool.baseline())
    assert choice.num_workers == 0 and pool.calls == [(0, None, False)]
    mine = s.find(4, 2, False)
    assert mine is not None and (mine.status, mine.fault, mine.reason) == (
        "skipped",
        "unsharded",
        "replays",
    )
    assert s.results[1] is refused
