"""Every random number generator as the tuner found it.

Measuring draws random numbers that the caller's run would otherwise draw: a shuffling
sampler seeds itself from torch's generator at every ``iter()``, a DataLoader with workers
draws their base seed, a dataset that augments in the main process draws from ``random``,
numpy or torch, and ``step_fn`` (dropout) from torch or CUDA. An answer from the cache
draws none of them, so without this a seeded script would train differently on its first
run (and on every new machine) than afterwards. :func:`trainperf.loader.tune_loader` runs
inside :func:`~trainperf._utils.rng.preserved_rng` (shared with ``tune_batch_size``, and
re-exported here), whether it measures, reads the cache or receives the choice from
another rank, with the generators of :func:`callers_generators` restored too.

A dataset may own generators too (``self.rng = torch.Generator()``, a numpy ``Generator`` or
``RandomState``, a ``random.Random``), drawn from in ``__getitem__`` to augment: measuring
``num_workers=0`` loads samples in this process and advances them, so the call also runs
inside :func:`preserved_generators` with those :func:`dataset_generators` finds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from trainperf._utils.rng import preserved_rng

__all__ = [
    "callers_generators",
    "dataset_generators",
    "preserved_generators",
    "preserved_rng",  # from _utils.rng
]

_WRAPPED_DEPTH = 4  # a dataset, and the datasets it wraps: Subset(Subset(ConcatDataset(...)))


def callers_generators(loader_kwargs: Mapping[str, Any]) -> list[torch.Generator]:
    """The generators the caller handed in: ``generator=`` and the sampler's own.

    Example:
        >>> from torch.utils.data import RandomSampler
        >>> g, h = torch.Generator(), torch.Generator()
        >>> sampler = RandomSampler(range(4), generator=h)
        >>> found = callers_generators({"generator": g, "sampler": sampler})
        >>> found[0] is g, found[1] is h
        (True, True)
    """
    found = [
        loader_kwargs.get("generator"),
        getattr(loader_kwargs.get("sampler"), "generator", None),
    ]
    unique: list[torch.Generator] = []
    for g in found:
        if isinstance(g, torch.Generator) and all(g is not u for u in unique):
            unique.append(g)
    return unique


def _is_generator(value: object) -> bool:
    return isinstance(
        value, torch.Generator | np.random.Generator | np.random.RandomState | random.Random
    ) and not isinstance(value, random.SystemRandom)  # no state: its getstate() raises


def _wrapped(dataset: object) -> list[object]:
    """The datasets ``dataset`` wraps: a ``Subset``'s ``.dataset``, a ``ConcatDataset``'s
    ``.datasets``."""
    inner = getattr(dataset, "__dict__", {})
    found = [inner["dataset"]] if inner.get("dataset") is not None else []
    if isinstance(inner.get("datasets"), list | tuple):
        found.extend(inner["datasets"])
    return found


def dataset_generators(dataset: object) -> list[object]:
    """The random generators ``dataset`` owns: those among its attributes (one level deep),
    and among those of the datasets it wraps (a ``Subset``'s, a ``ConcatDataset``'s).

    Example:
        >>> from torch.utils.data import Subset
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __init__(self):
        ...         self.rng, self.py, self.n = torch.Generator(), random.Random(0), 8
        >>> ds = Noisy()
        >>> found = dataset_generators(Subset(ds, [0, 1]))
        >>> found[0] is ds.rng, found[1] is ds.py, len(found)
        (True, True, 2)
    """
    found: list[object] = []
    level, seen = [dataset], {id(dataset)}
    for _ in range(_WRAPPED_DEPTH):
        for ds in level:
            for value in getattr(ds, "__dict__", {}).values():
                if _is_generator(value) and all(value is not f for f in found):
                    found.append(value)
        level = [w for ds in level for w in _wrapped(ds) if id(w) not in seen]
        seen.update(id(w) for w in level)
    return found


def _restorer(gen: object) -> Callable[[], object] | None:
    """A function that puts ``gen`` back in the state it is in now; None for anything
    else than the generators :func:`dataset_generators` finds."""
    if isinstance(gen, torch.Generator):
        torch_state = gen.get_state()
        return lambda: gen.set_state(torch_state)
    if isinstance(gen, np.random.Generator):
        bits = gen.bit_generator
        bits_state = bits.state
        return lambda: setattr(bits, "state", bits_state)
    if isinstance(gen, np.random.RandomState):
        legacy_state = gen.get_state()
        return lambda: gen.set_state(legacy_state)
    if isinstance(gen, random.Random) and not isinstance(gen, random.SystemRandom):
        py_state = gen.getstate()
        return lambda: gen.setstate(py_state)
    return None


@contextmanager
def preserved_generators(generators: Iterable[object]) -> Iterator[None]:
    """Put ``generators`` (torch ``Generator``, numpy ``Generator`` or ``RandomState``,
    ``random.Random``; anything else is left alone) back as they were when the block ends,
    however it ends.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> with preserved_generators([rng]):
        ...     drawn = rng.random()
        >>> rng.random() == drawn
        True
    """
    restore = [r for g in generators if (r := _restorer(g)) is not None]
    try:
        yield
    finally:
        for put_back in restore:
            put_back()
