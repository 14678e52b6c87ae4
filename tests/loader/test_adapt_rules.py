"""The adaptive loader's rules, each on synthetic epoch figures."""

from __future__ import annotations

import json
from typing import Any

from trainperf.loader._adapt_rules import (
    Change,
    cores_per_worker,
    decide,
    figures,
    increase_paid,
    needed_workers,
    rates,
    worker_cores_left,
)


def _fits(n: int, pf: int | None) -> bool:
    return True


def _decide(f: Any, **kw: Any) -> Change | None:
    args: dict[str, Any] = {
        "previous_cpus": f.cpus,
        "fastest_step_per_batch": f.step_per_batch,
        "max_workers": 16,
        "fits": _fits,
        **kw,
    }
    return decide(f, **args)


def test_cores_per_worker_from_workers_or_the_loading_thread() -> None:
    assert cores_per_worker(figures(num_workers=4, worker_cores=3.0)) == 0.75
    assert cores_per_worker(figures(wait_s=1.0, load_cpu_s=0.9)) == 0.9
    # Unread workers count as a whole core each; never under 0.01 (sleeping I/O).
    assert cores_per_worker(figures(num_workers=2, worker_cores=None)) == 1.0
    assert cores_per_worker(figures(wait_s=1.0, load_cpu_s=0.0)) == 0.01


def test_worker_cores_left_takes_off_the_step_and_other_processes() -> None:
    idle = figures(wait_s=0.0, step_s=1.0, step_cpu_s=1.0, host_busy=0.25, cpus=8)
    # The step uses 1 core of 8; the 2 busy cores are the step's and one other process's.
    assert worker_cores_left(idle) == 6.0
    assert worker_cores_left(figures(host_busy=None, cpus=4)) == 3.9


def test_needed_workers_keeps_up_with_the_step() -> None:
    assert needed_workers(figures(wait_s=9.0, step_s=1.0)) == 10
    assert needed_workers(figures(wait_s=0.0, step_s=1.0)) == 1
    # Two workers that kept the loop waiting half the time: four more than keep up.
    assert needed_workers(figures(num_workers=2, wait_s=1.0, step_s=1.0)) == 5


def test_input_bound_with_free_cores_adds_workers() -> None:
    change = _decide(figures(wait_s=4.0, step_s=1.0))
    assert change is not None
    assert (change.num_workers, change.prefetch_factor, change.reason) == (5, 2, "input-bound")
    assert (
        change.why
        == "5 workers would keep up with the step; one uses 0.01 cores, 3.1 are free for workers"
    )


def test_input_bound_bounded_by_max_workers_cores_and_memory() -> None:
    f = figures(wait_s=9.0, step_s=1.0)
    assert _decide(f, max_workers=3).num_workers == 3  # type: ignore[union-attr]
    assert _decide(f, fits=lambda n, pf: n <= 2).num_workers == 2  # type: ignore[union-attr]
    assert _decide(f, fits=lambda n, pf: False) is None
    # CPU-bound loading (a whole core per sample loaded) on 4 CPUs: 4 workers at most.
    busy_load = figures(wait_s=9.0, step_s=1.0, load_cpu_s=9.0, host_busy=None)
    assert _decide(busy_load).num_workers == 4  # type: ignore[union-attr]


def test_no_change_when_not_waiting() -> None:
    assert _decide(figures(wait_s=0.05, step_s=1.0)) is None  # 5 % waiting


def test_a_full_host_takes_waiting_workers_not_busy_ones() -> None:
    sleeping = _decide(figures(wait_s=4.0, step_s=1.0, host_busy=1.0))
    assert sleeping is not None and sleeping.num_workers == 5
    # Loading that keeps a core busy: one worker, which frees the main thread's core.
    busy = _decide(figures(wait_s=4.0, step_s=1.0, load_cpu_s=4.0, host_busy=1.0))
    assert busy is not None and busy.num_workers == 1
    two = figures(num_workers=1, prefetch_factor=2, worker_cores=1.0, wait_s=4.0, host_busy=1.0)
    assert _decide(two) is None


def test_memory_that_no_longer_fits_drops_workers() -> None:
    f = figures(num_workers=6, prefetch_factor=2, worker_cores=1.0, wait_s=0.0)
    change = _decide(f, fits=lambda n, pf: n <= 2)
    assert change is not None
    assert (change.num_workers, change.reason) == (2, "memory")
    none_fit = _decide(f, fits=lambda n, pf: False)
    assert none_fit is not None and (none_fit.num_workers, none_fit.prefetch_factor) == (0, None)


