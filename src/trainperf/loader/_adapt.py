"""``autotune_loader(..., adapt=True)``: a DataLoader that keeps itself tuned while it runs.

:class:`AdaptiveDataLoader` times every ``__next__`` (the loop waiting for data) and the
gaps between them (the step), reads its workers' CPU about twice a second, and every
``_CHECK_EVERY_S`` seconds of iteration (and at each ``iter()`` after the first) reads the
usable CPUs and memory again (:func:`trainperf.limits.host_limits`,
:func:`trainperf.limits.usable_cpus`). The rules of :mod:`trainperf.loader._adapt_rules`
then say whether ``num_workers`` / ``prefetch_factor`` change; memory and ``/dev/shm`` bind
through the one-off tuner's own rule (:meth:`trainperf.loader._search.Search.memory_problem`).

A change is made at a batch boundary, mid-epoch, when the sample sequence can be kept
exactly (:func:`trainperf.loader._adapt_plan.resumable`: a map-style dataset and torch's
own samplers): the epoch's indices are drawn once from the sampler, as the plain loader
draws them, and the new worker pool gets the indices the old one had prefetched but not
delivered, then the rest (:class:`~trainperf.loader._adapt_plan.EpochPlan`). Otherwise
changes wait for the next epoch boundary. Either way the samples come in exactly the order
the same loader gives without adapting: the sampler runs in this process whatever the
worker count, and workers return batches in order. A worker pool is shut down before a new
one starts, and the draws from the generator a new pool makes are those the fixed loader
makes, so a ``persistent_workers=True`` loader also keeps its order. An epoch's own pool
(not a persistent one) stops as soon as the caller lets go of its iterator (a ``break``),
as a plain DataLoader's does (:mod:`trainperf.loader._adapt_epoch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import time
import warnings
from collections.abc import Iterator
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader

from trainperf._utils.batches import batch_bytes, samples_in
from trainperf._utils.lifetime import DieWithParent
from trainperf._utils.stack import user_stacklevel
from trainperf._utils.validate import non_negative_int
from trainperf.limits import HostLimits, host_limits, local_world_size, usable_cpus
from trainperf.loader._adapt_change import TuningChange
from trainperf.loader._adapt_epoch import EpochIterator
from trainperf.loader._adapt_measure import Workers, cpu_mark, host_busy
from trainperf.loader._adapt_plan import EpochPlan, resumable
from trainperf.loader._adapt_rules import (
    DEEP_PREFETCH,
    Change,
    EpochFigures,
    Reason,
    decide,
    increase_paid,
    increased,
)
from trainperf.loader._args import checked_context
from trainperf.loader._autotune import _TOO_MANY, TunedDataLoader
from trainperf.loader._faults import (
    WorkerProcesses,
    child_signals_held,
    close_iterator,
    hang_timeout,
    start_method,
)
from trainperf.loader._iterable import (
    ALIKE,
    PROBE_WORKERS,
    check_sharding,
    is_iterable,
    unsharded_warning,
)
from trainperf.loader._report import CandidateResult
from trainperf.loader._search import Search, adaptive_max_workers
from trainperf.loader._tune import rank_share

__all__ = ["AdaptiveDataLoader", "TuningChange", "memory_rules"]

logger = logging.getLogger("trainperf.loader")

_CHECK_EVERY_S = 2.0  # seconds of iteration between mid-epoch checks
_CHECK_BATCHES = 4  # batches a mid-epoch check needs, the first of its window excluded
_SEED_OFFSET = 0x9E3779B97F4A7C15  # sets the private seed stream apart from the real one
_HANG: Reason = "hang"  # a pool it started gave no first batch in time (not a rule's)


@dataclasses.dataclass(frozen=True)
class _Trial:
    """A worker pool the loader started itself, on trial until its first batch arrives:
    ``previous`` is the setting to go back to, ``timeout_s`` the wait it is given."""

    previous: tuple[int, int | None]
    timeout_s: float


class _TimedIter:
    """The DataLoader's iterator, timed: waits in ``__next__``, gaps between calls.

    The figures cover a window: the epoch so far, or the time since the last mid-epoch
    check; the first batch of a window counts as its start-up.
    """

    def __init__(self, it: Any, loader: AdaptiveDataLoader, plan: EpochPlan | None) -> None:
        self.it, self.plan = it, plan
        self._loader: AdaptiveDataLoader | None = loader  # None once the epoch has ended
        self.yielded = 0  # batches of this epoch yielded, whatever pools made them
        self.returned: float | None = None
        self.returned_cpu = 0.0
        self.final: EpochFigures | None = None
        self.cut_by: str | None = None  # what ended it before its epoch did (see cut)
        self.trial: _Trial | None = None  # the pool's first batch is awaited within a bound
        self.new_window()

    def new_window(self) -> None:
        self.batches = self.samples = 0
        self.wait_s = self.step_s = self.startup_s = 0.0
        self.load_cpu_s = self.step_cpu_s = 0.0
        self.started = time.perf_counter()
        self.workers = Workers()
        self.cpu_mark = cpu_mark()

    @property
    def loader(self) -> AdaptiveDataLoader:
        if self._loader is None:
            raise RuntimeError("this epoch of the adaptive loader is over")
        return self._loader

    def __iter__(self) -> _TimedIter:
        return self

    def __len__(self) -> int:
        return len(self.it)

    def __next__(self) -> Any:
        if self._loader is None:  # the epoch is over: its exhausted iterator says so again
            return next(iter(()))
        if self.cut_by is not None:
            raise RuntimeError(_cut_message(self.cut_by))
        t0, c0 = time.perf_counter(), time.process_time()
        if self.returned is not None:
            self.step_s += t0 - self.returned
            self.step_cpu_s += c0 - self.returned_cpu
            due = t0 - self.started >= _CHECK_EVERY_S and self.batches > _CHECK_BATCHES
            if due and self.plan is not None and self.final is None:
                self.loader._check(self)  # a batch boundary: it may replace the pool
                t0, c0 = time.perf_counter(), time.process_time()
        try:
            batch = next(self.it)
        except StopIteration:
            self.loader._epoch_ended(self)
            # Over: no reference back, so a loader let go of after a full epoch is freed at
            # once, its workers with it (a cycle would keep them until the cyclic GC ran).
            self._loader = None
            raise
        except Exception as e:
            if _timed_out(e) and self.trial is not None:  # the bound of a pool on trial
                self.loader._pool_hung(self, self.trial)
                return self.__next__()  # the same batch, from the setting before
            if _timed_out(e):  # the DataLoader waits for the same batch on the next call
                if self.batches:  # the loop waited for data all that time
                    self.wait_s += time.perf_counter() - t0
                self.returned, self.returned_cpu = time.perf_counter(), time.process_time()
                raise
            # A batch that failed to load (a corrupt sample the loop catches and goes on):
            # the DataLoader used it up, so a pool started later must not replay it.
            self._count()
            self.returned, self.returned_cpu = time.perf_counter(), time.process_time()
            raise
        t1 = time.perf_counter()
        if self.trial is not None:  # the pool works: the caller's timeout (none) from now on
            self.trial, self.it._timeout = None, self.loader.timeout
        if self.batches == 0:
            self.startup_s = t1 - self.started
            self.loader._batch_bytes = batch_bytes(batch)
        else:
            self.wait_s += t1 - t0
            self.load_cpu_s += time.process_time() - c0
        self.batches += 1
        self._count()
        self.samples += samples_in(batch, self.loader.batch_size or 1)
        self.workers.read(self.it, t1)
        self.returned, self.returned_cpu = time.perf_counter(), time.process_time()
        return batch

    def abandon(self) -> None:
        """The caller let go of this epoch's iterator (:class:`EpochIterator`): its own pool
        stops now, as a plain DataLoader iterator's does when dropped; a persistent pool is
        the loader's and stays. Its figures are read at the next ``iter()``, as for a
        ``break``."""
        if self._loader is not None:  # else the epoch ended, and its own pool with it
            self._loader._shut_down_own(self)

    def cut(self, by: str) -> None:
        """The epoch's workers or sampler are taken away by ``by`` (a newer ``iter()``,
        ``close()``): an unfinished iterator refuses further batches from then on rather than
        end early or share the next epoch's."""
        if self._loader is not None and self.cut_by is None:
            self.cut_by = by

    def _count(self) -> None:
        """One more batch of this epoch used up (yielded, or failed to load)."""
        self.yielded += 1
        self.loader._yielded += 1
        if self.plan is not None:
            self.plan.received(self.yielded)

    def figures(self, limits: HostLimits) -> EpochFigures:
        return EpochFigures(
            num_workers=self.loader.num_workers,
            prefetch_factor=self.loader.prefetch_factor if self.loader.num_workers else None,
            batches=self.batches,
            samples=self.samples,
            wait_s=self.wait_s,
            step_s=self.step_s,
            startup_s=self.startup_s,
            load_cpu_s=self.load_cpu_s,
            step_cpu_s=self.step_cpu_s,
            worker_cores=self.workers.cores(),
            host_busy=host_busy(self.cpu_mark, cpu_mark()),
            cpus=usable_cpus(local_world_size(), limits=limits),
            memory_available=limits.memory_available,
        )


