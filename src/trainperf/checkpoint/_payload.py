"""What a Checkpointer file holds, and putting it back into live objects.

A file is a dict like the one ``save_checkpoint`` writes: every entry of the state as
``save_checkpoint`` saves it (modules unwrapped and as state dicts, objects with
``state_dict()`` as their state dicts, plain values as they are), DataLoaders as their
position (:mod:`._loader_state`), and under the reserved key ``"trainperf"`` the step, the
format version and the generator states (:mod:`._rng`).
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Mapping, MutableMapping, MutableSet
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainperf._utils.stack import user_stacklevel
from trainperf.checkpoint._files import _plain
from trainperf.checkpoint._loader_state import check_position, loader_state, restore_loader, track
from trainperf.checkpoint._prefix import check_state_dict, load_state_dict
from trainperf.checkpoint._refusal import refuse_loaders
from trainperf.checkpoint._rng import rng_state, set_rng_state
from trainperf.device import to_device
from trainperf.errors import CheckpointError, StateDictMismatchError

__all__ = ["RESERVED", "build_payload", "rank_payload", "restore_into", "saved_step"]

RESERVED = "trainperf"
_FORMAT = 1
_KEEP = object()  # _restore_value's "restored in place, nothing to replace"


def _check_state(state: object, what: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{what} takes a dict of what to save, such as {{'model': model, 'optimizer': "
            f"opt}}, got {type(state).__name__}"
        )
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{what}: the state's keys must be strings, got {bad!r}")
    if RESERVED in state:
        raise ValueError(
            f"{what}: the key {RESERVED!r} is reserved for the step and random states that "
            "Checkpointer adds; rename your entry"
        )
    return state


def _loader_entry(key: str, loader: DataLoader[Any]) -> dict[str, Any] | None:
    if "_trainperf_tracker" not in loader.__dict__:
        track(loader, known=False)
        warnings.warn(
            f"loader {key!r} was not given to Checkpointer.restore() before the loop, so "
            "where it is in the current pass is unknown: this checkpoint resumes it where "
            "it starts after the restore; it is tracked from its next pass on (call "
            "ckpt.restore(state) before the loop, even on the first run)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return loader_state(loader)


def _meta(step: int, rank: int, world_size: int) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "rng": rng_state(),
    }


def build_payload(
    state: Mapping[str, Any], step: int, rank: int = 0, world_size: int = 1
) -> dict[str, Any]:
    """The content of a step's main file; tensors are the live ones (not copied).

    Raises:
        TypeError: ``state`` is not a dict with string keys.
        ValueError: ``state`` uses the reserved key ``"trainperf"``.
        CheckpointError: ``state`` holds a loader a checkpoint cannot hold.
    """
    state = _check_state(state, "Checkpointer.save")
    refuse_loaders(state)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DataLoader):
            out[key] = _loader_entry(key, value)
            continue
        out[key] = _plain(value)  # as save_checkpoint saves each entry
    out[RESERVED] = _meta(step, rank, world_size)
    return out


def rank_payload(state: Mapping[str, Any], step: int, rank: int, world_size: int) -> dict[str, Any]:
    """What rank ``rank > 0`` keeps of a step: its loaders' positions and generator states
    (the model and optimizer are rank 0's to write)."""
    state = _check_state(state, "Checkpointer.save")
    refuse_loaders(state)
    out: dict[str, Any] = {
        key: _loader_entry(key, value)
        for key, value in state.items()
        if isinstance(value, DataLoader)
    }
    out[RESERVED] = _meta(step, rank, world_size)
    return out


def saved_step(payload: Mapping[str, Any], where: str) -> int:
    """The step a loaded file says it holds.

    Raises:
        ValueError: the file was not written by ``Checkpointer.save``.
    """
    meta = payload.get(RESERVED) if isinstance(payload, Mapping) else None
    if not isinstance(meta, Mapping) or not isinstance(meta.get("step"), int):
        raise ValueError(
            f"{where} was not written by Checkpointer.save (no {RESERVED!r} entry with its "
            "step); load it with load_checkpoint instead"
        )
    return int(meta["step"])


def _loads_in_place(value: Any) -> bool:
    """``value`` is restored in place: a module, anything with ``load_state_dict``, a
    DataLoader."""
    return isinstance(value, DataLoader) or _has_load(value)


def _has_load(value: Any) -> bool:
    """``value`` takes its saved state through ``load_state_dict``."""
    return isinstance(value, nn.Module) or (
        not isinstance(value, type) and callable(getattr(value, "load_state_dict", None))
    )


def _holds_state(value: Any, depth: int = 0) -> bool:
    """``value`` is, or holds (in lists, tuples and dicts), an object restored in place."""
    if _loads_in_place(value):
        return True
    if depth > 8:
        return False
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, (Mapping, list, tuple)):
        return any(_holds_state(v, depth + 1) for v in items)
    return False


