"""Where a DataLoader is in its epoch, saved and restored exactly, without loading what it
skips.

A tracked loader keeps its class's behaviour (its class becomes a subclass of its own class,
so ``isinstance`` checks, ``TunedDataLoader.tuning_report`` and
``DistributedLoader.set_epoch`` still work) and counts two things: the passes (epochs)
started and the batches handed out in the current pass. When a pass's sampler starts
drawing, the states it draws from are recorded: torch's global generator (``RandomSampler``
without a generator seeds itself from it), every generator (torch, NumPy, ``random.Random``)
and ``epoch`` attribute along the sampler chain (``BatchSampler.sampler``,
``DistributedSampler.epoch``); :mod:`._sampler_states` reads and puts them back. The
generators the loader's dataset owns (``self.rng``) are saved as they are at the checkpoint and
put back, so augmentation drawn from them in this process goes on as it would have; one the
sampler draws from too is put back again once the replay below has drawn the pass's order
(:mod:`._dataset_states`).

On restore, the next pass replays the interrupted one: the recorded states are put back just
while its sampler draws, so it yields the same order, and the first ``position`` batches of
indices are dropped at the sampler, so their samples are never loaded. Every random draw the
DataLoader makes while starting that pass (the workers' base seed) is undone, because the
interrupted run had made it before the checkpoint, and the generators stay where the
checkpoint left them. A batch size changed alone keeps the saved order too, for torch's own
samplers: the pass resumes after the samples consumed, or the whole batches of the new size
below them (:func:`._loader_resume.rebatched`).

Not exact, and documented: random augmentation done *inside* DataLoader workers (each worker's
generator has advanced through the batches it loaded, which the resumed pass does not replay),
an ``IterableDataset`` (no sampler to skip at: its pass restarts, with a warning) and
``in_order=False`` loaders (the consumed batches are not a prefix).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainperf._utils.seed_draw import sampler_generator, seed_drawn_from
from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._dataset_states import (
    dataset_states,
    put_back,
    restore_dataset_generators,
    shared_with_sampler,
)
from trainperf.checkpoint._loader_resume import (
    draw_tail,
    pass_length,
    pass_shape,
    rebatched,
    resume_note,
    tail_pulls,
)
from trainperf.checkpoint._sampler_states import SamplerStates, replaying, sampler_chain, sandbox

__all__ = ["check_position", "loader_state", "restore_loader", "track"]

_VERSION = 1
_TRACKER = "_trainperf_tracker"


@dataclass
class _Resume:
    passes: int
    position: int
    start: SamplerStates | None  # None: the pass's sampler had not drawn yet
    # The dataset's generators the sampler draws from too, with their states at the save.
    shared: list[tuple[Any, Any]] = field(default_factory=list)


@dataclass
class _Tracker:
    """A loader's pass count, position, and the states its current pass drew from."""

    passes: int = 0
    position: int = 0
    done: bool = False
    known: bool = True  # False: tracking began mid-pass, so the position is unknown
    start: SamplerStates | None = None
    resume: _Resume | None = None
    pass_id: int = 0
    notes: list[str] = field(default_factory=list)
    # The next new iterator draws its workers' base seed from a scratch generator: a
    # restored loader whose uninterrupted twin reuses its persistent workers draws none.
    scratch_seed: bool = False


class _IndexSampler:
    """Wraps the loader's index sampler: records where each pass starts drawing, and on
    resume replays that start and drops the batches already handed out."""

    def __init__(self, inner: Any, loader: DataLoader[Any]) -> None:
        self.inner = inner
        # A weak reference: the loader holds this object, and a cycle would keep a loader
        # with persistent workers (and so the workers) alive until the garbage collector ran.
        self._loader = weakref.ref(loader)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader()
        if loader is None:  # pragma: no cover - the loader is what iterates us
            yield from self.inner
            return
        tracker: _Tracker = loader.__dict__[_TRACKER]
        chain = sampler_chain(self.inner)
        gen = sampler_generator(loader)
        del loader
        resume, tracker.resume = tracker.resume, None
        if resume is None or resume.start is None:
            # Read now, at the first pull, the moment the inner sampler draws its order.
            tracker.start = SamplerStates.read(chain, gen)
            yield from self.inner
            return
        with replaying(chain, gen):
            resume.start.apply(chain, gen)
            it = iter(self.inner)
            skipped = sum(1 for _ in itertools.islice(it, resume.position))
            put_back(resume.shared)
            first = list(itertools.islice(it, 1))
        tracker.start = resume.start
        if skipped < resume.position:
            warnings.warn(
                f"the loader's sampler yields {skipped} batches this pass, fewer than the "
                f"{resume.position} the checkpoint had already consumed: the dataset or "
                "sampler changed since it was saved",
                UserWarning,
                stacklevel=2,
            )
        yield from first
        yield from it


class _Counting:
    """The iterator a tracked loader returns: counts what the loop takes."""

    def __init__(self, it: Iterator[Any], tracker: _Tracker, pass_id: int) -> None:
        self._it = it
        self._tracker = tracker
        self._pass_id = pass_id

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        tracker = self._tracker
        try:
            item = next(self._it)
        except StopIteration:
            if tracker.pass_id == self._pass_id:
                tracker.done = True
            raise
        if tracker.pass_id == self._pass_id:
            tracker.position += 1
        return item

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


