"""The timeline picture (``monitor/_plot.py``): what it marks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.monitor._fakes import doubling_timeline
from trainperf.monitor import analyse


@pytest.mark.slow  # matplotlib's import and one figure: about a second
def test_the_plot_marks_where_the_step_time_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    lines: list[float] = []
    real = Axes.axvline

    def spy(self: Axes, x: float = 0, *args: Any, **kwargs: Any) -> Any:
        lines.append(x)
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(Axes, "axvline", spy)
    timeline = doubling_timeline()
    report = analyse(timeline, cpus=2)
    assert report.regime_start == 60
    out = report.plot(tmp_path / "changed.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lines == [timeline[60].start] * 2  # one line on each panel
    lines.clear()
    analyse(timeline[60:], cpus=2).plot(tmp_path / "steady.png")
    assert lines == []
