"""The adaptive loader's epoch plan: how a worker pool is replaced mid-epoch with the
sample sequence kept exactly.

An :class:`AdaptiveDataLoader` whose samples come from one of torch's own samplers (see
:func:`resumable`) hands its DataLoader iterators an :class:`EpochPlan` in place of the
index sampler. The plan draws the epoch's indices from the real sampler once, as the plain
DataLoader would (one ``iter()`` of the sampler per epoch, consumed lazily in the same
order), and remembers the batches of indices it handed out that the loop has not received
yet (those a worker pool has prefetched). When the pool is replaced at a batch boundary,
the new pool's iterator is given those batches again, then the rest of the same draw: the
sequence of samples, and their count, is the one the loader gives without any change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

__all__ = ["EpochPlan", "resumable"]

_PURE_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
)


def resumable(loader: Any) -> str | None:
    """Why ``loader``'s settings may change only at epoch boundaries, or None when a pool
    can be replaced mid-epoch with the sample sequence kept exactly.

    Mid-epoch needs a map-style dataset (an ``IterableDataset``'s workers each iterate
    their own copy, their state cannot be handed on), batches returned in order, and
    indices from torch's own samplers (exact types: their sequence depends only on their
    state when an epoch starts; a custom sampler's iteration may have side effects, or
    depend on when it is drawn).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> resumable(DataLoader(range(8), batch_size=2, shuffle=True)) is None
        True
        >>> class Mine(SequentialSampler): pass
        >>> resumable(DataLoader(range(8), sampler=Mine(range(8))))
        'a custom sampler (Mine)'
    """
    from torch.utils.data import IterableDataset

    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset"
    if not getattr(loader, "in_order", True):
        return "in_order=False"
    if loader.batch_sampler is not None:
        if type(loader.batch_sampler) is not BatchSampler:
            return f"a custom batch_sampler ({type(loader.batch_sampler).__name__})"
        sampler = loader.batch_sampler.sampler
    else:
        sampler = loader.sampler
    if type(sampler) not in _PURE_SAMPLERS:
        return f"a custom sampler ({type(sampler).__name__})"
    return None


class EpochPlan:
    """The index sampler a DataLoader iterator sees: one draw of the real sampler per epoch,
    replayable from any batch boundary.

    Args:
        sampler: the loader's real index sampler (its ``batch_sampler``, or its ``sampler``
            without automatic batching).

    Example:
        >>> plan = EpochPlan(BatchSampler(SequentialSampler(range(6)), 2, False))
        >>> it = iter(plan)
        >>> next(it), next(it)  # a pool prefetched two batches; the loop received one
        ([0, 1], [2, 3])
        >>> plan.received(1)
        >>> plan.resume_at(1)
        >>> list(iter(plan))  # the new pool's iterator: the unreceived batch, then the rest
        [[2, 3], [4, 5]]
        >>> len(plan)
        3
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self._source: Iterator[Any] = iter(())
        self._handed = 0  # items drawn from this epoch's source
        self._pending: deque[tuple[int, Any]] = deque()  # (number, item) not received yet
        self._replay: deque[tuple[int, Any]] = deque()
        self._resuming = False

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        if self._resuming:
            # A DataLoader iterator may call iter() more than once as it starts (torch's
            # multiprocessing one does): each call resumes the same draw.
            return self._hand()
        self._source = iter(self.sampler)  # a new epoch: the draw the plain loader makes
        self._handed = 0
        self._pending.clear()
        self._replay.clear()
        return self._hand()

    def _hand(self) -> Iterator[Any]:
        while True:
            if self._replay:
                number, item = self._replay.popleft()
            else:
                try:
                    item = next(self._source)
                except StopIteration:
                    return
                number, self._handed = self._handed, self._handed + 1
            self._pending.append((number, item))
            yield item

    def received(self, count: int) -> None:
        """The loop has received ``count`` items of this epoch: forget those."""
        while self._pending and self._pending[0][0] < count:
            self._pending.popleft()

    def resume_at(self, count: int) -> None:
        """The next iterator resumes after the ``count`` items received (the pool that drew
        the rest is being shut down); call :meth:`resumed` once it has started."""
        self.received(count)
        # Before what an earlier resume has not handed out again yet: both are unreceived.
        self._replay = deque([*self._pending, *self._replay])
        self._pending.clear()
        self._resuming = True

    def resumed(self) -> None:
        """The resuming iterator has started: a later ``iter()`` is a new epoch again."""
        self._resuming = False
