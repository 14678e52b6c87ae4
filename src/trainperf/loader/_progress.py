"""A one-line progress bar on stderr for the time-budgeted tuner (no tqdm dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``tune_loader [#######.............] 7.1/30 s  workers=4 prefetch=2  best 1,234/s``.

    The bar fills with elapsed time against the budget; updates are throttled to 10 per
    second and nothing is written when ``enabled`` is False.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> bar = ProgressBar(10.0, stream=out, width=10)
        >>> bar.update("workers=2", force=True)
        >>> bar.close()
        >>> "tune_loader [" in out.getvalue() and out.getvalue().endswith("\\n")
        True
    """

    def __init__(
        self,
        budget_s: float,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        width: int = 24,
    ) -> None:
        self._budget = budget_s
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._width = width
        self._start = time.perf_counter()
        self._last = -1.0
        self._text = ""
        self._drawn = 0

    def update(self, text: str | None = None, *, force: bool = False) -> None:
        """Redraw with ``text`` (or the previous text) after the bar."""
        if text is not None:
            self._text = text
        if not self._enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        elapsed = now - self._start
        filled = min(self._width, int(self._width * elapsed / self._budget)) if self._budget else 0
        bar = "#" * filled + "." * (self._width - filled)
        line = f"tune_loader [{bar}] {elapsed:.1f}/{self._budget:g} s  {self._text}"
        pad = " " * max(0, self._drawn - len(line))
        self._stream.write("\r" + line + pad)
        self._stream.flush()
        self._drawn = len(line)

    def close(self) -> None:
        """Draw the final state and end the line."""
        if not self._enabled:
            return
        self.update(force=True)
        self._stream.write("\n")
        self._stream.flush()
