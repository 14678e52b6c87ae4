"""Sizes measured against each other in alternation: the rules, and the prober running them."""

from __future__ import annotations

import math

import pytest
import torch

from tests.batchsize._fakes import QUICK, Trainer, same_state, sample, state_of
from trainperf.batchsize import BatchSizeCandidate
from trainperf.batchsize._agree import Agreement
from trainperf.batchsize._compare import (
    AlternationOOM,
    Comparison,
    compare_cost,
    outgrows,
    rescaled,
    round_order,
    shortlist,
    undecided,
)
from trainperf.batchsize._memory import MemoryReader
from trainperf.batchsize._probe import Prober
from trainperf.batchsize._state import SavedState


def ok(n: int, rate: float, spread: float = 0.01) -> BatchSizeCandidate:
    return BatchSizeCandidate(n, "ok", samples_per_s=rate, spread=spread)


# --------------------------------------------------------------------------- rules


def test_rounds_alternate_their_order_so_a_steady_drift_costs_each_size_alike() -> None:
    assert [round_order([8, 16], r) for r in range(4)] == [[8, 16], [16, 8], [8, 16], [16, 8]]
    # A load rising by 10 % per window: in order 8, 16, 16, 8 each size gets the same mean.
    slot = iter(range(100))
    seen: dict[int, list[float]] = {8: [], 16: []}
    for r in range(2):
        for n in round_order([8, 16], r):
            seen[n].append(1.1 ** next(slot))
    assert sum(seen[8]) == pytest.approx(sum(seen[16]), rel=0.01)


def test_the_ratio_is_taken_within_each_round_and_a_spike_moves_one_round_only() -> None:
    # 64 is 5 % faster than 32; the host's load halves everything in round 2, and a spike
    # hits 32's window alone in round 3.
    rounds = ((100.0, 105.0), (50.0, 52.5), (60.0, 105.0), (98.0, 102.9))
    c = Comparison((32, 64), rounds)
    assert c.ratio(64) == pytest.approx(1.05)
    assert c.ratio(32) == 1.0 and c.leader() == 64
    assert c.samples_per_s(32) == pytest.approx(79.0)  # the reference's own median
    assert c.samples_per_s(64) == pytest.approx(79.0 * 1.05)
    assert c.ratio_spread(64) == pytest.approx((1.75 - 1.05) / 1.05)


def test_the_leader_is_the_highest_ratio_the_smaller_on_a_tie() -> None:
    assert Comparison((8, 16, 24), ((10.0, 12.0, 11.0),)).leader() == 16
    assert Comparison((8, 16), ((10.0, 10.0),)).leader() == 8
    empty = Comparison((8, 16), ())
    assert math.isnan(empty.ratio(16)) and math.isnan(empty.samples_per_s(16))
    assert empty.leader() == 8


def test_growth_goes_on_only_past_the_minimum_gain() -> None:
    c = Comparison((32, 64), ((100.0, 103.0), (100.0, 102.0), (100.0, 200.0)))
    assert outgrows(c, 32, 64, 0.01)  # median ratio 1.03
    assert not outgrows(c, 32, 64, 0.05)  # one lucky round does not count
    assert not outgrows(c, 64, 32, 0.0)
    assert not outgrows(Comparison((32, 64), ()), 32, 64, 0.0)


def test_the_shortlist_is_the_fastest_and_those_near_it() -> None:
    rates = [(8, 50.0), (16, 90.0), (32, 100.0), (48, 80.0), (64, 76.0)]
    assert shortlist(rates, within=0.25, most=3) == [32, 16, 48]
    assert shortlist(rates, within=0.05, most=3) == [32]
    assert shortlist([], within=0.25, most=3) == []


def test_a_rescaled_figure_keeps_the_probes_scale() -> None:
    ref, new = ok(32, 200.0), ok(64, 120.0, spread=0.4)
    cmp = Comparison((32, 64), ((50.0, 60.0), (100.0, 118.0), (80.0, 96.0)))
    r = rescaled(new, cmp, ref)
    assert r.samples_per_s == pytest.approx(240.0) and r.batch_size == 64
    assert r.spread == pytest.approx((1.2 - 1.18) / 1.2)
    assert "alternated with 32 (3 rounds): 120.0 %" in (r.reason or "")
    assert rescaled(ref, cmp, ref) is ref


