"""What a spawned worker prints before trainperf code runs in it, kept for the error report.

Under spawn each worker is a new interpreter that imports the main script again before
``worker_main`` starts. When that import fails (a bootstrapping ``RuntimeError`` from a
process started at import time, an exception raised by the script's unguarded top level,
a module only the launcher can import), Python prints the traceback on stderr and exits
with status 1: the launcher would only see the status. So while a worker starts, its fd 2
is a pipe to the launcher, which forwards every byte to its own stderr and keeps the tail;
the worker's first act is to put the real stderr back, which closes the pipe.

fd 2 is one per process: workers start one at a time (one lock, for every start method), so
launches from several threads cannot redirect it over each other.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator

from trainperf._utils.fds import readable
from trainperf.ddp._rank_exit import flush_std_streams, say

__all__ = ["StartupStderr", "last_traceback", "redirected_stderr", "unredirected_stderr"]

# Enough for a long traceback; older output is dropped.
_TAIL_BYTES = 16384
_TRACEBACK = "Traceback (most recent call last):"
# An exception line: "ValueError: ...", "pkg.mod.Error: ...", or a bare "KeyboardInterrupt".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?::|$)")

# Held while a worker starts. Without it a second launch's redirect, made while the first's
# is open, saves the first's pipe as the "real" stderr and puts it back on leaving: fd 2
# ends on a pipe nobody reads. A worker started meanwhile (forked or spawned) would inherit
# the other worker's pipe as its stderr.
_STARTING = threading.Lock()


def _reset_lock() -> None:
    # A forked worker copies the lock held by the thread that forks it: give it a free one.
    global _STARTING
    _STARTING = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock)


class StartupStderr:
    """The launcher's end of one worker's start-up stderr pipe."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.tail = bytearray()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        if self.fd is None:
            raise ValueError("the start-up stderr pipe is closed")
        return self.fd

    def read(self) -> bool:
        """Forward what is there to this process's stderr; False once the pipe is closed."""
        if self.fd is None:
            return False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                self.close()
                return False
            self.tail += data
            del self.tail[:-_TAIL_BYTES]
            say(self._decoder.decode(data), end="")

    def drain(self, timeout: float) -> None:
        """Read until the worker's end closes, or ``timeout`` seconds (a grandchild may hold
        it open)."""
        deadline = time.monotonic() + timeout
        while self.fd is not None and (remaining := deadline - time.monotonic()) > 0:
            with contextlib.suppress(OSError):
                readable([self.fd], remaining)
            self.read()

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def text(self) -> str:
        return self.tail.decode("utf-8", errors="replace")


def last_traceback(text: str) -> tuple[str, str] | None:
    """``(exception, traceback)`` of the last Python traceback in ``text``, or None.

    ``exception`` is its final line(s) joined into one sentence; ``traceback`` runs from the
    ``Traceback`` line to the end of the exception.

    Example:
        >>> out = 'noise\\nTraceback (most recent call last):\\n  File "t.py", line 1, in <module>'
        >>> out += '\\n    import nope\\nModuleNotFoundError: No module named \\'nope\\'\\n'
        >>> last_traceback(out)[0]
        "ModuleNotFoundError: No module named 'nope'"
        >>> last_traceback("no traceback here") is None
        True
    """
    start = text.rfind(_TRACEBACK)
    if start < 0:
        return None
    lines = text[start:].rstrip().splitlines()
    first = next(
        (i for i in range(1, len(lines)) if _EXCEPTION_LINE.match(lines[i])),
        None,
    )
    if first is None:
        return None
    words = " ".join(line.strip() for line in lines[first:] if line.strip())
    # The exception's own text: up to the first sentence of a wrapped message.
    head, sep, _ = words.partition(". ")
    summary = head + ("." if sep else "")
    if len(summary) > 300:
        summary = summary[:300] + "..."
    return summary, "\n".join(lines)


@contextlib.contextmanager
def redirected_stderr() -> Iterator[tuple[StartupStderr, int] | None]:
    """Around starting one spawned worker: fd 2 is a new pipe, so the worker inherits it.

    Yields the launcher's end of the pipe and a duplicate of the real stderr, which the
    worker restores (multiprocessing passes it along while the worker starts), or None
    where this process has no usable fd 2. Both duplicates of the launcher's are closed on
    leaving; so is the pipe when the body raised. Other threads' worker starts wait
    meanwhile.
    """
    with _STARTING:
        yield from _redirect()


@contextlib.contextmanager
def unredirected_stderr() -> Iterator[None]:
    """Around starting one forked worker: fd 2 as it is, while no other thread's start
    has it redirected (the worker inherits it)."""
    with _STARTING:
        yield None


def _redirect() -> Iterator[tuple[StartupStderr, int] | None]:
    try:
        real = os.dup(2)
    except OSError:
        yield None
        return
    read_end, write_end = os.pipe()
    reader = StartupStderr(read_end)
    flush_std_streams()
    os.dup2(write_end, 2)
    try:
        yield reader, real
    except BaseException:
        reader.close()
        raise
    finally:
        flush_std_streams()
        os.dup2(real, 2)
        os.close(write_end)
        os.close(real)
