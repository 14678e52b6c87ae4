"""The batches of one measurement: its DataLoader, every wait cut to the deadline.

:class:`Spec` is what one measurement (:func:`trainperf.loader.measure`) was asked to do;
:func:`loader_kwargs_for` turns it and the caller's arguments into the DataLoader's (workers
that die with this process, collect their garbage once, then run the caller's
``worker_init_fn``); :class:`Batches` fetches from it. With workers no wait outlasts the
deadline; a batch loaded in this process (``num_workers=0``) cannot be interrupted, so one
is not started when the last one says it would end after the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainperf._utils.batches import samples_in
from trainperf.loader._adapt_init import PoolInit
from trainperf.loader._memory import CollectFirst
from trainperf.loader._picklable import WorkerInit
from trainperf.loader._windows import DeadlineReached

__all__ = ["Batches", "Spec", "loader_kwargs_for"]


@dataclass(frozen=True)
class Spec:
    """What one measurement was asked to do."""

    dataset: Any
    batch_size: int
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    deadline: float
    hang_timeout_s: float
    cuda_device: torch.device | None  # where each batch is copied, as training would
    shm_free: int | None = None  # quoted when /dev/shm runs out
    memory_available: int | None = None  # quoted when a worker is SIGKILLed

    def config(self) -> dict[str, Any]:
        """The :class:`CandidateResult` fields that name the configuration."""
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "pin_memory": self.pin_memory,
        }


def loader_kwargs_for(
    loader_kwargs: Mapping[str, Any], spec: Spec, remaining: float
) -> tuple[dict[str, Any], float]:
    """The DataLoader arguments for this measurement, and the timeout it starts with."""
    kwargs = dict(loader_kwargs)
    kwargs.pop("timeout", None)
    kwargs.pop("persistent_workers", None)
    if spec.num_workers == 0:
        kwargs.pop("multiprocessing_context", None)
        return kwargs, 0.0
    # DataLoader needs a timeout to start with; each wait for a batch then sets its own.
    timeout_s = min(spec.hang_timeout_s, remaining)
    kwargs.update(prefetch_factor=spec.prefetch_factor, persistent_workers=True, timeout=timeout_s)
    # The workers die with this process (a SIGKILLed tuner leaves none behind), then
    # collect their garbage once, then run the caller's own worker_init_fn, whose failure
    # is then told from the dataset's (InitFailed).
    user_init = kwargs.get("worker_init_fn")
    init = None if user_init is None else PoolInit(user_init)
    kwargs["worker_init_fn"] = WorkerInit(CollectFirst(init))
    return kwargs, timeout_s


class Batches:
    """The batches of one DataLoader, every wait cut to the deadline. An epoch that ends
    starts the next one (persistent workers: the same processes)."""

    def __init__(self, spec: Spec, kwargs: dict[str, Any], timeout_s: float) -> None:
        self.spec = spec
        self.kwargs = kwargs
        self.timeout_s = timeout_s
        self.loader: Any = None
        self.it: Any = None
        self.samples = 0  # received so far, the first batch included
        self.main_batch_s: float | None = None  # the last batch loaded in this process

    def start(self) -> None:
        """Build the DataLoader and its iterator (which starts the workers)."""
        spec = self.spec
        self.loader = DataLoader(
            spec.dataset,
            batch_size=spec.batch_size,
            num_workers=spec.num_workers,
            pin_memory=spec.pin_memory,
            **self.kwargs,
        )
        self.it = iter(self.loader)

    def _in_this_process(self) -> Any:
        """A batch loaded here, which nothing can interrupt: one that the last one says
        would end after the deadline is not started."""
        start = time.perf_counter()
        last = self.main_batch_s
        if last is not None and start + last > self.spec.deadline:
            raise DeadlineReached
        batch = next(self.it)
        self.main_batch_s = time.perf_counter() - start
        return batch

    def _next_in_time(self) -> Any:
        spec = self.spec
        if spec.num_workers == 0:
            return self._in_this_process()
        wait = min(spec.hang_timeout_s, spec.deadline - time.perf_counter())
        if wait <= 0.001:
            raise DeadlineReached
        # With workers the budget is a hard limit, so no wait may outlast it: the iterator
        # reads its timeout before each wait (a private attribute; without it the wait is
        # the one DataLoader started with).
        settable = hasattr(self.it, "_timeout")
        if settable:
            self.it._timeout = wait
        try:
            return next(self.it)
        except RuntimeError as e:
            cut = (wait if settable else self.timeout_s) < spec.hang_timeout_s
            # DataLoader's own timeout; not a dataset's error that says "timed out after".
            if cut and str(e).startswith("DataLoader timed out after"):
                raise DeadlineReached from e
            raise

    def fetch(self) -> Any:
        """The next batch, from the next epoch when this one is done.

        Raises:
            ValueError: the loader yields no batch at all.
            DeadlineReached: the deadline passed while waiting.
        """
        try:
            return self._next_in_time()
        except StopIteration:
            self.it = iter(self.loader)
            try:
                return self._next_in_time()
            except StopIteration:
                raise ValueError(self._no_batch()) from None

    def _no_batch(self) -> str:
        return no_batch_message(
            self.spec.dataset,
            self.spec.batch_size,
            bool(self.kwargs.get("drop_last", False)),
            self.kwargs.get("sampler"),
        )

    def next_batch(self) -> int:
        """Fetch a batch, copy it to the CUDA device if any, and count its samples."""
        batch = self.fetch()
        device = self.spec.cuda_device
        if device is not None:
            from trainperf.device import to_device

            to_device(batch, device, non_blocking=self.spec.pin_memory)
        n = samples_in(batch, self.spec.batch_size)
        self.samples += n
        return n

    def sync(self) -> None:
        """Wait for the copies queued on the CUDA device."""
        torch.cuda.synchronize(self.spec.cuda_device)

    def release(self) -> None:
        """Drop the iterator and the loader (after :func:`close_iterator` stopped them)."""
        self.it = self.loader = None


def no_batch_message(
    dataset: Any, batch_size: int | None, drop_last: bool, sampler: Any = None
) -> str:
    """Why a DataLoader yields no batch, with only the fixes that apply; ``sampler`` (if
    given) says how many samples an epoch has.

    Example:
        >>> text = no_batch_message(range(3), 8, True)
        >>> "or drop_last=False" in text, text.endswith("or a batch_size of at most 3")
        (True, True)
        >>> "drop_last=False (" in no_batch_message(range(0), 8, False)
        False
        >>> no_batch_message(range(100), 8, True, sampler=[0, 1, 2]).endswith("at most 3")
        True
    """
    counted = dataset if sampler is None else sampler
    try:
        n: int | None = len(counted)
    except Exception:  # an IterableDataset, a sampler without a length, a __len__ that raises
        n = None
    where = "dataset" if sampler is None else "sampler"
    fixes = [f"give a {where} with at least one batch of samples"]
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if drop_last and batch_size is not None:
        short = n is not None and 0 < n < batch_size
        # Each worker batches its own shard of an IterableDataset, and a shard can be
        # shorter than batch_size however long the whole stream is.
        if n is None or short or iterable:
            fixes.append("drop_last=False (it keeps the last, smaller batch)")
        if short:
            fixes.append(f"a batch_size of at most {n}")
    if iterable:
        fixes.append(
            "an IterableDataset that yields its samples again on each iter() (one whose "
            "__iter__ returns itself is used up by the measurements)"
        )
    return (
        f"the DataLoader yields no batch (batch_size={batch_size}, drop_last={drop_last!r}, "
        f"{where} of {'?' if n is None else n} samples): " + ", or ".join(fixes)
    )
