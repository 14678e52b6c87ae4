"""The steps whose file :meth:`Checkpointer.restore
<trainperf.checkpoint.Checkpointer.restore>` found damaged (a CRC mismatch, a dangling
link), each with the version of the file it found so (path, device, inode, size, mtime,
ctime: :func:`~trainperf.checkpoint._held.version`).

``latest`` skips such a step, and retention neither counts nor deletes it, only while its
file is still that version: a file put right (a good copy put back, a link's target back,
the step written again by another ``Checkpointer``) counts again, without a save of that
step by this one. A step ``restore`` loads, or this ``Checkpointer`` saves again, is
forgotten.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from trainperf.checkpoint._held import _Key, version

__all__ = ["DamagedSteps"]


class DamagedSteps:
    """The steps ``restore`` found damaged, as of the file version it read: ``step in it``
    and iteration give only those whose file has not changed since."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[Path, _Key | None]] = {}

    def add(self, step: int, path: Path, seen: _Key | None) -> None:
        """``restore`` found ``path``, step ``step``'s file, damaged as of version ``seen``
        (taken before it read the file: a change after that is a new version)."""
        self._found[step] = (path, seen)

    def discard(self, step: int) -> None:
        """Step ``step`` was loaded or written again: its file is not the damaged one."""
        self._found.pop(step, None)

    def __contains__(self, step: object) -> bool:
        found = self._found.get(step) if isinstance(step, int) else None
        return found is not None and version(found[0]) == found[1]

    def __iter__(self) -> Iterator[int]:
        return iter([step for step in list(self._found) if step in self])
