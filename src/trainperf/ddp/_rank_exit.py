"""What a rank does on its way out after a fault, when the script may have closed
``sys.stderr`` (or has none): print on stderr or straight to fd 2, flush what can be
flushed, stop its own child processes. None of it raises: the ``os._exit`` that follows
must happen, or the rank goes through a normal interpreter shutdown, which can block
(threads, NCCL teardown) until its launcher kills it.

Used by :mod:`~trainperf.ddp._worker` (a spawned rank that failed, and its notices before
and after ``main``, which must not fail a rank either), :mod:`~trainperf.ddp._watchdog`
(every rank after a hang) and :mod:`~trainperf.ddp._stderr` (the launcher forwarding what a
starting worker printed, which must not fail the launch).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys

__all__ = ["enable_faulthandler", "flush_std_streams", "kill_children", "say"]


def say(text: str, end: str = "\n") -> None:
    """Print ``text`` and ``end`` on stderr: through ``sys.stderr``, or straight to fd 2
    when the script closed it (or has none, as under pythonw); nowhere if fd 2 is gone too.
    What follows (a report file, the exit) must happen whatever becomes of this.

    Example:
        >>> say("trainperf.ddp: a line on stderr")
    """
    stream = sys.stderr
    if stream is not None:
        try:
            print(text, end=end, file=stream, flush=True)
            return
        except Exception:  # closed (ValueError), or a broken pipe
            pass
    with contextlib.suppress(OSError):
        os.write(2, f"{text}{end}".encode(errors="replace"))


def flush_std_streams() -> None:
    """Flush ``sys.stderr`` and ``sys.stdout`` before ``os._exit`` (which does not) or
    before fd 2 is redirected; one the script closed, replaced or set to None is skipped.

    Example:
        >>> flush_std_streams()
    """
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):  # closed by the script, None, a broken pipe
            stream.flush()


def enable_faulthandler() -> bool:
    """Turn ``faulthandler`` on: on ``sys.stderr``, or on fd 2 when the script closed it (or
    has none); False if neither takes it. Never raises: a caller that registered itself
    first must not fail halfway."""
    for target in (sys.stderr, 2):
        try:
            faulthandler.enable(file=target, all_threads=True)
            return True
        except (AttributeError, OSError, RuntimeError, ValueError):
            continue
    return False


def kill_children() -> None:
    """Stop this rank's own processes (DataLoader workers, perhaps the one stuck in
    ``__getitem__``): exiting does not end them, and they would hold the job's pipes."""
    import psutil

    with contextlib.suppress(psutil.Error):
        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=5)
