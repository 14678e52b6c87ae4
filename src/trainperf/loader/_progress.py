"""The DataLoader tuner's progress bar: the shared :class:`trainperf._utils.progress.ProgressBar`
named ``tune_loader``.

On a terminal the line is redrawn in place with ``\\r``. Anywhere else (a CI log, a SLURM
``.err`` file, a pipe) only a start line and a final line are written.
"""

from __future__ import annotations

from typing import TextIO

from trainperf._utils import progress

__all__ = ["ProgressBar"]


class ProgressBar(progress.ProgressBar):
    """``tune_loader [#######.............] 7.1/30 s  workers=4 prefetch=2  best 1,234/s``.

    The bar fills with elapsed time against the budget; updates are throttled to 10 per
    second and nothing is written when ``enabled`` is False. When the stream is not a
    terminal, the first update writes one start line and :meth:`close` one final line
    (the bar's last state); nothing in between.

    Example:
        >>> import io
        >>> out = io.StringIO()  # not a terminal: a start line and a final line
        >>> bar = ProgressBar(10.0, stream=out, width=10)
        >>> bar.update("workers=2", force=True)
        >>> bar.update("workers=4", force=True)
        >>> bar.close()
        >>> lines = out.getvalue().splitlines()
        >>> len(lines), "\\r" in out.getvalue(), lines[-1].startswith("tune_loader [")
        (2, False, True)
    """

    def __init__(
        self,
        budget_s: float,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        width: int = 24,
    ) -> None:
        super().__init__(
            budget_s,
            name="tune_loader",
            what="DataLoader settings",
            enabled=enabled,
            stream=stream,
            width=width,
        )
