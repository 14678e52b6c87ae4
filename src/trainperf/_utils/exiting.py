"""Whether the interpreter is exiting, known before any ``atexit`` handler runs.

Python's thread shutdown, which runs before every ``atexit`` handler, sets
``threading._SHUTTING_DOWN``; it runs only where :mod:`threading` was imported, which
``import trainperf`` makes sure of by importing this module (a script that imports only
``trainperf``, lazy, would not import it). So a background checkpoint save made from an
``atexit`` handler, registered before or after the import, or from a finaliser at exit, is
known to be too late for a background writer, even where the ``checkpoint`` package is
first imported inside that handler.
"""

from __future__ import annotations

import threading

__all__ = ["exiting"]


def exiting() -> bool:
    """Whether the interpreter's exit has begun (Python's thread shutdown has started).

    Example:
        >>> exiting()
        False
    """
    return bool(getattr(threading, "_SHUTTING_DOWN", False))
