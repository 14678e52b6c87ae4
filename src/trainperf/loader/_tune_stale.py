"""Whether a cached ``tune_loader`` choice still describes the dataset: the main process's
rate now, on a few batches, against the rate the entry measured (:data:`STALE_FACTOR`,
beyond :data:`NOISE_FLOOR_S` a batch). The cache key sees the dataset's class and size, not
its settings.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from trainperf._utils.batches import samples_in
from trainperf.loader import _iterable
from trainperf.loader._tune_prepare import _for_measuring

if TYPE_CHECKING:
    from trainperf.loader._tune import _Call

__all__ = ["NOISE_FLOOR_S", "STALE_FACTOR"]

STALE_FACTOR = 3.0
"""A cached choice is tuned again when the main process now loads this many times faster or
slower than when it was measured (a heavier transform, augmentation switched on: the key
sees the dataset's class and size, not its settings)."""

NOISE_FLOOR_S = 0.001
"""Nor is it tuned again when its time per batch changed by less than this: batches that
take microseconds are timed within a busy host's scheduling noise (one reading of a
near-free dataset's rate differs several-fold from the next), and no training step feels
such a change."""


def _changed_since(call: _Call, cached_rate: float | None, deadline: float) -> str | None:
    """Why a cache hit of a map-style dataset no longer describes it, or None: the main
    process's samples/s on a few batches now (the fastest of up to three after the first, which
    carries the start-up the entry's steady-state rate leaves out, none started past the
    call's ``deadline``) against the rate the entry measured (:func:`_differs`)."""
    if not cached_rate or _iterable.is_iterable(call.dataset):
        return None  # a stream pays its start-up (a shuffle buffer, a connection) first
    now = _main_process_rate(call.dataset, call.setup.batch_size, call.loader_kwargs, deadline)
    if now is None or not _differs(now, cached_rate, call.setup.batch_size):
        return None
    return (
        f"the cached settings were not used (the main process now loads "
        f"{now:,.0f} samples/s, {cached_rate:,.0f} when they were tuned): tuned again"
    )


def _differs(now: float, then: float, batch_size: int) -> bool:
    """Whether the main process's samples/s ``now`` differs from ``then`` by more than
    :data:`STALE_FACTOR` either way and its time per batch by more than
    :data:`NOISE_FLOOR_S`.

    Example:
        >>> _differs(300_000.0, 60_000.0, 8)  # 5x faster, but 0.03 ms a batch against 0.13
        False
        >>> _differs(100.0, 100_000.0, 8)  # 80 ms a batch now, 0.08 ms then
        True
        >>> _differs(800.0, 200.0, 8)  # 4x faster: 10 ms a batch now, 40 ms then
        True
    """
    if 1 / STALE_FACTOR <= now / then <= STALE_FACTOR:
        return False
    return abs(batch_size / now - batch_size / then) > NOISE_FLOOR_S


def _main_process_rate(
    dataset: Any, batch_size: int, loader_kwargs: dict[str, Any], deadline: float
) -> float | None:
    """Samples/s of the fastest of up to three batches loaded in this process after the
    first (timed for at most a second), None when none could be timed (a loader of one
    batch; an error is left to the tuning that follows). As everywhere in the tuner, no
    batch is started that the one before it says would end past ``deadline`` (the call's
    budget): work in this process cannot be cut short."""
    kwargs = {k: v for k, v in _for_measuring(dataset, loader_kwargs).items() if k in _PLAIN}
    best = None
    try:
        it = iter(DataLoader(dataset, batch_size=batch_size, num_workers=0, **kwargs))
        t = time.perf_counter()
        next(it)  # start-up: a shuffle buffer, a connection, the first file's cold read
        last = time.perf_counter() - t  # start-up included: no shorter than a batch
        end = time.perf_counter() + 1.0
        for _ in range(3):
            t = time.perf_counter()
            if t + last > deadline:
                break
            batch = next(it)
            last = time.perf_counter() - t
            rate = samples_in(batch, batch_size) / max(last, 1e-9)
            best = rate if best is None else max(best, rate)
            if time.perf_counter() > end:
                break
    except Exception:
        return best
    return best


_PLAIN = ("shuffle", "sampler", "collate_fn", "drop_last", "generator")
"""The caller's DataLoader arguments a main-process read keeps (no worker settings)."""
