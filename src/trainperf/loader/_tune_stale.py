"""Whether a cached ``tune_loader`` choice still describes the dataset: the main process's
rate now, on a few batches, against the rate the entry measured (:data:`STALE_FACTOR`).
The cache key sees the dataset's class and size, not its settings.
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

__all__ = ["STALE_FACTOR"]

STALE_FACTOR = 3.0
"""A cached choice is tuned again when the main process now loads this many times faster or
slower than when it was measured (a heavier transform, augmentation switched on: the key
sees the dataset's class and size, not its settings)."""


def _changed_since(call: _Call, cached_rate: float | None) -> str | None:
    """Why a cache hit of a map-style dataset no longer describes it, or None: the main
    process's samples/s on a few batches now (the fastest of up to three after the first, which
    carries the start-up the entry's steady-state rate leaves out) against the rate the
    entry measured."""
    if not cached_rate or _iterable.is_iterable(call.dataset):
        return None  # a stream pays its start-up (a shuffle buffer, a connection) first
    now = _main_process_rate(call.dataset, call.setup.batch_size, call.loader_kwargs)
    if now is None or 1 / STALE_FACTOR <= now / cached_rate <= STALE_FACTOR:
        return None
    return (
        f"the cached settings were not used (the main process now loads "
        f"{now:,.0f} samples/s, {cached_rate:,.0f} when they were tuned): tuned again"
    )


def _main_process_rate(
    dataset: Any, batch_size: int, loader_kwargs: dict[str, Any]
) -> float | None:
    """Samples/s of the fastest of up to three batches loaded in this process after the
    first (timed for at most a second), None when none could be timed (a loader of one
    batch; an error is left to the tuning that follows)."""
    kwargs = {k: v for k, v in _for_measuring(dataset, loader_kwargs).items() if k in _PLAIN}
    best = None
    try:
        it = iter(DataLoader(dataset, batch_size=batch_size, num_workers=0, **kwargs))
        next(it)  # start-up: a shuffle buffer, a connection, the first file's cold read
        end = time.perf_counter() + 1.0
        for _ in range(3):
            t = time.perf_counter()
            batch = next(it)
            rate = samples_in(batch, batch_size) / max(time.perf_counter() - t, 1e-9)
            best = rate if best is None else max(best, rate)
            if time.perf_counter() > end:
                break
    except Exception:
        return best
    return best


_PLAIN = ("shuffle", "sampler", "collate_fn", "drop_last", "generator")
"""The caller's DataLoader arguments a main-process read keeps (no worker settings)."""
