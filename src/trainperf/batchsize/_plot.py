"""The chart of :meth:`trainperf.BatchSizeReport.plot` (matplotlib, imported here only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from trainperf._utils.imports import require
from trainperf._utils.plotting import checked_path, save_figure

if TYPE_CHECKING:
    from trainperf.batchsize._report import BatchSizeReport

__all__ = ["plot_report"]

GiB = float(2**30)


def plot_report(report: BatchSizeReport, path: str | os.PathLike[str]) -> Path:
    """Samples/s (left) and peak memory (right) against batch size; the choice starred.
    A report with no size measured (none, or only skipped ones) gets empty axes.

    Raises:
        FileNotFoundError: the folder ``path`` is in does not exist.
        IsADirectoryError: ``path`` is a folder.
        ModuleNotFoundError: matplotlib is not installed (``pip install 'trainperf[plot]'``).
    """
    out = checked_path(path, "BatchSizeReport.plot", "batch_size.png")
    require("matplotlib", "BatchSizeReport.plot()")
    # Figure without pyplot: no global backend switch, works on headless hosts.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    ok = sorted((c for c in report.candidates if c.ok), key=lambda c: c.batch_size)
    ax.plot(
        [c.batch_size for c in ok],
        [c.samples_per_s or 0.0 for c in ok],
        marker="o",
        color="tab:blue",
        label="samples/s",
    )
    best = report.chosen()
    if best is not None:
        ax.plot(
            [best.batch_size],
            [best.samples_per_s or 0.0],
            marker="*",
            markersize=16,
            linestyle="none",
            color="black",
            label=f"chosen: {best.batch_size}",
        )
    mem = ax.twinx()
    measured = sorted(
        (c for c in report.candidates if c.peak_memory is not None), key=lambda c: c.batch_size
    )
    mem.plot(
        [c.batch_size for c in measured],
        [(c.peak_memory or 0) / GiB for c in measured],
        marker="s",
        color="tab:orange",
        label="peak memory",
    )
    if report.usable_memory is not None:
        mem.axhline(report.usable_memory / GiB, linestyle="--", color="tab:red", label="usable")
    oom = [c for c in report.candidates if c.status == "oom"]
    for c in oom:
        ax.axvline(c.batch_size, color="tab:red", alpha=0.4, linestyle=":")
        ax.plot([c.batch_size], [0.0], marker="x", color="tab:red", linestyle="none")
    if ok or measured or oom:  # a log scale with no size on it raises
        ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (per step)")
    ax.set_ylabel("samples/s (steady state)")
    mem.set_ylabel("peak memory (GiB)")
    ax.set_title(f"Batch size on {report.device}")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    more_h, more_l = mem.get_legend_handles_labels()
    if handles or more_h:
        ax.legend(handles + more_h, labels + more_l, fontsize="small", loc="lower right")
    fig.tight_layout()
    save_figure(fig, out)
    return out