@contextlib.contextmanager
def _scratch_generator(loader: Any) -> Iterator[None]:
    """The workers' base seed drawn from a scratch generator (the sampler keeps its own
    reference, so its draws are untouched): torch's global generator and ``generator``
    stay where the checkpoint left them, as for a loader whose persistent workers go on."""
    real = loader.generator
    seed = (torch.initial_seed() if real is None else real.initial_seed()) + loader.__dict__[
        _TRACKER
    ].passes
    # A worker pool pulls its first indices before it returns: the sampler's states are read
    # then (_IndexSampler), from the caller's generator (sampler_generator).
    with seed_drawn_from(loader, torch.Generator().manual_seed(seed)):
        yield


def _tracked_iter(loader: Any, make: Callable[[], Iterator[Any]]) -> _Counting:
    """A tracked loader's ``__iter__``: ``make`` is its own class's."""
    tracker: _Tracker = loader.__dict__[_TRACKER]
    tracker.pass_id += 1
    if tracker.resume is None:
        tracker.passes += 1
        tracker.position, tracker.done, tracker.known, tracker.start = 0, False, True, None
        scratch, tracker.scratch_seed = tracker.scratch_seed, False
        with _scratch_generator(loader) if scratch else contextlib.nullcontext():
            it = make()
    else:
        resume = tracker.resume
        # The interrupted run made this pass's start-up draws (the workers' base seed)
        # before the checkpoint: undo them here.
        with sandbox([], loader.generator):
            it = make()
        tracker.passes, tracker.position = resume.passes, resume.position
        tracker.done, tracker.known = False, True
    return _Counting(iter(it), tracker, tracker.pass_id)


def _tracked_index_sampler(loader: Any, inner: Any) -> _IndexSampler:
    cached: _IndexSampler | None = loader.__dict__.get("_trainperf_index_sampler")
    if cached is None or cached.inner is not inner:
        cached = _IndexSampler(inner, loader)
        loader.__dict__["_trainperf_index_sampler"] = cached
    return cached


_CLASSES: dict[type, type] = {}


def _own_index_sampler(loader: DataLoader[Any]) -> Any:
    """The index sampler of ``loader``'s own class (the one a tracked loader wraps)."""
    base = type(loader).__mro__[1] if _TRACKER in loader.__dict__ else type(loader)
    return base._index_sampler.__get__(loader)  # type: ignore[attr-defined]


def _tracked_class(cls: type) -> type:
    """``cls`` with a counting ``__iter__`` and a replaying ``_index_sampler``.

    A plain subclass (no mixin base), so an instance's ``__class__`` may be switched to it.
    """
    if cls not in _CLASSES:
        base: Any = cls

        def __iter__(self: Any) -> _Counting:
            return _tracked_iter(self, lambda: base.__iter__(self))

        def _index_sampler(self: Any) -> _IndexSampler:
            return _tracked_index_sampler(self, base._index_sampler.__get__(self, base))

        def __reduce_ex__(self: Any, protocol: Any) -> tuple[Any, ...]:
            return _reduce_tracked(self, base)

        new = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__iter__": __iter__,
                "_index_sampler": property(_index_sampler),
                "__reduce_ex__": __reduce_ex__,
            },
        )
        _CLASSES[cls] = new
    return _CLASSES[cls]


def _reduce_tracked(loader: Any, base: type) -> tuple[Any, ...]:
    """What ``pickle`` and ``copy.deepcopy`` take of a tracked loader: its own state (its
    class's ``__getstate__``: a ``TunedDataLoader`` leaves its live pool behind), rebuilt as
    a tracked ``base``. The tracked class is made at run time, so pickle cannot name it; the
    sampler wrapper, which refers to the original loader, is left out: the copy makes its
    own; and the tracker is copied (``copy.copy`` would share it), so iterating the copy
    never touches the original's pass, nor the original the copy's."""
    getstate = getattr(loader, "__getstate__", None)  # object has one from Python 3.11
    state = loader.__dict__ if getstate is None else getstate()
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k != "_trainperf_index_sampler"}
        if isinstance(state.get(_TRACKER), _Tracker):
            tracker = state[_TRACKER]
            state[_TRACKER] = dataclasses.replace(tracker, notes=list(tracker.notes))
    return (_new_tracked, (base,), state)


def _new_tracked(base: type) -> Any:
    """An empty instance of the tracked ``base`` (its state is set after), for unpickling."""
    return object.__new__(_tracked_class(base))


def track(loader: DataLoader[Any], *, known: bool = True) -> None:
    """Start tracking ``loader``'s position (nothing happens if it is tracked already).

    ``known=False`` marks a loader whose current pass began before tracking did: its
    position stays unknown until its next pass starts.
    """
    if _TRACKER in loader.__dict__:
        return
    tracker = _Tracker(known=known)
    loader.__dict__[_TRACKER] = tracker
    loader.__class__ = _tracked_class(type(loader))