def _unfit(live: Any, saved: Any, where: str) -> str | None:
    """Why ``saved`` cannot be put back into ``live`` without leaving a live object
    unloaded (a dict entry the file lacks, a list of another length), or None; checked
    before anything is loaded."""
    if _loads_in_place(live):
        return None
    if isinstance(live, Mapping) and isinstance(saved, Mapping):
        for k, v in live.items():
            if k not in saved and _holds_state(v):
                held = ", ".join(repr(x) for x in saved) or "nothing"
                return (
                    f"the checkpoint's {where} has no entry {k!r} to load into it (it holds {held})"
                )
            if k in saved and (why := _unfit(v, saved[k], f"{where}[{k!r}]")) is not None:
                return why
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        if len(live) != len(saved):
            if _holds_state(live):
                return (
                    f"the checkpoint's {where} holds {len(saved)} items, the live one "
                    f"{len(live)} with objects to load into"
                )
            return None
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            if (why := _unfit(a, b, f"{where}[{i}]")) is not None:
                return why
    return None


def _kind(value: Any) -> str:
    """``value``'s type, with its article: "an OrderedDict", "None"."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _optimizer_unfit(live: torch.optim.Optimizer, saved: Any) -> str | None:
    """Why torch's ``Optimizer.load_state_dict`` would refuse ``saved``, or None."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), Mapping):
        return f"the checkpoint holds {_kind(saved)} there, not an optimizer's state dict"
    sizes = [len(g["params"]) for g in live.param_groups]
    were = [len(g["params"]) if isinstance(g, Mapping) else 0 for g in groups]
    if sizes != were:
        return (
            f"the optimizer has {len(sizes)} parameter group(s) of {sizes} parameters, the "
            f"checkpoint's {len(were)} of {were}: build it with the parameter groups it was "
            "saved with, in the same order"
        )
    return None


def _object_unfit(live: Any, saved: Any) -> str | None:
    """Why ``live.load_state_dict(saved)`` would fail, where that can be told before."""
    if isinstance(live, torch.optim.Optimizer):
        return _optimizer_unfit(live, saved)
    if isinstance(saved, Mapping):
        return None
    try:
        own = live.state_dict()
    except Exception:  # advisory: its load_state_dict will say what it needs
        return None
    if isinstance(own, Mapping):
        return (
            f"the checkpoint holds {_kind(saved)} there, but {type(live).__name__}."
            "state_dict() is a dict: another entry's value, or state saved before the "
            "object was"
        )
    return None


def check_loads(live: Any, saved: Any, name: str, place: str, entry: str) -> None:
    """Before anything is loaded: each object in ``live`` that is restored in place takes
    its saved state (a module its weights, an optimizer its parameter groups), so that a
    misfit leaves every live object as it was. ``name`` is ``live``'s, ``state['model']``;
    ``entry`` the top-level entry of ``state`` that holds it, ``'model'``.

    Raises:
        StateDictMismatchError: a module's weights do not fit it.
        ValueError: another object's saved state does not fit it.
    """
    if isinstance(live, nn.Module):
        _check_module(live, saved, name, place, entry)
    elif _has_load(live):
        why = _object_unfit(live, saved)
        if why is not None:
            raise ValueError(
                f"{place}: {name} cannot be restored: {why}; nothing was loaded (restore it "
                "into the object it was saved from)"
            )
    elif isinstance(live, Mapping) and isinstance(saved, Mapping):
        for k, v in live.items():
            if k in saved:
                check_loads(v, saved[k], f"{name}[{k!r}]", place, entry)
    elif (
        isinstance(live, (list, tuple))
        and isinstance(saved, (list, tuple))
        and len(live) == len(saved)
    ):
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            check_loads(a, b, f"{name}[{i}]", place, entry)


def _check_module(live: nn.Module, saved: Any, name: str, place: str, entry: str) -> None:
    if not isinstance(saved, Mapping):
        raise ValueError(
            f"{place}: {name} is a {type(live).__name__}, but the checkpoint holds "
            f"{_kind(saved)} there, not its weights; nothing was loaded (restore it into the "
            "object it was saved from)"
        )
    try:
        check_state_dict(live, saved, _partial(name, entry))
    except StateDictMismatchError as e:
        raise StateDictMismatchError(
            f"{place}: {name} does not fit its saved weights; nothing was loaded. {e}",
            missing=e.missing,
            unexpected=e.unexpected,
            mismatched=e.mismatched,
        ) from e


