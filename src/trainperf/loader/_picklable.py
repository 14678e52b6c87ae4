"""Batches a worker could not send back: :func:`unpicklable_part` and :func:`pickle_refusal`.

A DataLoader worker sends every batch to the main process pickled (tensors through shared
memory, everything else by value). A ``collate_fn`` that returns something that cannot be
pickled (a generator, a lock, an open file) makes the worker's queue drop the batch with a
traceback on stderr, and the main process waits for it until the hang timeout. The tuner
loads the first batch in the main process anyway (``num_workers=0``, its baseline), so it
checks that batch before any pool is started: one that cannot be pickled refuses every worker
configuration, with the reason, instead of a pool measured until it "hangs".

The check pickles the batch with its tensors and plain arrays left out (they are payload,
sent through shared memory, and copying them would cost what the check is meant to save).
It refuses only what it can tell: on CPython < 3.12 (3.10, 3.11), where pickle's depth counts
against the caller's Python stack, a batch that reaches the recursion limit on the caller's
stack may still pickle on a worker's feeder thread, whose stack is shallow (from 3.12 pickle
counts its depth apart from the Python stack, and the caller's depth matters no more); and a
failure of the check itself leaves tuning as it was without it.

A later batch that cannot be pickled (one sample in a thousand holds a lock) is past that
check, and torch's worker drops it the same way: the loop waits for it for ever (without a
``timeout``), and the tuner's pool "hangs" until its budget or hang timeout runs out. So every
worker trainperf's loaders start (the tuner's, a :class:`~trainperf.loader.TunedDataLoader`'s,
an adaptive loader's pools) runs :class:`WorkerInit` as its ``worker_init_fn``: the worker's
data queue then sends such a batch back as a ``pickle.PicklingError`` that names the batch,
the part of it and its type, and the loop (or the tuner, as a ``pickle`` fault) gets it at
once. A batch that pickles but whose tensors could not be sent (``/dev/shm`` full, too many
open files, a tensor that requires grad) comes back as the error it met, with its fix; the
dataset's own error whose class cannot be pickled (one defined in a function) as a
``RuntimeError`` with its text. Only torch's data queue is changed (found in the frame of
torch's worker loop): the dataset's own queues keep Python's handler, which drops what they
cannot pickle; on a torch whose loop is not found, no queue is changed.
"""

from __future__ import annotations

import functools
import multiprocessing.queues
import pickle
import sys
from collections.abc import Callable, Mapping
from multiprocessing.reduction import ForkingPickler
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.utils.data._utils.worker
from torch._utils import ExceptionWrapper

from trainperf._utils.lifetime import DieWithParent
from trainperf.loader._report import CandidateResult

__all__ = [
    "FD_FIX",
    "UNSENDABLE",
    "FirstBatch",
    "WorkerInit",
    "pickle_refusal",
    "unpicklable_batch",
    "unpicklable_part",
]

_FIX = (
    "fix: return tensors, numbers, strings, lists, tuples or dicts from the dataset and "
    "collate_fn (no locks, lambdas, generators or open files; list(...) of a generator), or "
    "use num_workers=0"
)

UNSENDABLE = " cannot be sent to the main process: "
"""In the message of a batch a worker could not pickle (:func:`unpicklable_batch`)."""

Found = tuple[str, str, str]
"""Where in the batch (``"batch[1]['ids']"``), the type's name, and pickle's error."""


class _Discard:
    """A file that keeps nothing: the check needs pickle's verdict, not its bytes."""

    def write(self, data: bytes) -> int:
        return len(data)


