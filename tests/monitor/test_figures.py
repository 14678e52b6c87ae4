"""The figures the rules and predictions share (``monitor/_figures.py``), each on its own."""

from __future__ import annotations

import pytest

from tests.monitor._fakes import cpu_loop, figures
from trainperf.monitor import LoopSetup
from trainperf.monitor._figures import (
    compute_s,
    main_cores,
    mean_step_s,
    others_cores,
    oversubscribed,
    threads_that_fit,
    wait_s,
    worker_cores,
)


def test_time_per_step_splits_into_the_wait_and_the_rest() -> None:
    f = cpu_loop(wait_fraction=0.75)  # 100 steps in 2 s
    assert mean_step_s(f) == pytest.approx(0.02)
    assert wait_s(f) == pytest.approx(0.015)
    assert compute_s(f) == pytest.approx(0.005)
    unmeasured = cpu_loop(wait_fraction=0.75, wait_measured=False)
    assert wait_s(unmeasured) == 0.0 and compute_s(unmeasured) == pytest.approx(0.02)
    assert mean_step_s(figures(measured_steps=0, wall_s=0.0)) == 0.0


def test_the_workers_cores_are_apart_from_the_loops_own() -> None:
    f = cpu_loop(process_cpu=150.0, workers_cpu=110.0, host_cpu=80.0)
    assert worker_cores(f) == pytest.approx(1.1)
    assert main_cores(f) == pytest.approx(0.4)
    assert worker_cores(cpu_loop()) == 0.0 and main_cores(cpu_loop()) is None
    assert main_cores(cpu_loop(process_cpu=50.0)) == pytest.approx(0.5)  # no workers sampled


def test_other_processes_cores_are_the_hosts_busy_cores_minus_this_trees() -> None:
    # 2 CPUs, all of the host: 95 % busy is 1.9 cores, 0.7 of them this tree's.
    assert others_cores(cpu_loop(process_cpu=70.0, host_cpu=95.0)) == pytest.approx(1.2)
    # A 2-CPU share of a 16-CPU host 50 % busy: 8 cores busy, 0.7 ours, the rest spread
    # evenly, 2/16 of them on this process's CPUs.
    spread = cpu_loop(process_cpu=70.0, host_cpu=50.0, setup=LoopSetup(host_cpus=16))
    assert others_cores(spread) == pytest.approx((8 - 0.7) * 2 / 16)
    assert others_cores(cpu_loop(process_cpu=190.0, host_cpu=90.0)) == 0.0  # all ours
    assert others_cores(cpu_loop(process_cpu=0.0, host_cpu=100.0)) == pytest.approx(2.0)
    assert others_cores(cpu_loop(host_cpu=90.0)) == 0.0  # no process samples
    # The host's busy share counts stolen time (no process ran then): 95 % busy with 30 %
    # stolen is 1.3 cores run, 0.7 of them this tree's.
    stolen = cpu_loop(process_cpu=70.0, host_cpu=95.0, host_steal=30.0)
    assert others_cores(stolen) == pytest.approx(0.6)
    assert others_cores(cpu_loop(process_cpu=70.0, host_cpu=40.0, host_steal=30.0)) == 0.0


def test_threads_that_fit_leave_the_workers_and_other_processes_their_cores() -> None:
    f = cpu_loop(process_cpu=120.0, workers_cpu=60.0, host_cpu=80.0)  # others: 0.4 cores
    assert threads_that_fit(f) == 1  # floor(2 - 0.6 - 0.4 + 0.5)
    assert threads_that_fit(f, others=False) == 1  # floor(2 - 0.6 + 0.5)
    assert threads_that_fit(cpu_loop(process_cpu=100.0, host_cpu=50.0)) == 2
    busy = cpu_loop(process_cpu=200.0, workers_cpu=200.0, host_cpu=100.0)
    assert threads_that_fit(busy) == 1  # never fewer than one


@pytest.mark.parametrize(
    ("threads", "process_cpu", "workers_cpu", "host_cpu", "crowded"),
    [
        (16, 180.0, 120.0, 95.0, True),  # far above the 1 that fits beside 1.2 worker cores
        (2, 180.0, 120.0, 95.0, True),  # above it still
        (1, 180.0, 120.0, 95.0, False),  # one fits
        (2, 200.0, 0.0, 100.0, False),  # as many as the CPUs: other processes aside
        (16, 60.0, 20.0, 50.0, False),  # idle CPUs: extra threads cost little
        (16, 60.0, 20.0, 90.0, True),  # the host is busy: the edge
        (16, 60.0, 20.0, 89.9, False),
        (16, 160.0, 20.0, 80.0, True),  # this tree saturates its CPUs
        (16, 130.0, 60.0, 77.0, True),  # 65 %: threads far above the CPUs idle at barriers
        (4, 120.0, 60.0, 70.0, True),  # twice the CPUs: far enough
        (3, 130.0, 60.0, 77.0, False),  # not twice the CPUs: 80 % it must be
        (16, 110.0, 60.0, 60.0, False),  # 55 %
    ],
)
def test_oversubscribed_needs_surplus_threads_on_busy_cpus(
    threads: int, process_cpu: float, workers_cpu: float, host_cpu: float, crowded: bool
) -> None:
    f = cpu_loop(
        process_cpu=process_cpu, workers_cpu=workers_cpu, host_cpu=host_cpu,
        setup=LoopSetup(torch_threads=threads),
    )  # fmt: skip
    assert oversubscribed(f) is crowded


def test_oversubscribed_needs_the_thread_count() -> None:
    assert not oversubscribed(cpu_loop(process_cpu=200.0, workers_cpu=150.0, host_cpu=100.0))
