"""The chart of :meth:`trainperf.TuningReport.plot` (matplotlib, imported here only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from trainperf._utils.imports import require
from trainperf._utils.plotting import checked_path, save_figure

if TYPE_CHECKING:
    from trainperf.loader._report import CandidateResult, TuningReport

__all__ = ["plot_report"]


def plot_report(report: TuningReport, path: str | os.PathLike[str]) -> Path:
    """Throughput against ``num_workers``, one line per (prefetch_factor, pin_memory) pair,
    the choice starred and the ``step_fn`` throughput a horizontal line.

    Raises:
        FileNotFoundError: the folder ``path`` is in does not exist.
        IsADirectoryError: ``path`` is a folder.
        ModuleNotFoundError: matplotlib is not installed (``pip install 'trainperf[plot]'``).
    """
    out = checked_path(path, "TuningReport.plot", "loader.png")
    require("matplotlib", "TuningReport.plot()")
    # Figure without pyplot: no global backend switch, works on headless hosts.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    groups: dict[tuple[int | None, bool], list[CandidateResult]] = {}
    for c in report.candidates:
        if c.ok:
            key = (c.prefetch_factor or 2, c.pin_memory)
            groups.setdefault(key, []).append(c)
    zero = [c for c in report.candidates if c.ok and c.num_workers == 0]
    for (pf, pin), cs in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        pts = sorted({c.num_workers: c for c in cs + zero}.values(), key=lambda c: c.num_workers)
        ax.plot(
            [c.num_workers for c in pts],
            [c.samples_per_s or 0.0 for c in pts],
            marker="o",
            label=f"prefetch_factor={pf}, pin_memory={pin}",
        )
    best = report.chosen()
    if best is not None:
        ax.plot(
            [best.num_workers],
            [best.samples_per_s or 0.0],
            marker="*",
            markersize=16,
            linestyle="none",
            color="black",
            label="chosen",
        )
    if report.step_samples_per_s is not None:
        ax.axhline(report.step_samples_per_s, linestyle="--", color="grey", label="step_fn")
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples/s (steady state)")
    ax.set_title(f"DataLoader throughput, batch_size={report.batch_size}")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, out)
    return out
