"""What the search of ``tune_loader`` starts from: ``num_workers=0`` and ``step_fn``
measured (:func:`_prepare`), and the :class:`~trainperf.loader._search.Search` set up from
them, whose ``measure`` times one candidate on the caller's dataset within the call's
deadline (:class:`_Measurer`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from trainperf._utils.stack import user_stacklevel
from trainperf.loader import _iterable, _user
from trainperf.loader._faults import hang_timeout
from trainperf.loader._measure import measure
from trainperf.loader._picklable import FirstBatch, pickle_refusal
from trainperf.loader._progress import ProgressBar
from trainperf.loader._report import CandidateResult
from trainperf.loader._search import Search
from trainperf.loader._step import Shares, main_process_cores, split_cores
from trainperf.loader._tune_setup import _Setup
from trainperf.loader._user import user_config

__all__ = ["main_rss"]


@dataclass(frozen=True)
class _Measurer:
    """The search's ``measure``: one candidate timed on the caller's dataset and arguments,
    within the call's deadline, and shown on the progress bar."""

    dataset: Any
    batch_size: int
    loader_kwargs: dict[str, Any]  # without pin_memory and persistent_workers: tuned here
    setup: _Setup
    deadline: float
    bar: ProgressBar
    user_timeout: float
    main_cores: float  # cores the main process keeps: the workers' hang bound counts the rest
    batch_s: float = 1.0  # seconds per batch in the main process, known after the baseline
    on_first_batch: Callable[[Any], None] | None = None  # the baseline's: a batch to check

    def __call__(self, n: int, pf: int | None, pin: bool) -> CandidateResult:
        setup = self.setup
        self.bar.update(f"measuring workers={n} prefetch={pf or '-'}", force=True)
        r = measure(
            self.dataset,
            self.batch_size,
            self.loader_kwargs,
            num_workers=n,
            prefetch_factor=pf,
            pin_memory=pin,
            deadline=self.deadline,
            hang_timeout_s=hang_timeout(
                n,
                user_timeout=self.user_timeout,
                start_method=setup.start_method,
                batch_s=self.batch_s,
                cpus=setup.cpus,
                main_cores=self.main_cores,
            ),
            device=setup.device if setup.device.type == "cuda" else None,
            shm_free=setup.share.shm_free,
            memory_available=setup.share.memory_available,
            on_tick=self.bar.update,
            on_first_batch=self.on_first_batch,
        )
        done = "-" if r.samples_per_s is None else f"{r.samples_per_s:,.0f}/s"
        self.bar.update(f"workers={n} prefetch={pf or '-'}: {done}", force=True)
        return r


@dataclass(frozen=True)
class _Prepared:
    """What the search starts from."""

    baseline: CandidateResult
    shares: Shares
    search: Search


def _measure_baseline(measurer: _Measurer) -> CandidateResult:
    try:
        return measurer(0, None, measurer.setup.pin_options[0])
    except ValueError as e:
        if not _raised_loading(e):  # an argument DataLoader refuses, or no batch at all
            raise
        raise RuntimeError(_main_failure(measurer.dataset, e)) from e
    except Exception as e:
        raise RuntimeError(_main_failure(measurer.dataset, e)) from e


def _main_failure(dataset: Any, error: BaseException) -> str:
    """Why tuning cannot start, naming the index whose ``dataset[index]`` raised where the
    traceback shows it, and a ``__len__`` that counts past the samples served."""
    index = _failed_index(error)
    where = "" if index is _UNKNOWN else f" at dataset[{index!r}]"
    message = (
        f"the dataset fails in the main process (num_workers=0){where}, so there is nothing "
        f"to tune: {error!r}"
    )
    if isinstance(error, IndexError) and isinstance(index, int):
        try:
            length = len(dataset)
        except Exception:  # no length to blame
            return message
        message += (
            f"; len(dataset) is {length}: if dataset[{index}] should exist, the dataset is "
            "broken there; if not, __len__ counts more samples than __getitem__ serves"
        )
    return message


_UNKNOWN = object()


def _failed_index(error: BaseException) -> Any:
    """The index DataLoader's fetcher passed to the ``__getitem__`` that raised ``error``
    (the first argument of the first frame past the fetcher), or ``_UNKNOWN``: the error
    came from ``collate_fn`` or a batched ``__getitems__``."""
    tb = error.__traceback__
    past_fetcher = False
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__") == "torch.utils.data._utils.fetch":
            past_fetcher = True
        elif past_fetcher:
            code = frame.f_code
            if code.co_name != "__getitem__" or code.co_argcount < 2:
                return _UNKNOWN
            return frame.f_locals.get(code.co_varnames[1], _UNKNOWN)
        tb = tb.tb_next
    return _UNKNOWN


def _raised_loading(error: BaseException) -> bool:
    """Whether ``error`` came from loading a batch (the dataset or ``collate_fn``, called
    by DataLoader's fetcher), not from DataLoader's checks of its arguments.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> def fail(batch): raise ValueError("a corrupt sample")
        >>> try:
        ...     next(iter(DataLoader(range(4), collate_fn=fail)))
        ... except ValueError as e:
        ...     _raised_loading(e)
        True
        >>> try:
        ...     DataLoader(range(4), sampler=[0, 1], shuffle=True)
        ... except ValueError as e:
        ...     _raised_loading(e)
        False
    """
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "torch.utils.data._utils.fetch":
            return True
        tb = tb.tb_next
    return False


