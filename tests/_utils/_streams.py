"""Iterable datasets for the checks that a stream starts afresh on each ``iter()``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils.data import IterableDataset


class OwnIterator(IterableDataset[torch.Tensor]):
    """A one-shot stream: its ``__iter__`` returns itself, so reading it uses it up."""

    def __init__(self, n: int) -> None:
        self.left = list(range(n))

    def __iter__(self) -> OwnIterator:
        return self

    def __next__(self) -> torch.Tensor:
        if not self.left:
            raise StopIteration
        return torch.tensor([float(self.left.pop())])


class Resets(IterableDataset[torch.Tensor]):
    """An older tutorial's stream: ``__iter__`` rewinds it and returns it."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self) -> Resets:
        self.i = 0
        return self

    def __next__(self) -> torch.Tensor:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return torch.tensor([float(self.i - 1)])


class Fresh(IterableDataset[torch.Tensor]):
    """A stream that starts afresh on each ``iter()``, with a ``__next__`` never used."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from (torch.tensor([float(i)]) for i in range(64))

    def __next__(self) -> torch.Tensor:  # not its iterator: iter() returns a generator
        raise AssertionError("never called")


def assert_refused_unread(read: Callable[[OwnIterator], object], reader: str) -> None:
    """``read(dataset)`` refuses a one-shot stream, naming ``reader``, before reading it."""
    one_shot = OwnIterator(8)
    with pytest.raises(
        ValueError,
        match=rf"OwnIterator is a one-shot iterator \(its __iter__ returns it as it is\): "
        rf"{re.escape(reader)} would use up samples .* afresh .* yield from",
    ):
        read(one_shot)
    assert len(one_shot.left) == 8  # not one sample taken
