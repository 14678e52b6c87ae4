"""Before a save: would each value load back with ``weights_only=True``, and can it be
pickled at all? A round trip in memory of the value less its tensors (:func:`save_refusal`),
made only when it holds something beyond plain data; ``Checkpointer`` and
``save_checkpoint`` refuse what fails before anything is written. And the loaders a
``Checkpointer`` cannot hold (:func:`refuse_loaders`).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainperf.checkpoint._allow import allow_data_only
from trainperf.checkpoint._formats import refusal_reason
from trainperf.errors import CheckpointError

__all__ = ["Refusal", "refuse_loaders", "save_refusal", "weights_only_refusal"]

_CHECKED_ITEMS = 100_000  # a value with more items than this is not checked


class _TooBig(Exception):
    """More items than :data:`_CHECKED_ITEMS`, or nested too deep, to check cheaply."""


# Leaves and containers that loading with weights_only=True always accepts: a value made of
# nothing else needs no round trip.
_SAFE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_PLAIN_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set, torch.Size)


_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exactly these: subclasses are checked
_PLAIN_LEAVES = frozenset((*_SAFE_LEAVES, *_TENSORS))


def _loads_back(value: Any) -> bool:
    """A tensor or a numeric numpy array (subclasses and object arrays are checked)."""
    if type(value) in _TENSORS:
        return True
    return type(value) is np.ndarray and value.dtype != object


def _holds_odd(value: Any) -> bool:
    """Whether ``value`` holds anything but plain containers of numbers, strings, dtypes,
    devices, tensors and numeric numpy arrays: a quick walk (a loop, no call per item) that
    decides whether the round trip is needed at all.

    Raises:
        _TooBig: more than :data:`_CHECKED_ITEMS` items, or nested deeper than 16.
    """
    stack, seen = [(value, 0)], 0
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t in _PLAIN_LEAVES:
            continue
        if t is np.ndarray:
            if v.dtype == object:
                return True
            continue
        if t not in _PLAIN_CONTAINERS:
            return True
        if depth > 16:
            raise _TooBig
        items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
        seen += len(items)
        if seen > _CHECKED_ITEMS:
            raise _TooBig
        stack.extend((x, depth + 1) for x in items if type(x) not in _PLAIN_LEAVES)
    return False


def _skeleton(value: Any, budget: list[int], depth: int = 0) -> Any:
    """``value`` with every tensor and numeric numpy array replaced by None (they load
    back, and copying them would cost what the save does), containers rebuilt as their
    own type.

    Raises:
        _TooBig: more than ``budget`` items (a long string counts a hundredth of its length).
    """
    budget[0] -= 1 + (len(value) // 100 if isinstance(value, (str, bytes)) else 0)
    if budget[0] < 0 or depth > 16:
        raise _TooBig
    if _loads_back(value):
        return None
    if isinstance(value, dict):
        items = [(_skeleton(k, budget, depth + 1), _skeleton(v, budget, depth + 1))
                 for k, v in value.items()]  # fmt: skip
        if isinstance(value, collections.defaultdict):
            return collections.defaultdict(value.default_factory, items)
        return _same_container(value, items, dict)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_skeleton(v, budget, depth + 1) for v in value]
        if hasattr(value, "_fields"):  # a namedtuple
            return _same_container(value, items, tuple, star=True)
        plain = next(t for t in (list, tuple, set, frozenset) if isinstance(value, t))
        return _same_container(value, items, plain)
    return value


def _same_container(value: Any, items: list[Any], plain: type, *, star: bool = False) -> Any:
    """``items`` as a container of ``value``'s type, which is what the check must see; the
    plain builtin ``plain`` where that type cannot be built from them."""
    try:
        return type(value)(*items) if star else type(value)(items)
    except Exception:
        return plain(items)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a value would not load back: ``reason``; ``unpicklable``: it cannot be pickled
    at all (rather than pickled into something ``weights_only=True`` refuses)."""

    reason: str
    unpicklable: bool = False


