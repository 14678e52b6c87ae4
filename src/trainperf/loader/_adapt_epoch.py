"""What ``iter()`` of an :class:`~trainperf.loader.AdaptiveDataLoader` returns: an
:class:`EpochIterator`, whose workers stop as soon as the caller lets go of it.

The loader keeps each epoch's timing state (``_TimedIter`` in :mod:`trainperf.loader._adapt_timed`),
which it reads at the next ``iter()`` to retune; that state holds the epoch's DataLoader
iterator, and with it the worker pool. Handed to the caller directly, it stayed referenced
by the loader after a ``break``, so the workers ran on until the next ``iter()``. The caller
gets this handle instead, which only the caller references: when it is dropped (the loop is
left, ``del``), its finalizer stops the epoch's own pool at once, as a plain DataLoader
iterator's ``__del__`` does. A persistent pool (``persistent_workers=True``) is the
loader's, and stays, as torch's does.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

__all__ = ["EpochIterator"]


class _Epoch(Protocol):
    """The epoch's timing state, as the handle uses it."""

    def __next__(self) -> Any: ...

    def __len__(self) -> int: ...

    def abandon(self) -> None: ...


class EpochIterator:
    """One epoch of an adaptive loader, as the caller iterates it.

    Example:
        >>> class Counted:
        ...     def __init__(self): self.left, self.stopped = 2, False
        ...     def __next__(self):
        ...         if not self.left: raise StopIteration
        ...         self.left -= 1
        ...         return self.left
        ...     def __len__(self): return 2
        ...     def abandon(self): self.stopped = True
        >>> epoch = Counted()
        >>> it = EpochIterator(epoch)
        >>> next(it), len(it), epoch.stopped
        (1, 2, False)
        >>> del it  # the loop is left: the epoch's workers stop
        >>> epoch.stopped
        True
    """

    __slots__ = ("__weakref__", "_stop", "_timed")

    def __init__(self, timed: _Epoch) -> None:
        self._timed = timed
        # The callback holds the epoch's state, never this handle: a reference back (a
        # bound method of the handle, a closure over it) would keep the handle alive.
        self._stop = weakref.finalize(self, timed.abandon)
        # At interpreter exit torch's own handlers stop the workers.
        self._stop.atexit = False

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        return next(self._timed)

    def __len__(self) -> int:
        return len(self._timed)
