"""Every random number generator as a block found it: :func:`preserved_rng`.

Measuring draws random numbers that the caller's run would otherwise draw (a shuffling
sampler seeds itself from torch's generator at every ``iter()``, DataLoader workers draw
their base seed, augmentation and dropout draw from ``random``, numpy, torch or CUDA). The
DataLoader tuner and ``tune_batch_size`` run inside :func:`preserved_rng`, so a seeded
script trains the same whether they measured or answered from their cache.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["preserved_rng"]


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
