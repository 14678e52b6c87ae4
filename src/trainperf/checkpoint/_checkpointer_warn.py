"""What a :class:`~trainperf.checkpoint.Checkpointer` warns about, and the error it raises for
a file it cannot read: a directory that already holds a later step (or, under a later
step's name, a copy of another step that makes every resume raise, or a file a resume
cannot use: unreadable, cut short, foreign), retired files it could not delete, a
background writer the system refused (made a blocking save, with the limit to raise), a
file whose read failed (not skipped for an older one), and a complete file this process
cannot load (a newer PyTorch's, one ``weights_only`` refuses: not skipped either).
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._formats import newer_format
from trainperf.checkpoint._held import held_step, version
from trainperf.checkpoint._steps import main_file, misnamed
from trainperf.errors import CheckpointError, UnsafeCheckpointError

if TYPE_CHECKING:
    from trainperf.checkpoint._checkpointer import Checkpointer

__all__ = ["stop_at", "warn_if_behind", "warn_notes"]


def warn_if_behind(ckpt: Checkpointer, step: int) -> None:
    """Warn when the directory holds a later step than ``step``: an earlier run's, another
    process's written since, or a step count that restarted. :meth:`latest` and
    :meth:`restore` take the highest step, so a resume would continue from that one, not
    from this run; if that file holds another step than its name says (a copy), they raise
    instead, so every resume fails until it is moved. Also warn of each file above both
    ``step`` and that later step that a resume cannot use (unreadable, cut short, foreign:
    :func:`_warn_unusable`). Once per later step seen, and per version of an unusable file:
    the directory's names are listed at each save, and only a file named above every step
    known (on disk or saved here) is read, once (an unreadable one at each save).
    """
    highest, held, unusable = _highest_resumed(ckpt, ckpt._highest)
    ckpt._highest = max(highest, step)
    for later, path, why in unusable:
        if later > step:
            _warn_unusable(ckpt, step, later, path, why)
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


def _warn_unusable(
    ckpt: Checkpointer, step: int, later: int, path: Path, why: str | OSError
) -> None:
    """Warn, once per version of the file, that ``path`` (of step ``later``, above ``step``)
    is not one a resume can use: unreadable (``why`` an ``OSError``: latest and restore raise
    at it, as the file may be fine) or not a loadable step file (``why`` says why: they skip
    it for an older one; a dangling symbolic link is named as one). ``keep=`` never deletes
    it either way."""
    told = version(path) or (os.fspath(path),)
    if told in ckpt._unusable_told:
        return
    ckpt._unusable_told.add(told)
    target = None if isinstance(why, OSError) else _dangling(path)
    if isinstance(why, OSError):
        text = (
            f"Checkpointer.save(step={step}): step {later}, later than this save, could not "
            f"be read, so latest() and restore() will raise OSError at it instead of "
            f"resuming from this run, and keep={ckpt.keep} never deletes it: {why}. If it "
            f"is damaged for good, move it out of {ckpt.directory}"
        )
    elif target is not None:
        text = (
            f"Checkpointer.save(step={step}): {path} (step {later}, later than this save) "
            f"is a dangling symbolic link to {target}, which does not exist: "
            f"latest() and restore() skip it for an older step, and keep={ckpt.keep} never "
            f"deletes it. Put its target back, or remove the link (rm {path})"
        )
    else:
        text = (
            f"Checkpointer.save(step={step}): {path} (step {later}, later than this save) "
            f"is not a checkpoint restore can load ({why}): latest() and restore() skip it "
            f"for an older step, and keep={ckpt.keep} never deletes it. If it is a "
            f"checkpoint cut short or damaged in a copy, copy it again; otherwise move it "
            f"out of {ckpt.directory}"
        )
    warnings.warn(text, UserWarning, stacklevel=user_stacklevel())


def _dangling(path: Path) -> str | None:
    """Where the symbolic link ``path`` points when that does not exist; None otherwise."""
    try:
        target = os.readlink(path)
    except OSError:  # not a link (or gone since)
        return None
    return None if os.path.exists(path) else os.fspath(path.parent / target)


def _highest_resumed(
    ckpt: Checkpointer, known: int
) -> tuple[int, int, list[tuple[int, Path, str | OSError]]]:
    """The highest step on disk above ``known`` whose file a resume would stop at, the
    step that file holds (another one: a misnamed copy, which restore raises for), and the
    files above it that a resume cannot use: ``(step, path, why)``, ``why`` the read error
    (restore raises it) or why the file is not a step file (cut short, foreign: restore
    skips it); ``(known, known, those files)`` when there is no such step. The files
    restore found damaged are passed over (it warned of them). Names at or below ``known``
    are not looked at, and a file is read once per version
    (:func:`~trainperf.checkpoint._held.held_step`; an unreadable one at every call)."""
    unusable: list[tuple[int, Path, str | OSError]] = []
    for step in reversed(ckpt.steps()):
        if step <= known:
            break
        if step in ckpt._damaged:
            continue
        path = main_file(ckpt.directory, step)
        try:
            held: int | str | OSError = held_step(path, raise_read_errors=True)
        except OSError as e:
            held = e
        if isinstance(held, int):
            return step, held, unusable
        unusable.append((step, path, held))
    return known, known, unusable


def warn_notes(notes: list[str], told: set[str]) -> None:
    """Warn of each retired file retention could not delete (``notes``: its path and why),
    once per Checkpointer (``told``, its notes warned of so far): one left in place (a
    directory with a step file's name, a file the user may not delete) would otherwise be
    warned of at every save."""
    for note in notes:
        if note in told:
            continue
        told.add(note)
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


def stop_at(e: Exception, step: int, path: Path, *, instead: str) -> CheckpointError | None:
    """The error that stops restore at step ``step``, whose file ``path`` (the main file or
    a rank's own) failed to load with ``e``, when the file is complete but this process
    cannot load it: it holds values weights_only refuses, or it was saved by a newer
    PyTorch. Falling back to ``instead`` (an older checkpoint, rank 0's random states)
    would silently lose the steps since, or change the rank's random numbers, and the other
    files are likely alike. None: a file to skip."""
    if not isinstance(e, UnsafeCheckpointError) and newer_format(e.__cause__) is None:
        return None
    kind = UnsafeCheckpointError if isinstance(e, UnsafeCheckpointError) else CheckpointError
    return kind(
        f"Checkpointer.restore stops at step {step} rather than fall back to {instead}: {e}",
        path,
    )
