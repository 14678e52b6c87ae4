"""The step a step file holds, read once per version of the file.

Retention (``keep=``) asks of every step file in the directory, at every save, whether
``Checkpointer.restore`` would load it: :func:`held_step` answers from the file's pickle
(:func:`~trainperf.checkpoint._skim.skim`, about 0.2 s for a file of 12,000 tensors) and
remembers the answer under the file's path, device, inode, size, mtime and ctime, so an
unchanged file is read once, and a file rewritten, replaced or renamed is read again.

One answer is kept per path (its newest version), and retention drops the answers for the
files it deletes (:func:`forget`), so a long run keeps about ``keep`` answers per directory,
not one per save.

The forked background writer runs retention in a child process, whose answers die with it:
it sends back through its pipe the answers for the files still in the directory
(:func:`known`), and the parent takes them as that directory's (:func:`learn`). A read the
system refused (EIO, EACCES: the file may be fine) is not remembered.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeAlias

from trainperf.checkpoint._formats import read_error, read_failure
from trainperf.checkpoint._payload import saved_step
from trainperf.checkpoint._skim import skim

__all__ = ["forget", "held_step", "known", "learn", "version", "vouch"]

# (path, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): ctime too, which no tool can
# set back, so a file rewritten in place with its mtime restored is read again.
_Key: TypeAlias = tuple[str, int, int, int, int, int]
# Per path, the version read and the answer: the step the file holds, or why it is not a
# step file. Bounded (a huge keep, many directories): the oldest answers go first. No lock: a
# lock a writer thread held at a fork would stay held in the child.
_HELD: dict[str, tuple[_Key, int | str]] = {}
_LIMIT = 4096


def version(path: Path) -> _Key | None:
    """The version of ``path`` now (taken before reading it: a change after this gets a
    new key, so an answer is never kept for a version it was not read from); None when it
    cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(key: _Key, held: int | str) -> None:
    """Keep ``held`` for this version of its path, in place of any older version's answer;
    past the limit, drop the oldest answers (one at a time: no copy of the whole cache)."""
    _HELD.pop(key[0], None)  # re-inserted last: the newest answer
    _HELD[key[0]] = (key, held)
    while len(_HELD) > _LIMIT:
        try:
            oldest = next(iter(_HELD), None)
        except RuntimeError:
            # Another thread (the forked writer's reaper: learn, forget) changed the cache
            # between iter() and next(); the next answer kept trims what is left over.
            break
        if oldest is None:
            break
        _HELD.pop(oldest, None)


def held_step(path: Path, *, raise_read_errors: bool = False) -> int | str:
    """The step the torch.save file ``path`` holds (its ``"trainperf"`` entry), or why it
    holds none (cut short, damaged, not a torch.save file, a foreign one). Read once per
    version of the file.

    Raises:
        OSError: with ``raise_read_errors``, the file could not be read (as
            ``load_checkpoint`` raises it: an ``OSError`` of the same errno naming the
            file and what to check); without it, that is returned as the reason.
    """
    key = version(path)
    kept = _HELD.get(os.fspath(path))
    if key is not None and kept is not None and kept[0] == key:
        return kept[1]
    try:
        skimmed = skim(path)
    except Exception as e:
        # A directory with a step file's name is "not a checkpoint", as for load_checkpoint;
        # any other read failure may pass, so it is not remembered.
        if read_failure(e) and not isinstance(e, IsADirectoryError):
            if raise_read_errors:
                raise read_error(path, e) from e
            return f"{type(e).__name__}: {e}"
        held: int | str = f"{type(e).__name__}: {e}"
    else:
        held = _step_in(skimmed, path)
    if key is not None:
        _remember(key, held)
    return held


def _step_in(skimmed: Any, path: Path) -> int | str:
    """The step in what :func:`skim` read from ``path``, or why there is none."""
    try:
        return saved_step(skimmed, str(path))
    except ValueError as e:
        return str(e)


def vouch(path: Path, step: int) -> None:
    """Remember that ``path``, just written by ``Checkpointer.save``, holds ``step``."""
    key = version(path)
    if key is not None:
        _remember(key, step)


def forget(path: Path) -> None:
    """Drop the answer for ``path`` (retention deleted it)."""
    _HELD.pop(os.fspath(path), None)


def known(directory: Path) -> list[list[Any]]:
    """The remembered answers for the files now in ``directory``, JSON-safe (for
    :func:`learn`): those for files deleted since are not sent."""
    try:
        names = set(os.listdir(directory))
    except OSError:
        return []
    where = os.fspath(directory)
    return [
        [*key, held]
        for path, (key, held) in list(_HELD.items())
        if os.path.dirname(path) == where and os.path.basename(path) in names
    ]


def learn(directory: Path, entries: Iterable[Any]) -> None:
    """Take the answers :func:`known` gave in another process (the forked writer, after its
    retention) as ``directory``'s: this process's answers for files there are dropped first
    (retention there may have deleted them); entries of another shape are ignored."""
    where = os.fspath(directory)
    # list(): a snapshot taken at once, as held_step may add answers from another thread.
    for path in [p for p in list(_HELD) if os.path.dirname(p) == where]:
        _HELD.pop(path, None)
    for entry in entries:
        if (
            isinstance(entry, list)
            and len(entry) == 7
            and isinstance(entry[0], str)
            and os.path.dirname(entry[0]) == where
            and all(type(n) is int for n in entry[1:6])
            and type(entry[6]) in (int, str)
        ):
            _remember((entry[0], *entry[1:6]), entry[6])
