"""A one-line progress bar on stderr for the time-budgeted tuners (no tqdm dependency).

On a terminal the line is redrawn in place with ``\\r``. Anywhere else (a CI log, a SLURM
``.err`` file, a pipe) every redraw would become a line of its own, so only a start line and
a final line are written there.

Used by the ``loader`` tuner (:class:`trainperf.loader._progress.ProgressBar`, named
``tune_loader``) and the ``batchsize`` tuner (:class:`trainperf.batchsize._progress.BatchSizeBar`,
named ``tune_batch_size``).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``<name> [#######.............] 7.1/30 s  <text>``.

    The bar fills with elapsed time against the budget; updates are throttled to 10 per
    second and nothing is written when ``enabled`` is False. When the stream is not a
    terminal, the first update writes one start line (``<name>: measuring <what> (budget
    <budget> s)``) and :meth:`close` one final line (the bar's last state); nothing in
    between.

    Args:
        budget_s: the tuner's budget: the bar is full when it is spent.
        name: the tuner's name, first on every line.
        what: what it measures, for the start line.
        enabled: False writes nothing.
        stream: where to write (default ``sys.stderr``).
        width: the bar's characters.

    Example:
        >>> import io
        >>> out = io.StringIO()  # not a terminal: a start line and a final line
        >>> bar = ProgressBar(10.0, name="tune_it", what="settings", stream=out, width=10)
        >>> bar.update("a=2", force=True)
        >>> bar.update("a=4", force=True)
        >>> bar.close()
        >>> first, last = out.getvalue().splitlines()
        >>> first, last.startswith("tune_it [..."), last.endswith("a=4")
        ('tune_it: measuring settings (budget 10 s)', True, True)
    """

    def __init__(
        self,
        budget_s: float,
        *,
        name: str,
        what: str,
        enabled: bool = True,
        stream: TextIO | None = None,
        width: int = 24,
    ) -> None:
        self._budget = budget_s
        self._name = name
        self._what = what
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._width = width
        self._start = time.perf_counter()
        self._last = -1.0
        self._text = ""
        self._drawn = 0
        self._started = False
        try:
            self._tty = bool(self._stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self._tty = False

    def update(self, text: str | None = None, *, force: bool = False) -> None:
        """Redraw with ``text`` (or the previous text) after the bar."""
        if text is not None:
            self._text = text
        if not self._enabled:
            return
        if not self._tty:
            if not self._started:
                self._started = True
                self._stream.write(
                    f"{self._name}: measuring {self._what} (budget {self._budget:g} s)\n"
                )
                self._stream.flush()
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        line = self._line(now)
        pad = " " * max(0, self._drawn - len(line))
        self._stream.write("\r" + line + pad)
        self._stream.flush()
        self._drawn = len(line)

    def _line(self, now: float) -> str:
        elapsed = now - self._start
        filled = min(self._width, int(self._width * elapsed / self._budget)) if self._budget else 0
        bar = "#" * filled + "." * (self._width - filled)
        return f"{self._name} [{bar}] {elapsed:.1f}/{self._budget:g} s  {self._text}"

    def close(self) -> None:
        """Draw the final state and end the line."""
        if not self._enabled:
            return
        if self._tty:
            self.update(force=True)
            self._stream.write("\n")
        else:
            self._stream.write(self._line(time.perf_counter()) + "\n")
        self._stream.flush()
