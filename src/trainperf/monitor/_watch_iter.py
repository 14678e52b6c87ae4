"""What :meth:`Watch.iter` accepts (:func:`check_iterable`) and returns: the iterable's
items, each timed as a wait for data unless another thread than the loop's takes them
(:func:`wait_elsewhere`), and the watch's accounting of each pass over the iterable (the
samples a step took, an adaptive loader's changes).
"""

from __future__ import annotations

import reprlib
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from trainperf._utils.stack import user_stacklevel
from trainperf.monitor._handover import batch_layout
from trainperf.monitor._probe import batch_size, loader_batch_size, loader_facts, shared_leading

if TYPE_CHECKING:
    from trainperf.monitor._watch import Watch

T = TypeVar("T")
_OPEN_PASSES = 64  # open w.iter() passes remembered (peeks that never finish are dropped)
_SOURCES = 64  # iterables remembered for the predictions (the ones that fed fewest go first)


@dataclass
class _Pass:
    """One pass of a :meth:`Watch.iter` iterator over its iterable: which iterable, and the
    samples it handed out since ``step`` (the watch's count of ``w.step()`` calls then)."""

    iterable_id: int
    step: int = 0
    taken: int = 0
    fed: int = 0  # the steps in which this pass handed out a batch
    fed_last: int = -1  # the last of them


@dataclass
class _Source:
    """An iterable ``w.iter()`` was given, for the predictions: its loader settings at the
    latest ``w.iter()`` of it (``given``: the count of ``w.iter()`` calls then) and a weak
    reference to read them again when the report is made (an adaptive loader changes them),
    the steps in which it handed out a batch (in all, in its longest pass, and in its
    longest pass that ended: an epoch's), and its first batch's layout and samples (for the
    hand-over probe)."""

    facts: dict[str, Any]
    ref: Callable[[], object | None]
    given: int
    weak: bool = True  # ref is a weak reference (not so for a list, a tuple)
    steps: int = 0
    last_step: int = -1
    pass_steps: int = 0
    epoch_steps: int = 0
    layout: tuple[int, ...] | None = None
    layout_batch: int | None = None


def note_source(w: Watch, iterable: object) -> None:
    """Remember ``iterable``'s loader settings (and a weak reference to it) for
    :func:`feeding_source`; the steps it fed so far stay. An entry under the same ``id`` of
    an iterable since collected (loaders built anew each epoch reuse their predecessors'
    ids) is replaced, not inherited."""
    facts = loader_facts(iterable)
    ref: Callable[[], object | None]
    weak = True
    try:
        ref = weakref.ref(iterable)
    except TypeError:  # a list, a tuple: no settings to read again
        ref, weak = (lambda: None), False
    given = max((s.given for s in tuple(w._sources.values())), default=0) + 1
    known = w._sources.get(id(iterable))
    if known is not None and (known.ref() is iterable or not (weak or known.weak)):
        known.facts, known.ref, known.given = facts, ref, given
        return
    if known is not None:
        del w._sources[id(iterable)]
    elif len(w._sources) >= _SOURCES:
        del w._sources[min(w._sources, key=lambda k: (w._sources[k].steps, w._sources[k].given))]
    w._sources[id(iterable)] = _Source(facts, ref, given, weak)


def feeding_source(w: Watch) -> _Source | None:
    """The iterable whose passes handed out batches in the most steps (one pass's most; then
    all passes'): the loop's own loader, not a validation pass drawn once an epoch (all its
    batches fall in one step, however many epochs), nor one iterated only before the first
    step; on a tie the one ``w.iter()`` was given last (a loader made anew each epoch: the
    latest). None before any ``w.iter()``."""
    # A tuple first: a w.iter() in the loop's thread may add one while another reports.
    return max(
        tuple(w._sources.values()), key=lambda s: (s.pass_steps, s.steps, s.given), default=None
    )


