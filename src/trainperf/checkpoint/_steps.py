"""A Checkpointer directory's files: step-numbered names, listing, retention, stale temps.

Names sort by step under ``ls``: ``step-000000030.pt`` (nine digits, zero-padded; a step past
999,999,999 gets more digits and still parses). Under a process group, rank ``r > 0`` keeps
its own generator states and loader position beside it in ``step-000000030.rank-00001.pt``.
Only the names :func:`main_file` and :func:`rank_file` write are step files: one with more
leading zeros (``step-0000000030.pt``) would name a step whose file is looked up under
another name, so it is nobody's, and is neither listed, loaded, counted nor deleted.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path

from trainperf._utils.atomic import remove_dead_temp
from trainperf.checkpoint._held import forget, held_step
from trainperf.errors import CheckpointError

__all__ = [
    "main_file",
    "misnamed",
    "not_a_directory",
    "not_a_step_file",
    "pinned",
    "rank_file",
    "refuse_misnamed",
    "remove_dead_temps",
    "retire",
    "steps_on_disk",
    "this_host",
    "to_retire",
]

# The names main_file and rank_file write: zero-padded to 9 (5) digits, a leading zero only
# within that width (f"{step:09d}" of 1234567890 is "1234567890", never "01234567890").
_STEP = r"(?:\d{9}|[1-9]\d{9,})"
_RANK = r"(?:\d{5}|[1-9]\d{5,})"
_MAIN = re.compile(rf"^step-({_STEP})\.pt$")
_ANY = re.compile(rf"^step-({_STEP})\.(?:rank-{_RANK}\.)?pt$")
# write_atomically's temp names: .NAME.tmp-HOST-SLOT (HOST sanitised as it does).
_TEMP = re.compile(rf"^\.(step-{_STEP}\.(?:rank-{_RANK}\.)?pt)\.tmp-(.+)-(\d+)$")


def main_file(directory: Path, step: int) -> Path:
    """``directory/step-000000030.pt``.

    Example:
        >>> main_file(Path("runs"), 30).name
        'step-000000030.pt'
    """
    return directory / f"step-{step:09d}.pt"


def rank_file(directory: Path, step: int, rank: int) -> Path:
    """``directory/step-000000030.rank-00001.pt``: rank ``rank``'s own part of a step.

    Example:
        >>> rank_file(Path("runs"), 30, 1).name
        'step-000000030.rank-00001.pt'
    """
    return directory / f"step-{step:09d}.rank-{rank:05d}.pt"


def _names(directory: Path) -> list[str]:
    """The names in the Checkpointer directory ``directory``; none while it does not exist.

    Raises:
        CheckpointError: it, or the nearest path above it that exists, is a file.
        OSError: it could not be listed (:func:`_unlisted`).
    """
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise (not_a_directory(directory) or _unlisted(directory, e)) from e


# What to check when a Checkpointer directory cannot be listed.
_LIST_FIXES = {
    errno.EACCES: "check the permissions of it and the directories above it (ls -ld {}) and "
    "the user the run is started as",
    errno.EMFILE: "too many files are open in this process: close some, or raise the limit "
    "(ulimit -n)",
    errno.ENFILE: "the system's open-file table is full: close files, or raise fs.file-max",
}
_LIST_FIXES[errno.EPERM] = _LIST_FIXES[errno.EACCES]


def _unlisted(directory: Path, e: OSError) -> OSError:
    """The error (same errno, so the same subclass: ``PermissionError`` for EACCES) for the
    Checkpointer directory ``directory`` that ``os.listdir`` failed on with ``e``: its step
    files may be fine, so not a ``CheckpointError``, as for a step file that cannot be read.

    Example:
        >>> e = PermissionError(errno.EACCES, "Permission denied")
        >>> print(_unlisted(Path("runs"), e))  # doctest: +ELLIPSIS
        [Errno 13] cannot list the Checkpointer directory runs: Permission denied. The step ...
    """
    fix = _LIST_FIXES.get(
        e.errno or 0,
        "a disk or filesystem error (a network mount that went away): check the storage and retry",
    )
    return OSError(
        e.errno,
        f"cannot list the Checkpointer directory {directory}: {e.strerror or e}. The step "
        f"files in it may be fine: {fix.format(directory)}",
    )


def not_a_directory(directory: Path) -> CheckpointError | None:
    """The error for a Checkpointer directory that is a file, or under one (no step file
    could be written there); None when it, or the nearest path above it that exists, is a
    directory.

    Example:
        >>> import tempfile
        >>> log = Path(tempfile.mkdtemp(), "runs")
        >>> _ = log.write_text("a log")
        >>> print(not_a_directory(log / "exp1"))  # doctest: +ELLIPSIS
        Checkpointer directory .../runs/exp1 is in .../runs, a file, not a directory: give ...
        >>> not_a_directory(log.parent) is None
        True
    """
    for path in (directory, *directory.parents):
        if os.path.exists(path):  # False, not an error, where a parent may not be searched
            if os.path.isdir(path):
                return None
            what = "is a file" if path == directory else f"is in {path}, a file"
            return CheckpointError(
                f"Checkpointer directory {directory} {what}, not a directory: give a "
                "directory for the step files (it is created if missing)",
                directory,
            )
    return None


def steps_on_disk(directory: Path) -> list[int]:
    """Steps with a complete main file (complete: it was renamed into place), ascending."""
    return sorted(int(m[1]) for name in _names(directory) if (m := _MAIN.match(name)))


def to_retire(steps: list[int], keep: int, protect: int) -> list[int]:
    """Which of ``steps`` (with a main file) ``keep=N`` deletes: all but the ``keep``
    newest, never ``protect`` (the one just written, even if older numbers exist above it).

    Example:
        >>> to_retire([10, 20, 30, 40], keep=2, protect=40)
        [10, 20]
        >>> to_retire([10, 20, 300], keep=1, protect=20)  # a restarted run, older numbers
        [10]
    """
    newest = sorted(set(steps), reverse=True)
    kept = set(newest[:keep]) | {protect}
    return sorted(s for s in steps if s not in kept and s < max(kept))


def not_a_step_file(path: Path, *, raise_read_errors: bool = False) -> str | None:
    """Why ``path`` is not a file ``Checkpointer.restore`` would load, or None: it must be a
    complete torch.save file (a zip archive with its directory, or the legacy format) whose
    pickle holds the ``"trainperf"`` entry with the step its name says (a step file copied or
    renamed to another step's name is not: :func:`misnamed`). Only the pickle is read, with
    every class and tensor stubbed (:func:`~trainperf.checkpoint._held.held_step`, once per
    version of the file): nothing is run, no tensor data read, so a byte changed in tensor
    data (a CRC mismatch) or a legacy file cut inside its tensor data passes here, and
    ``restore`` finds it.

    A file the system cannot read (EACCES, EIO, EMFILE) may be fine: with
    ``raise_read_errors`` that is raised, as ``load_checkpoint`` raises it (an ``OSError``
    of the same errno naming the file and what to check), not reported.

    Raises:
        OSError: with ``raise_read_errors``, the file could not be read.
    """
    held = held_step(path, raise_read_errors=raise_read_errors)
    if isinstance(held, str):
        return held
    m = _MAIN.match(path.name)
    if m is not None and int(m[1]) != held:
        return str(misnamed(path, int(m[1]), held))
    return None


def misnamed(
    path: Path, named: int, held: int, *, named_rank: int = 0, held_rank: int = 0
) -> CheckpointError:
    """The error for the step file ``path`` whose name says step ``named`` (of rank
    ``named_rank``'s file; 0: the main file) but which holds step ``held`` of rank
    ``held_rank`` (a copy or a rename): loading it would resume at the wrong step, or give
    a rank another step's (another rank's) random states and loader positions.

    Example:
        >>> print(misnamed(Path("runs/step-000000200.pt"), 200, 100))  # doctest: +ELLIPSIS
        runs/step-000000200.pt holds step 100, but its name says step 200 (copied or ...
        >>> print(misnamed(Path("runs/step-000000200.rank-00001.pt"), 200, 200,
        ...                named_rank=1, held_rank=2))  # doctest: +ELLIPSIS
        runs/step-000000200.rank-00001.pt holds rank 2's part of step 200, but its name ...
    """
    right = _file_of(path.parent, held, held_rank)
    whose = _part(held, held_rank) if held_rank else f"step {held}'s checkpoint"
    fix = (
        f"{right.name} is there too, so this is a copy: move it out of {path.parent}"
        if os.path.lexists(right)
        else f"rename it to {right.name} if it is {whose}, or move it out of {path.parent}"
    )
    if named_rank == 0:
        source, harm = "another step's file", "continue at the wrong step"
    else:
        source = "another file"
        harm = (
            f"give rank {named_rank} the random states and loader positions of "
            f"{_part(held, held_rank)}"
        )
    return CheckpointError(
        f"{path} holds {_part(held, held_rank)}, but its name says "
        f"{_part(named, named_rank)} (copied or renamed from {source}): resuming from it "
        f"would {harm}; {fix}",
        path,
    )


def refuse_misnamed(
    method: str, path: Path, named: int, held: int, *, named_rank: int = 0, held_rank: int = 0
) -> None:
    """Raise :func:`misnamed`'s error, as ``Checkpointer.<method>``'s, when the step file
    ``path`` holds another step (or rank) than its name says: falling back to an older file
    would lose the steps since, and loading it would resume wrongly while ``latest()``,
    ``steps()`` and ``keep=`` go by the name.

    Raises:
        CheckpointError: ``(held, held_rank)`` is not ``(named, named_rank)``.
    """
    if (held, held_rank) != (named, named_rank):
        e = misnamed(path, named, held, named_rank=named_rank, held_rank=held_rank)
        raise CheckpointError(f"Checkpointer.{method} stops at step {named}: {e}", path)


def _file_of(directory: Path, step: int, rank: int) -> Path:
    return main_file(directory, step) if rank == 0 else rank_file(directory, step, rank)


def _part(step: int, rank: int) -> str:
    return f"step {step}" if rank == 0 else f"rank {rank}'s part of step {step}"


def retire(directory: Path, keep: int, protect: int, damaged: Iterable[int] = ()) -> list[str]:
    """Delete the main and rank files of the steps :func:`to_retire` names, and rank files
    of older steps whose main file never appeared; return what could not be deleted.

    Only step files (:func:`not_a_step_file`: what ``restore`` would load) count toward
    ``keep`` and are deleted. Any other file with a step file's name (cut short by another
    tool, a foreign file: one from another tool, ``torch.save`` of something else, or
    another step's file copied or renamed to this name), or whose step is in ``damaged``
    (a restore found its data corrupt), neither counts nor is deleted, nor are its rank
    files: it would hold one of the ``keep`` places for good, above the files that do load,
    and it may be all that is left of something. Nor does a write-protected one
    (:func:`pinned`), nor its rank files: the user kept it. A directory with a step file's
    name is never deleted: it is returned as not deleted, saying so."""
    names = _names(directory)
    mains = {int(m[1]): name for name in names if (m := _MAIN.match(name))}
    bad = set(damaged)
    steps = [step for step, name in mains.items() if _counts(directory / name, step, protect, bad)]
    doomed = set(to_retire(steps, keep, protect))
    oldest_kept = min((s for s in steps if s not in doomed), default=protect)
    failed = []
    for name in names:
        m = _ANY.match(name)
        if m is None:
            continue
        step = int(m[1])
        if step in doomed or (step < oldest_kept and step not in mains):
            if os.path.isdir(directory / name) and not os.path.islink(directory / name):
                failed.append(_a_directory(directory / name))
                continue
            try:
                os.unlink(directory / name)
            except FileNotFoundError:
                pass
            except OSError as e:
                failed.append(f"{directory / name}: {e.strerror or e}")
                continue
            forget(directory / name)  # or the answers kept would grow by one per save
    return failed


def _a_directory(path: Path) -> str:
    """The note for a directory with a step file's name that retention would delete: it
    deletes files only (the directory may hold anything)."""
    return (
        f"{path}: a directory, not a checkpoint file (retention deletes files only): remove it "
        f"(rm -r {path}) or move it out of {path.parent}"
    )


def _counts(path: Path, step: int, protect: int, damaged: set[int]) -> bool:
    """Whether the main file ``path`` of ``step`` counts toward ``keep`` (and may go): the one
    just written does; a damaged, write-protected or foreign one does not."""
    if step == protect:
        return True
    return step not in damaged and not pinned(path) and not_a_step_file(path) is None


def pinned(path: Path) -> bool:
    """Whether ``path`` is write-protected (no write bit for anyone, ``chmod a-w``): the way
    to keep a step that ``keep=`` would delete (``rm`` asks before deleting one too)."""
    try:
        return not os.stat(path).st_mode & 0o222
    except OSError:
        return False


def this_host() -> str:
    """The host name as :mod:`trainperf._utils.atomic` puts it in temp names."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def remove_dead_temps(directory: Path) -> list[str]:
    """Remove this host's temp files in ``directory`` that no live writer holds (left by a
    killed save); return their names. Other hosts' temp files are left alone."""
    host = this_host()
    removed = []
    for name in _names(directory):
        m = _TEMP.match(name)
        if m and m[2] == host and remove_dead_temp(directory / name):
            removed.append(name)
    return sorted(removed)
