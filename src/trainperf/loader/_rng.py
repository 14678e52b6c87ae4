"""Every random number generator as the tuner found it: :func:`preserved_rng`.

Measuring draws random numbers that the caller's run would otherwise draw: a shuffling
sampler seeds itself from torch's generator at every ``iter()``, a DataLoader with workers
draws their base seed, a dataset that augments in the main process draws from ``random``,
numpy or torch, and ``step_fn`` (dropout) from torch or CUDA. An answer from the cache
draws none of them, so without this a seeded script would train differently on its first
run (and on every new machine) than afterwards. :func:`trainperf.loader.tune_loader` runs
inside :func:`preserved_rng`, whether it measures, reads the cache or receives the choice
from another rank.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ["callers_generators", "preserved_rng"]


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
