"""What a :class:`~trainperf.checkpoint.Checkpointer` warns about, and the error it raises for
a file it cannot read: a directory that already holds a later step (or, under a later
step's name, a copy of another step that makes every resume raise), retired files it could
not delete, a background writer the system refused (made a blocking save, with the limit to
raise), and a file whose read failed (not skipped for an older one).
"""

from __future__ import annotations

import errno
import warnings
from typing import TYPE_CHECKING

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._held import held_step
from trainperf.checkpoint._steps import main_file, misnamed

if TYPE_CHECKING:
    from trainperf.checkpoint._checkpointer import Checkpointer

__all__ = ["warn_if_behind", "warn_notes"]


def warn_if_behind(ckpt: Checkpointer, step: int) -> None:
    """Warn when the directory holds a later step than ``step``: an earlier run's, another
    process's written since, or a step count that restarted. :meth:`latest` and
    :meth:`restore` take the highest step, so a resume would continue from that one, not
    from this run; if that file holds another step than its name says (a copy), they raise
    instead, so every resume fails until it is moved. Once per later step seen: the
    directory's names are listed at each save, and only a file named above every step known
    (on disk or saved here) is read, once.
    """
    highest, held = _highest_resumed(ckpt, ckpt._highest)
    ckpt._highest = max(highest, step)
    if step >= highest or highest <= ckpt._behind_told:
        return
    ckpt._behind_told = highest
    if held != highest:
        _warn_misnamed(ckpt, step, highest, held)
        return
    warnings.warn(
        f"Checkpointer.save(step={step}): {ckpt.directory} already holds step "
        f"{highest}, a later one (an earlier run's, another process's, or this run's step "
        f"count restarted). latest() and restore() take the highest step, so a resume would "
        f"continue from step {highest}, not from this run, and keep={ckpt.keep} never "
        "deletes it. Start a new run in a new directory, remove the later files, or continue "
        "that run: step = ckpt.restore(state) before the loop",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_misnamed(ckpt: Checkpointer, step: int, named: int, held: int) -> None:
    """Warn that the newest step file, named ``named``, holds step ``held``: restore and
    latest refuse it (neither loads nor skips it), so no resume from this run can work."""
    e = misnamed(main_file(ckpt.directory, named), named, held)
    warnings.warn(
        f"Checkpointer.save(step={step}): latest() and restore() will raise CheckpointError "
        f"at the newest step file of {ckpt.directory} instead of resuming from this run, "
        f"and keep={ckpt.keep} never deletes it: {e}",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _highest_resumed(ckpt: Checkpointer, known: int) -> tuple[int, int]:
    """The highest step on disk above ``known`` whose file a resume would stop at, and the
    step that file holds (another one: a misnamed copy, which restore raises for); else
    ``(known, known)``. Not the files restore found damaged, nor those it would skip (cut
    short, foreign), as a resume skips them too. Names at or below ``known`` are not looked
    at, and a file is read once per version
    (:func:`~trainperf.checkpoint._held.held_step`)."""
    for step in reversed(ckpt.steps()):
        if step <= known:
            break
        held = None if step in ckpt._damaged else held_step(main_file(ckpt.directory, step))
        if isinstance(held, int):
            return step, held
    return known, known


def warn_notes(notes: list[str]) -> None:
    for note in notes:
        warnings.warn(
            f"Checkpointer: could not delete the retired checkpoint {note}",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


# Why the system refuses a new process or pipe, and what lifts the limit.
_NO_WRITER_FIXES = {
    errno.EAGAIN: "the limit on processes or threads is reached (ulimit -u, a container's "
    "pids.max)",
    errno.ENOMEM: "the kernel would not commit memory for the fork (vm.overcommit_memory=2, "
    "a tight memory limit)",
    errno.EMFILE: "too many files are open in this process (ulimit -n)",
    errno.ENFILE: "the system's open-file table is full (fs.file-max)",
}


def _warn_no_writer(step: int, kind: str, e: OSError) -> None:
    """Warn that a background save could not start its writer and is made blocking."""
    why = _NO_WRITER_FIXES.get(e.errno or 0, "see the error")
    warnings.warn(
        f"Checkpointer.save(step={step}, blocking=False): the system refused the {kind} "
        f"writer ({type(e).__name__}: {e.strerror or e}; {why}): saving synchronously "
        "instead. Raise that limit to get background saves back",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _stops_at(method: str, step: int, e: OSError) -> OSError:
    """The error ``Checkpointer.<method>`` raises when step ``step``'s file could not be read
    (EIO, EACCES, EMFILE), not found damaged: an older file would silently lose the steps
    since, and the next saves would bury this one. Same errno, so the same subclass."""
    return OSError(
        e.errno,
        f"Checkpointer.{method} stops at step {step} rather than fall back to an older "
        f"checkpoint: {e.strerror or e}",
    )