class _Timed(Iterator[T]):
    """What :meth:`Watch.iter` returns: the iterable's items, with the time spent getting
    each one (``iter()`` of the iterable included: starting a DataLoader's workers is a wait
    for data) added to the watch's pending data wait, and the iterable's ``len()``.

    The iterator holds no item between calls (a batch on the GPU is not kept alive while
    the next one loads). An exception from the iterable passes through and the iterator
    goes on (a loop that skips a bad batch keeps its epoch). Iterating it again once it is
    exhausted starts a new pass over the iterable, as a DataLoader does each epoch (before
    that, iterating it again goes on with the pass it is in, as any iterator does).
    Iterated in a thread other than the one that steps the watch (a prefetch thread feeding
    the loop through a queue), its waits are not the loop's: they are left out, and the
    watch warns once (see :func:`wait_elsewhere`).
    """

    def __init__(self, watch: Watch, iterable: Iterable[T]) -> None:
        self._watch, self._iterable = watch, iterable
        self._it: Iterator[T] | None = None  # iter(iterable), made (and timed) at first next()
        self._done = False
        self._pass = _new_pass(watch, iterable)
        self._rows = _yields_rows(iterable)
        self._per_batch = loader_batch_size(iterable)  # a DataLoader's, else None
        # The leading size of the per-sample tensors a full batch held (collate_fn=list of
        # images: their channels or height), by which the epoch's short last batch is read.
        self._sample_leading: int | None = None
        history = getattr(iterable, "tuning_history", None)
        # An AdaptiveDataLoader's changes (at iter(), or mid-epoch in next()) are read as
        # its history grows: each is marked at the step that took its first batch.
        self._history = history if isinstance(history, list) else None
        self._seen = len(self._history) if self._history is not None else 0

    def __iter__(self) -> _Timed[T]:
        if self._done:  # a new pass, like a DataLoader's next epoch
            self._pass = _new_pass(self._watch, self._iterable)
            self._it, self._done = None, False
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        w = self._watch
        own = (
            w._state != "running"
            or threading.current_thread() is w._loop_thread
            or not _taken_elsewhere(w)
        )
        clock, cpu = time.perf_counter, time.thread_time
        t, c = clock(), cpu()
        try:
            if self._it is None:
                self._it = iter(self._iterable)
            item = next(self._it)
        except StopIteration:
            self._done = True
            _pass_ended(w, self._pass)
            raise
        finally:
            if own:
                _add_wait(w, clock() - t, cpu() - c)
        if self._history is not None and len(self._history) > self._seen:
            _retuned(self._watch, self._history[self._seen :])
            self._seen = len(self._history)
        n = 1 if self._rows else batch_size(item, self._per_batch, self._sample_leading)
        if n is not None and n == self._per_batch and n != (lead := shared_leading(item)):
            self._sample_leading = lead
        _took(self._watch, item, self._pass, n)
        return item

    @property
    def done(self) -> bool:
        """True once the iterable is exhausted (until a new pass starts)."""
        return self._done

    def __bool__(self) -> bool:  # an iterator is true, whatever its len() says
        return True

    def __len__(self) -> int:
        if not hasattr(self._iterable, "__len__"):
            name = type(self._iterable).__name__
            raise TypeError(f"the {name} given to w.iter() has no len()")
        return len(self._iterable)  # type: ignore[arg-type]


def check_iterable(iterable: object) -> None:
    """Refuse what ``iter()`` would refuse, at the ``w.iter()`` call and without calling it
    (``iter(loader)`` starts a DataLoader's workers: that is timed at the first batch).

    Raises:
        TypeError: ``iterable`` has neither ``__iter__`` nor ``__getitem__``.
    """
    kind = type(iterable)
    if getattr(kind, "__iter__", None) is not None or hasattr(kind, "__getitem__"):
        return
    hint = "; to count n steps without a loader, w.iter(range(n))" if kind is int else ""
    raise TypeError(
        f"w.iter() needs an iterable (a DataLoader, a list of batches), got "
        f"{kind.__name__}: {reprlib.repr(iterable)}; pass what the loop iterates: "
        f"`for batch in w.iter(loader):`{hint}"
    )


def refuse_own(w: Watch, iterable: object) -> None:
    """Refuse an iterator ``w.iter()`` already returned: each item's wait and samples would
    count twice in its step (another watch's iterator is that watch's to time: allowed).

    Raises:
        ValueError: ``iterable`` is an iterator ``w``'s ``w.iter()`` returned.
    """
    if isinstance(iterable, _Timed) and iterable._watch is w:
        raise ValueError(
            "w.iter() was given an iterator this watch's w.iter() already returned, which "
            "would count each batch's wait and samples twice; iterate it as it is: "
            "`batches = w.iter(loader)`, then `for batch in batches:`"
        )


def _new_pass(w: Watch, iterable: object) -> _Pass:
    """A pass over ``iterable`` starts. A pass over the same iterable left open (a
    ``break``) is over: the samples it handed out since the last ``w.step()`` were not
    trained on, so they leave the next step's count. Passes over other iterables (a
    validation loader inside the loop) are left alone."""
    steps = w._first + len(w._ends)
    for old in [p for p in w._passes if p.iterable_id == id(iterable)]:
        with w._lock:  # as in _took: w.step() may reset the count meanwhile
            if old.step == steps and w._count_known:
                w._pending_count = max(0, w._pending_count - old.taken)
        _pass_ended(w, old)  # left for a new pass: the loop's epoch is what it took
    new = _Pass(id(iterable), steps)
    w._passes.append(new)
    del w._passes[:-_OPEN_PASSES]
    return new


