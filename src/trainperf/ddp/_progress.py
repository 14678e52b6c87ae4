"""What each rank records for hang detection: its progress and the collective it is in.

**Progress** is any of: a ``torch.distributed`` collective called from Python returned
(``all_reduce``, ``broadcast``, ``barrier``, ``all_gather``, the ``*_object`` ones, ...;
``new_group``; and the C++ ones DDP's constructor calls through ``torch.distributed``), an
optimizer stepped (``torch.optim`` global step hook: this covers DDP, whose gradient
all-reduce runs in C++ inside ``backward()``), a DataLoader returned a batch (so an
evaluation loop with no optimizer step and no collective is progress too), the rank finished
its set-up, or returned from ``main``. A job makes progress while any rank does; a hang is
``hang_timeout`` seconds with none on any rank.

**Known slow work**: trainperf's own long operations (a blocking checkpoint save) run inside
:func:`busy`, which marks the rank's slot "busy in <what> since <time>". A rank in such a
block counts as making progress for up to ``BUSY_CAP`` times the timeout (one rank alone
in a long save while the others wait in a barrier is not a hang); past that it is named as
stuck in that work. A rank in a collective inside such a block (a sharded ``state_dict()`` during
a save) does not count: there it waits for the others like any rank in a collective.

Each rank writes into a fixed-size **slot** (:mod:`~trainperf.ddp._progress_slots`): under
``launch`` one shared file that the launcher reads without the ranks' cooperation, under
``watchdog()`` this process's own memory.

The wrappers replace the functions on ``torch.distributed`` and
``torch.distributed.distributed_c10d`` when the rank starts, so ``dist.all_reduce(...)`` is
seen; a name imported before that (``from torch.distributed import all_reduce`` in a module
the launcher had already imported) still calls the original, unseen. Each call costs about
a few microseconds (measured by ``benchmarks/launch_bench.py``).

Modules: ``_progress_slots`` (a slot's layout, reading it, the launcher's file of slots),
``_progress_tracker`` (the writer of a rank's slot), this one (the wrappers and hooks that
feed the writer, and :func:`busy`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from trainperf.ddp._progress_tracker import Tracker

__all__ = ["busy", "install", "under_launcher", "uninstall"]


# What the wrappers watch: every Python-level collective of torch.distributed that exists.
_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list",
)  # fmt: skip
# Collectives in C++ that torch's own Python calls as ``dist.<name>(process_group, tensors,
# ...)``: DDP's constructor checks and broadcasts the parameters with them (and its forward
# broadcasts the buffers), so a rank that has not reached ``DDP(model)`` yet is waited for
# there. Unwatched, the waiting rank looked busy in its own code and no hang was declared.
_CPP_COLLECTIVES = ("_verify_params_across_processes", "_broadcast_coalesced")
# Calls every rank of the group must make, that wait for the others in torch's own Python (a
# store-based barrier): they look like busy code on the stack. Recorded without a tensor.
_GROUP_CALLS = ("new_group",)


_NO_TENSORS = 1 << 16  # a ``skip`` past every argument: the call has no tensor to describe

_installed: list[Tracker] = []
_launched: list[bool] = []  # set in ranks that launch() started with hang detection


def under_launcher() -> bool:
    """Whether ``launch(hang_timeout=...)`` already watches this process."""
    return bool(_launched)


def _wrap(name: str, fn: Callable[..., Any], skip: int = 0) -> Callable[..., Any]:
    """``fn`` reporting to the tracker (``skip``: leading arguments before its tensors; the
    tracker describes the first one it is given)."""

    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        tracker = _installed[0] if _installed else None
        if tracker is None or tracker.depth:
            return fn(*args, **kwargs)  # nested (all_gather_object calls all_gather): outer counts
        tracker.depth += 1
        tracker.enter(name, args[skip:], kwargs if skip < _NO_TENSORS else {})
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.depth -= 1
            tracker.exit()

    watched.__trainperf_watched__ = fn  # type: ignore[attr-defined]
    return watched


_originals: list[tuple[Any, str, Callable[..., Any]]] = []
_hooks: list[Any] = []


def install(tracker: Tracker) -> None:
    """Route this process's collectives and optimizer steps to ``tracker``.

    A second call only swaps the tracker. The wrappers stay until :func:`uninstall` (a
    launched rank keeps them for its life; ``watchdog`` removes them when it stops).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.optim.optimizer import register_optimizer_step_post_hook

    first = not _installed
    _installed[:] = [tracker]
    if not first:
        return
    for name in _COLLECTIVES:
        _watch(name, c10d, dist)
    for name in _CPP_COLLECTIVES:
        _watch(name, dist, None, skip=1)
    for name in _GROUP_CALLS:
        _watch(name, c10d, dist, skip=_NO_TENSORS)
    _hooks.append(register_optimizer_step_post_hook(_on_step))
    _watch_batches()


def _watch(name: str, home: Any, alias: Any, skip: int = 0) -> None:
    """Replace ``home.<name>`` with its watched wrapper, and ``alias.<name>`` where it is the
    same function (``torch.distributed`` re-exports ``distributed_c10d``'s)."""
    found = getattr(home, name, None)
    if found is None or hasattr(found, "__trainperf_watched__"):
        return
    fn: Callable[..., Any] = found
    watched = _wrap(name, fn, skip)
    _originals.append((home, name, fn))
    setattr(home, name, watched)
    if alias is not None and getattr(alias, name, None) is fn:
        _originals.append((alias, name, fn))
        setattr(alias, name, watched)


def _watch_batches() -> None:
    """Count every batch a DataLoader returns (one wrapper on the iterators' base class)."""
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    fn = base.__next__
    if hasattr(fn, "__trainperf_watched__"):
        return

    @functools.wraps(fn)
    def watched_next(self: Any) -> Any:
        out = fn(self)
        if _installed:
            _installed[0].batch()
        return out

    watched_next.__trainperf_watched__ = fn  # type: ignore[attr-defined]
    _originals.append((base, "__next__", fn))
    base.__next__ = watched_next  # type: ignore[method-assign]


def uninstall() -> None:
    """Put back the original collectives and drop the optimizer hook."""
    for module, name, fn in reversed(_originals):
        setattr(module, name, fn)
    _originals.clear()
    for hook in _hooks:
        hook.remove()
    _hooks.clear()
    _installed.clear()


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """Mark this rank as busy in known slow work (``"saving checkpoint /ckpt/step-9.pt"``).

    For trainperf's own long operations: while the block runs, the hang detection
    (``launch(hang_timeout=...)`` or ``watchdog()``) counts this rank as making progress, for
    up to ``BUSY_CAP`` times the timeout; past that the report names it as stuck in
    ``what``. Cheap, and nothing at all when no detection watches this process. Only the
    main thread's blocks count: a background thread's work, or a forked child's (a
    background checkpoint writer inherits the tracker), does not hold the job up.

    Example:
        >>> with busy("saving checkpoint /tmp/step-1.pt"):  # no detection here: no effect
        ...     pass
    """
    tracker = _installed[0] if _installed else None
    if tracker is None or threading.get_ident() != tracker.thread or os.getpid() != tracker.pid:
        yield
        return
    tracker.busy_enter(what)
    try:
        yield
    finally:
        tracker.busy_exit()


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _installed:
        _installed[0].step()
