"""The crowding probe (``monitor/_crowding.py``): what fewer torch threads gain, measured."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import psutil
import pytest
import torch

from tests.monitor._fakes import cpu_loop
from trainperf.monitor import _crowding
from trainperf.monitor._crowding import Crowding, crowding_beside, measure_crowding, with_crowding
from trainperf.monitor._setup import LoopSetup


def _children() -> set[int]:
    """This process's children."""
    return {p.pid for p in psutil.Process().children()}


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_crowding, "_CACHE", {})


def test_the_probe_measures_both_counts_beside_spinners_and_leaves_no_child() -> None:
    before_threads, before_children = torch.get_num_threads(), _children()
    c = measure_crowding(8, 1, 2)
    assert c is not None and (c.threads, c.fit, c.busy) == (8, 1, 2)
    assert c.rounds >= 2 and c.speedup > 0
    assert torch.get_num_threads() == before_threads
    assert _children() <= before_children  # the spinners were killed and waited for


def test_the_probe_is_remembered_and_only_looked_up_without_probe() -> None:
    assert measure_crowding(4, 1, 0, probe=False) is None  # never measured
    first = measure_crowding(4, 1, 0)
    assert first is not None and measure_crowding(4, 1, 0, probe=False) is first
    assert measure_crowding(4, 1, 0) is first


@pytest.mark.parametrize("threads, fit, busy", [(2, 2, 0), (2, 3, 0), (4, 0, 0), (4, 1, -1)])
def test_nothing_to_measure_without_surplus_threads(threads: int, fit: int, busy: int) -> None:
    assert measure_crowding(threads, fit, busy) is None


def test_a_refused_spinner_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        raise BlockingIOError("Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert measure_crowding(4, 1, 1) is None


def test_a_spinner_refused_part_way_stops_the_ones_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real, started, before = subprocess.Popen, [], _children()

    def second_refused(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        if started:
            raise BlockingIOError("Resource temporarily unavailable")
        p = real(*args, **kwargs)  # type: ignore[call-overload]
        started.append(p)
        return p

    monkeypatch.setattr(subprocess, "Popen", second_refused)
    assert measure_crowding(4, 1, 2) is None
    assert len(started) == 1 and started[0].returncode is not None  # killed and waited for
    assert _children() <= before


def test_the_spinners_are_fresh_interpreters_not_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A forked spinner would share the loop's signal handlers and stack: a Ctrl-C would run
    # the loop's own except blocks in it.
    monkeypatch.setattr(os, "fork", pytest.fail)
    commands: list[object] = []
    real = subprocess.Popen

    def spy(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        commands.append(args)
        return real(args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "Popen", spy)
    assert measure_crowding(4, 1, 2) is not None
    assert len(commands) == 2 and all(c[0] == sys.executable for c in commands)  # type: ignore[index]


def _crowded(**changes: object) -> object:
    setup = LoopSetup(torch_threads=16, num_workers=2)
    loop = {"process_cpu": 180.0, "workers_cpu": 120.0, "host_cpu": 95.0, "setup": setup}
    return cpu_loop(**{**loop, **changes})


def test_a_crowded_cpu_loop_gets_the_probe_of_its_thread_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def fake(threads: int, fit: int, busy: int, *, probe: bool = True) -> Crowding:
        calls.append((threads, fit, busy, probe))
        return Crowding(threads, fit, busy, 1.5 + busy * 0.12345, 4)

    monkeypatch.setattr(_crowding, "measure_crowding", fake)
    setup = with_crowding(_crowded(), probe=False)  # type: ignore[arg-type]
    # 1.2 worker cores: the figures beside one and two spinners, weighted 0.8 and 0.2;
    # 1 thread fits.
    assert calls == [(16, 1, 1, False), (16, 1, 2, False)]
    assert setup is not None and setup.torch_threads == 16
    expected = 0.8 * (1.5 + 0.12345) + 0.2 * (1.5 + 2 * 0.12345)
    assert (setup.fewer_threads, setup.fewer_threads_speedup) == (1, round(expected, 4))


def test_a_fraction_of_a_core_is_weighed_between_the_whole_spinner_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    figures = {0: 1.2, 1: 2.2, 2: 3.0}
    calls = []

    def fake(threads: int, fit: int, busy: int, *, probe: bool = True) -> Crowding | None:
        calls.append(busy)
        return Crowding(threads, fit, busy, figures[busy], 4) if busy in figures else None

    monkeypatch.setattr(_crowding, "measure_crowding", fake)
    assert crowding_beside(16, 1, 0.5) == pytest.approx(1.7)
    assert crowding_beside(16, 1, 0.25) == pytest.approx(0.75 * 1.2 + 0.25 * 2.2)
    calls.clear()
    assert crowding_beside(16, 1, 1.04) == pytest.approx(2.2)  # 0.04 of a core: not measured
    assert crowding_beside(16, 1, 0.95) == pytest.approx(2.2)
    assert calls == [1, 1]
    assert crowding_beside(16, 1, 2.5) is None  # beside 3 not measured: no figure
    assert crowding_beside(16, 1, -0.2) == pytest.approx(1.2)  # never below none


def test_no_probe_for_a_gpu_loop_or_threads_that_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_crowding, "measure_crowding", pytest.fail)
    crowded = _crowded()
    assert with_crowding(dataclasses.replace(crowded, cuda_used=True)) is None  # type: ignore
    assert with_crowding(_crowded(setup=LoopSetup(torch_threads=1, num_workers=2))) is None  # type: ignore
    assert with_crowding(_crowded(setup=LoopSetup(num_workers=2))) is None  # type: ignore
