"""The tuner's progress bar: the DataLoader tuner's :class:`~trainperf.loader._progress.ProgressBar`
under this tuner's name.

The loader's bar names itself ``tune_loader`` in its line and in the start line it writes
where the stream is not a terminal; this subclass renames both and changes nothing else.
"""

from __future__ import annotations

from trainperf.loader._progress import ProgressBar

__all__ = ["BatchSizeBar"]

_NAME = "tune_batch_size"


class BatchSizeBar(ProgressBar):
    """``tune_batch_size [#####...] 7.1/60 s  batch 128: 1,234/s``.

    Example:
        >>> import io
        >>> out = io.StringIO()  # not a terminal: a start line and a final line
        >>> bar = BatchSizeBar(10.0, stream=out, width=10)
        >>> bar.update("batch 8", force=True)
        >>> bar.close()
        >>> first, last = out.getvalue().splitlines()
        >>> first, last.startswith("tune_batch_size [")
        ('tune_batch_size: measuring batch sizes (budget 10 s)', True)
    """

    def update(self, text: str | None = None, *, force: bool = False) -> None:
        if self._enabled and not self._tty and not self._started:
            self._started = True  # the start line is this tuner's, not tune_loader's
            self._stream.write(f"{_NAME}: measuring batch sizes (budget {self._budget:g} s)\n")
            self._stream.flush()
        super().update(text, force=force)

    def _line(self, now: float) -> str:
        return _NAME + super()._line(now).removeprefix("tune_loader")
