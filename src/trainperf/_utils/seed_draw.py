"""A new worker pool's base seed drawn from another generator: :func:`seed_drawn_from`, and
:func:`sampler_generator`, the caller's generator meanwhile.

A DataLoader iterator with workers draws its workers' base seed from ``loader.generator``
as it starts. Where that draw must not move the caller's generator (a resumed pass, whose
interrupted run made the draw before the checkpoint; an adaptive loader's extra pools), the
loader's ``generator`` is swapped for another one around the iterator's start. The pool
pulls its first indices from the sampler before it returns, though, and what records the
sampler's states then (the Checkpointer's tracked sampler) must read the caller's
generator: :func:`sampler_generator`. Used by :mod:`trainperf.checkpoint._loader_state` and
:mod:`trainperf.loader._adapt_pool`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["sampler_generator", "seed_drawn_from"]

_REAL = "_trainperf_real_generator"  # in the loader's __dict__ while another one draws


@contextlib.contextmanager
def seed_drawn_from(loader: Any, other: torch.Generator) -> Iterator[None]:
    """``loader.generator`` is ``other`` within the block (what it was is put back after it,
    however it ends); :func:`sampler_generator` gives the caller's meanwhile, also inside
    another such block (a resumed pass's scratch draw around an adaptive loader's own).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> mine, scratch = torch.Generator(), torch.Generator()
        >>> loader = DataLoader([1, 2], generator=mine)
        >>> with seed_drawn_from(loader, scratch):
        ...     loader.generator is scratch, sampler_generator(loader) is mine
        (True, True)
        >>> loader.generator is mine, sampler_generator(loader) is mine
        (True, True)
    """
    before = loader.generator
    outer = _REAL in loader.__dict__  # a block around this one holds the caller's already
    if not outer:
        loader.__dict__[_REAL] = before
    loader.generator = other
    try:
        yield
    finally:
        loader.generator = before
        if not outer:
            loader.__dict__.pop(_REAL, None)


def sampler_generator(loader: Any) -> torch.Generator | None:
    """The caller's ``generator`` of ``loader``, also while :func:`seed_drawn_from` swaps
    another one in."""
    generator: torch.Generator | None = loader.__dict__.get(_REAL, loader.generator)
    return generator
