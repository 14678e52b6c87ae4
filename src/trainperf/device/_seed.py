"""Seeds for reproducible runs: :func:`seed_everything`, and :func:`worker_init_fn` for workers."""

from __future__ import annotations

import functools
import math
import multiprocessing
import operator
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trainperf._utils import launch_env
from trainperf._utils.validate import int_like, non_negative_int


def seed_everything(seed: int, *, deterministic: bool = False) -> int:
    """Seed Python's ``random``, NumPy, torch and every CUDA device, for reproducible runs.

    Also sets ``PYTHONHASHSEED`` for child processes (this process's string hashing was
    fixed when it started). For DataLoader workers, pass :func:`worker_init_fn` and a seeded
    generator: ``DataLoader(ds, worker_init_fn=worker_init_fn,
    generator=torch.Generator().manual_seed(seed))``.

    Args:
        seed: an int in ``[0, 2**32 - 1]``.
        deterministic: also make torch pick deterministic algorithms (erroring on ops that
            have none), turn cuDNN's autotuner off and set ``CUBLAS_WORKSPACE_CONFIG``.
            Slower; ``False`` leaves those settings as they are.

    Returns:
        The seed, for logging.

    Raises:
        TypeError: ``seed`` is not an integer: a float, or a tensor that is not 0-dim
            (``torch.tensor([5])``: pass ``seed.item()``; a 0-dim integer tensor is taken).
        ValueError: ``seed`` is outside ``[0, 2**32 - 1]``.

    Example:
        >>> seed_everything(7)
        7
        >>> a = torch.rand(1); _ = seed_everything(7); bool(torch.equal(a, torch.rand(1)))
        True
    """
    given: object = seed  # callers pass anything; checked here
    # operator.index reads a bool tensor as 0 or 1, and any one-element integer tensor
    # (tensor([5])) as its value, where it refuses np.array([5]); a NumPy bool it refuses.
    if isinstance(given, bool) or (
        isinstance(given, torch.Tensor) and (given.dtype == torch.bool or given.dim() > 0)
    ):
        raise TypeError(f"seed must be an int, got {seed!r}{_seed_fix(given)}")
    try:
        seed = operator.index(seed)
    except TypeError as e:
        raise TypeError(f"seed must be an int, got {seed!r}{_seed_fix(given)}") from e
    if not 0 <= seed <= 2**32 - 1:
        raise ValueError(f"seed must be in [0, 2**32 - 1] (NumPy's range), got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # lazy: queued until CUDA starts, never starts it
    os.environ["PYTHONHASHSEED"] = str(seed)
    if deterministic:
        # cuBLAS reads this when it creates its handle, i.e. at the first matmul on a device.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return seed


def _seed_fix(seed: object) -> str:
    """The fix that :func:`seed_everything`'s refusal of ``seed`` names, where one keeps its
    value: ``seed.item()`` for a one-element integer tensor or array that is not 0-dim,
    ``int(seed)`` for a whole number of another type (as :func:`worker_init_fn`'s error)."""
    if isinstance(seed, (torch.Tensor, np.ndarray)) and seed.ndim > 0:
        item = seed.item() if math.prod(seed.shape) == 1 else None
        whole = isinstance(item, int) and not isinstance(item, bool)
        return " (pass seed.item())" if whole else ""
    return " (pass int(seed))" if int_like(seed, 0) else ""


def _worker_seed_state(seed: int) -> np.ndarray[Any, Any]:
    # SeedSequence spreads nearby seeds (base_seed + 0, base_seed + 1...) over unrelated
    # NumPy states, which a plain `seed % 2**32` would not.
    return np.random.SeedSequence(seed).generate_state(4)


class _CarriesRank:
    """:func:`worker_init_fn` as the DataLoader gets it: an object that, pickled for a
    ``spawn`` or ``forkserver`` worker, records the rank of the process that pickles it. A
    function pickles as its name alone, and such a worker has no process group to ask (nor
    a ``RANK`` variable, where the rank came from ``init_process_group(rank=...)``)."""

    def __init__(
        self, fn: Callable[[int], None], rank: int | None = None, pid: int | None = None
    ) -> None:
        functools.update_wrapper(self, fn)  # its name, docstring and signature
        self._fn = fn
        self._rank = rank  # the rank of the process that pickled this copy, and its pid
        self._pid = pid

    def __reduce__(self) -> tuple[Callable[[int, int], _CarriesRank], tuple[int, int]]:
        return (_recorded, (_global_rank(), os.getpid()))

    def __repr__(self) -> str:
        return "<function trainperf.worker_init_fn>"

    def __call__(self, worker_id: int) -> None:
        _seed_worker(worker_id, self._rank_here())

    def _rank_here(self) -> int:
        """This process's rank; in a spawned worker, the one its starter recorded."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())  # a forked worker has a copy of its rank's group
        parent = multiprocessing.parent_process()
        if self._rank is not None and parent is not None and parent.pid == self._pid:
            return self._rank
        return _global_rank()


def _recorded(rank: int, pid: int) -> _CarriesRank:
    """:func:`worker_init_fn` as unpickled in a worker: with its starter's rank."""
    copy = _CarriesRank(worker_init_fn._fn, rank, pid)
    copy.__module__ = worker_init_fn.__module__  # its public path, set by the package
    return copy


@_CarriesRank
def worker_init_fn(worker_id: int) -> None:
    """Give each DataLoader worker its own reproducible ``random`` and NumPy seed, and
    under DDP each rank's workers their own streams.

    Inside a worker the seed comes from ``torch.initial_seed()``, which the DataLoader sets
    to ``base_seed + worker_id`` (``base_seed`` drawn from the loader's generator), so
    seeding that generator makes every worker's stream reproducible. Recent PyTorch seeds
    NumPy in workers itself; this function makes the scheme explicit and version-proof.
    Called outside a worker, it seeds from ``torch.initial_seed() + worker_id``.

    Every rank seeds its generator alike (``seed_everything(42)`` on each), so worker ``k``
    of every rank would draw the same augmentations; on a rank other than 0 (the process
    group's, else ``RANK``) the rank is mixed into the seed, torch's included. Rank 0, and a
    run without DDP, draw as they always did. A ``spawn`` or ``forkserver`` worker has no
    process group of its own: the rank is recorded when the rank pickles this function for
    the worker, so a rank set up with ``init_process_group(rank=...)`` and no ``RANK``
    variable seeds its workers as that rank too.

    Args:
        worker_id: the worker's number, as the DataLoader passes it.

    Raises:
        ValueError: ``worker_id`` is not an int >= 0.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(4), num_workers=0, worker_init_fn=worker_init_fn,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> worker_init_fn(0)
    """
    _seed_worker(worker_id, _global_rank())


def _seed_worker(worker_id: int, rank: int) -> None:
    worker_id = non_negative_int("worker_id", worker_id)
    info = torch.utils.data.get_worker_info()
    seed = info.seed if info is not None else torch.initial_seed() + worker_id
    if rank:
        seed = int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0])
        if info is not None:  # a worker's own torch seed; never the main process's
            torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(_worker_seed_state(seed))


def _global_rank() -> int:
    """The process group's rank, else ``RANK`` (a worker of a rank inherits it), else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return launch_env.read_int("RANK") or 0
