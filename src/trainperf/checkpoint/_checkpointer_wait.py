"""Waiting for a :class:`~trainperf.checkpoint.Checkpointer`'s background write: before the
next save, ``wait`` or ``restore`` (:func:`settle`: its failure raised, its notes passed on;
``restore`` also for other Checkpointers' writes into the same directory:
:func:`settle_directory`; ``latest`` for all of them without raising:
:func:`wait_directory`), telling hang detection the rank is busy with its own checkpoint
meanwhile (:func:`_finish`), and at process exit, for every write still running whether or
not its Checkpointer is gone (:func:`_wait_at_exit`, registered on import).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import warnings
from typing import TYPE_CHECKING

from trainperf._utils.exiting import exiting as process_exiting
from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._checkpointer_warn import warn_notes
from trainperf.checkpoint._files import saving
from trainperf.checkpoint._wait_notice import tell, wait_telling
from trainperf.checkpoint._writer import SaveHandle, pending_handles, unreported_failures
from trainperf.errors import CheckpointError

if TYPE_CHECKING:
    from trainperf.checkpoint._checkpointer import Checkpointer

__all__ = [
    "exiting",
    "failure_of_pending",
    "settle",
    "settle_directory",
    "tell_earlier",
    "wait_directory",
]


def settle(ckpt: Checkpointer) -> None:
    """Wait for the write in flight; raise its failure; pass its notes on."""
    pending = ckpt._pending
    if pending is None:
        return
    if pending._starting:
        raise _starting_error(pending)
    # Forgotten only once finished: a wait cut short (Ctrl-C in a notebook) must leave it
    # pending, or the next save would start a second write while this one still reads the
    # staging buffers that save refills, and this step's file would get the next one's values.
    _finish(pending)
    ckpt._pending = None
    warn_notes(pending.notes, ckpt._notes_told)
    pending.raise_failure()
    # Written again: a damaged file of that step was replaced (a forked writer's own
    # discard in _after stays in its copy of this object).
    ckpt._damaged.discard(pending.step)


def _starting_error(pending: SaveHandle) -> RuntimeError:
    """The error of a wait for ``pending`` while its ``save`` starts the writer: only a
    signal handler that interrupted that save can ask, and the writer (or the reaper that
    finishes a forked one) starts only once the handler returns, so the wait would hang."""
    return RuntimeError(
        f"Checkpointer: save, wait or restore called while its save of step {pending.step} "
        f"to {pending.path} is starting its background writer (from a signal handler that "
        "interrupted that save): waiting for that write here would hang, as its writer starts "
        "only once the handler returns. In the handler, set a flag and save or restore from "
        "the loop (Checkpointer.preemption() does this); latest() may be called there"
    )


def settle_directory(ckpt: Checkpointer) -> None:
    """:func:`settle`, then wait for this process's other background writes into ``ckpt``'s
    directory (an earlier Checkpointer of it: a notebook cell run again, a resume through a
    new object), so that a restore reads the newest step saved, not the one before it.
    Their failures are left to their own Checkpointer (or the exit hook) to report.
    Directories compare resolved: ``runs/../ckpt`` or a symlink to it is the same one."""
    settle(ckpt)
    wait_directory(ckpt)


def wait_directory(ckpt: Checkpointer) -> None:
    """Wait for this process's background writes into ``ckpt``'s directory that are in
    flight now (its own included), raising nothing: their failures stay for their
    Checkpointer's next ``save`` or ``wait`` (or the exit hook). Only those writes: one
    started meanwhile is not waited for, nor one whose ``save`` is still starting its writer
    (a signal handler that interrupted that save: the writer starts once it returns, so the
    older step is named); no timeout, as for ``wait`` (a forked writer's reaper finishes its
    handle however the child ends). ``ckpt``'s own write, once done, replaced any damaged
    file of its step."""
    directory = ckpt.directory.resolve()
    for pending in pending_handles():
        if pending._starting or pending.path is None:
            continue
        if pending.path.parent.resolve() == directory:
            _finish(pending)
    own = ckpt._pending
    if own is not None and own.done() and own._failure is None:
        ckpt._damaged.discard(own.step)  # written again: not the damaged file any more


def failure_of_pending(ckpt: Checkpointer) -> CheckpointError | None:
    """:func:`settle`, returning the write's failure (marked reported) instead of raising it."""
    try:
        settle(ckpt)
    except CheckpointError as e:
        return e
    return None


def tell_earlier(error: BaseException, earlier: CheckpointError) -> None:
    """Make sure the earlier write's failure is not lost behind ``error``, the failure of the
    save made before reporting it: appended to a :class:`CheckpointError`'s message (the
    same object, its type and ``path`` kept), otherwise warned."""
    if isinstance(error, CheckpointError) and len(error.args) == 1:
        error.args = (f"{error.args[0]}; earlier, {earlier}",)
        return
    warnings.warn(str(earlier), UserWarning, stacklevel=user_stacklevel())


def _finish(pending: SaveHandle) -> None:
    """Wait for a background write, telling hang detection that this rank is waiting for
    its own checkpoint (known slow work: the other ranks may wait in a collective, or have
    returned, meanwhile), not hung; a wait that goes on says so
    (:func:`~trainperf.checkpoint._wait_notice.wait_telling`)."""
    with saving(pending.path):
        wait_telling(pending)


# Set once the exit hook has run: a save after it is made blocking, since nothing would wait
# for a background writer: the process would exit under it, leaving only its temp file. The
# hook runs first from threading's exit hooks, before every atexit handler, so that is any
# save from an atexit handler, whenever registered, or from a finaliser at exit.
_EXITED = [False]


def exiting() -> bool:
    """Whether the process is exiting: :func:`_wait_at_exit` has run, or the interpreter's
    exit began before this module was imported (first imported in an ``atexit`` handler:
    :mod:`trainperf._utils.exiting`, which ``import trainperf`` imports)."""
    return _EXITED[0] or process_exiting()


def _wait_at_exit() -> None:
    """Finish every background write still running when the process exits (its Checkpointer
    may be gone), then print each failed write that was never reported to stderr."""
    _EXITED[0] = True
    for pending in pending_handles():
        if not pending.done():
            tell(
                f"trainperf: waiting for the background save of step {pending.step} to "
                f"{pending.path} before exiting"
            )
            _finish(pending)
    for failed in unreported_failures():
        message, cause = failed._failure or ("unknown", None)
        tell(
            f"trainperf: ERROR: the background save of step {failed.step} to {failed.path} "
            f"failed: {message} ({type(cause).__name__}: {cause}); no older checkpoint was "
            "deleted"
        )


atexit.register(_wait_at_exit)
# Processes that end in os._exit (multiprocessing's fork children, fork-started ranks) skip
# atexit but run threading's exit hooks (in multiprocessing's _bootstrap).
with contextlib.suppress(AttributeError, RuntimeError):
    threading._register_atexit(_wait_at_exit)  # type: ignore[attr-defined]
