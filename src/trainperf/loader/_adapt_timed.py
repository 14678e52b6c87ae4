"""The timing state of one epoch of an :class:`~trainperf.loader.AdaptiveDataLoader`.

:class:`_TimedIter` wraps the epoch's DataLoader iterator: it times every ``__next__`` (the
loop waiting for data) and the gaps between them (the step), reads the workers' CPU, and
every ``_CHECK_EVERY_S`` seconds of iteration (after the window's first batch, so not
within a new pool's start-up) hands the window that ends at that batch
boundary to the loader's mid-epoch check (:func:`trainperf.loader._adapt_retune.check`). A
pool on trial (until each of its workers' first batch, where the epoch can be resumed) that
gives no batch in time goes to :func:`trainperf.loader._adapt_pool.pool_hung`, one that
breaks first (it could not start, a worker died) to
:func:`~trainperf.loader._adapt_pool.pool_failed`. What the caller holds is the
:class:`~trainperf.loader._adapt_epoch.EpochIterator` around it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from trainperf._utils.batches import batch_bytes, samples_in
from trainperf.limits import HostLimits, local_world_size, usable_cpus
from trainperf.loader._adapt_init import init_failure
from trainperf.loader._adapt_measure import Workers, cpu_mark, host_busy
from trainperf.loader._adapt_pool import pool_broke, pool_failed, pool_hung, shut_down_own
from trainperf.loader._adapt_retune import check
from trainperf.loader._adapt_rules import EpochFigures
from trainperf.loader._workers import pool_start_held, worker_failures

if TYPE_CHECKING:
    from trainperf.loader._adapt import AdaptiveDataLoader
    from trainperf.loader._adapt_plan import EpochPlan
    from trainperf.loader._adapt_pool import _Trial

_CHECK_EVERY_S = 2.0  # seconds of iteration between mid-epoch checks
_CHECK_BATCHES = 4  # batches a mid-epoch check needs, the first of its window excluded


class _TimedIter:
    """The DataLoader's iterator, timed: waits in ``__next__``, gaps between calls.

    The figures cover a window: the epoch so far, or the time since the last mid-epoch
    check; the first batch of a window counts as its start-up.
    """

    def __init__(
        self,
        it: Any,
        loader: AdaptiveDataLoader,
        plan: EpochPlan | None,
        started: float | None = None,
    ) -> None:
        """``started``: when ``iter()`` began starting ``it`` (its workers' start-up counts
        in the first window's ``startup_s``); None: now."""
        self.it, self.plan = it, plan
        self._loader: AdaptiveDataLoader | None = loader  # None once the epoch has ended
        self.yielded = 0  # batches of this epoch yielded, whatever pools made them
        self.returned: float | None = None
        self.returned_cpu = 0.0
        self.final: EpochFigures | None = None
        self.cut_by: str | None = None  # what ended it before its epoch did (see cut)
        self.trial = None  # each worker's first batch is awaited within a bound
        self.new_window(started)

    @property
    def trial(self) -> _Trial | None:
        """The pool on trial, until each of its workers has delivered its first batch."""
        return self._trial

    @trial.setter
    def trial(self, trial: _Trial | None) -> None:
        self._trial, self._trial_batches = trial, 0

    def _trial_passed(self) -> bool:
        """Whether the pool on trial has now delivered one batch per worker: torch hands
        batch ``k`` of a map-style pool to worker ``k mod n``, so until then a worker may
        still die on its first sample. Without a plan the trial ends at the first batch:
        a pool given up later would start the epoch again
        (:func:`~trainperf.loader._adapt_pool.resume`), repeating
        what was yielded."""
        self._trial_batches += 1
        return self.plan is None or self._trial_batches >= self.loader.num_workers

    @property
    def delivered(self) -> int:
        """Workers of the pool on trial that have delivered their first batch (batch ``k``
        is worker ``k mod n``'s)."""
        return self._trial_batches

    def _end_trial(self) -> None:
        """The pool works, or is left: the caller's timeout (none) bounds its waits from now
        on, the next epoch's included where the pool is kept."""
        if self.trial is not None:
            self.trial, self.it._timeout = None, self.loader.timeout

    def new_window(self, started: float | None = None) -> None:
        """Start the figures of a new window, whose start-up is counted from ``started``
        (None: now)."""
        self.batches = self.samples = 0
        self.wait_s = self.step_s = self.startup_s = 0.0
        self.load_cpu_s = self.step_cpu_s = 0.0
        self.started = time.perf_counter() if started is None else started
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
            # Seconds after the window's first batch: a new pool's start-up (13 s for 16
            # spawn workers on 2 cores) is no time a rule can judge the running pool by.
            running = t0 - self.started - self.startup_s
            due = running >= _CHECK_EVERY_S and self.batches > _CHECK_BATCHES
            if due and self.plan is not None and self.final is None:
                with pool_start_held():  # a pool it starts is judged in the try below
                    check(self.loader, self)  # a batch boundary: it may replace the pool
                    t0, c0 = time.perf_counter(), time.process_time()
        try:
            if self.trial is not None:
                # A worker of the pool on trial that died while torch's SIGCHLD handler
                # was held (as the pool started) is reported here, where it is judged.
                worker_failures()
            batch = next(self.it)
        except StopIteration:
            if self.batches:  # an epoch's own pool stops in this call: the loop waits for it
                self.wait_s += time.perf_counter() - t0
            self._over()
            raise
        except Exception as e:
            trial = self.trial
            if _timed_out(e) and trial is not None and trial.timeout_s is not None:
                with pool_start_held():  # the pool it goes back to is on trial too
                    pool_hung(self.loader, self, trial)  # the bound of a pool on trial
                return self.__next__()  # the same batch, from the setting before
            if trial is not None and (why := pool_broke(self.loader, self.it, e)) is not None:
                with pool_start_held():
                    pool_failed(self.loader, self, trial, why)  # it could not start, or died
                return self.__next__()
            if _timed_out(e):  # the DataLoader waits for the same batch on the next call
                if self.batches:  # the loop waited for data all that time
                    self.wait_s += time.perf_counter() - t0
                self.returned, self.returned_cpu = time.perf_counter(), time.process_time()
                raise
            # A batch that failed to load (a corrupt sample the loop catches and goes on):
            # the DataLoader used it up, so a pool started later must not replay it, and
            # the worker that raised it is alive: its first batch, as far as the trial goes.
            self._count()
            if self.trial is not None and self._trial_passed():
                self._end_trial()
            self.returned, self.returned_cpu = time.perf_counter(), time.process_time()
            if (failed := init_failure(self.loader, e)) is not None:
                raise failed from e
            raise
        t1 = time.perf_counter()
        if self.trial is not None and self._trial_passed():
            self._end_trial()
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
        the loader's and stays. Its figures are read now, as at the epoch's end, for the
        next ``iter()`` to retune by, and a trial left unfinished ends (see :meth:`cut`)."""
        if self._loader is not None:  # else the epoch ended, and its own pool with it
            shut_down_own(self._loader, self)
            self._over()

    def _over(self) -> None:
        """The epoch ended, or its iterator was let go of (a ``break``): a trial left
        unfinished ends (a pool kept for the next epoch waits as the caller's ``timeout``
        says), the figures are read for the next ``iter()`` to retune by, and no reference
        back is kept, so a loader let go of is freed at once, its persistent pool with it
        (a cycle kept the workers alive until the cyclic GC ran, where a plain
        DataLoader's stop at once)."""
        self._end_trial()
        self.loader._epoch_ended(self)
        self._loader = None

    def cut(self, by: str) -> None:
        """The epoch's workers or sampler are taken away by ``by`` (a newer ``iter()``,
        ``close()``): an unfinished iterator refuses further batches from then on rather than
        end early or share the next epoch's. A trial left unfinished (a ``break`` before
        each worker delivered) ends: a persistent pool kept for the next epoch waits as
        the caller's ``timeout`` says, not within the trial's bound."""
        if self._loader is not None:
            self._end_trial()
            if self.cut_by is None:
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
