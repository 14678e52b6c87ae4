"""What a long wait for a background write prints on stderr: :func:`wait_telling` waits,
saying ``trainperf: still waiting ...`` (:func:`still_waiting`) after
:data:`FIRST_NOTICE_S` and again every :data:`NOTICE_EVERY_S`, best effort (:func:`tell`).

Used by :meth:`SaveHandle.wait <trainperf.checkpoint.SaveHandle.wait>` (``_writer``) and by
the Checkpointer's own waits and exit hook (``_checkpointer_wait``); it imports neither, so
both can import it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainperf.checkpoint._writer import SaveHandle

__all__ = ["FIRST_NOTICE_S", "NOTICE_EVERY_S", "still_waiting", "tell", "wait_telling"]

# A wait for a background write has no bound (a save of many GB to a slow disk takes
# minutes), but one that goes on this long says so on stderr, and again at each interval
# after: a stopped writer (SIGSTOP, a debugger) or a filesystem that stopped answering (a
# hung NFS mount) would otherwise hang the loop in silence. Tests set them small.
FIRST_NOTICE_S = 60.0
NOTICE_EVERY_S = 300.0


def wait_telling(pending: SaveHandle, timeout: float | None = None) -> bool:
    """Wait for ``pending``'s write, up to ``timeout`` seconds (None: as long as it takes),
    saying so on stderr while it goes on (:func:`still_waiting`); True if it finished.
    A NaN ``timeout`` does not wait, as for ``threading.Event.wait``."""
    if timeout is not None and math.isnan(timeout):  # min() and >= below would never end
        timeout = 0.0
    started = time.monotonic()
    notice_at = FIRST_NOTICE_S
    while True:
        left = notice_at if timeout is None else min(notice_at, timeout)
        if pending._event.wait(max(left - (time.monotonic() - started), 0.0)):
            return True
        waited = time.monotonic() - started
        if timeout is not None and waited >= timeout:
            return False
        if waited >= notice_at:
            tell(still_waiting(pending, waited))
            notice_at = waited + NOTICE_EVERY_S


def tell(line: str) -> None:
    """Print ``line`` on stderr, best effort (as :mod:`warnings` does): a stderr whose reader
    has gone (``2>&1 | tee log``, tee killed: ``BrokenPipeError``) or that was closed
    (``ValueError``) must not raise out of a wait, which would leave that save unwritten."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def still_waiting(pending: SaveHandle, waited_s: float) -> str:
    """The line printed while a wait for ``pending`` goes on: the step, the file, the
    writer, for how long, and what to check."""
    path = pending.path
    where = "its file" if path is None else str(path)
    began = time.monotonic() - pending._began
    if pending._pid is not None:
        writer = f"its writer process (pid {pending._pid})"
        check = (
            f"is the writer stopped or stuck? (ps -o pid,stat,etime -p {pending._pid}: T means "
            f"stopped, kill -CONT {pending._pid} resumes it; D means it waits on the filesystem)"
        )
    elif pending._thread_id is not None:
        me = os.getpid()
        writer = f"its writer thread (native id {pending._thread_id}) in this process (pid {me})"
        check = (
            f"is the writer stuck? (ps -L -o tid,stat -p {me}: D beside {pending._thread_id} "
            "means it waits on the filesystem)"
        )
    else:
        writer, check = f"its {pending.writer} writer", "is the writer alive?"
    if path is not None:
        d = path.parent
        check += (
            f"; is the filesystem responsive? (ls -l {d}; df -h {d}); does the temp file grow? "
            f"(ls -l {d}/.{path.name}.tmp-*)"
        )
    return (
        f"trainperf: still waiting for the background save of step {pending.step} to {where} "
        f"after {waited_s:.0f} s (the write began {began:.0f} s ago): {writer}. Check: "
        f"{check}. It still waits (a save of many GB can take minutes), and says so again "
        f"every {NOTICE_EVERY_S:g} s"
    )
