"""``autotune_loader``: :func:`~trainperf.loader.tune_loader`, then the DataLoader it chose.

The loader is a :class:`TunedDataLoader`: a plain DataLoader that carries the report and
whose workers die with the process that iterates it (:class:`trainperf.DieWithParent`
around the caller's ``worker_init_fn``), so a training process killed with SIGKILL (the
out-of-memory killer, ``kill -9``, a scheduler's hard stop) leaves no worker behind.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _torch_loader

from trainperf.loader._args import (
    CheckedArgs,
    check_args,
    check_flags,
    check_sizes,
    loader_args,
)
from trainperf.loader._choice import has_set_epoch
from trainperf.loader._faults import budget_cut
from trainperf.loader._iterable import tail_batches
from trainperf.loader._picklable import WorkerInit
from trainperf.loader._report import TuningReport
from trainperf.loader._tune import tune_loader

__all__ = ["TunedDataLoader", "autotune_loader"]

_TOO_MANY = "This DataLoader will create"  # torch's "more workers than CPUs" warning


def _references(value: object) -> int:
    return sys.getrefcount(value)


# What _references(obj.attr) counts for an object that only that attribute holds (the
# call's own references among them, however this interpreter passes arguments).
_holder = types.SimpleNamespace(value=object())
_ONE_HOLDER = _references(_holder.value)
del _holder


class _EndMarking(_torch_loader._MultiProcessingDataLoaderIter):
    """torch's worker-pool iterator, marking its epoch's end: ``trainperf_ended`` is set once
    it has raised ``StopIteration`` (the loop over it has ended), and cleared when the pool
    is reset for another epoch. Until then a loop may still be reading it, even with its
    last batch handed out (torch's counters say nothing more is coming by then)."""

    trainperf_ended = False

    def _next_data(self) -> Any:
        try:
            return super()._next_data()  # type: ignore[no-untyped-call]
        except StopIteration:
            self.trainperf_ended = True
            raise

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        self.trainperf_ended = False
        super()._reset(loader, first_iter)


def _handed_out(iterator: Any) -> bool:
    """Whether ``iterator`` has yielded as many batches as its pass holds (torch's count
    against its sampler's length; False where either is unknown)."""
    try:
        return bool(iterator._num_yielded >= len(iterator))
    except (AttributeError, TypeError):
        return False


def _epoch_done(iterator: object) -> bool:
    """Whether a worker pool's iterator has ended its epoch (:class:`_EndMarking`); one of
    another class (made elsewhere) counts as running."""
    return getattr(iterator, "trainperf_ended", False) is True


class TunedDataLoader(DataLoader):  # type: ignore[type-arg]
    """A plain :class:`torch.utils.data.DataLoader` that also carries the tuning report.

    Its workers die with the process that iterates it: with ``num_workers > 0`` its
    ``worker_init_fn`` is :class:`trainperf.DieWithParent` around yours (``.user_fn``), and
    each ``iter()`` ties the new workers to the process that starts them (a loader built in
    one process and iterated in another still works). A batch a worker cannot pickle (a
    lock or lambda in one sample) raises ``pickle.PicklingError`` naming it in the loop, at
    once, where torch's workers drop it and the loop waits for ever
    (:mod:`trainperf.loader._picklable`). ``copy.deepcopy`` and ``pickle``
    work at any time: the copy leaves a live persistent pool behind and starts its own.

    ``batch_size``, ``num_workers``, ``prefetch_factor`` and ``timeout`` may be NumPy
    integers or floats: they are kept as the Python numbers they equal.

    Attributes:
        tuning_report: the :class:`TuningReport` its settings came from.

    Raises:
        ValueError: ``batch_size`` is not None or an int >= 1, or ``num_workers``,
            ``prefetch_factor`` or ``timeout`` is one ``tune_loader`` refuses
            (:func:`~trainperf.loader._args.check_sizes`), and DataLoader's own.

    Example:
        >>> from trainperf import DieWithParent
        >>> loader = TunedDataLoader(range(8), batch_size=4, num_workers=2, worker_init_fn=print)
        >>> isinstance(loader.worker_init_fn, DieWithParent), loader.worker_init_fn.user_fn
        (True, <built-in function print>)
    """

    tuning_report: TuningReport
    # Set by autotune_loader: the worker count was measured here (torch's "more workers
    # than cores" warning is its generic advice, not about this choice), and the caller's
    # own persistent_workers (None: built directly, its own settings are the caller's), on
    # which the draws from the generator at each epoch's start depend (see __iter__).
    _measured = False
    _persistent_asked: bool | None = None
    _iterated = False

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        # Before DataLoader's own checks, which raise a bare TypeError for num_workers="2"
        # and take num_workers=2.0 or prefetch_factor=0 only to fail in the training loop.
        # By name, with NumPy numbers converted: DataLoader refuses a NumPy batch_size.
        super().__init__(dataset, **check_sizes(loader_args(args, kwargs)))
        if self.num_workers > 0:
            self.worker_init_fn = WorkerInit(self.worker_init_fn)

    @property
    def _draws_once(self) -> bool:
        """Whether the plain DataLoader of the caller's own arguments keeps a persistent
        pool, which draws its workers' base seed from the generator at the first epoch only
        (a new iterator draws at every epoch)."""
        if self._persistent_asked is None:
            return bool(self.persistent_workers and self.num_workers > 0)
        return self._persistent_asked

    def __iter__(self) -> Any:
        """A new epoch's iterator, with the draws from the generator of the plain
        DataLoader with the caller's arguments, so the sampler shuffles every epoch as that
        one does. Where the tuner chose ``persistent_workers=True`` (the caller did not),
        the reused pool skips the draw a new pool makes: the same draw is made here. Where
        the caller asked for a persistent pool and the tuner chose no workers, the caller's
        loader reuses its pool and draws nothing: the new iterator's draw is made from a
        throwaway generator (the sampler holds its own reference to the real one)."""
        reused = bool(self.persistent_workers and self.num_workers > 0) and (
            self._iterator is not None
        )
        if (
            reused
            and self._persistent_asked is False
            and _references(self._iterator) > _ONE_HOLDER  # and a loop, or a variable
            and not _epoch_done(self._iterator)
        ):
            # The tuner made the pool persistent (the caller did not), and its epoch is still
            # held and not over: a peek (next(iter(loader))) inside a loop over the loader,
            # zip(loader, loader). Resetting the pool would restart that epoch under the loop
            # (samples repeated, silently); the plain DataLoader of the caller's arguments
            # starts a new pool, with its draws, and so does this one. A pass that ended (at
            # its StopIteration) is reset as usual, held or not (`it = iter(loader)` after
            # StopIteration). A peek's pool ends with the peek; but where the held pass has
            # handed out all its batches (a loop that reads by count, never reaching
            # StopIteration), the new pool is the one kept: the old one ends when its loop
            # lets go of it, and the pools do not alternate.
            self._iterated = True
            fresh = self._get_iterator()
            if _handed_out(self._iterator):
                self._iterator = fresh
            return fresh
        plain_reuses = self._draws_once and self._iterated
        self._iterated = True
        if reused and not plain_reuses:
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        if plain_reuses and not reused:
            real = self.generator
            # No workers here (the tuner keeps the caller's persistent pool otherwise):
            # the seed this generator gives is not used.
            self.generator = torch.Generator()
            try:
                return super().__iter__()
            finally:
                self.generator = real
        return super().__iter__()

    def _get_iterator(self) -> Any:
        """torch's iterator; a worker pool's marks its epoch's end (:class:`_EndMarking`), by
        which :meth:`__iter__` tells a finished epoch still referenced from one in progress."""
        iterator = super()._get_iterator()
        if type(iterator) is _torch_loader._MultiProcessingDataLoaderIter:
            iterator.__class__ = _EndMarking
        return iterator

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` take: everything but a live persistent
        worker pool (which a plain DataLoader refuses to copy): the copy starts its own
        workers at its first ``iter()``, and this loader keeps its pool.

        Example:
            >>> import copy
            >>> loader = TunedDataLoader(range(4), batch_size=2)
            >>> [b.tolist() for b in copy.deepcopy(loader)]
            [[0, 1], [2, 3]]
        """
        state = self.__dict__.copy()
        state["_iterator"] = None
        return state

    def check_worker_number_rationality(self) -> None:
        """torch's warning about more workers than CPUs, unless the count was measured."""
        if not self._measured:
            super().check_worker_number_rationality()

    def __repr__(self) -> str:
        """The settings it runs with now (an adaptive loader's change them).

        Example:
            >>> TunedDataLoader(range(8), batch_size=4, pin_memory=True)
            TunedDataLoader(batch_size=4, num_workers=0, pin_memory=True)
        """
        settings = {"batch_size": self.batch_size, "num_workers": self.num_workers}
        if self.num_workers:
            settings["prefetch_factor"] = self.prefetch_factor
        settings["pin_memory"] = self.pin_memory
        if self.num_workers:
            settings["persistent_workers"] = self.persistent_workers
        settings.update(self._repr_extra())
        text = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        return f"{type(self).__name__}({text})"

    def _repr_extra(self) -> dict[str, Any]:
        return {}


def autotune_loader(
    dataset: Any,
    batch_size: int,
    *,
    device: str | torch.device | None = None,
    max_workers: int | None = None,
    budget_s: float = 30.0,
    epochs_hint: int | None = None,
    step_fn: Callable[[Any], Any] | None = None,
    cache: bool = True,
    progress: bool = True,
    adapt: bool = False,
    **loader_kwargs: Any,
) -> TunedDataLoader:
    """:func:`tune_loader`, then the DataLoader built from ``report.best_kwargs``.

    The result is an ordinary ``DataLoader`` (a subclass that adds one attribute): the
    report is ``loader.tuning_report``. Its workers die with the process that iterates it
    (see :class:`TunedDataLoader`). Arguments, errors and warnings are those of
    :func:`tune_loader`; as there, ``step_fn``'s calls (up to six, only when measuring, not
    on a cache hit) are real steps that train the model unless you snapshot and restore
    its and the optimizer's ``state_dict()`` around this call.

    With ``adapt=True`` the loader is an :class:`~trainperf.loader.AdaptiveDataLoader`: it
    keeps measuring while iterated and changes ``num_workers`` / ``prefetch_factor`` at a
    batch boundary, mid-epoch where the sample sequence can be kept exactly (else at the
    next epoch boundary), when the loop waits for data, when its workers take
    CPUs the step needs, or when the usable CPUs or memory change; each change is logged
    and kept in ``loader.tuning_history``. The sample order stays the fixed loader's.

    Returns:
        The tuned DataLoader.

    Raises:
        TypeError: ``adapt`` (or ``cache``, ``progress``) is not True or False; and those
            of :func:`tune_loader`.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> loader = autotune_loader(TensorDataset(torch.randn(128, 4)), 16, device="cpu",
        ...                          max_workers=0, budget_s=5, cache=False, progress=False)
        >>> loader.num_workers, loader.tuning_report.num_workers, len(loader)
        (0, 0, 8)
    """
    # Checked here too: the loader is built from these numbers, as Python's (a NumPy
    # scalar passed in is converted); tune_loader's own check then finds nothing to change.
    args = check_args(batch_size, max_workers, budget_s, epochs_hint, step_fn, loader_kwargs)
    check_flags(cache=cache, progress=progress, adapt=adapt)
    report = tune_loader(
        dataset,
        args.batch_size,
        device=device,
        max_workers=args.max_workers,
        budget_s=args.budget_s,
        epochs_hint=args.epochs_hint,
        step_fn=step_fn,
        cache=cache,
        progress=progress,
        **args.loader_kwargs,
    )
    if adapt:
        loader = _adaptive(dataset, report, args)
    else:
        loader = _tuned(dataset, report, asked=args.loader_kwargs.get("persistent_workers"))
    loader.tuning_report = report
    return loader


def _tuned(dataset: Any, report: TuningReport, *, asked: object) -> TunedDataLoader:
    """The fixed loader from the tuner's settings; ``asked``: the caller's own
    ``persistent_workers`` (None when not given)."""
    kwargs = report.best_kwargs
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TOO_MANY, UserWarning)
        loader = TunedDataLoader(dataset, **kwargs)
    loader._measured = True
    loader._persistent_asked = bool(asked)
    return loader


_BROKEN = ("crash", "hang", "pickle", "error")  # faults of the dataset's, not the host's


def _below_failures(report: TuningReport) -> int:
    """The most workers below every count the tuner saw fail for a reason of the dataset's
    (a worker that crashed, hung, could not be pickled, raised), 0 for a stream that does
    not shard across workers; the host's reasons (memory, ``/dev/shm``, CPUs) are the
    adaptive loader's own rules to judge, and so is a pool the budget cut short before its
    first batch (too short a budget for ``spawn`` workers to start is not a hang of the
    dataset's; the adaptive loader's own hang rule steps back from a real one)."""
    if any(c.fault == "unsharded" for c in report.candidates):
        return 0
    failed = [
        c.num_workers
        for c in report.candidates
        if c.fault in _BROKEN and not budget_cut(c.fault, c.reason)
    ]
    return max(0, min(failed) - 1) if failed else 1 << 30


def _bounds(dataset: Any, args: CheckedArgs) -> tuple[bool, int | None]:
    """Whether the adaptive loader keeps the workers it starts between epochs, and the most
    it may start (None: its own default), for the caller's ``args``."""
    # Kept unless the caller said otherwise; not for a dataset with set_epoch() unless
    # asked: kept workers never see its calls.
    asked = args.loader_kwargs.get("persistent_workers")
    keep = asked is not False and args.epochs_hint != 1 and (asked or not has_set_epoch(dataset))
    cap, _ = tail_batches(dataset, args.loader_kwargs)  # an IterableDataset with drop_last
    bound = args.max_workers
    if cap is not None and (bound is None or cap < bound):
        bound = cap
    return bool(keep), bound


def _adaptive(dataset: Any, report: TuningReport, args: CheckedArgs) -> TunedDataLoader:
    """The adaptive loader from the tuner's settings: within the caller's ``max_workers``
    (see :func:`_bounds`), else the adaptive loader's own default bound, not the tuner's;
    the caller's ``multiprocessing_context`` and ``timeout`` (among ``args.loader_kwargs``,
    the caller's DataLoader arguments), which the settings drop with ``num_workers=0``, are
    kept for the workers it adds."""
    # Imported here: the adaptive loader is a TunedDataLoader, defined above.
    from trainperf.loader._adapt import AdaptiveDataLoader, memory_rules
    from trainperf.loader._faults import start_method
    from trainperf.loader._search import adaptive_max_workers
    from trainperf.loader._tune import main_rss

    keep_workers, bound = _bounds(dataset, args)
    given = args.loader_kwargs
    most = adaptive_max_workers(report.cpus) if bound is None else bound
    kwargs = dict(report.best_kwargs)
    for kept in ("multiprocessing_context", "timeout"):  # dropped with num_workers=0
        if given.get(kept) and not kwargs.get(kept):
            kwargs[kept] = given[kept]
    rules = memory_rules(list(report.candidates), most, main_rss(), start_method(kwargs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TOO_MANY, UserWarning)
        loader = AdaptiveDataLoader(
            dataset,
            # The caller's bound holds while adapting too, and below any worker count the
            # tuner saw fail: adding it mid-epoch would raise in the training loop.
            max_workers=min(most, _below_failures(report)),
            tuner=rules,
            keep_workers=keep_workers,
            **kwargs,
        )
    loader._measured = True  # as _tuned's: each pool it starts has a measured size too
    # The order kept is the plain DataLoader's with the caller's arguments: its pool is
    # persistent only where the caller asked (the tuner's choice draws as a new pool would).
    loader._persistent_asked = bool(given.get("persistent_workers"))
    return loader
