"""The timeline picture of a :class:`~trainperf.monitor.WatchReport` (``report.plot(path)``).

matplotlib is imported here, inside :func:`plot_report`, and only there: ``import
trainperf`` never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainperf._utils.imports import require
from trainperf._utils.plotting import checked_path, save_figure
from trainperf.monitor._records import StepRecord

if TYPE_CHECKING:
    from trainperf.monitor._report import WatchReport

__all__ = ["plot_report"]


def plot_report(report: WatchReport, path: str | Path) -> Path:
    """Save ``report``'s timeline PNG (see :meth:`WatchReport.plot`).

    Raises:
        FileNotFoundError: the folder ``path`` is in does not exist.
        IsADirectoryError: ``path`` is a folder.
        ModuleNotFoundError: matplotlib is not installed (``pip install 'trainperf[plot]'``).
    """
    out = checked_path(path, "WatchReport.plot", "timeline.png")
    require("matplotlib", "WatchReport.plot()")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6))
    FigureCanvasAgg(fig)  # a canvas of our own: pyplot's global state is left alone
    top, bottom = fig.subplots(2, 1, sharex=True)
    starts, widths, waits, computes = _binned(report.timeline)
    waited = "data wait" if report.wait_fraction is not None else "data wait (not measured)"
    top.bar(starts, waits, width=widths, align="edge", color="tab:orange", label=waited)
    top.bar(
        starts, computes, width=widths, bottom=waits, align="edge", color="tab:blue",
        label="compute",
    )  # fmt: skip
    changed = next((s for s in report.timeline if s.index == report.regime_start), None)
    if changed is not None:  # where the verdict's figures start: the change in step time
        for ax in (top, bottom):
            ax.axvline(changed.start, color="tab:red", linestyle="--", linewidth=1)
        top.text(changed.start, 0, " step time changed", color="tab:red", va="bottom")
    _mark_loader_changes(report, top, bottom)
    top.set_ylabel("step time (ms)")
    top.set_title(f"trainperf.watch: {report.verdict.kind}")
    top.legend(loc="upper right")
    times = [s.time for s in report.samples]
    gpu = [(s.time, s.gpu_utilization) for s in report.samples if s.gpu_utilization is not None]
    if gpu:
        bottom.plot([t for t, _ in gpu], [u for _, u in gpu], label="GPU utilisation %")
    cpu = [s.process_cpu / report.cpus for s in report.samples]
    bottom.plot(times, cpu, label="process CPU % of usable")
    bottom.plot(times, [s.host_cpu for s in report.samples], label="host CPU %", alpha=0.6)
    bottom.set_ylim(0, 105)
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right")
    save_figure(fig, out, dpi=100)
    return out


def _mark_loader_changes(report: WatchReport, top: Any, bottom: Any) -> None:
    """A line on both panels and a label (``num_workers 0→4``) where an adaptive loader
    changed its settings (``report.loader_changes``)."""
    steps = {s.index: s.start for s in report.timeline}
    for change in report.loader_changes:
        x = steps.get(change.step, change.time)  # the step's start, else the change's time
        for ax in (top, bottom):
            ax.axvline(x, color="tab:green", linestyle=":", linewidth=1.5)
        top.text(x, 0.98, f" {change.label}", color="tab:green", va="top", rotation=90,
                 transform=top.get_xaxis_transform())  # fmt: skip


_MAX_BARS = 2000


def _binned(
    timeline: Sequence[StepRecord],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Bar positions, widths and mean wait/compute (ms) per bar, at most ``_MAX_BARS`` bars."""
    size = max(1, -(-len(timeline) // _MAX_BARS))  # long runs: average runs of steps per bar
    starts, widths, waits, computes = [], [], [], []
    for i in range(0, len(timeline), size):
        group = timeline[i : i + size]
        starts.append(group[0].start)
        widths.append(max(sum(s.duration for s in group), 1e-6))
        waits.append(sum(s.wait for s in group) / len(group) * 1e3)
        computes.append(sum(s.compute for s in group) / len(group) * 1e3)
    return starts, widths, waits, computes
