"""The worker pools of an :class:`~trainperf.loader.AdaptiveDataLoader`: a change applied
(:func:`apply_change`: the old pool shut down, the new setting recorded), the epoch
resumed on the new pool where the old one left it (:func:`resume`), the bound a pool it
started gets for each worker's first batch (:func:`arm`, :func:`hang_bound`) and what
happens when one does not come (:func:`pool_hung`) or the pool breaks first (:func:`pool_broke`,
:func:`pool_failed`: it cannot start, a worker dies), and the draw of a new pool's worker
seeds from a private generator, so that the sampler's sequence is the fixed loader's
(:func:`no_extra_draw`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from trainperf._utils.seed_draw import sampler_generator, seed_drawn_from
from trainperf._utils.stack import user_stacklevel
from trainperf.limits import HostLimits, host_limits, local_world_size
from trainperf.loader._adapt_change import TuningChange
from trainperf.loader._adapt_init import InitFailed
from trainperf.loader._adapt_rules import Change, EpochFigures, Reason
from trainperf.loader._faults import classify_fault, hang_timeout, start_method
from trainperf.loader._picklable import WorkerInit
from trainperf.loader._tune_setup import rank_share
from trainperf.loader._workers import WorkerProcesses, child_signals_held, close_iterator

if TYPE_CHECKING:
    from trainperf.loader._adapt import AdaptiveDataLoader
    from trainperf.loader._adapt_timed import _TimedIter

__all__ = [
    "FailedStart",
    "apply_change",
    "arm",
    "fit_timeout",
    "hang_bound",
    "no_extra_draw",
    "pool_broke",
    "pool_failed",
    "pool_hung",
    "resume",
    "shut_down_own",
    "shut_down_pool",
    "start_failure",
]

logger = logging.getLogger("trainperf.loader")

_SEED_OFFSET = 0x9E3779B97F4A7C15  # sets the private seed stream apart from the real one
_HANG: Reason = "hang"  # a worker it started gave no first batch in time (not a rule's)
_FAILED: Reason = "failed"  # a pool it started broke before each worker's first batch
# Faults of the pool's own, not the dataset's: a dataset that raises in a worker ("error")
# raises in the main process too, and is the caller's to see, as with any DataLoader.
_POOL_FAULTS = ("crash", "pickle", "memory", "shm")


@dataclasses.dataclass(frozen=True)
class _Trial:
    """A worker pool the loader started itself, on trial until each worker's first batch
    arrives (its first batch only where the epoch cannot be resumed: ``_TimedIter``):
    ``previous`` is the setting to go back to, ``timeout_s`` the wait it is given (None:
    the caller's ``timeout`` bounds it, and a hang raises, as it means)."""

    previous: tuple[int, int | None]
    timeout_s: float | None


def _rank_limits() -> HostLimits:
    """The host's limits now, with the memory and ``/dev/shm`` this rank's loader may use
    (the one-off tuner's share: each local rank starts its own workers)."""
    return rank_share(host_limits(), local_world_size())


def resume(loader: AdaptiveDataLoader, timed: _TimedIter) -> Any:
    """A new iterator that goes on with ``timed``'s epoch after the batches it yielded;
    without a plan (``epoch_boundaries_only``: pools start only as an epoch does), one
    that starts the epoch again from the sampler."""
    plan = timed.plan
    if plan is not None:
        plan.resume_at(timed.yielded)
    try:
        # The fixed loader starts no second iterator in an epoch: no draw from the
        # generator.
        return loader._start(scratch=True)
    finally:
        if plan is not None:
            plan.resumed()


def arm(loader: AdaptiveDataLoader, it: Any) -> _Trial | None:
    """Give the pool just started (``it``) the bound of its trial, if it is on one: the
    DataLoader's own wait for a batch (the iterator's copy of ``timeout``), until the
    trial ends (``_TimedIter.__next__``)."""
    trial, loader._trial = loader._trial, None
    if trial is not None and trial.timeout_s is not None:
        it._timeout = trial.timeout_s
    return trial


def apply_change(
    loader: AdaptiveDataLoader, change: Change, f: EpochFigures, *, epoch: int, epoch_batch: int
) -> None:
    old = (loader.num_workers, loader.prefetch_factor if loader.num_workers else None)
    shut_down_pool(loader)
    loader.num_workers = change.num_workers
    fit_timeout(loader)
    # A pool it starts is on trial until each worker's first batch: given up if it breaks,
    # and, unless a timeout of the caller's bounds the wait (and raises, as it means), if
    # no batch comes within the tuner's bound for a hang.
    loader._trial = None
    if change.num_workers > 0:
        bound = None if loader.timeout else hang_bound(loader, change.num_workers, f)
        loader._trial = _Trial(old, bound)
    if change.num_workers > 0:
        loader.prefetch_factor = change.prefetch_factor or 2
        if loader._keep_workers and not loader.persistent_workers:
            # DataLoader refuses this once built, to protect the pool it caches; this
            # loader shuts that pool down itself before any change.
            object.__setattr__(loader, "persistent_workers", True)
        if loader.multiprocessing_context is None and loader._context_kept is not None:
            loader.multiprocessing_context = loader._context_kept
        if not isinstance(loader.worker_init_fn, WorkerInit):
            loader.worker_init_fn = WorkerInit(loader.worker_init_fn)
    record = TuningChange(
        epoch=epoch,
        time=time.time(),
        old=old,
        new=(change.num_workers, change.prefetch_factor if change.num_workers else None),
        reason=change.reason,
        why=change.why,
        figures=f,
        batch=loader._yielded,
        epoch_batch=epoch_batch,
    )
    loader.tuning_history.append(record)
    logger.info("loader retuned: %s", record)


def hang_bound(loader: AdaptiveDataLoader, n: int, f: EpochFigures) -> float:
    """Seconds without a first batch from ``n`` new workers that count as a hang: the
    one-off tuner's rule (:func:`~trainperf.loader._faults.hang_timeout`), from one
    batch's cost in a single process (the loop's time per batch in ``f`` times the
    workers that shared it) and the cores the step keeps (``f.step_cores``, as the tuner
    keeps its ``step_fn``'s), and at least three times the start-up ``f`` saw."""
    per_batch = (f.wait_s + f.step_s) / f.timed if f.timed else 1.0
    bound = hang_timeout(
        n,
        user_timeout=0.0,
        start_method=start_method({"multiprocessing_context": loader._worker_context}),
        batch_s=per_batch * max(1, f.num_workers),
        cpus=f.cpus,
        main_cores=f.step_cores,
    )
    return max(bound, 3.0 * f.startup_s)


def fit_timeout(loader: AdaptiveDataLoader) -> None:
    """A ``timeout`` waits for workers: set aside while none run (DataLoader refuses one
    without workers), back when they do."""
    if loader.num_workers == 0 and loader.timeout:
        loader._timeout_kept, loader.timeout = loader.timeout, 0
    elif loader.num_workers > 0 and loader._timeout_kept:
        loader.timeout, loader._timeout_kept = loader._timeout_kept, 0.0


def pool_hung(loader: AdaptiveDataLoader, timed: _TimedIter, trial: _Trial) -> None:
    """The pool it started gave no batch within its trial's bound (workers blocked on
    something inherited across fork, say): stop it, go back to the setting before it,
    resumed where the epoch was, and try no more workers than that from now on (every
    new worker would start as those did; fewer than a count that hung, after a
    decrease)."""
    hung, delivered = loader.num_workers, timed.delivered
    why = f"no batch from {_awaited(delivered, hung)} within {trial.timeout_s or 0:.1f} s"
    _step_back(loader, timed, trial, _HANG, why)
    name, most = type(loader).__name__, loader._max_workers
    text = _hang_warning(name, loader.dataset, hung, trial, most, delivered)
    warnings.warn(text, RuntimeWarning, stacklevel=user_stacklevel())


def pool_broke(loader: AdaptiveDataLoader, it: Any, error: BaseException) -> str | None:
    """Why ``error``, raised by the pool ``it`` on trial (before each of its workers'
    first batch), is the pool's own failure (it could not start: its arguments cannot be pickled for
    ``spawn``, no process could be started; or a worker died), or None when it is not
    (the dataset raised in a worker: the caller's error, as with any DataLoader)."""
    if isinstance(it, FailedStart):
        return it.why
    if isinstance(error, InitFailed):
        return None  # the caller's worker_init_fn raised: its error (_adapt_init)
    method = start_method({"multiprocessing_context": loader._worker_context})
    fault, why = classify_fault(error, start_method=method, timeout_s=0.0)
    return why if fault in _POOL_FAULTS else None


def pool_failed(loader: AdaptiveDataLoader, timed: _TimedIter, trial: _Trial, why: str) -> None:
    """The pool it started broke before each of its workers' first batch (``why``,
    :func:`pool_broke`): stop what is left of it, go back to the setting before it, resumed
    where the epoch was, and try no more workers than that from now on, as for a hang
    (:func:`pool_hung`)."""
    failed, delivered = loader.num_workers, timed.delivered
    what = f"{_awaited(delivered, failed)} failed before its first batch: {why}"
    _step_back(loader, timed, trial, _FAILED, what)
    name, most = type(loader).__name__, loader._max_workers
    text = _failed_warning(name, failed, why, trial, most, delivered)
    warnings.warn(text, RuntimeWarning, stacklevel=user_stacklevel())


def _step_back(
    loader: AdaptiveDataLoader, timed: _TimedIter, trial: _Trial, reason: Reason, why: str
) -> None:
    """Stop the pool on trial, go back to ``trial.previous`` where the epoch was, and cap
    the workers below the count given up (at the previous count after an increase)."""
    given_up = loader.num_workers
    timed.trial = None
    _stop_hung(loader, timed.it)
    back, _ = trial.previous
    loader._max_workers = min(loader._max_workers, back if back < given_up else given_up - 1)
    loader._before = None  # no increase ran to be judged
    change = Change(back, trial.previous[1], reason, why)
    f = timed.figures(_rank_limits())
    apply_change(loader, change, f, epoch=loader._epoch - 1, epoch_batch=timed.yielded)
    if loader._trial is not None:  # back to workers, on trial too: then the main process
        loader._trial = dataclasses.replace(loader._trial, previous=(0, None))
    timed.it = resume(loader, timed)
    timed.trial = arm(loader, timed.it)
    timed.new_window()
    timed.returned = None  # the wait was the failed pool's, not a step


class FailedStart:
    """A pool on trial that could not start (``error`` raised as DataLoader started its
    workers), in place of its iterator: its first ``next()`` raises ``error``, where the
    epoch's timing state gives the pool up (:func:`pool_failed`) as for a worker that died.

    Example:
        >>> it = FailedStart(OSError("[Errno 11] Resource temporarily unavailable"), "no fork")
        >>> next(it)
        Traceback (most recent call last):
        ...
        OSError: [Errno 11] Resource temporarily unavailable
    """

    def __init__(self, error: Exception, why: str, length: int = 0) -> None:
        self.error, self.why, self.length = error, why, length
        self._timeout = 0.0  # set by arm, as on a DataLoader iterator

    def __iter__(self) -> FailedStart:
        return self

    def __len__(self) -> int:
        return self.length

    def __next__(self) -> Any:
        raise self.error


def start_failure(loader: AdaptiveDataLoader, error: Exception) -> str | None:
    """Why ``error``, raised while DataLoader started a pool on trial, is the pool's own
    failure (:func:`pool_broke`; an ``OSError`` such as a refused fork too), or None."""
    if isinstance(error, OSError):
        return f"its workers could not be started ({type(error).__name__}: {error})"
    return pool_broke(loader, None, error)


def _stop_hung(loader: AdaptiveDataLoader, it: Any) -> None:
    """Stop a blocked pool's workers: killed first, so that no join waits on them."""
    if isinstance(it, FailedStart):
        return  # none started
    if loader._iterator is it:
        loader._iterator = None
    with child_signals_held():  # torch's handler would raise for the killed workers
        close_iterator(it, WorkerProcesses(), kill_first=True)


def shut_down_own(loader: AdaptiveDataLoader, timed: _TimedIter) -> None:
    """Stop the workers of an epoch's own pool (not the loader's persistent one)."""
    if timed.it is not loader._iterator:
        _shut_down(timed.it)


def shut_down_pool(loader: AdaptiveDataLoader) -> None:
    """Stop a persistent pool's workers now, so a new one never runs beside them."""
    it = loader._iterator
    if it is None:
        return
    loader._iterator = None
    _shut_down(it)


@contextlib.contextmanager
def no_extra_draw(loader: AdaptiveDataLoader) -> Iterator[None]:
    """A new iterator draws its workers' base seed from ``generator`` (or torch's
    global generator) as it starts; the sampler holds its own reference, so the draw is
    made from this loader's private generator instead and the sampler's sequence is
    untouched. Each pool draws anew: no two replay the same worker random streams.

    A worker pool's iterator pulls its first indices from the sampler before it returns:
    what records the sampler's states then (a :class:`trainperf.Checkpointer`, to replay
    the epoch's order on resume) reads the caller's generator
    (:func:`~trainperf._utils.seed_draw.sampler_generator`)."""
    if loader._seeds is None:
        # Seeded once, from the real generator's seed or torch's (which follows
        # torch.manual_seed, per rank where each rank seeds its own), offset so that
        # its first draw is not the plain loader's first pool's.
        real = sampler_generator(loader)  # the caller's, also inside a resume's own swap
        seed = torch.initial_seed() if real is None else real.initial_seed()
        loader._seeds = torch.Generator().manual_seed((seed + _SEED_OFFSET) % 2**64)
    with seed_drawn_from(loader, loader._seeds):
        yield


def _awaited(delivered: int, n: int) -> str:
    """The worker of a new pool of ``n`` whose first batch its trial waited for when the pool
    hung or broke, ``delivered`` of them having given theirs: batch ``k`` is worker ``k mod
    n``'s and the trial takes them in order, so it is worker ``delivered`` (a later one may
    have delivered too, its batch held by torch until its turn).

    Example:
        >>> _awaited(0, 8), _awaited(5, 8)
        ('worker 0 of the 8 it started', 'worker 5 of the 8 it started')
    """
    return f"worker {delivered} of the {n} it started"


def _hang_warning(
    name: str, dataset: Any, hung: int, trial: _Trial, most: int, delivered: int
) -> str:
    """What a loader whose new pool of ``hung`` workers, ``delivered`` of which gave their
    first batch, gave no further batch says, and the fix.

    Example:
        >>> trial = _Trial((0, None), 10.0)
        >>> print(_hang_warning("AdaptiveDataLoader", range(4), 8, trial, 0, 0))
        ... # doctest: +ELLIPSIS
        AdaptiveDataLoader got no batch from worker 0 of the 8 it started within 10.0 s: ...
        >>> print(_hang_warning("AdaptiveDataLoader", range(4), 8, trial, 0, 5))
        ... # doctest: +ELLIPSIS
        AdaptiveDataLoader got no batch from worker 5 of the 8 it started within 10.0 s: ...
    """
    back = trial.previous[0]
    return (
        f"{name} got no batch from {_awaited(delivered, hung)} within "
        f"{trial.timeout_s:.1f} s: {type(dataset).__name__} blocks in worker processes (a "
        "lock, thread pool or open handle inherited across fork, say). It stopped the pool, went "
        f"back to num_workers={back} where the epoch was (no sample lost or repeated), and "
        f"uses at most {most} workers from now on. Fix: make the dataset safe in worker "
        "processes (open files and connections lazily, in __getitem__ or worker_init_fn), or "
        "load in the main process (num_workers=0 with adapt=False, or max_workers=0); if its "
        "workers only start slowly, a timeout= of yours longer than that replaces this bound"
    )


def _failed_warning(
    name: str, failed: int, why: str, trial: _Trial, most: int, delivered: int
) -> str:
    """What a loader whose new pool of ``failed`` workers broke before each worker's first
    batch (``delivered`` of them had given theirs) says.

    Example:
        >>> trial = _Trial((0, None), 9.0)
        >>> print(_failed_warning("AdaptiveDataLoader", 2, "a worker died", trial, 0, 0))
        ... # doctest: +ELLIPSIS
        AdaptiveDataLoader gave up its new pool, as worker 0 of the 2 it started failed before ...
        >>> print(_failed_warning("AdaptiveDataLoader", 2, "a worker died", trial, 0, 1))
        ... # doctest: +ELLIPSIS
        AdaptiveDataLoader gave up its new pool, as worker 1 of the 2 it started failed before ...
    """
    return (
        f"{name} gave up its new pool, as {_awaited(delivered, failed)} failed before its first "
        f"batch: {why}. "
        f"It went back to num_workers={trial.previous[0]} where the epoch was (no sample lost "
        f"or repeated) and uses at most {most} workers from now on; to keep it loading in the "
        "main process from the start, pass max_workers=0 (or adapt=False with num_workers=0)"
    )


def _shut_down(it: Any) -> None:
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
