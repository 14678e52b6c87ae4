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
inside :func:`preserved_generators` with those :func:`dataset_generators` finds (both in
:mod:`trainperf._utils.rng`, shared with ``tune_batch_size``, and re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainperf._utils.rng import dataset_generators, preserved_generators, preserved_rng

__all__ = [
    "callers_generators",
    "dataset_generators",  # from _utils.rng
    "preserved_generators",  # from _utils.rng
    "preserved_rng",  # from _utils.rng
]


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