def _taken_elsewhere(w: Watch) -> bool:
    """Whether this ``next()`` runs in a thread other than the one that steps ``w``, while
    that one is alive (a prefetch thread; a thread that takes over from an ended one is
    the loop's). Before the first step no thread steps yet: it notes this one, for the
    first ``w.step()`` to judge (``claim_steps``)."""
    me, stepper = threading.current_thread(), w._stepper
    if stepper is None:
        w._fetcher = me
        return False
    if stepper is me or not stepper.is_alive():
        return False
    wait_elsewhere(w, me, stepper)
    return True


def wait_elsewhere(w: Watch, fetcher: threading.Thread, stepper: threading.Thread) -> None:
    """Note that ``fetcher`` takes the batches ``w.iter()`` times while ``stepper`` steps
    ``w``, and warn (once per watch): ``fetcher`` waits for each batch while the loop's
    steps run, so that wait is no wait of the loop's, and the loop's own (taking a batch
    from the queue) is part of its step. The report then leaves the data wait unmeasured."""
    if w._wait_elsewhere is not None:
        return
    w._wait_elsewhere = (fetcher.name, stepper.name)
    warnings.warn(
        f"w.iter() is iterated in thread {fetcher.name!r} while thread {stepper.name!r} "
        "steps the watch (a prefetch thread?): the time it waits for each batch overlaps "
        "the training steps and is no wait of the loop's, so the report leaves the data "
        "wait unmeasured (wait_fraction None, nothing called input-bound) and counts each "
        "batch's samples in the step under way when it was taken; to measure the loop's "
        f"wait, wrap what {stepper.name!r} iterates: for batch in w.iter(prefetcher)",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def _pass_ended(w: Watch, done: _Pass) -> None:
    """``done`` is over (exhausted, or left for a new pass over its iterable): the steps it
    fed are an epoch of its iterable's, by which stalls once an epoch are told (a
    validation pass between epochs is no save)."""
    if done in w._passes:
        w._passes.remove(done)
    source = w._sources.get(done.iterable_id)
    if source is not None and w._state == "running":  # after stop() the report stays
        source.epoch_steps = max(source.epoch_steps, done.fed)


def _add_wait(w: Watch, wall: float, cpu: float) -> None:
    if w._state != "running":
        return
    # A clock that stepped back (one a test replaced) measured no wait, not a negative one.
    w._pending_wait += max(0.0, wall)
    w._pending_wait_cpu += max(0.0, cpu)


def _retuned(w: Watch, changes: list[Any]) -> None:
    if w._state != "running":
        return  # a change made after stop() is not the watched loop's
    step = w._first + len(w._ends)  # the step taking this batch
    w._retunes.extend((step, change) for change in changes)


def _yields_rows(iterable: object) -> bool:
    """Whether ``iterable`` is a tensor or NumPy array of 1 or 2 dimensions: iterated, it
    yields its rows (or scalars), each one sample, not a batch whose first dimension (a
    row's width) counts its samples. A 3-D one yields batches, counted as any batch."""
    return isinstance(iterable, (torch.Tensor, np.ndarray)) and 1 <= iterable.ndim <= 2


def _took(w: Watch, item: Any, now: _Pass, n: int | None) -> None:
    """Count a batch ``w.iter`` handed out, of ``n`` samples (None: unknown), and, on CUDA,
    start its step's span."""
    if w._state != "running":
        return  # iterated after stop(): the report stays as it was
    steps = w._first + len(w._ends)
    if now.step != steps:
        now.step, now.taken = steps, 0
    now.taken += n or 0
    w._items += 1
    if now.fed_last != steps:
        now.fed, now.fed_last = now.fed + 1, steps
    source = w._sources.get(now.iterable_id)
    if source is not None:
        if source.last_step != steps:
            source.steps, source.last_step = source.steps + 1, steps
        source.pass_steps = max(source.pass_steps, now.fed)
        if source.layout is None:
            source.layout, source.layout_batch = batch_layout(item), n
    with w._lock:  # a prefetch thread's count, and the loop's w.step() that resets it
        if n is None:
            w._count_known = False
        else:
            w._pending_count += n
    if w._cuda and w._step_start is None:
        # With the stream idle this event completes at once, so the step's span is
        # then host time; analyse() bounds it with NVML's utilisation.
        w._step_start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        w._step_start.record(w._stream)