def test_halved_cpus_refit_busy_workers() -> None:
    # Eight busy workers (a core each) when there were 8 CPUs; now 4.
    f = figures(num_workers=8, prefetch_factor=2, worker_cores=8.0, cpus=4, host_busy=None)
    change = _decide(f, previous_cpus=8)
    assert change is not None
    assert (change.num_workers, change.reason) == (4, "cpus")
    assert "8 → 4" in change.why
    # Workers that mostly wait still fit: no change.
    waiting = figures(num_workers=8, prefetch_factor=2, worker_cores=0.4, cpus=4, wait_s=0.0)
    assert _decide(waiting, previous_cpus=8) is None


def test_oversubscribed_host_and_slowed_step_drop_workers() -> None:
    f = figures(num_workers=4, prefetch_factor=2, worker_cores=2.0, host_busy=1.0, wait_s=0.0)
    slowed = _decide(f, fastest_step_per_batch=f.step_per_batch / 2)
    assert slowed is not None
    assert slowed.reason == "oversubscribed" and slowed.num_workers < 4
    assert "2.00x its fastest" in slowed.why
    # Full CPUs but a step as fast as ever: the workers are not in its way.
    assert _decide(f) is None


def test_a_slowed_step_that_waits_for_data_keeps_its_workers() -> None:
    # A full host slowed the step, but the loop waits for data half the time: fewer workers
    # would only make it wait longer (this once cut 3 workers to 1 under a CPU hog).
    f = figures(num_workers=3, prefetch_factor=2, worker_cores=0.4, host_busy=1.0, wait_s=1.0)
    assert _decide(f, fastest_step_per_batch=f.step_per_batch / 2, max_workers=3) is None
    # Waiting 5 % of the time: the workers may be what slowed the step.
    less = figures(num_workers=3, prefetch_factor=2, worker_cores=3.0, host_busy=1.0, wait_s=0.05)
    cut = _decide(less, fastest_step_per_batch=less.step_per_batch / 2, max_workers=3)
    assert cut is not None and cut.reason == "oversubscribed" and cut.num_workers < 3


def test_figures_to_dict_is_json_and_rates_reads() -> None:
    f = figures(wait_s=1.0, step_s=3.0, samples=800, startup_s=0.0, host_busy=None)
    assert json.loads(json.dumps(f.to_dict()))["wait_s"] == 1.0
    assert rates(f) == "200 samples/s, waited for data 25 % of the time, 4 usable CPUs"


def test_an_increase_pays_by_a_faster_loop_or_less_waiting() -> None:
    before = figures(num_workers=2, prefetch_factor=2, wait_s=1.0, step_s=1.0)  # 500/s
    # 5 % more samples per second, the wait share unchanged (rate 1.05x: same batches,
    # the loop 1.05x as fast).
    faster = figures(num_workers=3, prefetch_factor=2, wait_s=1.0 / 1.05, step_s=1.0 / 1.05)
    assert faster.loop_samples_per_s > 1.049 * before.loop_samples_per_s
    assert increase_paid(before, faster) == "paid"
    less_wait = figures(num_workers=3, prefetch_factor=2, wait_s=0.8, step_s=1.2)  # 40 %
    assert increase_paid(before, less_wait) == "paid"


def test_an_increase_that_did_not_pay_holds_or_goes_back() -> None:
    # The reviewer's loop: ~620 samples/s whatever the workers, waiting the same share.
    before = figures(num_workers=2, prefetch_factor=2, wait_s=0.4, step_s=1.2)
    slightly = figures(num_workers=3, prefetch_factor=2, wait_s=0.39, step_s=1.19)
    assert increase_paid(before, slightly) == "hold"  # 1 % faster: keep it, no more
    slower = figures(num_workers=3, prefetch_factor=2, wait_s=0.42, step_s=1.22)
    assert increase_paid(before, slower) == "back"  # the previous count was as fast
    assert increase_paid(before, before) == "back"


def test_loop_samples_per_s_leaves_out_start_up() -> None:
    f = figures(batches=11, samples=110, wait_s=0.5, step_s=0.5, startup_s=5.0)
    assert f.loop_samples_per_s == 100.0
    assert f.samples_per_s < 20  # the start-up counted
    assert figures(batches=1, samples=10).loop_samples_per_s == 0.0


