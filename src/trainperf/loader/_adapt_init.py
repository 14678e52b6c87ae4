"""The caller's ``worker_init_fn`` in the worker pools an
:class:`~trainperf.loader.AdaptiveDataLoader` starts itself (after its first change).

A loader built with ``num_workers=0`` never runs that function; the loader may later run it
in workers it adds. When it raises there, torch's own error ("Caught ValueError in DataLoader
worker process 0") reads like the dataset's and says nothing of where the workers came from.
In those pools the function runs inside :class:`PoolInit`, which marks its failure
(:class:`InitFailed`), and the loop gets :func:`init_failure`'s error instead: what raised,
in which pool, and how to get back the setting the loader was built with. The dataset's own
errors stay torch's. The one-off tuner's measurements run it in a :class:`PoolInit` too, and
report its failure with :func:`init_reason`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from trainperf._utils.lifetime import DieWithParent
from trainperf.loader._picklable import WorkerInit

if TYPE_CHECKING:
    from trainperf.loader._adapt import AdaptiveDataLoader

__all__ = ["InitFailed", "PoolInit", "init_failure", "init_reason", "pool_init_fn"]


class InitFailed(RuntimeError):
    """Raised in a worker by :class:`PoolInit` when the caller's ``worker_init_fn`` raised;
    torch re-raises it in the main process ("Caught InitFailed ..."), where
    :func:`init_failure` turns it into the loader's error."""


class PoolInit:
    """The caller's ``worker_init_fn`` (``user_fn``), as the pools the loader started run it.

    Example:
        >>> def broken(worker_id): raise ValueError(f"no shard for worker {worker_id}")
        >>> PoolInit(broken)(3)
        Traceback (most recent call last):
        ...
        trainperf.loader._adapt_init.InitFailed: ValueError: no shard for worker 3
    """

    def __init__(self, user_fn: Callable[[int], None]) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        try:
            self.user_fn(worker_id)
        except Exception as e:
            raise InitFailed(f"{type(e).__name__}: {e}") from e


@contextlib.contextmanager
def pool_init_fn(loader: AdaptiveDataLoader) -> Iterator[None]:
    """While a pool of the loader's own starts (it has changed its setting), its workers run
    the caller's ``worker_init_fn`` in a :class:`PoolInit`; the loader's attribute is put
    back at once (a DataLoader iterator keeps the function it started with)."""
    kept = loader.worker_init_fn
    user_fn = kept.user_fn if isinstance(kept, DieWithParent) else kept
    if not loader.tuning_history or not loader.num_workers or user_fn is None:
        yield
        return
    loader.worker_init_fn = WorkerInit(PoolInit(user_fn))
    try:
        yield
    finally:
        loader.worker_init_fn = kept


_INIT_FIX = "make worker_init_fn work in every worker process (worker_id 0 to num_workers - 1)"


def _raised(error: InitFailed) -> str:
    """What the caller's function raised: ``"ValueError: no shard for worker 3"``."""
    return str(error).rstrip().splitlines()[-1].split(f"{InitFailed.__name__}: ", 1)[-1]


def _name(user_fn: object) -> str:
    """The caller's ``worker_init_fn``'s name, inside a :class:`DieWithParent` or not."""
    user_fn = getattr(user_fn, "user_fn", user_fn)
    return getattr(user_fn, "__qualname__", type(user_fn).__name__)  # a callable object's


def init_reason(user_fn: object, error: InitFailed) -> str:
    """Why a measurement's pool failed when ``user_fn``, the caller's ``worker_init_fn``,
    raised (``error``: torch's re-raise of :class:`InitFailed`), and the fix.

    Example:
        >>> def broken(worker_id): raise ValueError("no shard")
        >>> init_reason(broken, InitFailed("ValueError: no shard"))  # doctest: +ELLIPSIS
        'worker_init_fn broken raised in a worker: ValueError: no shard; fix: make ...'
    """
    return f"worker_init_fn {_name(user_fn)} raised in a worker: {_raised(error)}; fix: {_INIT_FIX}"


def init_failure(loader: AdaptiveDataLoader, error: BaseException) -> RuntimeError | None:
    """The loader's error for ``error``, torch's re-raise of an :class:`InitFailed`, or None
    for any other error (the dataset's own, say: the caller's to see as torch raised it)."""
    if not isinstance(error, InitFailed):
        return None
    built = loader.tuning_history[0].old[0] if loader.tuning_history else loader.num_workers
    return RuntimeError(
        f"worker_init_fn {_name(loader.worker_init_fn)} raised in a worker of the pool "
        f"{type(loader).__name__} started itself (num_workers={loader.num_workers}; built "
        f"with num_workers={built}): {_raised(error)}. Fix: {_INIT_FIX}, or keep the "
        f"loader's setting: autotune_loader(..., adapt=False), or max_workers={built} for "
        f"{type(loader).__name__}"
    )
