"""Every random number generator as a block found it: :func:`preserved_rng`, and the
generators a dataset owns (:func:`dataset_generators`, :func:`preserved_generators`).

Measuring draws random numbers that the caller's run would otherwise draw (a shuffling
sampler seeds itself from torch's generator at every ``iter()``, DataLoader workers draw
their base seed, augmentation and dropout draw from ``random``, numpy, torch or CUDA). The
DataLoader tuner and ``tune_batch_size`` run inside :func:`preserved_rng`, so a seeded
script trains the same whether they measured or answered from their cache.

A dataset may own generators too (``self.rng = torch.Generator()``, a numpy ``Generator``
or ``RandomState``, a ``random.Random``) and draw from them in ``__getitem__``; reading
samples in this process advances them. The DataLoader tuner (``num_workers=0``, through
:mod:`trainperf.loader._rng`, which re-exports these) and ``tune_batch_size`` (the dataset
behind a ``batches_from`` sampler) run inside :func:`preserved_generators` with those
:func:`dataset_generators` finds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["dataset_generators", "preserved_generators", "preserved_rng"]

_WRAPPED_DEPTH = 4  # a dataset, and the datasets it wraps: Subset(Subset(ConcatDataset(...)))


def _cuda_started() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _restore_cuda(saved: list[torch.Tensor] | None) -> None:
    if saved is not None:
        torch.cuda.set_rng_state_all(saved)
        return
    if not _cuda_started():
        return
    # CUDA started during the call: put each device's generator back where it stood right
    # after start-up. A CUDA generator's state is its seed and an offset, so re-seeding it
    # with the seed it started with (the caller's torch.manual_seed, applied when CUDA
    # started) is that state exactly.
    for gen in torch.cuda.default_generators:
        gen.manual_seed(gen.initial_seed())


@contextmanager
def preserved_rng(generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
    """Restore python's ``random``, numpy's global generator, torch's CPU generator, the
    CUDA generators and ``generators`` when the block ends, however it ends.

    MPS's generator is not covered.

    Args:
        generators: further generators to restore (the caller's ``generator=``, a
            sampler's).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> before = torch.get_rng_state()
        >>> with preserved_rng():
        ...     _ = torch.rand(3), random.random(), np.random.rand()
        >>> torch.equal(torch.get_rng_state(), before)
        True
    """
    py_state, np_state, cpu_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if _cuda_started() else None
    saved = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        _restore_cuda(cuda_state)
        for g, state in saved:
            g.set_state(state)


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
    found_ids: set[int] = set()  # a ConcatDataset of thousands of shards: no quadratic scan
    level, seen = [dataset], {id(dataset)}
    for _ in range(_WRAPPED_DEPTH):
        for ds in level:
            for value in getattr(ds, "__dict__", {}).values():
                if _is_generator(value) and id(value) not in found_ids:
                    found_ids.add(id(value))
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
