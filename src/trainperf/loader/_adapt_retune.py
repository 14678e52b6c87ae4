"""Whether an :class:`~trainperf.loader.AdaptiveDataLoader` changes its setting: the rules
of :mod:`trainperf.loader._adapt_rules` fed with what it measured, at an epoch boundary
(:func:`retune`) or mid-epoch at a batch boundary (:func:`check`).

Between the measured figures and the rules sit the loader's memory of what did not pay
(an increase that did not raise the rate caps later ones: :func:`_judge`), the memory and
``/dev/shm`` rules (:meth:`AdaptiveDataLoader.fits`), and, before the first increase, the
check that an ``IterableDataset`` shards its stream across workers (:func:`_shards`).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import TYPE_CHECKING

from trainperf._utils.stack import user_stacklevel
from trainperf.limits import HostLimits
from trainperf.loader._adapt_pool import _rank_limits, apply_change, arm, resume, shut_down_own
from trainperf.loader._adapt_rules import (
    DEEP_PREFETCH,
    Change,
    EpochFigures,
    amortized,
    decide,
    increase_paid,
    increased,
)
from trainperf.loader._iterable import (
    ALIKE,
    PROBE_WORKERS,
    check_sharding,
    is_iterable,
    unsharded_warning,
)

if TYPE_CHECKING:
    from trainperf.loader._adapt import AdaptiveDataLoader
    from trainperf.loader._adapt_timed import _TimedIter

__all__ = ["check", "decide_change", "retune"]


def retune(loader: AdaptiveDataLoader, timed: _TimedIter) -> None:
    limits = _rank_limits()  # memory and /dev/shm as this epoch starts
    f = timed.final or timed.figures(limits)
    if f.batches < 2:
        return
    change = decide_change(loader, f, limits, timed.yielded)  # what each iter() took
    if change is not None:
        apply_change(loader, change, f, epoch=loader._epoch, epoch_batch=0)


def check(loader: AdaptiveDataLoader, timed: _TimedIter) -> None:
    """Mid-epoch, at a batch boundary: apply the rules to the window that ends here and,
    on a change, hand the rest of the epoch to a new pool."""
    limits = _rank_limits()
    f = timed.figures(limits)
    change = decide_change(loader, f, limits, len(loader))  # a plan's: map-style
    plan = timed.plan
    started = time.perf_counter()  # the pool's change counts in the new window's start-up
    if change is not None and plan is not None:
        shut_down_own(loader, timed)
        apply_change(loader, change, f, epoch=loader._epoch - 1, epoch_batch=timed.yielded)
        timed.it = resume(loader, timed)
        timed.trial = arm(loader, timed.it)
    timed.new_window(started)


def decide_change(
    loader: AdaptiveDataLoader,
    f: EpochFigures,
    limits: HostLimits,
    epoch_batches: int | None = None,
) -> Change | None:
    """The change the rules make of ``f``, or None; ``epoch_batches``: the batches of an
    epoch, over which a pool not kept between epochs pays its start-up again (None:
    unknown, the start-up is left out)."""
    loader._fastest_step = min(loader._fastest_step, f.step_per_batch)
    if f.cpus != loader._cpus:
        # What more workers (or prefetch) could not do may have changed.
        loader._ceiling = loader._prefetch_ceiling = None
    restarts = None if loader.persistent_workers else epoch_batches
    before, loader._before = loader._before, None
    if before is not None:
        _judge(loader, amortized(before, restarts), amortized(f, restarts))
    ceiling = loader._max_workers if loader._ceiling is None else loader._ceiling
    change = decide(
        f,
        previous_cpus=loader._cpus,
        fastest_step_per_batch=loader._fastest_step,
        max_workers=min(loader._max_workers, ceiling),
        fits=lambda n, pf: loader.fits(n, pf, limits),
        before=before,
        max_prefetch=loader._prefetch_ceiling or DEEP_PREFETCH,
        epoch_batches=restarts,
    )
    loader._cpus = f.cpus
    pinned = loader._pinned_workers
    if change is not None and pinned is not None and change.num_workers != pinned:
        return None  # a stream with drop_last: another count drops other samples
    if change is not None and change.num_workers > f.num_workers:
        probing = loader._sharded is None and is_iterable(loader.dataset)
        if probing and not loader.fits(
            f.num_workers + PROBE_WORKERS, change.prefetch_factor, limits
        ):
            return None  # the probe's workers beside the running ones would not fit: later
        if not _shards(loader):
            return None
    if change is not None and change.reason in ("input-bound", "prefetch"):
        loader._before = f
    return change


def _judge(loader: AdaptiveDataLoader, before: EpochFigures, f: EpochFigures) -> None:
    """After an increase (``before`` led to it, ``f`` ran with it) that did not pay, no
    later check goes beyond it: the wait left is not the workers' (the main process's
    own cost, say); the rules hold or go back (no-gain)."""
    if not increased(before, f) or (verdict := increase_paid(before, f)) == "paid":
        return
    kept = f if verdict == "hold" else before
    if f.num_workers > before.num_workers:
        loader._ceiling = kept.num_workers
    # No deeper prefetch either: the workers are not what the loop waits for.
    loader._prefetch_ceiling = kept.prefetch_factor or 2


def _shards(loader: AdaptiveDataLoader) -> bool:
    """Whether more workers keep the samples: an ``IterableDataset`` whose workers each
    replay the whole stream would yield every sample once per worker. Checked once, on
    two short-lived workers (:func:`~trainperf.loader._iterable.check_sharding`), before
    the first increase; a stream that does not shard, or whose workers failed or were
    too slow to tell, stays at the workers it has, with a ``RuntimeWarning``. A stream
    whose first items are all alike cannot tell, and gets workers (as in the tuner).
    The probe waits (no increase) while its two workers, beside the running ones, would
    not fit the memory rules."""
    if loader._sharded is None:
        loader._sharded = True
        if is_iterable(loader.dataset):
            loader._sharded = _check_sharding(loader)
    return loader._sharded


def _check_sharding(loader: AdaptiveDataLoader) -> bool:
    kwargs = {
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader._worker_context,
    }
    # No deadline of ours: the check's own limit per start method (spawned workers
    # import torch first).
    check = check_sharding(loader.dataset, kwargs, math.inf)
    undecided = check.duplicated is None and check.why != ALIKE
    if not (check.duplicated or undecided):
        return True
    loader._max_workers = min(loader._max_workers, loader.num_workers)
    name = type(loader).__name__
    if check.duplicated:
        text = unsharded_warning(loader.dataset, check, name, loader.num_workers)
    else:
        text = (
            f"{name} keeps num_workers={loader.num_workers}: could not tell whether "
            f"{type(loader.dataset).__name__}, an IterableDataset, shards its stream across "
            f"workers ({check.why}); unless it does, every worker yields every sample. "
            "Give each worker its share in __iter__ with "
            "torch.utils.data.get_worker_info(), then pass max_workers or tune again"
        )
    warnings.warn(text, RuntimeWarning, stacklevel=user_stacklevel())
    return False
