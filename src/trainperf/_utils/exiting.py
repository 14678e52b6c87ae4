"""Whether the interpreter is exiting, known before any ``atexit`` handler runs.

``import trainperf`` registers a mark among :mod:`threading`'s exit hooks, which Python runs
in its thread shutdown, before every ``atexit`` handler (importing :mod:`threading` here
makes sure that shutdown runs: a script that imports only ``trainperf``, lazy, would not).
So a background checkpoint save made from an ``atexit`` handler, registered before or after
the import, or from a finaliser at exit, is known to be too late for a background writer,
even where the ``checkpoint`` package is first imported inside that handler.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["exiting"]

_EXITED = [False]


def exiting() -> bool:
    """Whether the interpreter's exit has begun (threading's exit hooks have run).

    Example:
        >>> exiting()
        False
    """
    return _EXITED[0] or bool(getattr(threading, "_SHUTTING_DOWN", False))  # imported late


def _mark() -> None:
    _EXITED[0] = True


with contextlib.suppress(AttributeError, RuntimeError):  # a Python without it; at exit
    threading._register_atexit(_mark)  # type: ignore[attr-defined]
