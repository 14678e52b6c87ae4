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


def _figure_of(report: Any, path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The matplotlib Figure ``report.plot(path)`` draws."""
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    real = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> Any:
        drawn.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    report.plot(path)
    (fig,) = drawn
    return fig


def _marks(ax: Any) -> list[float]:
    """x of the vertical lines an axes holds (axvline: two points at one x)."""
    out = []
    for line in ax.lines:
        xs = list(line.get_xdata())
        if len(xs) == 2 and xs[0] == xs[1]:
            out.append(float(xs[0]))
    return out


@pytest.mark.slow  # matplotlib's import and one figure: about a second
def test_the_plot_marks_where_an_adaptive_loader_changed_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import dataclasses
    import json

    from trainperf.monitor import LoaderChange

    timeline = doubling_timeline()[60:]  # steady: no step-time change to mark
    plain = analyse(timeline, cpus=2)
    change = LoaderChange(75, 1.5, (0, None), (4, 2), "input-bound", "waited 90 %")
    report = dataclasses.replace(plain, loader_changes=(change,))
    top, bottom = _figure_of(report, tmp_path / "retuned.png", monkeypatch).axes
    x = timeline[75 - 60].start
    assert _marks(top) == [x] and _marks(bottom) == [x]
    assert [t.get_text().strip() for t in top.texts] == ["num_workers 0→4"]
    assert top.texts[0].get_position()[0] == x
    data = json.loads(json.dumps(report.to_dict()))
    assert data["loader_changes"] == [
        {"step": 75, "time": 1.5, "old": [0, None], "new": [4, 2], "reason": "input-bound",
         "why": "waited 90 %"}
    ]  # fmt: skip
    assert "the loader retuned at step 75: num_workers 0→4 (input-bound)" in str(report)
    # Without changes: no marker, and an empty list.
    top, bottom = _figure_of(plain, tmp_path / "plain.png", monkeypatch).axes
    assert _marks(top) == [] and len(top.texts) == 0 and plain.to_dict()["loader_changes"] == []


@pytest.mark.slow  # a worker pool starts
def test_watch_reports_the_step_at_which_an_adaptive_loader_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainperf.loader._adapt_retune as adapt_retune
    import trainperf.loader._adapt_timed as adapt_timed
    from trainperf import watch
    from trainperf.loader import AdaptiveDataLoader
    from trainperf.loader._adapt_rules import Change

    monkeypatch.setattr(adapt_timed, "_CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(adapt_timed, "_CHECK_BATCHES", 5)  # the first check after 6 batches
    script = iter([Change(1, 2, "input-bound", "forced")])
    monkeypatch.setattr(adapt_retune, "decide", lambda f, **kw: next(script, None))
    loader = AdaptiveDataLoader(range(64), batch_size=4)
    try:
        with watch(device="cpu", warmup_steps=0) as w:
            for _ in range(2):  # two epochs: the change is mid-epoch, in the first
                for _batch in w.iter(loader):
                    w.step()
    finally:
        loader.close()
    (made,) = loader.tuning_history
    assert made.epoch == 0 and made.epoch_batch == 6
    (seen,) = w.report().loader_changes
    assert seen.step == made.batch == 6  # one batch a step: the step that took batch 6
    assert (seen.old, seen.new, seen.reason, seen.label) == (
        (0, None), (1, 2), "input-bound", "num_workers 0→1",
    )  # fmt: skip
    report = w.report()
    assert 0 < seen.time < report.timeline[-1].start + 1
    assert report.to_dict()["loader_changes"][0]["step"] == 6


def _small_report() -> Any:
    from trainperf.monitor import StepRecord

    return analyse([StepRecord(i, i * 0.02, 0.015, 0.005, 32, None) for i in range(8)])


def test_plot_into_a_missing_folder_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match=r"folder .*no/such.* does not exist.*mkdir"):
        _small_report().plot(missing / "timeline.png")
    assert not missing.exists()


@pytest.mark.parametrize("path", ["", "."])
def test_plot_to_a_folder_is_refused_not_written_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # matplotlib would write "<folder>.png" (here "./.png") and the call return the folder.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(IsADirectoryError, match=r"is a folder.*pass a file path"):
        _small_report().plot(path)
    with pytest.raises(IsADirectoryError, match=r"is a folder"):
        _small_report().plot(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()


@pytest.mark.slow  # matplotlib's import and one figure: about a second
def test_plot_to_a_path_without_a_suffix_writes_a_png_at_that_path(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = _small_report().plot(tmp_path / "timeline")
    # matplotlib alone would write "timeline.png" and the call return a path that is not there.
    assert out == tmp_path / "timeline"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["timeline"]
