"""Worker memory: what one DataLoader worker is expected to reach over a run.

Worker memory grows after the measurement: a forked worker shares its parent's pages until
it writes to them, and merely reading a Python object writes to it (its reference count),
so a dataset of many Python objects is copied page by page into every worker over an epoch
(a list of objects measured 18 MiB per worker after a few seconds, 97 MiB after an epoch);
tensor and array buffers are never written and stay shared. The private memory of the
workers is therefore read twice, after the first batch and at the end, and the growth per
sample in between is projected over the dataset (:func:`project_worker_uss`). A full
garbage collection also writes to every Python container object, copying their pages at
once; it would come at a random moment in a worker's life, so each worker runs one as it
starts (:class:`CollectFirst`, before the caller's ``worker_init_fn``) and the first reading
already includes it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from trainperf.loader._workers import main_private_bytes

__all__ = ["MiB", "CollectFirst", "UssReading", "project_worker_uss", "projected_uss"]

MiB = 1 << 20

UssReading = tuple[int, dict[int, int]]
"""``(samples received so far, {worker pid: private bytes})``."""


class CollectFirst:
    """``worker_init_fn`` that runs a full garbage collection, then the caller's own."""

    def __init__(self, init: Callable[[int], object] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        gc.collect()
        if self.init is not None:
            self.init(worker_id)


def project_worker_uss(
    late: int,
    growth: int,
    samples_between: float,
    samples_per_worker: int | None,
    parent_private: int,
    noise: int = MiB,
) -> int:
    """Private memory one worker is expected to reach over a run, from two readings.

    The growth between the readings beyond ``noise`` (allocator churn, batches in flight)
    is taken as pages copied from the parent, at a rate per sample that is kept for every
    sample the worker will load. The rate only falls as the copied pages accumulate, so
    this overestimates; and it is capped at the parent's private memory, since a worker
    cannot copy more than there is. Tensor-backed datasets grow by less than ``noise``
    and keep their measured size.

    Args:
        late: the worker's private memory at the second reading, in bytes.
        growth: how much it grew since the first reading, in bytes.
        samples_between: samples the worker loaded between the two readings.
        samples_per_worker: samples one worker loads over the run; None when unknown (the
            growth is then bounded only by ``parent_private``).
        parent_private: the main process's private anonymous memory, in bytes.
        noise: growth up to this much is not copying.

    Returns:
        The projected private memory, in bytes (at least ``late``).

    Example:
        >>> MiB = 2**20
        >>> # 41 MiB grown over 10,000 samples: 4 KiB copied per sample beyond 1 MiB of
        >>> # noise; over 50,000 samples that is 200 MiB more.
        >>> project_worker_uss(50 * MiB, 41 * MiB, 10_000, 50_000, 2048 * MiB) // MiB
        250
        >>> # Never more than the parent holds.
        >>> project_worker_uss(50 * MiB, 41 * MiB, 10_000, 10**7, 300 * MiB) // MiB
        350
        >>> # A tensor-backed dataset: half a MiB of churn is not growth.
        >>> project_worker_uss(12 * MiB, MiB // 2, 10_000, 10**7, 2048 * MiB) // MiB
        12
    """
    copied = max(0, growth - noise)
    if copied == 0 or samples_between <= 0:
        return late
    if samples_per_worker is None:
        return late + parent_private
    return late + int(min(copied / samples_between * samples_per_worker, parent_private))


def projected_uss(
    first: UssReading | None,
    last: UssReading,
    *,
    num_workers: int,
    batch_bytes: int,
    samples_per_worker: int | None,
) -> int | None:
    """:func:`project_worker_uss` from two readings ``(samples received, {pid: uss})``.

    The growth is the smallest among the workers read twice (a worker that was still
    starting at the first reading grew for another reason); the level is the largest.
    """
    samples, uss = last
    if not uss:
        return None
    late = max(uss.values())
    if first is None:
        return late
    samples0, uss0 = first
    grown = [uss[pid] - uss0[pid] for pid in uss if pid in uss0]
    if not grown:
        return late
    return project_worker_uss(
        late,
        min(grown),
        (samples - samples0) / num_workers,
        samples_per_worker,
        main_private_bytes(),
        # A batch or two held in a worker's shared memory count as its own until sent.
        noise=MiB + 2 * batch_bytes,
    )