def test_the_cost_counts_a_warm_step_and_a_window_per_round() -> None:
    cs = [ok(10, 100.0), ok(100, 100.0)]  # 0.1 s and 1 s per step
    assert compare_cost(cs, 3, 0.25) == pytest.approx(0.1 + 3 * 0.25 + 1.0 + 3 * 1.0)


# --------------------------------------------------------------------------- the prober


def prober(t: Trainer, **kw: object) -> Prober:
    state = SavedState.save([t.model, t.opt])
    return Prober(
        t, sample, torch.device("cpu"), MemoryReader(), state, Agreement(),
        deadline=kw.pop("deadline", math.inf), usable=lambda: None, policy=QUICK,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_prober_alternates_windows_and_puts_the_state_back() -> None:
    t = Trainer()
    t(sample(4))  # moments exist
    before = state_of(t.model, t.opt)
    cmp = prober(t).compare([ok(8, 4000.0), ok(16, 8000.0)], 3)
    assert cmp is not None and cmp.sizes == (8, 16) and len(cmp.rounds) == 3
    assert all(rate > 0 for r in cmp.rounds for rate in r)
    # Windows of 10 steps (0.02 s at 2 ms a step): A B, B A, A B; no untimed step first on
    # the CPU (no caching allocator to grow back).
    assert t.sizes[1:] == [n for n in (8, 16, 16, 8, 8, 16) for _ in range(10)]
    assert same_state(before, state_of(t.model, t.opt))


def test_an_out_of_memory_error_while_alternating_names_the_size_that_raised() -> None:
    t = Trainer(oom_above=8)
    before = state_of(t.model, t.opt)
    got = prober(t).compare([ok(8, 4000.0), ok(16, 8000.0)], 3)
    assert isinstance(got, AlternationOOM) and got.size == 16
    assert got.reason.startswith("CUDA out of memory. Tried to allocate 16 MiB")
    assert t.sizes[-1] == 16 and t.sizes.count(16) == 1  # it stopped at the first failure
    assert same_state(before, state_of(t.model, t.opt))


def test_each_size_runs_alone_its_batch_kept_on_the_host_and_gradients_dropped() -> None:
    t = Trainer()
    grads_at_start: list[bool] = []
    built: list[int] = []

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        grads_at_start.append(any(p.grad is not None for p in t.model.parameters()))
        return t(batch)

    def counted(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        built.append(n)
        return sample(n)

    state = SavedState.save([t.model, t.opt])
    p = Prober(
        step, counted, torch.device("cpu"), MemoryReader(), state, Agreement(), deadline=math.inf,
        usable=lambda: None, policy=QUICK,
    )  # fmt: skip
    cmp = p.compare([ok(8, 4000.0), ok(16, 8000.0)], 2)
    assert isinstance(cmp, Comparison) and len(cmp.rounds) == 2
    assert built == [8, 16]  # each batch built once
    # Windows of 10 steps (0.02 s at 2 ms a step): 8 16, 16 8. Each starts without the
    # gradients the window before it left (16's second window follows its first too).
    assert t.sizes == [n for n in (8, 16, 16, 8) for _ in range(10)]
    assert [grads_at_start[i] for i in (0, 10, 20, 30)] == [False] * 4
    assert any(grads_at_start)  # within a window they are kept, as in training


def test_the_deadline_ends_the_rounds_after_the_first() -> None:
    t = Trainer()
    cmp = prober(t, deadline=0.0).compare([ok(8, 4000.0), ok(16, 8000.0)], 5)
    assert cmp is not None and len(cmp.rounds) == 1


def test_rounds_that_disagree_leave_the_verdict_open() -> None:
    wide = Comparison((4, 8), ((100.0, 100.0), (100.0, 130.0), (100.0, 90.0)))
    tight = Comparison((4, 8), ((100.0, 101.0), (100.0, 103.0), (100.0, 100.0)))
    assert undecided(wide, 8) and not undecided(tight, 8)
    assert not undecided(wide, 8, spread=0.5)
    assert not undecided(Comparison((4, 8), ()), 8)  # no round: nothing to wait for