def save_refusal(value: Any) -> Refusal | None:
    """Why ``value`` could not be saved and loaded back with ``weights_only=True``, or None:
    a round trip in memory through ``torch.save`` of ``value`` less its tensors and numeric
    numpy arrays (they load back), made only when it holds something other than numbers,
    strings and such in plain containers, of up to 100,000 items (a long string counts a
    hundredth of its length).

    Example:
        >>> import threading
        >>> save_refusal({"epoch": 3, "w": torch.ones(2)}) is None
        True
        >>> refusal = save_refusal({"lock": threading.Lock()})
        >>> refusal.unpicklable, "lock" in refusal.reason
        (True, True)
    """
    try:
        if not _holds_odd(value):
            return None  # numbers, strings, tensors in plain containers: nothing to refuse
        skeleton = _skeleton(value, [_CHECKED_ITEMS])
    except _TooBig:
        return None
    buf = _pickled(skeleton, value)
    if not isinstance(buf, io.BytesIO):
        return buf
    buf.seek(0)
    try:
        with allow_data_only():
            torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as e:
        return Refusal(refusal_reason(str(e)))
    except Exception:
        return None  # an allowed class that fails to rebuild: for the load to say
    return None


def _pickled(skeleton: Any, value: Any) -> io.BytesIO | Refusal | None:
    """``skeleton`` saved in memory, or ``value`` where that fails (a container subclass may
    pickle only with its tensors in it; a value that fails too costs little, as torch.save
    pickles everything before it copies any tensor's data); the refusal when both fail;
    None when memory ran out, which says nothing about the value."""
    for attempt in (skeleton, value):
        buf = io.BytesIO()
        try:
            torch.save(attempt, buf)
            return buf
        except MemoryError:
            return None
        except Exception as e:
            error = e
    return Refusal(f"{type(error).__name__}: {error}", unpicklable=True)


def weights_only_refusal(value: Any) -> str | None:
    """Why ``load_checkpoint`` (``weights_only=True``) would refuse ``value``, or None (also
    for a value that cannot be pickled, which the save reports): :func:`save_refusal`'s.

    Example:
        >>> import http
        >>> weights_only_refusal({"epoch": 3, "lr": [0.1, 0.01]}) is None
        True
        >>> "HTTPStatus" in weights_only_refusal({"status": http.HTTPStatus.OK})
        True
        >>> "HTTPStatus" in weights_only_refusal({"w": torch.ones(2), "s": http.HTTPStatus.OK})
        True
    """
    refusal = save_refusal(value)
    return None if refusal is None or refusal.unpicklable else refusal.reason


def _find_loader(value: Any, kinds: tuple[type, ...]) -> tuple[str, Any] | None:
    """The first object of one of ``kinds`` in ``value`` or its dicts, lists and tuples (up
    to 8 deep), with its place (``"['train']"``), or None."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    left = _CHECKED_ITEMS  # a bigger entry is not looked through
    while stack:
        v, path = stack.pop()
        if isinstance(v, kinds):
            return "".join(f"[{k!r}]" for k in path), v
        if isinstance(v, torch.Tensor) or not isinstance(v, (Mapping, list, tuple)):
            continue
        left -= len(v)
        if len(path) >= 8 or left < 0:
            continue
        items = v.items() if isinstance(v, Mapping) else enumerate(v)
        stack.extend((x, (*path, k)) for k, x in items if type(x) not in _PLAIN_LEAVES)
    return None


def refuse_loaders(state: Mapping[str, Any]) -> None:
    """Before anything is written: refuse a loader that a checkpoint cannot hold, a
    ``trainperf.pipelines`` image loader anywhere in ``state`` or a DataLoader inside another
    entry (only a top-level one is saved, as its position).

    Raises:
        CheckpointError: where it is, its class, and the fix.
    """
    from trainperf.pipelines._base import ImageLoader  # imports no decoding library

    for key, value in state.items():
        if isinstance(value, DataLoader):
            continue
        found = _find_loader(value, (DataLoader, ImageLoader))
        if found is None:
            continue
        where, loader = f"state[{key!r}]{found[0]}", found[1]
        kind = type(loader).__name__
        if isinstance(loader, DataLoader):
            raise CheckpointError(
                f"Checkpointer.save: {where} is a {kind} inside another entry of state, and "
                "a loader is saved (as its position in the epoch) only as a top-level entry "
                "of state: give it a key of its own, state = {..., 'train_loader': loader}; "
                "nothing was written"
            )
        raise CheckpointError(
            f"Checkpointer.save: {where} is a trainperf.pipelines image loader ({kind}), "
            "which a checkpoint cannot hold (its decoders and workers cannot be saved, "
            "and its place in the epoch is not tracked); nothing was written. Save the "
            "epoch number instead (state['epoch'] = epoch) and after restore build the "
            "loader again, setting loader.epoch = state['epoch'] so its next pass is "
            "shuffled as that epoch's. Exact mid-epoch resume is supported for torch "
            "DataLoaders (top-level entries of state)"
        )