class _WithoutPayload(ForkingPickler):
    """The workers' pickler (torch's reducers included), with tensors and plain arrays
    pickled as ``None``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) or (
            isinstance(obj, np.ndarray) and not obj.dtype.hasobject
        ):
            return type(None), ()
        return NotImplemented


def _pickle_error(obj: Any) -> Exception | None:
    try:
        _WithoutPayload(_Discard()).dump(obj)
    except Exception as e:  # whatever stops pickle stops the worker's queue too
        return e
    return None


def _shown(obj: Any, render: Callable[[Any], str] = str) -> str:
    """``render(obj)``, or the type's name when that raises (user classes' ``__str__`` and
    ``__repr__`` can, and the message must still be made)."""
    try:
        return render(obj)
    except Exception:
        return type(obj).__name__


def _type_name(obj: Any) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _innermost(obj: Any, where: str, error: Exception, depth: int = 0) -> Found:
    """The deepest part of ``obj`` (lists, tuples and dict values, eight levels at most) that
    cannot be pickled, ``obj`` itself when no part of it is to blame."""
    if depth < 8 and not isinstance(obj, (str, bytes)):
        if isinstance(obj, Mapping):
            parts: list[tuple[str, Any]] = [
                (f"{where}[{_shown(k, repr)}]", v) for k, v in obj.items()
            ]
        elif isinstance(obj, (list, tuple)):
            parts = [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        else:
            parts = []
        for part_where, part in parts:
            part_error = _pickle_error(part)
            if part_error is not None and not isinstance(part_error, RecursionError):
                return _innermost(part, part_where, part_error, depth + 1)
    text = _shown(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    return where, _type_name(obj), message


def unpicklable_part(batch: Any) -> Found | None:
    """What in ``batch`` a worker could not send back, or None when it pickles; tensors and
    plain arrays are left out of the check. None also when pickling reaches the recursion
    limit: the check runs on the caller's stack, a worker's feeder thread on a shallow one
    (on CPython < 3.12 pickle's depth counts against that stack).

    Example:
        >>> unpicklable_part({"x": torch.zeros(2), "ids": [1, 2]}) is None
        True
        >>> unpicklable_part([torch.zeros(2), (i for i in range(2))])
        ('batch[1]', 'generator', "cannot pickle 'generator' object")
    """
    error = _pickle_error(batch)
    # RecursionError: deep on this stack, maybe not on a worker's shallow one (CPython < 3.12).
    if error is None or isinstance(error, RecursionError):
        return None
    where = "batch" if isinstance(batch, (Mapping, list, tuple)) else "the batch"
    return _innermost(batch, where, error)


class FirstBatch:
    """``measure``'s ``on_first_batch``: checks the first batch it is given
    (:func:`unpicklable_part`) and keeps only the finding, not the batch."""

    def __init__(self) -> None:
        self.checked = False
        self.found: Found | None = None

    def __call__(self, batch: Any) -> None:
        if not self.checked:
            self.checked = True
            try:
                self.found = unpicklable_part(batch)
            except Exception:  # a user class failing as it is looked into: no finding
                self.found = None


def pickle_refusal(found: Found | None, *, max_workers: int, pin: bool) -> CandidateResult | None:
    """The failed 1-worker configuration that makes the search refuse every worker count
    when the first batch cannot be pickled (``found``, :func:`unpicklable_part`), else None.

    Example:
        >>> r = pickle_refusal(("batch", "generator", "cannot pickle"), max_workers=2, pin=False)
        >>> r.fault, r.reason.split(":")[0]
        ('pickle', 'batch is a generator, which cannot be pickled (cannot pickle)')
    """
    if found is None or max_workers == 0:
        return None
    where, type_name, error = found
    return CandidateResult(
        1,
        2,
        pin,
        "failed",
        fault="pickle",
        reason=(
            f"{where} is a {type_name}, which cannot be pickled ({error}): a worker sends "
            f"every batch to the main process pickled, so no worker configuration can deliver "
            f"one (its pool would wait until the hang timeout); {_FIX}"
        ),
    )


def unpicklable_batch(index: int, batch: Any, error: Exception) -> Exception:
    """What a worker sends back for the batch ``index`` (counted from 0 in its iterator) that
    its queue could not pickle (``error``): a ``pickle.PicklingError`` naming the part to
    blame where there is one; else the queue's error itself (:func:`_send_failure`), since
    the batch pickles and what failed was sending its tensors (``/dev/shm`` full, too many
    open files, a tensor that requires grad).

    Example:
        >>> error = unpicklable_batch(3, [1, (i for i in [])], TypeError("no"))
        >>> print(str(error).split("; ")[0])
        batch 3 (counted from 0 in this iteration) cannot be sent to the main process: \
batch[1] is a generator, which cannot be pickled (cannot pickle 'generator' object)
        >>> print(unpicklable_batch(0, [torch.zeros(2)], OSError("Too many open files")))
        ... # doctest: +ELLIPSIS
        the worker could not send batch 0 ... OSError: Too many open files; fix: raise ...
    """
    try:
        found = unpicklable_part(batch)
    except Exception:  # a user class failing as it is looked into: the queue's error alone
        found = None
    if found is None:
        return _send_failure(index, error)
    where, type_name, message = found
    return pickle.PicklingError(
        f"batch {index} (counted from 0 in this iteration){UNSENDABLE}{where} is a "
        f"{type_name}, which cannot be pickled ({message}); a worker sends every batch to "
        f"the main process pickled; {_FIX}"
    )


_SHM_MARKERS = ("no space left on device", "</torch_", "shared memory", "bus error")
_SHM_FIX = (
    "fix: give the container more shared memory for /dev/shm (docker run --shm-size=16g, or "
    "a memory-backed emptyDir on Kubernetes), or use fewer workers or a smaller "
    "prefetch_factor"
)
FD_FIX = (
    "fix: raise the open-file limit (ulimit -n), or call "
    "torch.multiprocessing.set_sharing_strategy('file_system') before the loader starts"
)
"""The fix for a process out of file descriptors, here and in
:func:`~trainperf.loader._faults.classify_fault`."""


def _send_failure(index: int, error: Exception) -> Exception:
    """The queue's ``error`` for a batch that pickles (no part of it to blame), with the
    batch's index and the fix for shared memory or open files: of its own type where that
    pickles and can be rebuilt from the message, else a ``RuntimeError``."""
    text = _shown(error)
    low = text.lower()
    fix = (
        FD_FIX
        if "too many open files" in low
        else _SHM_FIX
        if any(m in low for m in _SHM_MARKERS)
        else ""
    )
    message = (
        f"the worker could not send batch {index} (counted from 0 in this iteration) to the "
        f"main process: {_type_name(error)}: {text}" + (f"; {fix}" if fix else "")
    )
    cls = type(error)
    if _pickle_error(cls) is None:  # the main process must unpickle the class
        try:
            rebuilt = cls(message)
        except Exception:  # its __init__ takes other arguments
            pass
        else:
            if _shown(rebuilt) == message:
                return rebuilt
    return RuntimeError(message)


def _class_unsendable(wrapper: ExceptionWrapper, error: Exception) -> ExceptionWrapper:
    """torch's ``wrapper`` of the dataset's error, which could not be pickled (it keeps the
    exception's class: one defined in a function cannot be), as a ``RuntimeError`` with the
    same traceback and text and why it changed."""
    cls = getattr(wrapper, "exc_type", None)
    if cls is not None and _pickle_error(cls) is not None:
        name = f"{cls.__module__}.{cls.__qualname__}"
        why = f"its class {name} cannot be pickled: define it at module level"
    else:
        why = f"it cannot be pickled: {_shown(error)}"
    where = getattr(wrapper, "where", "in DataLoader worker process")
    sent = ExceptionWrapper((RuntimeError, RuntimeError(why), None), where)  # type: ignore[no-untyped-call]
    text = str(getattr(wrapper, "exc_msg", "")).rstrip()
    sent.exc_msg = f"{text} ({why})\n" if text else f"RuntimeError: the worker's error ({why})\n"
    return sent


# Python's handler (it prints the traceback): a private hook "for overriding", per its docs.
_Queue: Any = multiprocessing.queues.Queue  # the hook is not in the type stubs
_queue_feeder_error: Callable[[Exception, Any], None] = _Queue._on_queue_feeder_error


def _send_unpicklable(queue: Any, error: Exception, obj: Any) -> None:
    """A worker's data queue's handler for an object its feeder thread could not pickle
    (torch queues ``(index, batch)`` and ``(index, ExceptionWrapper)``): it goes back as an
    error the main process raises for that index (:func:`unpicklable_batch`,
    :func:`_class_unsendable`); anything else is printed, as Python's handler does (it was
    dropped)."""
    if not (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], int)):
        _queue_feeder_error(error, obj)
        return
    try:
        queue.put(_sendable(*obj, error))
        return
    except Exception:  # a queue closed at shutdown: the feeder thread must not die here
        pass
    _queue_feeder_error(error, obj)  # out of the except: it prints the pickling error


def _sendable(index: int, data: Any, error: Exception) -> tuple[int, ExceptionWrapper]:
    """What goes back for the item ``(index, data)`` the queue could not pickle."""
    if isinstance(data, ExceptionWrapper):
        return index, _class_unsendable(data, error)
    failure = unpicklable_batch(index, data, error)
    info = torch.utils.data.get_worker_info()
    where = "in DataLoader worker process" + ("" if info is None else f" {info.id}")
    return index, ExceptionWrapper((type(failure), failure, None), where)  # type: ignore[no-untyped-call]


_WORKER_LOOP = getattr(torch.utils.data._utils.worker, "_worker_loop", None)


def _data_queue() -> Any:
    """The queue torch's worker loop sends batches on (its ``data_queue``), read from the
    frame of the ``_worker_loop`` that calls the ``worker_init_fn``; None where none is
    found (a torch whose loop is named or built otherwise)."""
    code = getattr(_WORKER_LOOP, "__code__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            queue = frame.f_locals.get("data_queue")
            return queue if isinstance(queue, _Queue) else None
        frame = frame.f_back
    return None


class WorkerInit(DieWithParent):
    """:class:`trainperf.DieWithParent` (around ``user_fn``) that also makes the worker's
    data queue send back a batch, or an error of the dataset's, that it cannot pickle as
    an error (:func:`_send_unpicklable`) instead of dropping it: the ``worker_init_fn`` of
    every worker trainperf's loaders start. Only torch's data queue: other queues in the
    worker (the dataset's own) keep Python's handler.

    Example:
        >>> init = WorkerInit(print)
        >>> isinstance(init, DieWithParent), init.user_fn
        (True, <built-in function print>)
    """

    def __call__(self, worker_id: int) -> None:
        if torch.utils.data.get_worker_info() is not None:
            queue = _data_queue()
            if queue is not None:
                # Read by the queue at its first put (its feeder thread starts), after this.
                queue._on_queue_feeder_error = functools.partial(_send_unpicklable, queue)
        super().__call__(worker_id)