def test_decide_goes_back_or_holds_after_an_increase_that_did_not_pay() -> None:
    kw: dict[str, Any] = {"prefetch_factor": 2, "worker_cores": 0.1, "cpus": 8}
    before = figures(num_workers=2, wait_s=0.4, step_s=1.2, **kw)
    same = figures(num_workers=3, wait_s=0.4, step_s=1.2, **kw)  # waiting 25 %, cores free
    assert _decide(same).reason == "input-bound"  # type: ignore[union-attr]  # without before
    back = _decide(same, before=before)
    assert back is not None
    assert (back.num_workers, back.prefetch_factor, back.reason) == (2, 2, "no-gain")
    assert back.why == "3 workers gave 625 samples/s, 2 workers gave 625"
    slightly = figures(num_workers=3, wait_s=0.39, step_s=1.19, **kw)
    assert _decide(slightly, before=before) is None  # held: no more workers
    paid = figures(num_workers=3, wait_s=0.25, step_s=1.0, **kw)
    assert _decide(paid, before=before).reason == "input-bound"  # type: ignore[union-attr]
    # Figures that follow no increase (fewer workers than before) are not judged.
    unjudged = _decide(same, before=figures(num_workers=3, **kw))
    assert unjudged is not None and unjudged.reason == "input-bound"
    memory = _decide(same, before=before, fits=lambda n, pf: n <= 1)  # memory comes first
    assert memory is not None and memory.reason == "memory"


def test_input_bound_without_room_for_workers_tries_a_deeper_prefetch_once() -> None:
    kw: dict[str, Any] = {"num_workers": 4, "prefetch_factor": 2, "worker_cores": 0.2}
    waiting = figures(wait_s=1.0, step_s=1.0, **kw)  # at max_workers, CPUs 20 % busy
    change = _decide(waiting, max_workers=4)
    assert change is not None
    assert (change.num_workers, change.prefetch_factor, change.reason) == (4, 4, "prefetch")
    assert "no more workers to add at 4" in change.why
    assert _decide(waiting, max_workers=4, max_prefetch=2) is None  # tried already
    assert _decide(figures(wait_s=1.0, step_s=1.0, **{**kw, "prefetch_factor": 4}),
                   max_workers=4) is None  # fmt: skip
    assert _decide(waiting, max_workers=4, fits=lambda n, pf: pf <= 2) is None  # no memory
    full = figures(wait_s=1.0, step_s=1.0, host_busy=0.95, **kw)  # more in flight: no CPU
    assert _decide(full, max_workers=4) is None
    assert _decide(figures(wait_s=0.05, step_s=1.0, **kw), max_workers=4) is None  # 5 %
    unknown = figures(wait_s=1.0, step_s=1.0, host_busy=None, **kw)  # not measured: no trial
    assert _decide(unknown, max_workers=4) is None


def test_a_deeper_prefetch_that_did_not_pay_goes_back() -> None:
    kw: dict[str, Any] = {"num_workers": 4, "worker_cores": 0.2}
    before = figures(prefetch_factor=2, wait_s=1.0, step_s=1.0, **kw)
    same = figures(prefetch_factor=4, wait_s=1.0, step_s=1.0, **kw)
    back = _decide(same, before=before, max_workers=4)
    assert back is not None
    assert (back.num_workers, back.prefetch_factor, back.reason) == (4, 2, "no-gain")
    assert back.why == "4 workers at prefetch 4 gave 500 samples/s, 4 workers gave 500"
    paid = figures(prefetch_factor=4, wait_s=0.5, step_s=1.0, **kw)  # waits 17 points less
    assert _decide(paid, before=before, max_workers=4) is None  # kept; nothing deeper


def test_memory_keeps_workers_at_a_shallower_prefetch_when_that_fits() -> None:
    f = figures(num_workers=4, prefetch_factor=4, worker_cores=1.0, wait_s=0.0)
    twelve = lambda n, pf: n * (pf + 1) <= 12  # noqa: E731  # 12 batches in flight fit
    change = _decide(f, fits=twelve)
    assert change is not None
    assert (change.num_workers, change.prefetch_factor, change.reason) == (4, 2, "memory")
    assert change.why == "4 workers at prefetch 4 no longer fit memory"
    eight = figures(num_workers=8, prefetch_factor=2, worker_cores=1.0, wait_s=0.0)
    fewer = _decide(eight, fits=twelve)  # 4 fit at prefetch 2, 6 at prefetch 1
    assert fewer is not None and (fewer.num_workers, fewer.prefetch_factor) == (6, 1)