def _timed_out(e: Exception) -> bool:
    """``e`` is the DataLoader's ``timeout`` expiring: no batch was used up by it.

    Example:
        >>> _timed_out(RuntimeError("DataLoader timed out after 5 seconds"))
        True
    """
    return isinstance(e, RuntimeError) and str(e).startswith("DataLoader timed out after")


def _rank_limits() -> HostLimits:
    """The host's limits now, with the memory and ``/dev/shm`` this rank's loader may use
    (the one-off tuner's share: each local rank starts its own workers)."""
    return rank_share(host_limits(), local_world_size())


def _not_measuring(n: int, pf: int | None, pin: bool) -> CandidateResult:
    raise RuntimeError("the adaptive loader measures while it is iterated, not by a search")


def memory_rules(
    candidates: list[CandidateResult], max_workers: int, main_rss: int, start_method: str
) -> Search:
    """The one-off tuner's memory and ``/dev/shm`` rules (:class:`Search`), fed with what
    it measured (``candidates``: worker memory, batch size); only ``memory_problem`` is used.

    Example:
        >>> rules = memory_rules([], 4, 2**30, "fork")
        >>> rules.memory_problem(2, 2, False) is None  # the limits are set per call
        False
    """
    return Search(
        measure=_not_measuring,
        out_of_time=lambda: True,
        worker_cpus=1,
        max_workers=max_workers,
        memory_available=0,
        shm_free=None,
        start_method=start_method,
        main_rss=main_rss,
        results=list(candidates),
    )