def _prepare(
    dataset: Any,
    loader_kwargs: Mapping[str, Any],
    step_fn: Callable[[Any], Any] | None,
    setup: _Setup,
    deadline: float,
    bar: ProgressBar,
) -> _Prepared:
    """Measure ``num_workers=0`` and ``step_fn``, and set up the search from them."""
    first = FirstBatch()
    measurer = _Measurer(
        dataset,
        setup.batch_size,
        # The four settings a candidate sets itself; the caller's are one candidate.
        {k: v for k, v in loader_kwargs.items() if k not in _user.GIVEN},
        setup,
        deadline,
        bar,
        user_timeout=float(loader_kwargs.get("timeout") or 0.0),
        # Until step_fn has been measured: one core kept for the main process.
        main_cores=main_process_cores(setup.cpus),
        on_first_batch=first if setup.max_workers > 0 else None,
    )
    baseline = _measure_baseline(measurer)
    measurer = dataclasses.replace(
        measurer, batch_s=_main_batch_s(baseline, setup.batch_size), on_first_batch=None
    )
    notes = _first_notes(dataset, loader_kwargs, setup)
    shares = split_cores(
        dataset,
        setup.batch_size,
        loader_kwargs,
        step_fn,
        device=setup.device,
        cpus=setup.cpus,
        baseline=baseline,
        batch_s=measurer.batch_s,
        deadline=deadline,
        notes=notes,
    )
    refused = _refused(dataset, loader_kwargs, setup, first, deadline, notes)
    search = Search(
        measure=dataclasses.replace(measurer, main_cores=shares.main_cores),
        out_of_time=lambda: time.perf_counter() >= deadline - 0.05,
        worker_cpus=shares.worker_cpus,
        main_cores=shares.main_cores,
        cpus=setup.cpus,
        max_workers=setup.max_workers,
        memory_available=setup.share.memory_available,
        shm_free=setup.share.shm_free,
        start_method=setup.start_method,
        pin_options=setup.pin_options,
        step_samples_per_s=shares.step_samples_per_s,
        main_rss=main_rss(),
        user=user_config(loader_kwargs),
        # One worker's memory is measured before a pool of several is started.
        probe_first=True,
        refused=refused,
        notes=notes,
    )
    return _Prepared(baseline, shares, search)


def _refused(
    dataset: Any,
    loader_kwargs: Mapping[str, Any],
    setup: _Setup,
    first: FirstBatch,
    deadline: float,
    notes: list[str],
) -> CandidateResult | None:
    """The failed configuration that rules out every worker count, with its warning: a first
    batch that workers could not send back (:mod:`trainperf.loader._picklable`), or an
    ``IterableDataset`` that does not shard (:func:`~trainperf.loader._iterable.sharding_refusal`);
    else None."""
    pin = setup.pin_options[0]
    refused = pickle_refusal(first.found, max_workers=setup.max_workers, pin=pin)
    if refused is None:
        return _iterable.sharding_refusal(
            dataset,
            loader_kwargs,
            max_workers=setup.max_workers,
            pin=pin,
            deadline=deadline,
            notes=notes,
        )
    # Checked before the sharding, whose two workers would wait for batches in vain.
    warnings.warn(
        f"tune_loader keeps num_workers=0: {refused.reason}",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
    return refused


def _first_notes(dataset: Any, loader_kwargs: Mapping[str, Any], setup: _Setup) -> list[str]:
    """The report's notes known before the search: a stream's tail batches, a rank's share."""
    notes: list[str] = []
    cap, tail = _iterable.tail_batches(dataset, loader_kwargs)
    if tail is not None and (cap is not None or setup.max_workers > 0):
        notes.append(tail)
    if setup.local_ranks > 1:
        notes.append(
            f"memory and /dev/shm: this rank's share, 1/{setup.local_ranks} of what the host "
            f"has free ({setup.local_ranks} training processes on this host each start "
            f"their own workers)"
        )
    return notes


def main_rss() -> int:
    """This process's resident memory: what a forked worker is assumed to copy at worst,
    until one worker has been measured."""
    return int(psutil.Process().memory_info().rss)


def _main_batch_s(baseline: CandidateResult, batch_size: int) -> float:
    """Seconds one batch takes in the main process: the steady rate's, or the first batch's
    when that is all there is (1 s when nothing is known)."""
    rate = baseline.samples_per_s
    if rate:
        return batch_size / rate
    return baseline.startup_s or 1.0


def _for_measuring(dataset: Any, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The caller's arguments with a copy of their ``sampler``, which the measurements
    iterate again and again: one that keeps state across ``iter()`` calls (an epoch counter
    that reshuffles, its own generator) starts the first real epoch where the plain
    DataLoader would. The copy shares the dataset (not copied)."""
    sampler = loader_kwargs.get("sampler")
    if sampler is None or isinstance(sampler, (range, list, tuple)):
        return loader_kwargs
    try:
        copied = copy.deepcopy(sampler, memo={id(dataset): dataset})
    except Exception:  # a sampler that cannot be copied is measured as it is
        return loader_kwargs
    return {**loader_kwargs, "sampler": copied}
