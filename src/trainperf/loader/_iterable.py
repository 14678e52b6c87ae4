"""An ``IterableDataset`` that does not shard its stream across workers: found, and refused.

A map-style dataset is split across workers by the sampler. An ``IterableDataset`` is not:
each worker runs its own copy of ``__iter__``, and unless that reads
``torch.utils.data.get_worker_info()`` and yields only its share, every worker replays the
whole stream, so one epoch with ``N`` workers yields every sample ``N`` times (and the
tuner, counting samples, would call that speed). :func:`check_sharding` finds this on a
short, bounded probe before any worker configuration is measured:

- a DataLoader with 2 workers and ``batch_size=None`` fingerprints each item in the worker
  (its ``collate_fn``), so only hashes travel; the caller's ``worker_init_fn`` and
  ``multiprocessing_context`` are kept;
- both workers' random generators (``random``, numpy's, torch's) are seeded alike before
  the caller's ``worker_init_fn`` runs, so a stream that augments at random still yields
  the same items in both workers when it does not shard;
- the workers run on copies of the dataset (forked, or unpickled under ``spawn``), so the
  caller's dataset object and its own generators are not touched; the main process's
  generators are restored by :func:`trainperf._utils.rng.preserved_rng` as for any
  measurement;
- it stops at the first item on which the workers differ (the stream is sharded), or
  after :data:`ITEMS` items each, and at the deadline.

:func:`duplicated` is the decision: the same first :data:`ITEMS` items in both workers, not
all alike, means the stream is not sharded; a stream whose first items are all the same
(a constant synthetic sample) cannot be told apart and is measured as before, with a note.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainperf._utils.lifetime import DieWithParent
from trainperf._utils.stack import user_stacklevel
from trainperf.loader._faults import start_method
from trainperf.loader._report import CandidateResult
from trainperf.loader._workers import WorkerProcesses, close_iterator

__all__ = [
    "PROBE_WORKERS",
    "ALIKE",
    "ITEMS",
    "SHARDING_EXAMPLE",
    "ShardCheck",
    "check_sharding",
    "duplicated",
    "fingerprint",
    "is_iterable",
    "sharding_refusal",
    "tail_batches",
    "unsharded_result",
    "unsharded_warning",
]

ITEMS = 4
"""Items compared per worker before a stream counts as not sharded."""
ALIKE = "its first items are all alike"
"""Why a check could not tell: a constant stream looks the same sharded or not."""
PROBE_WORKERS = 2
"""Workers :func:`check_sharding` starts (beside any the caller's loader has running)."""
_LIMIT_S = {"fork": 10.0, "spawn": 40.0, "forkserver": 40.0}
"""Seconds the check may take at most (spawned workers import torch again first)."""
_SEED = 0x5EED

SHARDING_EXAMPLE = """\
    info = torch.utils.data.get_worker_info()
    n, i = (1, 0) if info is None else (info.num_workers, info.id)
    yield from itertools.islice(self.samples(), i, None, n)"""
"""The three lines of ``__iter__`` that give each worker its share of the stream."""


def is_iterable(dataset: Any) -> bool:
    """Whether DataLoader treats ``dataset`` as an iterable-style dataset."""
    return isinstance(dataset, IterableDataset)


def tail_batches(dataset: Any, loader_kwargs: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """The most workers an ``IterableDataset`` may get without changing what an epoch
    yields (None: no bound), and a note saying why.

    Each worker batches its own share of the stream, so each ends the epoch with its own
    partial batch: with ``drop_last=True`` each drops it (up to ``batch_size - 1`` samples
    per worker lost per epoch, that the caller's loader keeps), so the workers stay at the
    caller's own ``num_workers``; without it the samples are all there, in up to one
    partial batch per worker.

    Example:
        >>> class Stream(IterableDataset):
        ...     def __iter__(self): yield from range(4)
        >>> tail_batches(Stream(), {"drop_last": True})[0], tail_batches(range(4), {})
        (0, (None, None))
    """
    if not is_iterable(dataset):
        return None, None
    given = int(loader_kwargs.get("num_workers") or 0)
    if loader_kwargs.get("drop_last"):
        return given, (
            f"num_workers kept at your {given}: with drop_last=True each worker of an "
            f"IterableDataset drops its own last partial batch, so more workers would drop "
            f"more samples per epoch than your loader does"
        )
    return None, (
        "an IterableDataset's workers each end the epoch with their own partial batch: with "
        "k workers an epoch may end in up to k partial batches (every sample is still there)"
    )


def _feed(h: Any, x: Any, depth: int = 0) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
        # As bytes: numpy has no bfloat16, and a byte view costs no copy.
        h.update(t.view(torch.uint8).numpy().data)
    elif isinstance(x, np.ndarray):
        h.update(f"A{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, (str, bytes, int, float, bool, type(None))):
        h.update(f"{type(x).__name__}:{x!r}".encode())
    elif isinstance(x, Mapping) and depth < 8:
        h.update(b"{")
        for k, v in x.items():
            _feed(h, k, depth + 1)
            _feed(h, v, depth + 1)
    elif isinstance(x, (list, tuple)) and depth < 8:
        h.update(b"[")
        for v in x:
            _feed(h, v, depth + 1)
    elif hasattr(x, "tobytes") and hasattr(x, "mode"):  # a PIL image
        h.update(x.tobytes())
    else:
        try:
            h.update(pickle.dumps(x))
        except Exception:
            h.update(repr(x).encode())


def fingerprint(item: Any) -> str:
    """A digest of an item's content: equal items (tensors, arrays, images, nested
    containers of them) give equal digests.

    Example:
        >>> a = fingerprint({"x": torch.arange(4), "label": 3})
        >>> a == fingerprint({"x": torch.arange(4), "label": 3})
        True
        >>> a == fingerprint({"x": torch.arange(4), "label": 2})
        False
    """
    h = hashlib.blake2b(digest_size=16)
    _feed(h, item)
    return h.hexdigest()


def duplicated(first: Sequence[str], second: Sequence[str], enough: int = ITEMS) -> bool | None:
    """Whether two workers' streams (item fingerprints, in order) are the same stream.

    False as soon as they differ at a position both reached (the stream is sharded); True
    when their first ``enough`` items agree and are not all alike; None when that cannot be
    told (fewer items, or a stream whose items are all the same).

    Example:
        >>> duplicated(list("abcd"), list("abcd")), duplicated(list("ab"), list("ba"))
        (True, False)
        >>> duplicated(list("aaaa"), list("aaaa")), duplicated(list("ab"), list("ab"))
        (None, None)
    """
    m = min(len(first), len(second))
    if list(first[:m]) != list(second[:m]):
        return False
    if m < enough or len(set(first[:m])) < 2:
        return None
    return True


class _Fingerprint:
    """The check's ``collate_fn`` (``batch_size=None``: called on each item, in the worker):
    ``(worker id, fingerprint)``, so only a hash travels to the main process."""

    def __call__(self, item: Any) -> tuple[int, str]:
        info = get_worker_info()
        return (-1 if info is None else info.id), fingerprint(item)


class _SeededAlike:
    """The check's ``worker_init_fn``: every worker's generators seeded alike, then the
    caller's own ``worker_init_fn``, which may give each worker its share."""

    def __init__(self, init: Callable[[int], object] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        random.seed(_SEED)
        np.random.seed(_SEED)
        torch.manual_seed(_SEED)
        if self.init is not None:
            self.init(worker_id)


@dataclass(frozen=True)
class ShardCheck:
    """What :func:`check_sharding` found.

    Attributes:
        duplicated: True, the two workers yielded the same stream; False, they differ (it
            is sharded); None, it cannot be told (see ``why``).
        items: items compared per worker.
        why: why it cannot be told, else None.
        elapsed_s: seconds the check took.
    """

    duplicated: bool | None
    items: int
    why: str | None
    elapsed_s: float


def _streams(it: Any, deadline: float, enough: int) -> tuple[dict[int, list[str]], bool | None]:
    """Fingerprints by worker until :func:`duplicated` decides, the streams end, or the
    deadline; every wait is cut to the time left."""
    streams: dict[int, list[str]] = {0: [], 1: []}
    verdict: bool | None = None
    for _ in range(4 * enough):  # a stream that ends early: the other one is not read forever
        left = deadline - time.perf_counter()
        if left <= 0.01:
            break
        if hasattr(it, "_timeout"):
            it._timeout = left
        try:
            worker, digest = next(it)
        except StopIteration:
            break
        streams.setdefault(worker, []).append(digest)
        verdict = duplicated(streams[0], streams[1], enough)
        if verdict is False or min(len(streams[0]), len(streams[1])) >= enough:
            break
    return streams, verdict


def check_sharding(
    dataset: Any,
    loader_kwargs: Mapping[str, Any],
    deadline: float,
    enough: int = ITEMS,
) -> ShardCheck:
    """Whether an ``IterableDataset`` yields the same stream in two workers (see the
    module docstring). Never raises for the dataset's sake: a stream that fails or hangs
    in a worker is undecided here, and the measurements report its fault.

    Args:
        dataset: an iterable-style dataset.
        loader_kwargs: the caller's DataLoader arguments (``worker_init_fn`` and
            ``multiprocessing_context`` are used).
        deadline: ``time.perf_counter()`` value by which to stop.
        enough: items compared per worker.
    """
    t0 = time.perf_counter()
    method = start_method(loader_kwargs)
    deadline = min(deadline, t0 + _LIMIT_S.get(method, 40.0))
    if deadline - t0 <= 0.1:
        return ShardCheck(None, 0, "the time budget ran out first", 0.0)
    kwargs = {k: loader_kwargs[k] for k in ("multiprocessing_context",) if k in loader_kwargs}
    workers = WorkerProcesses()
    it = None
    why: str | None = None
    streams: dict[int, list[str]] = {0: [], 1: []}
    verdict: bool | None = None
    try:
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=PROBE_WORKERS,
            collate_fn=_Fingerprint(),
            worker_init_fn=DieWithParent(_SeededAlike(loader_kwargs.get("worker_init_fn"))),
            timeout=deadline - t0,
            # The workers' base seed from a generator of its own: the caller's are untouched.
            generator=torch.Generator().manual_seed(_SEED),
            **kwargs,
        )
        it = iter(loader)
        streams, verdict = _streams(it, deadline, enough)
    except Exception as e:
        why = f"its workers failed ({type(e).__name__})"
    finally:
        if it is not None:
            workers.scan(it)
            close_iterator(it, workers, kill_first=True)
    items = min(len(streams[0]), len(streams[1]))
    if verdict is None and why is None:
        alike = items >= enough and len(set(streams[0][:items])) < 2
        why = ALIKE if alike else f"only {items} items came in time"
    if verdict is not None:
        why = None
    return ShardCheck(verdict, items, why, time.perf_counter() - t0)


def unsharded_result(dataset: Any, check: ShardCheck, pin: bool) -> CandidateResult:
    """The failed 2-worker configuration that makes the search refuse every worker count.

    Example:
        >>> class Stream(IterableDataset):
        ...     def __iter__(self): return iter(range(8))
        >>> r = unsharded_result(Stream(), ShardCheck(True, 4, None, 0.1), False)
        >>> r.status, r.fault, r.reason.split(" across ")[0]
        ('failed', 'unsharded', 'Stream is an IterableDataset that does not shard its stream')
    """
    return CandidateResult(
        2,
        2,
        pin,
        "failed",
        fault="unsharded",
        elapsed_s=check.elapsed_s,
        reason=(
            f"{type(dataset).__name__} is an IterableDataset that does not shard its stream "
            f"across workers: with 2 workers seeded alike, both yielded the same first "
            f"{check.items} items, so each of N workers would replay the whole stream and an "
            f"epoch would yield N times its samples; fix: in __iter__, yield only this "
            f"worker's share (torch.utils.data.get_worker_info(); see the warning)"
        ),
    )


def unsharded_warning(
    dataset: Any, check: ShardCheck, who: str = "tune_loader", workers: int = 0
) -> str:
    """The ``RuntimeWarning`` for a stream that is not sharded, with the fix in code.

    Example:
        >>> class Stream(IterableDataset):
        ...     def __iter__(self): return iter(range(8))
        >>> print(unsharded_warning(Stream(), ShardCheck(True, 4, None, 0.1)))
        ... # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
        tune_loader keeps num_workers=0: Stream is an IterableDataset that does not shard ...
            info = torch.utils.data.get_worker_info()
            n, i = (1, 0) if info is None else (info.num_workers, info.id)
            yield from itertools.islice(self.samples(), i, None, n)
    """
    return (
        f"{who} keeps num_workers={workers}: {type(dataset).__name__} is an IterableDataset that "
        f"does not shard its stream across workers (with 2 workers, both yielded the same "
        f"first {check.items} items), so with N workers every sample would come N times. "
        f"Give each worker its share in __iter__, with torch.utils.data.get_worker_info() "
        f"(None in the main process), e.g.:\n\n{SHARDING_EXAMPLE}\n"
    )


def sharding_refusal(
    dataset: Any,
    loader_kwargs: Mapping[str, Any],
    *,
    max_workers: int,
    pin: bool,
    deadline: float,
    notes: list[str],
) -> CandidateResult | None:
    """For an ``IterableDataset`` that workers could load, :func:`check_sharding`; when it
    does not shard, a ``RuntimeWarning`` (:func:`unsharded_warning`) and the failed
    configuration that makes the search refuse every worker count, else None. A check that
    cannot tell adds a note.
    """
    if max_workers == 0 or not is_iterable(dataset):
        return None
    check = check_sharding(dataset, loader_kwargs, deadline)
    if check.duplicated is None:
        notes.append(
            f"could not tell whether the IterableDataset shards its stream across workers "
            f"({check.why}); if it does not, every worker yields every sample: see "
            f"torch.utils.data.get_worker_info()"
        )
    if not check.duplicated:
        return None
    warning = unsharded_warning(dataset, check)
    warnings.warn(warning, RuntimeWarning, stacklevel=user_stacklevel())
    return unsharded_result(dataset, check, pin)