class AdaptiveDataLoader(TunedDataLoader):
    """A :class:`TunedDataLoader` that retunes ``num_workers`` / ``prefetch_factor`` while it
    runs, from what it measures while iterated (see :mod:`trainperf.loader._adapt`).

    Every change is logged at INFO on the ``trainperf.loader`` logger and kept in
    ``tuning_history``. A change is made mid-epoch, at a batch boundary, when the sample
    sequence can be kept exactly (a map-style dataset and torch's own samplers), else at the
    next epoch boundary; either way the samples and their order are those the same loader
    gives without adapting. As with a plain DataLoader, an epoch's workers stop as soon as
    its iterator is let go of (a ``break`` out of the loop), unless they are persistent.

    Args:
        dataset: as for DataLoader.
        max_workers: the most workers it will use (default: eight per usable CPU, 2 to
            64: :func:`~trainperf.loader._search.adaptive_max_workers`).
        tuner: the one-off tuner's memory rules with what it measured
            (:func:`memory_rules`); None: a worker's memory is assumed to be the whole
            main process's, the worst case.
        keep_workers: keep the workers it starts alive between epochs
            (``persistent_workers`` becomes True then); False restarts them each epoch;
            None (the default): False when ``persistent_workers=False`` is passed, else True.
        mid_epoch: allow changes within an epoch (where the order can be kept); False:
            only at epoch boundaries.
        **kwargs: DataLoader arguments; a ``multiprocessing_context`` with
            ``num_workers=0`` (which DataLoader refuses) is kept for the workers it adds.

    Attributes:
        tuning_history: the :class:`TuningChange` records, oldest first.
        epoch_boundaries_only: why changes wait for an epoch boundary (``"an
            IterableDataset"``, ``"a custom sampler (Mine)"``, ``"mid_epoch=False"``, or
            that its index sampler is wrapped: a :class:`trainperf.Checkpointer` tracks
            it), or None when they may happen mid-epoch.

    Raises:
        ValueError: ``max_workers`` is not None or an int >= 0, or a
            ``multiprocessing_context`` kept for later is no start method or context (and
            DataLoader's own).

    Example:
        >>> loader = AdaptiveDataLoader(range(8), batch_size=4, max_workers=2)
        >>> [b.tolist() for b in loader], loader.tuning_history, loader.epoch_boundaries_only
        ([[0, 1, 2, 3], [4, 5, 6, 7]], [], None)
    """

    tuning_history: list[TuningChange]

    def __init__(
        self,
        dataset: Any,
        *args: Any,
        max_workers: int | None = None,
        tuner: Search | None = None,
        keep_workers: bool | None = None,
        mid_epoch: bool = True,
        **kwargs: Any,
    ) -> None:
        non_negative_int("max_workers", max_workers, none_ok=True)
        kept = None
        if kwargs.get("multiprocessing_context") is not None and not _workers_given(args, kwargs):
            # DataLoader refuses a start method without workers: kept for those it adds.
            kept = checked_context(kwargs.pop("multiprocessing_context"))
        super().__init__(dataset, *args, **kwargs)
        self._context_kept = kept
        # Your persistent_workers=False holds for the pools it starts (a dataset changed
        # between epochs, a curriculum, must reach fresh workers).
        self._keep_workers = (
            kwargs.get("persistent_workers") is not False if keep_workers is None else keep_workers
        )
        self._batch_bytes = 0  # of the latest window's first batch
        self._main = psutil.Process()
        limits = host_limits()
        self._cpus = usable_cpus(local_world_size(), limits=limits)
        self._max_workers = adaptive_max_workers(self._cpus) if max_workers is None else max_workers
        self._tuner = tuner or memory_rules(
            [],
            self._max_workers,
            int(self._main.memory_info().rss),
            start_method({"multiprocessing_context": self._worker_context}),
        )
        self._epoch = 0
        self._yielded = 0  # batches yielded over all epochs
        self._current: _TimedIter | None = None
        self._seeds: torch.Generator | None = None  # worker seeds of the pools it starts
        self._before: EpochFigures | None = None  # what led to the last increase
        self._ceiling: int | None = None  # workers beyond which more did not pay
        self._prefetch_ceiling: int | None = None  # the same for prefetch_factor
        self._fastest_step = float("inf")
        self._sharded: bool | None = None  # an IterableDataset's stream, once checked
        self._timeout_kept = 0.0  # the ``timeout`` set aside while no workers run
        # Whether these arguments ask for a persistent pool (see _draws_once).
        self._persistent_asked = bool(self.persistent_workers and self.num_workers > 0)
        self._trial: _Trial | None = None  # for the next pool it starts
        self.tuning_history = []
        self._why_not_mid_epoch = resumable(self) if mid_epoch else "mid_epoch=False"
        self._plan = None if self._why_not_mid_epoch else EpochPlan(self._real_index_sampler)
        self._fit_timeout()  # a timeout given with no workers waits for the ones it adds

    @property
    def _worker_context(self) -> Any:
        """The start method its workers use: the DataLoader's, or the caller's kept while
        no workers ran (None: the default)."""
        return self.multiprocessing_context or self._context_kept

    @property
    def epoch_boundaries_only(self) -> str | None:
        """Why changes wait for an epoch boundary, or None when they may happen mid-epoch."""
        if self._why_not_mid_epoch is None and _wraps_index_sampler(type(self)):
            # Another layer (a Checkpointer tracking this loader) wraps the index sampler
            # and counts each iterator's draws: a pool replaced under it would break that.
            return f"its index sampler is wrapped ({type(self).__name__})"
        return self._why_not_mid_epoch

    def _repr_extra(self) -> dict[str, Any]:
        return {"changes": len(self.tuning_history)}

    @property
    def _draws_once(self) -> bool:
        """Whether the plain DataLoader whose order this one keeps has a persistent pool,
        which draws its workers' base seed from the generator once, not at every epoch: a
        pool rebuilt later must then not draw again, nor one kept draw less.

        That loader is the one the caller's own arguments build: built directly, these
        arguments; built by ``autotune_loader``, whether the caller asked for
        ``persistent_workers`` (``_persistent_asked``, set by it), not the tuner's choice.
        """
        return self._persistent_asked

    @property
    def _real_index_sampler(self) -> Any:
        return DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]

    @property
    def _index_sampler(self) -> Any:
        # What DataLoader's iterators draw indices from: the epoch plan, which replays the
        # indices a replaced pool had not delivered (see _adapt_plan).
        # A subclass that wraps this (a Checkpointer tracking the loader) gets the real
        # sampler: it adapts at epoch boundaries only, and a plan no iterator reports
        # received batches to would keep every item of the epoch.
        plan = self.__dict__.get("_plan")
        if plan is None or _wraps_index_sampler(type(self)):
            return self._real_index_sampler
        return plan

    def __iter__(self) -> Any:
        if self._current is not None:
            self._epoch_ended(self._current)
            self._retune(self._current)
            self._release(self._current)
        reuse = bool(self.persistent_workers and self.num_workers > 0) and (
            self._iterator is not None
        )
        if self._epoch > 0 and reuse and not self._draws_once:
            # The loader as built would start a new iterator, which draws its workers' base
            # seed from the generator: the same draw keeps the sampler's sequence.
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        scratch = self._draws_once and self._epoch > 0 and not reuse
        it = self._start(scratch)
        plan = None if self.epoch_boundaries_only else self._plan
        self._current = _TimedIter(it, self, plan)
        self._current.trial = self._arm(it)
        self._epoch += 1
        # Only the caller holds this: dropping it stops the epoch's own workers at once.
        return EpochIterator(self._current)

    def _start(self, scratch: bool) -> Any:
        """A DataLoader iterator; ``scratch``: its draw from the generator is not the fixed
        loader's (that one would start none here), so it draws from the private one."""
        with self._no_extra_draw() if scratch else _nothing(), warnings.catch_warnings():
            if self.tuning_history:
                # More workers than cores is this loader's measured choice (they wait on
                # I/O), not the mistake DataLoader's check warns about.
                warnings.filterwarnings("ignore", _TOO_MANY, UserWarning)
            # DataLoader's own: every draw from the generator is decided here (__iter__,
            # _draws_once), none by a base class's per-epoch draw for a tuner's pool.
            return DataLoader.__iter__(self)

    def _epoch_ended(self, timed: _TimedIter) -> None:
        """Read the epoch's figures as it ends (or, cut short, as the next one starts)."""
        if timed.final is None:
            timed.final = timed.figures(_rank_limits())

    def fits(self, n: int, pf: int | None, limits: HostLimits | None = None) -> bool:
        """Whether ``n`` workers with ``pf`` batches each in flight fit the memory and
        ``/dev/shm`` of ``limits`` (default: now), by the one-off tuner's rule."""
        limits = limits or _rank_limits()
        results = self._tuner.results
        if self._batch_bytes and not any(c.batch_bytes for c in results):
            # Built without a tuning run: the batches seen here say what one occupies.
            seen = CandidateResult(0, None, False, "ok", batch_bytes=self._batch_bytes)
            results = [*results, seen]
        search = dataclasses.replace(
            self._tuner,
            memory_available=limits.memory_available,
            shm_free=limits.shm_free,
            results=results,
        )
        return search.memory_problem(n, pf, bool(self.pin_memory)) is None

    def _decide(self, f: EpochFigures, limits: HostLimits) -> Change | None:
        self._fastest_step = min(self._fastest_step, f.step_per_batch)
        if f.cpus != self._cpus:
            # What more workers (or prefetch) could not do may have changed.
            self._ceiling = self._prefetch_ceiling = None
        before, self._before = self._before, None
        if before is not None:
            self._judge(before, f)
        ceiling = self._max_workers if self._ceiling is None else self._ceiling
        change = decide(
            f,
            previous_cpus=self._cpus,
            fastest_step_per_batch=self._fastest_step,
            max_workers=min(self._max_workers, ceiling),
            fits=lambda n, pf: self.fits(n, pf, limits),
            before=before,
            max_prefetch=self._prefetch_ceiling or DEEP_PREFETCH,
        )
        self._cpus = f.cpus
        if change is not None and change.num_workers > f.num_workers:
            probing = self._sharded is None and is_iterable(self.dataset)
            if probing and not self.fits(
                f.num_workers + PROBE_WORKERS, change.prefetch_factor, limits
            ):
                return None  # the probe's workers beside the running ones would not fit: later
            if not self._shards():
                return None
        if change is not None and change.reason in ("input-bound", "prefetch"):
            self._before = f
        return change

    def _judge(self, before: EpochFigures, f: EpochFigures) -> None:
        """After an increase (``before`` led to it, ``f`` ran with it) that did not pay, no
        later check goes beyond it: the wait left is not the workers' (the main process's
        own cost, say); the rules hold or go back (no-gain)."""
        if not increased(before, f) or (verdict := increase_paid(before, f)) == "paid":
            return
        kept = f if verdict == "hold" else before
        if f.num_workers > before.num_workers:
            self._ceiling = kept.num_workers
        # No deeper prefetch either: the workers are not what the loop waits for.
        self._prefetch_ceiling = kept.prefetch_factor or 2

    def _shards(self) -> bool:
        """Whether more workers keep the samples: an ``IterableDataset`` whose workers each
        replay the whole stream would yield every sample once per worker. Checked once, on
        two short-lived workers (:func:`~trainperf.loader._iterable.check_sharding`), before
        the first increase; a stream that does not shard, or whose workers failed or were
        too slow to tell, stays at the workers it has, with a ``RuntimeWarning``. A stream
        whose first items are all alike cannot tell, and gets workers (as in the tuner).
        The probe waits (no increase) while its two workers, beside the running ones, would
        not fit the memory rules."""
        if self._sharded is None:
            self._sharded = True
            if is_iterable(self.dataset):
                self._sharded = self._check_sharding()
        return self._sharded

    def _check_sharding(self) -> bool:
        kwargs = {
            "worker_init_fn": self.worker_init_fn,
            "multiprocessing_context": self._worker_context,
        }
        # No deadline of ours: the check's own limit per start method (spawned workers
        # import torch first).
        check = check_sharding(self.dataset, kwargs, math.inf)
        undecided = check.duplicated is None and check.why != ALIKE
        if not (check.duplicated or undecided):
            return True
        self._max_workers = min(self._max_workers, self.num_workers)
        name = type(self).__name__
        if check.duplicated:
            text = unsharded_warning(self.dataset, check, name, self.num_workers)
        else:
            text = (
                f"{name} keeps num_workers={self.num_workers}: could not tell whether "
                f"{type(self.dataset).__name__}, an IterableDataset, shards its stream across "
                f"workers ({check.why}); unless it does, every worker yields every sample. "
                "Give each worker its share in __iter__ with "
                "torch.utils.data.get_worker_info(), then pass max_workers or tune again"
            )
        warnings.warn(text, RuntimeWarning, stacklevel=user_stacklevel())
        return False

    def _retune(self, timed: _TimedIter) -> None:
        limits = _rank_limits()  # memory and /dev/shm as this epoch starts
        f = timed.final or timed.figures(limits)
        if f.batches < 2:
            return
        change = self._decide(f, limits)
        if change is not None:
            self._apply(change, f, epoch=self._epoch, epoch_batch=0)

    def _check(self, timed: _TimedIter) -> None:
        """Mid-epoch, at a batch boundary: apply the rules to the window that ends here and,
        on a change, hand the rest of the epoch to a new pool."""
        limits = _rank_limits()
        f = timed.figures(limits)
        change = self._decide(f, limits)
        plan = timed.plan
        if change is not None and plan is not None:
            self._shut_down_own(timed)
            self._apply(change, f, epoch=self._epoch - 1, epoch_batch=timed.yielded)
            timed.it = self._resume(timed)
            timed.trial = self._arm(timed.it)
        timed.new_window()

    def _resume(self, timed: _TimedIter) -> Any:
        """A new iterator that goes on with ``timed``'s epoch after the batches it yielded;
        without a plan (``epoch_boundaries_only``: pools start only as an epoch does), one
        that starts the epoch again from the sampler."""
        plan = timed.plan
        if plan is not None:
            plan.resume_at(timed.yielded)
        try:
            # The fixed loader starts no second iterator in an epoch: no draw from the
            # generator.
            return self._start(scratch=True)
        finally:
            if plan is not None:
                plan.resumed()

    def _arm(self, it: Any) -> _Trial | None:
        """Give the pool just started (``it``) the bound of its trial, if it is on one: the
        DataLoader's own wait for a batch (the iterator's copy of ``timeout``), until the
        first batch arrives (``_TimedIter.__next__``)."""
        trial, self._trial = self._trial, None
        if trial is not None:
            it._timeout = trial.timeout_s
        return trial

    def _pool_hung(self, timed: _TimedIter, trial: _Trial) -> None:
        """The pool it started gave no batch within its trial's bound (workers blocked on
        something inherited across fork, say): stop it, go back to the setting before it,
        resumed where the epoch was, and try no more workers than that from now on (every
        new worker would start as those did; fewer than a count that hung, after a
        decrease)."""
        hung = self.num_workers
        timed.trial = None
        self._stop_hung(timed.it)
        back, _ = trial.previous
        self._max_workers = min(self._max_workers, back if back < hung else hung - 1)
        self._before = None  # no increase ran to be judged
        why = f"no batch from the {hung} workers it started within {trial.timeout_s:.1f} s"
        change = Change(back, trial.previous[1], _HANG, why)
        f = timed.figures(_rank_limits())
        self._apply(change, f, epoch=self._epoch - 1, epoch_batch=timed.yielded)
        if self._trial is not None:  # back to workers, on trial too: then the main process
            self._trial = dataclasses.replace(self._trial, previous=(0, None))
        timed.it = self._resume(timed)
        timed.trial = self._arm(timed.it)
        timed.new_window()
        timed.returned = None  # the wait was the hang's, not a step
        text = _hang_warning(type(self).__name__, self.dataset, hung, trial, self._max_workers)
        warnings.warn(text, RuntimeWarning, stacklevel=user_stacklevel())

    def _stop_hung(self, it: Any) -> None:
        """Stop a blocked pool's workers: killed first, so that no join waits on them."""
        if self._iterator is it:
            self._iterator = None
        with child_signals_held():  # torch's handler would raise for the killed workers
            close_iterator(it, WorkerProcesses(), kill_first=True)

    def _apply(self, change: Change, f: EpochFigures, *, epoch: int, epoch_batch: int) -> None:
        old = (self.num_workers, self.prefetch_factor if self.num_workers else None)
        self._shut_down_pool()
        self.num_workers = change.num_workers
        self._fit_timeout()
        # A pool it starts, unless a timeout of the caller's bounds the wait (and raises,
        # as it means), gets a bound for its first batch: the tuner's for a hang.
        self._trial = None
        if change.num_workers > 0 and not self.timeout:
            self._trial = _Trial(old, self._hang_bound(change.num_workers, f))
        if change.num_workers > 0:
            self.prefetch_factor = change.prefetch_factor or 2
            if self._keep_workers and not self.persistent_workers:
                # DataLoader refuses this once built, to protect the pool it caches; this
                # loader shuts that pool down itself before any change.
                object.__setattr__(self, "persistent_workers", True)
            if self.multiprocessing_context is None and self._context_kept is not None:
                self.multiprocessing_context = self._context_kept
            if not isinstance(self.worker_init_fn, DieWithParent):
                self.worker_init_fn = DieWithParent(self.worker_init_fn)
        record = TuningChange(
            epoch=epoch,
            time=time.time(),
            old=old,
            new=(change.num_workers, change.prefetch_factor if change.num_workers else None),
            reason=change.reason,
            why=change.why,
            figures=f,
            batch=self._yielded,
            epoch_batch=epoch_batch,
        )
        self.tuning_history.append(record)
        logger.info("loader retuned: %s", record)

    def _hang_bound(self, n: int, f: EpochFigures) -> float:
        """Seconds without a first batch from ``n`` new workers that count as a hang: the
        one-off tuner's rule (:func:`~trainperf.loader._faults.hang_timeout`), from one
        batch's cost in a single process (the loop's time per batch in ``f`` times the
        workers that shared it), and at least three times the start-up ``f`` saw."""
        per_batch = (f.wait_s + f.step_s) / f.timed if f.timed else 1.0
        bound = hang_timeout(
            n,
            user_timeout=0.0,
            start_method=start_method({"multiprocessing_context": self._worker_context}),
            batch_s=per_batch * max(1, f.num_workers),
            worker_cpus=max(1, f.cpus),
        )
        return max(bound, 3.0 * f.startup_s)

    def _fit_timeout(self) -> None:
        """A ``timeout`` waits for workers: set aside while none run (DataLoader refuses one
        without workers), back when they do."""
        if self.num_workers == 0 and self.timeout:
            self._timeout_kept, self.timeout = self.timeout, 0
        elif self.num_workers > 0 and self._timeout_kept:
            self.timeout, self._timeout_kept = self._timeout_kept, 0.0

    def _release(self, timed: _TimedIter) -> None:
        """Stop a finished or abandoned (``break``) epoch's own workers before a new pool
        starts; a persistent pool is the loader's and stays."""
        self._current = None
        timed.cut(_BY_ITER)
        self._shut_down_own(timed)

    def _shut_down_own(self, timed: _TimedIter) -> None:
        """Stop the workers of an epoch's own pool (not the loader's persistent one)."""
        if timed.it is not self._iterator:
            _shut_down(timed.it)

    def close(self) -> None:
        """Stop the workers now (a persistent pool's otherwise live until the loader is
        garbage-collected, as with any DataLoader); the next ``iter()`` starts anew."""
        if self._current is not None:
            self._current.cut(_BY_CLOSE)
            self._shut_down_own(self._current)
        self._shut_down_pool()

    def _shut_down_pool(self) -> None:
        """Stop a persistent pool's workers now, so a new one never runs beside them."""
        it = self._iterator
        if it is None:
            return
        self._iterator = None
        _shut_down(it)

    @contextlib.contextmanager
    def _no_extra_draw(self) -> Iterator[None]:
        """A new iterator draws its workers' base seed from ``generator`` (or torch's
        global generator) as it starts; the sampler holds its own reference, so the draw is
        made from this loader's private generator instead and the sampler's sequence is
        untouched. Each pool draws anew: no two replay the same worker random streams."""
        real = self.generator
        if self._seeds is None:
            # Seeded once, from the real generator's seed or torch's (which follows
            # torch.manual_seed, per rank where each rank seeds its own), offset so that
            # its first draw is not the plain loader's first pool's.
            seed = torch.initial_seed() if real is None else real.initial_seed()
            self._seeds = torch.Generator().manual_seed((seed + _SEED_OFFSET) % 2**64)
        self.generator = self._seeds
        try:
            yield
        finally:
            self.generator = real