def _partial(name: str, entry: str) -> str:
    """How to load only the keys that fit into the module at ``name`` (``state['model']``,
    ``state['nets'][0]``), which restore, loading modules strictly, does not do itself; a
    module nested in the top-level entry ``entry`` is left out with the whole entry."""
    saved = "trainperf.load_checkpoint(path)" + name.removeprefix("state")
    if name == f"state[{entry!r}]":
        without = "without it (Checkpointer.restore loads modules strictly)"
    else:
        without = (
            f"without the entry {entry!r} that holds it (Checkpointer.restore takes top-level "
            "entries whole and loads modules strictly; load its other objects from the file "
            "yourself)"
        )
    load = "trainperf.load_state_dict(module, ..., strict=False)"
    return f"restore {without}, then pass {saved} to {load}"


def _load_into(live: Any, saved: Any, name: str, place: str, loaded: list[str]) -> None:
    """``live.load_state_dict(saved)`` (modules through :func:`load_state_dict`), a
    failure named with the entry, the file and what was loaded before it."""
    try:
        if isinstance(live, nn.Module):
            load_state_dict(live, saved)
        else:
            live.load_state_dict(saved)
    except Exception as e:
        before = ", ".join(loaded) or "nothing"
        raise CheckpointError(
            f"{place}: {name}.load_state_dict failed ({type(e).__name__}: {e}). Loaded "
            f"before it: {before}; {name} may be partly loaded. Build it as it was when "
            "saved (the same class and arguments) and restore into fresh objects",
            place,
        ) from e
    loaded.append(name)


def _restore_value(live: Any, saved: Any, where: str, place: str, loaded: list[str]) -> Any:
    """Load ``saved`` into ``live`` (returns ``_KEEP``), or return the plain value that
    replaces ``live``. ``where`` names ``live`` (``state['model']``); ``place`` the file
    and step; ``loaded`` collects what was loaded, for the error of a later failure."""
    if _has_load(live):
        _load_into(live, saved, where, place, loaded)
        return _KEEP
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return _into_tensor(live, saved)
    if isinstance(live, MutableMapping) and isinstance(saved, Mapping):
        for k in list(live):
            if k in saved:  # a plain value the file lacks keeps its live value
                new = _restore_value(live[k], saved[k], f"{where}[{k!r}]", place, loaded)
                if new is not _KEEP:
                    live[k] = new
        if not _holds_state(live):  # a dict of plain values gets the file's other entries too
            for k in saved:
                if k not in live:
                    live[k] = saved[k]
        return _KEEP
    if isinstance(live, np.ndarray) and isinstance(saved, np.ndarray):
        return _into_array(live, saved)
    if isinstance(live, MutableSet) and isinstance(saved, AbstractSet):
        live.clear()
        for item in saved:  # not |=: a set's |= refuses other Sets and rebinds the name
            live.add(item)
        return _KEEP
    if isinstance(live, collections.deque) and isinstance(saved, collections.deque):
        return _into_deque(live, saved)
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        if len(live) != len(saved):
            if isinstance(live, list):  # the loop's own reference to it must see the values
                live[:] = saved
                return _KEEP
            return saved
        pairs = list(zip(live, saved, strict=True))
        values = [
            _restore_value(a, b, f"{where}[{i}]", place, loaded) for i, (a, b) in enumerate(pairs)
        ]
        if isinstance(live, list):
            for i, v in enumerate(values):
                if v is not _KEEP:
                    live[i] = v
            return _KEEP
        return _same_tuple(
            live, [a if v is _KEEP else v for a, v in zip(live, values, strict=True)]
        )
    return saved


def _into_tensor(live: torch.Tensor, saved: torch.Tensor) -> Any:
    """``saved`` copied into ``live`` (returns ``_KEEP``: other references see it, and it
    keeps its device) when it has the same shape and dtype and can be written; else
    ``saved``, which replaces it (another dtype is not cast: ``2.7`` never becomes ``2``)."""
    if live.shape != saved.shape or live.dtype != saved.dtype or live.is_inference():
        return saved
    try:
        with torch.no_grad():
            live.copy_(saved)
    except RuntimeError:  # an expanded tensor (one element in several places): not writable
        return saved
    return _KEEP


def _into_array(live: np.ndarray[Any, Any], saved: np.ndarray[Any, Any]) -> Any:
    """``saved`` copied into ``live`` (returns ``_KEEP``) when it has the same shape and
    dtype and can be written (not a read-only view or memory map); else ``saved``."""
    if live.shape != saved.shape or live.dtype != saved.dtype or not live.flags.writeable:
        return saved
    live[...] = saved
    return _KEEP


def _into_deque(live: collections.deque[Any], saved: collections.deque[Any]) -> Any:
    """``saved``'s items put into ``live`` (returns ``_KEEP``) when both have the same
    ``maxlen``; else ``saved``, which replaces it (a deque's ``maxlen`` cannot change, and a
    shorter one would drop saved items)."""
    if live.maxlen != saved.maxlen:
        return saved
    live.clear()
    live.extend(saved)
    return _KEEP


