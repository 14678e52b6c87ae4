"""The tuner's progress bar: the shared :class:`trainperf._utils.progress.ProgressBar`
named ``tune_batch_size``.
"""

from __future__ import annotations

from typing import TextIO

from trainperf._utils import progress

__all__ = ["BatchSizeBar"]


class BatchSizeBar(progress.ProgressBar):
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
            name="tune_batch_size",
            what="batch sizes",
            enabled=enabled,
            stream=stream,
            width=width,
        )