def _workers_given(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ``num_workers`` of DataLoader arguments (after ``dataset``), by name or position."""
    bound = inspect.signature(DataLoader).bind_partial(None, *args, **kwargs).arguments
    return int(bound.get("num_workers") or 0)


def _wraps_index_sampler(cls: type) -> bool:
    """Whether a subclass of :class:`AdaptiveDataLoader` redefines ``_index_sampler``."""
    own = AdaptiveDataLoader.__dict__["_index_sampler"]
    return inspect.getattr_static(cls, "_index_sampler") is not own


_BY_ITER, _BY_CLOSE = "a newer iter() of the same loader", "close()"
_CUT_FIX = {
    _BY_CLOSE: "call close() once the loop is done; a new iter(loader) starts a new epoch",
    _BY_ITER: (
        "take one iterator per epoch (not zip(loader, loader) or a loop over the loader "
        "inside a loop over it); where two streams are needed, build two loaders"
    ),
}


def _cut_message(by: str) -> str:
    """Why an adaptive loader's iterator gives no more batches before its epoch ended.

    Example:
        >>> _cut_message("close()").split(":")[0]
        'this AdaptiveDataLoader iterator was stopped before its epoch ended, by close()'
    """
    return (
        f"this AdaptiveDataLoader iterator was stopped before its epoch ended, by {by}: an "
        "adaptive loader runs one epoch at a time (its workers and its sampler's order are "
        "shared), so the rest of this epoch is not given out rather than lost or split "
        f"between two iterators. Fix: {_CUT_FIX[by]}"
    )


def _hang_warning(name: str, dataset: Any, hung: int, trial: _Trial, most: int) -> str:
    """What a loader whose new pool of ``hung`` workers gave no batch says, and the fix.

    Example:
        >>> print(_hang_warning("AdaptiveDataLoader", range(4), 8, _Trial((0, None), 10.0), 0))
        ... # doctest: +ELLIPSIS
        AdaptiveDataLoader started 8 workers and got no batch from them within 10.0 s: ...
    """
    back = trial.previous[0]
    return (
        f"{name} started {hung} workers and got no batch from them within "
        f"{trial.timeout_s:.1f} s: {type(dataset).__name__} blocks in worker processes (a "
        "lock, thread pool or open handle inherited across fork, say). It stopped them, went "
        f"back to num_workers={back} where the epoch was (no sample lost or repeated), and "
        f"uses at most {most} workers from now on. Fix: make the dataset safe in worker "
        "processes (open files and connections lazily, in __getitem__ or worker_init_fn), or "
        "load in the main process (num_workers=0 with adapt=False, or max_workers=0); if its "
        "workers only start slowly, a timeout= of yours longer than that replaces this bound"
    )


def _shut_down(it: Any) -> None:
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield
