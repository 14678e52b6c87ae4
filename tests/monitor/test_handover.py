"""The hand-over probe (``monitor/_handover.py``): a batch's layout, one worker measured."""

from __future__ import annotations

import time

import pytest
import torch

from trainperf.monitor import _handover
from trainperf.monitor._handover import Handover, batch_layout, measure_handover


def test_the_layout_is_every_tensor_s_bytes_in_order() -> None:
    batch = {"x": torch.zeros(4, 3), "y": [torch.zeros(4, dtype=torch.int64), "label"]}
    assert batch_layout(batch) == (48, 32)
    assert batch_layout(torch.zeros(2, dtype=torch.uint8)) == (2,)
    assert batch_layout("not a tensor") == ()
    assert len(batch_layout([torch.zeros(1)] * 100)) == 64  # capped


@pytest.mark.slow
def test_one_worker_is_measured_once_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_handover, "_CACHE", {})
    first = measure_handover((8 * 4096,), 8)
    if first is None:
        pytest.skip("no /proc schedstat here")
    assert isinstance(first, Handover) and first.batches >= 8
    assert first.receive_s > 0 and first.produce_s >= 0
    assert measure_handover((8 * 4096,), 8) is first  # remembered, not measured again


def test_pauses_alike_share_a_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_handover, "_CACHE", {})
    monkeypatch.setattr(_handover, "_can_fork_a_worker", lambda: True)
    pauses: list[float] = []

    def fake(layout: tuple[int, ...], batch: int, pause_s: float = 0.0) -> Handover:
        pauses.append(pause_s)
        return Handover(0.001, 0.0, 8)

    monkeypatch.setattr(_handover, "_probe", fake)
    first = measure_handover((64,), 8, pause_s=0.003)
    assert measure_handover((64,), 8, pause_s=0.0032) is first  # within sqrt(2)
    assert measure_handover((64,), 8, pause_s=0.006) is not first
    assert measure_handover((64,), 8, pause_s=0.00005) is measure_handover((64,), 8)  # none
    assert measure_handover((64,), 8, pause_s=5.0) is not None
    assert pauses == [0.003, 0.006, 0.00005, 0.02]  # a long step: 20 ms at most
    assert measure_handover((64,), 8, pause_s=0.012, probe=False) is None  # not measured


@pytest.mark.slow
def test_a_pause_before_each_receive_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_handover, "_CACHE", {})
    pauses: list[float] = []
    sleep = time.sleep

    def timed_sleep(seconds: float) -> None:
        pauses.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(_handover.time, "sleep", timed_sleep)
    paused = measure_handover((8 * 4096,), 8, pause_s=0.005)
    if paused is None:
        pytest.skip("no /proc schedstat here")
    assert paused.batches >= 8 and paused.receive_s > 0
    # The probe paused before every receive it measured, for the loop's step.
    assert pauses.count(0.005) >= paused.batches, pauses


def test_nothing_to_measure_is_none() -> None:
    assert measure_handover((), 8) is None
    assert measure_handover((64,), 0) is None


def test_a_worker_that_fails_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_handover, "_CACHE", {})

    def broken(layout: tuple[int, ...], batch: int, pause_s: float = 0.0) -> Handover:
        raise RuntimeError("DataLoader worker (pid 1) exited unexpectedly")

    monkeypatch.setattr(_handover, "_probe", broken)
    assert measure_handover((64,), 8) is None


def test_no_probe_in_a_daemonic_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # A DataLoader worker or a pool worker may not have children: not measured, no error.
    import multiprocessing

    monkeypatch.setattr(_handover, "_CACHE", {})
    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True)
    called: list[int] = []
    monkeypatch.setattr(_handover, "_probe", lambda *a: called.append(1))
    assert measure_handover((64,), 8) is None and not called
