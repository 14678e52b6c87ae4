"""The hypervisor's stolen CPU time (``_utils/steal.py``): the share, the correction, the meter."""

from __future__ import annotations

import sys

import pytest

from trainperf._utils import steal
from trainperf._utils.steal import MAX_STEAL, StealMeter, cpu_ticks, steal_share, undo_steal


def test_the_share_is_stolen_ticks_over_all_ticks_between_two_readings() -> None:
    assert steal_share((0.0, 100.0), (25.0, 200.0)) == pytest.approx(0.25)
    assert steal_share((0.0, 100.0), (0.0, 100.0)) is None  # no time passed
    assert steal_share(None, (1.0, 2.0)) is None
    assert steal_share((5.0, 100.0), (4.0, 200.0)) == 0.0  # a counter reset reads as none


def test_demand_is_divided_by_the_share_left_and_the_share_is_capped() -> None:
    assert undo_steal(0.6, 0.25) == pytest.approx(0.8)
    assert undo_steal(0.6, 0.0) == 0.6
    assert undo_steal(0.1, 1.0) == pytest.approx(0.1 / (1 - MAX_STEAL))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="steal is Linux's figure")
def test_linux_reports_steal_within_the_total() -> None:
    ticks = cpu_ticks()
    assert ticks is not None
    stolen, total = ticks
    assert 0.0 <= stolen <= total and total > 0


def test_the_meter_reads_the_share_since_its_last_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([(0.0, 100.0), (10.0, 200.0), (10.0, 200.0), (40.0, 300.0)])
    monkeypatch.setattr(steal, "cpu_ticks", lambda: next(readings))
    meter = StealMeter()
    assert meter.share() == pytest.approx(0.1)
    assert meter.share() is None  # no time passed: the last reading stays
    assert meter.share() == pytest.approx(0.3)


def test_without_a_platform_figure_there_is_no_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steal, "cpu_ticks", lambda: None)
    assert StealMeter().share() is None
