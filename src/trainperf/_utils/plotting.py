"""Where a report's ``plot(path)`` writes: :func:`checked_path` before drawing,
:func:`save_figure` after.

Neither imports matplotlib: the caller has it already (the figure), or has not yet
checked that it is installed (the path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["checked_path", "save_figure"]


def checked_path(path: str | os.PathLike[str], method: str, example: str) -> Path:
    """``path`` as a Path, refused before any drawing where no file can be written there
    (matplotlib's own error comes only after the figure is drawn, without a fix).

    Args:
        path: the image file the caller asked for.
        method: the caller's name in the message, e.g. ``"WatchReport.plot"``.
        example: a file name for the fix, e.g. ``"timeline.png"``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: the folder ``path`` is in does not exist.
        NotADirectoryError: a file stands where that folder (or one above it) should be.
        IsADirectoryError: ``path`` is a folder (matplotlib would write ``<folder>.png``).

    Example:
        >>> checked_path("chart.png", "Report.plot", "chart.png").name
        'chart.png'
    """
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(
            f"{method}({os.fspath(path)!r}): {str(out)!r} is a folder; pass a file path in "
            f"it, e.g. {method}({str(out / example)!r})"
        )
    # The nearest part of the folder's path that exists: a file there makes mkdir fail too.
    nearest = next((p for p in (out.parent, *out.parent.parents) if p.exists()), None)
    if nearest is not None and not nearest.is_dir():
        raise NotADirectoryError(
            f"{method}({os.fspath(path)!r}): {str(nearest)!r} is a file, not a folder; pass "
            f"a path in a folder, e.g. {method}({str(nearest.parent / example)!r})"
        )
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"{method}({os.fspath(path)!r}): the folder {str(out.parent)!r} does not exist; "
            "create it first (Path(...).mkdir(parents=True)) or pass a path in a folder "
            "that exists"
        )
    return out


def save_figure(fig: Figure, out: Path, dpi: float | None = None) -> None:
    """Write ``fig`` to ``out`` exactly: its suffix picks the format, none writes a PNG.

    Given no format, matplotlib writes ``"chart"`` as ``"chart.png"``, and the path a
    report returns would not be the file written. An unknown suffix raises matplotlib's
    ``ValueError: Format 'xyz' is not supported (supported formats: ..., png, ...)``
    before anything is written.

    Args:
        fig: the drawn figure.
        out: the file to write (from :func:`checked_path`).
        dpi: passed to ``savefig``; None keeps matplotlib's ``savefig.dpi`` setting.
    """
    fig.savefig(out, dpi=dpi, format=out.suffix[1:] or "png")
