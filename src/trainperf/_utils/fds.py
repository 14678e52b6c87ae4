"""Waiting for file descriptors to become readable, whatever their number.

``select.select`` refuses descriptors from 1024 on (``FD_SETSIZE``), which a training
process with many files, sockets and shared-memory handles open reaches; ``poll`` has no
such limit.
"""

from __future__ import annotations

import math
import select
from collections.abc import Sequence

__all__ = ["readable"]


def readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """Those of ``fds`` that are readable, at end of file or hung up, once one is or after
    ``timeout`` seconds (None: as long as it takes).

    Example:
        >>> import os
        >>> r, w = os.pipe()
        >>> readable([r], 0.0)
        []
        >>> _ = os.write(w, b"x")
        >>> readable([r], 0.0) == [r]
        True
        >>> os.close(r), os.close(w)
        (None, None)
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(ms)]