def _finished(done: bool, position: int, length: int | None) -> bool:
    """Whether a pass is over: it raised StopIteration, or every batch of it was taken (a
    save at its last batch must not resume into its empty tail, which would cost a loop
    ``for epoch in range(step // len(loader), epochs)`` a whole epoch)."""
    return done or (length is not None and position >= length)


def loader_state(loader: DataLoader[Any]) -> dict[str, Any] | None:
    """The tracked ``loader``'s pass, position and generator states, as plain data; None
    when its position is unknown (tracking began mid-pass).

    A pass the loop broke out of before its end is resumed where it was left, whatever
    stopped the loop (a time limit, ``max_steps``, a preemption): never a batch skipped. A
    pass whose every batch was taken is over, StopIteration or not (a save at its last
    batch, inside the loop): the resume starts the next pass, as a loop that derives its
    epoch from the step (``step // len(loader)``) expects.
    """
    tracker: _Tracker = loader.__dict__[_TRACKER]
    if not tracker.known:
        return None
    length = pass_length(loader)
    chain = sampler_chain(_own_index_sampler(loader))
    return {
        "version": _VERSION,
        "passes": tracker.passes,
        "position": tracker.position,
        "length": length,
        "shape": pass_shape(loader, chain),
        "done": _finished(tracker.done, tracker.position, length),
        "ended": tracker.done,  # the pass raised StopIteration: its sampler drew its tail
        "start": None if tracker.start is None else tracker.start.to_dict(),
        "now": SamplerStates.read(chain, loader.generator).to_dict(),
        "dataset": dataset_states(loader),
    }


def check_position(saved: Any, key: str) -> None:
    """Raise unless ``saved`` is what :func:`loader_state` returns (or None: a position
    unknown when it was saved).

    Raises:
        ValueError: it is something else (another entry's value).
    """
    if saved is not None and (not isinstance(saved, Mapping) or saved.get("version") != _VERSION):
        raise ValueError(
            f"checkpoint entry {key!r} is not a DataLoader position saved by Checkpointer "
            f"(got {type(saved).__name__}); restore it into the object it was saved from"
        )


def restore_loader(loader: DataLoader[Any], saved: Mapping[str, Any] | None, key: str) -> None:
    """Track ``loader`` and make its next pass continue the one ``saved`` was taken in.

    Raises:
        ValueError: ``saved`` is not what :func:`loader_state` returns.
    """
    track(loader)
    if saved is None:
        warnings.warn(
            f"the checkpoint has no position for loader {key!r} (its tracking began in the "
            "middle of a pass: pass the loader to Checkpointer.restore before the loop); it "
            "starts where it is",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return
    check_position(saved, key)
    tracker: _Tracker = loader.__dict__[_TRACKER]
    chain = sampler_chain(_own_index_sampler(loader))
    SamplerStates.from_dict(saved["now"]).apply(chain, loader.generator)
    restored = restore_dataset_generators(loader, saved.get("dataset"), key)
    shared = shared_with_sampler(loader, chain, restored)
    tracker.passes, tracker.position, tracker.known = saved["passes"], saved["position"], True
    tracker.done, tracker.resume = True, None
    # Files from before a finished pass was always marked done say so by their position.
    done = _finished(saved["done"], saved["position"], saved["length"])
    # Whether the loader whose order this one keeps reuses a persistent pool (no draw at
    # the next pass): a tuned loader's own rule (the caller's arguments, not the tuner's).
    reuses = getattr(loader, "_draws_once", None)
    if reuses is None:
        reuses = loader.persistent_workers and loader.num_workers
    tracker.scratch_seed = bool(done and saved["passes"] >= 1 and reuses)
    if done and saved.get("ended") is False and saved["start"] is not None:
        pass_start = SamplerStates.from_dict(saved["start"])
        pulls = tail_pulls(loader, chain, saved)
        draw_tail(chain, loader.generator, pass_start, pulls, shared)
    if done or (saved["start"] is None and not _begun(saved)):
        return
    # Nothing consumed (a pass saved before its first batch): any order continues it.
    resumed_at = rebatched(loader, chain, saved) if saved["position"] > 0 else None
    if resumed_at is not None:
        position, note = resumed_at
    else:
        position = saved["position"]
        note = resume_note(loader, chain, saved) if position > 0 else None
    if note is not None:
        warnings.warn(f"loader {key!r}: {note}", UserWarning, stacklevel=user_stacklevel())
        if resumed_at is None:
            return
    start = None if saved["start"] is None else SamplerStates.from_dict(saved["start"])
    tracker.position = position
    tracker.resume = _Resume(saved["passes"], position, start, shared)
    # Saved again before the loop starts, it must still say "in the middle of this pass".
    tracker.done, tracker.start = False, start


def _begun(saved: Mapping[str, Any]) -> bool:
    """Whether ``saved`` is a pass whose iterator was made (it drew its workers' base seed)
    but whose sampler had not drawn yet: resumed, that iterator's draws are undone and the
    sampler draws as the uninterrupted run's did after the save."""
    return bool(saved["passes"] >= 1 and saved["position"] == 0)