def _same_tuple(live: tuple[Any, ...], values: list[Any]) -> tuple[Any, ...]:
    """``values`` as a tuple of ``live``'s type: a namedtuple takes them as arguments; a
    tuple subclass whose constructor takes no iterable becomes a plain tuple."""
    if hasattr(live, "_fields"):
        return type(live)(*values)
    try:
        return type(live)(values)
    except TypeError:
        return tuple(values)


def restore_into(
    state: Mapping[str, Any],
    saved: Mapping[str, Any],
    own: Mapping[str, Any] | None,
    where: str,
    step: int,
) -> None:
    """Load ``saved`` (a main file, ``where``, of step ``step``) into the live objects of
    ``state``; ``own`` is this rank's own file (loader positions and generator states), None
    on rank 0. A loader that ``own`` lacks (the rank saved a state without it) gets rank 0's
    position, with a warning naming the loader and the rank.

    Plain values in ``state`` are replaced by the saved ones (when ``state`` is a mutable
    dict); dicts, lists, sets, deques, tensors and NumPy arrays are updated in place where
    they can be, so other references to them see the saved values (a tensor or array of
    another shape or dtype, a read-only array, a deque of another ``maxlen`` and a tuple,
    frozenset or other immutable value are replaced instead). Entries the file has and ``state``
    lacks are ignored. Everything that can be checked is checked before anything is loaded.

    Raises:
        TypeError: ``state`` is not a dict with string keys.
        ValueError: ``state`` has entries the file lacks, a module or other object to
            load into that the file lacks at a deeper level of its dicts (a plain value
            the file lacks keeps its live value), a list or tuple of such objects whose
            length the file's does not match, an optimizer whose parameter groups differ
            from the saved ones, a loader whose entry is not a position, the reserved
            key, or a file without the generator states ``Checkpointer.save`` writes.
            Nothing is loaded then.
        StateDictMismatchError: a module's weights do not fit it; nothing is loaded then.
        CheckpointError: an object's ``load_state_dict`` failed after the checks (the
            message names it, the file and step, and what was loaded before it).
    """
    state = _check_state(state, "Checkpointer.restore")
    missing = [k for k in state if k not in saved]
    if missing:
        has = sorted(k for k in saved if k != RESERVED)
        raise ValueError(
            f"{where} has no entry {', '.join(map(repr, missing))} (it holds {has}): give "
            "restore the keys the checkpoints were saved with"
        )
    mine = own if own is not None else saved
    if not isinstance(mine.get(RESERVED), Mapping) or "rng" not in mine[RESERVED]:
        raise ValueError(
            f"{where} (step {step}) has no random-generator states under {RESERVED!r}, so "
            "Checkpointer.save did not write it: load it with trainperf.load_checkpoint, "
            "or move it out of the checkpoint directory"
        )
    place = f"{where} (step {step})"
    positions = _positions(state, saved, own, step)
    for key, live in state.items():
        why = _unfit(live, saved[key], key)
        if why is not None:
            raise ValueError(
                f"{where}: {why}: give restore the objects the checkpoints were saved with"
            )
        if isinstance(live, DataLoader):
            check_position(positions[key], key)
        else:
            check_loads(live, saved[key], f"state[{key!r}]", place, key)
    loaded: list[str] = []
    for key, live in state.items():
        if isinstance(live, DataLoader):
            # Generator states are CPU tensors, whatever device restore(device=) loaded onto.
            restore_loader(live, to_device(positions[key], "cpu"), key)
            continue
        new = _restore_value(live, saved[key], f"state[{key!r}]", place, loaded)
        if new is not _KEEP and isinstance(state, MutableMapping):
            state[key] = new
    set_rng_state(to_device(mine[RESERVED]["rng"], "cpu"))


def _positions(
    state: Mapping[str, Any], saved: Mapping[str, Any], own: Mapping[str, Any] | None, step: int
) -> dict[str, Any]:
    """The saved position of each loader in ``state``: this rank's own (from ``own``, its
    file; rank 0's from ``saved``, the main file, when ``own`` is None), or rank 0's with a
    warning where this rank's file lacks the loader (it saved a state without it)."""
    out: dict[str, Any] = {}
    for key, live in state.items():
        if not isinstance(live, DataLoader):
            continue
        if own is None or key in own:
            out[key] = (saved if own is None else own)[key]
            continue
        rank = own[RESERVED].get("rank", "?")
        warnings.warn(
            f"rank {rank}'s own file of step {step} has no position for loader {key!r} (that "
            "rank saved a state without it): rank 0's position stands in, so if this rank's "
            "loader had taken another number of batches, or draws from generators of its own "
            "(a sampler seeded per rank, the workers' seeds), its next batches differ from "
            "the interrupted run's; give Checkpointer.save the same loaders on every rank",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        out[key] = saved[key]
    return out
