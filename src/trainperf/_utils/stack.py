"""The ``stacklevel`` that makes a warning name the caller's line: :func:`user_stacklevel`.

A warning raised deep inside trainperf (a loader position found stale while
``Checkpointer.restore`` reads a file, a tuner refusing a worker count) is most useful
pointing at the user's own call, however many private functions lie between; counting
levels by hand goes wrong as soon as a helper moves. Used by the ``loader``,
``checkpoint``, ``monitor`` and ``pipelines`` packages.
"""

from __future__ import annotations

import os
import sys

__all__ = ["user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _inside(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this, so that
    the warning names the first line outside the trainperf package: the caller's
    ``tune_loader(...)`` or ``ckpt.restore(...)``.

    Example:
        >>> user_stacklevel()  # called from outside the package: the line itself
        1
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
