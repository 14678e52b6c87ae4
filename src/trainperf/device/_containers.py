"""How :func:`to_device` and :func:`check_same_device` walk each type, and how a copy of a
container is rebuilt around its moved contents.

The traversal of a type (a leaf, a tensor, an object with its own ``.to``, a mapping, a
sequence, ...) is decided once per type by :func:`kind_of` and kept in a table.
:mod:`._move` walks exact dicts, lists, tuples and tensors itself and hands everything
else to :func:`rebuild`; :mod:`._same_device` reads the same table.
"""

from __future__ import annotations

import array
import collections
import copy
import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from typing import Any

import torch

# id(original) -> result, for one call; KEEP_ALIVE holds the values a container handed out
# as it was iterated (a mapping may make them on the fly), so no id is reused mid-call.
Memo = dict[int, Any]
KEEP_ALIVE = -1  # ids are never negative
PENDING: Any = object()  # memo value of a dataclass or namespace whose attributes are moving


# How a type is traversed; decided once per type, then looked up.
(
    LEAF,
    TENSOR,
    HAS_TO,
    STORAGE,
    NAMEDTUPLE,
    MAPPING,
    SEQUENCE,
    SET,
    DATACLASS,
    NAMESPACE,
) = range(10)
ATOMS: frozenset[type] = frozenset(
    (str, bytes, int, float, bool, complex, type(None), torch.Size, torch.dtype)
)
KINDS: dict[type, int] = dict.fromkeys(ATOMS, LEAF)
KINDS.update({torch.Tensor: TENSOR, torch.nn.Parameter: TENSOR})


def kind_of(cls: type) -> int:
    kind = KINDS.get(cls)
    if kind is not None:
        return kind
    if issubclass(cls, torch.Tensor):
        kind = TENSOR
    elif issubclass(cls, (str, bytes, bytearray, array.array, int, float, torch.Size)):
        kind = LEAF
    elif issubclass(cls, (torch.UntypedStorage, torch.TypedStorage)):
        kind = STORAGE  # their .to takes the device as a keyword only
    elif callable(getattr(cls, "to", None)):
        # Before the container checks: a mapping with its own .to (Hugging Face's
        # BatchEncoding) knows best how to move itself.
        kind = HAS_TO
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        kind = NAMEDTUPLE
    elif issubclass(cls, Mapping):
        kind = MAPPING
    elif issubclass(cls, (list, tuple, MutableSequence)):  # deque, UserList, ...
        kind = SEQUENCE
    elif issubclass(cls, (set, frozenset)):
        kind = SET
    elif dataclasses.is_dataclass(cls):
        kind = DATACLASS
    elif issubclass(cls, types.SimpleNamespace):
        kind = NAMESPACE
    else:
        kind = LEAF
    if len(KINDS) < 4096:  # types made on the fly (namedtuple factories) must not leak
        KINDS[cls] = kind
    return kind


def rebuild(
    obj: Any,
    kind: int,
    move: Callable[[Any, Memo], Any],
    memo: Memo,
    device: torch.device,
    skip: frozenset[Any],
) -> Any:
    """Everything but tensors, dicts, lists and tuples of exact types (the hot path's)."""
    if kind == HAS_TO:
        target = _own_copy(obj)
        moved = target.to(device)
        # A .to that moves in place and forgets to return self must not turn the batch into
        # None (Lightning keeps the object too).
        return target if moved is None else moved
    if kind == STORAGE:
        return _move_storage(obj, device)
    if kind == NAMEDTUPLE:
        return _with_state(obj, type(obj)(*[move(v, memo) for v in obj]))
    if kind == MAPPING:
        return _move_mapping(obj, move, memo, skip)
    if kind == SEQUENCE:
        return _move_sequence(obj, move, memo)
    if kind == SET:
        return type(obj)(move(v, memo) for v in obj)
    if kind == DATACLASS:
        return _move_attributes(obj, dataclass_items(obj), move, memo)
    if kind == NAMESPACE:
        return _move_attributes(obj, list(vars(obj).items()), move, memo)
    return obj


def _own_copy(obj: Any) -> Any:
    """A shallow copy for an object's own ``.to`` to work on: Hugging Face's
    ``BatchEncoding.to`` replaces its ``data`` in place, which would move the caller's batch
    too. The copy gets its own dicts, lists and sets, for a ``.to`` that moves the tensors
    inside those in place. A module is its own (``Module.to`` moves it in place, as torch
    does); an object that cannot be copied is moved itself."""
    if isinstance(obj, torch.nn.Module):
        return obj
    try:
        new = copy.copy(obj)
    except Exception:  # any failure of a user's __copy__ or __reduce__
        return obj
    _unshare(new, obj)
    return new


def move_tensor(
    x: torch.Tensor,
    device: torch.device,
    dtype: Any,
    nb: bool,
    memory_format: torch.memory_format = torch.preserve_format,
) -> Any:
    """A tensor subclass; a Parameter stays one, a leaf (as ``Module.to`` leaves it)."""
    if not isinstance(x, torch.nn.Parameter):
        return x.to(device, dtype, non_blocking=nb, memory_format=memory_format)
    with torch.no_grad():
        moved = x.to(device, dtype, non_blocking=nb, memory_format=memory_format)
    if type(moved) is not torch.Tensor:  # x itself, or what a subclass's own .to made
        return moved
    return torch.nn.Parameter(moved, requires_grad=x.requires_grad)


def _move_storage(storage: Any, device: torch.device) -> Any:
    if isinstance(storage, torch.TypedStorage):  # deprecated by PyTorch; its own .to
        return storage.to(device=device)
    # Through a byte tensor, which reaches every device (UntypedStorage.to has no meta).
    as_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    moved = as_bytes.to(device)
    return storage if moved is as_bytes else moved.untyped_storage()


@functools.lru_cache(maxsize=256)
def _field_names(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    """A dataclass's field names, and those not to take from its ``__dict__`` as others."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    return names, frozenset(names).union(_cached_names(cls))


def dataclass_items(obj: Any) -> list[tuple[str, Any]]:
    """A dataclass's fields, then the other attributes in its ``__dict__`` (those set in
    ``__post_init__``), without ``cached_property`` values. A field not set yet (an
    ``init=False`` field without a default) is left out."""
    cls: type = type(obj)
    names, not_others = _field_names(cls)
    missing = object()
    items = [(name, getattr(obj, name, missing)) for name in names]
    items = [(name, value) for name, value in items if value is not missing]
    state = getattr(obj, "__dict__", None)
    if state:
        items += [(name, value) for name, value in state.items() if name not in not_others]
    return items


def _move_attributes(
    obj: Any,
    items: list[tuple[str, Any]],
    move: Callable[[Any, Memo], Any],
    memo: Memo,
) -> Any:
    """Move a dataclass's or namespace's attributes into a shallow copy, or return ``obj``
    if none moved. Copy and set rather than call ``__init__``: works for frozen classes,
    ``init=False`` fields and InitVars alike, and does not re-run ``__post_init__``."""
    key = id(obj)
    memo[key] = PENDING  # a reference back to obj from inside makes the copy (see _mover)
    changed = [(name, moved) for name, value in items if (moved := move(value, memo)) is not value]
    new = memo[key]
    if new is PENDING:
        if not changed:
            memo[key] = obj
            return obj
        new = memo[key] = copy.copy(obj)
    for name, value in changed:
        object.__setattr__(new, name, value)
    _forget_cached(new)
    return new


def _move_mapping(
    obj: Mapping[Any, Any],
    move: Callable[[Any, Memo], Any],
    memo: Memo,
    skip: frozenset[Any],
) -> Any:
    if isinstance(obj, collections.ChainMap):
        return _move_chain_map(obj, move, memo)
    before = list(obj.items())
    memo.setdefault(KEEP_ALIVE, []).append(before)
    if not isinstance(obj, MutableMapping):
        after = [(k, v if k in skip else move(v, memo)) for k, v in before]
        unchanged = all(new is old for (_, new), (_, old) in zip(after, before, strict=True))
        return _construct(obj, dict(after), unchanged)
    # A shallow copy keeps the subclass and its state (defaultdict's factory, attributes).
    new = memo[id(obj)] = copy.copy(obj)
    _unshare(new, obj)
    after = [(k, v if k in skip else move(v, memo)) for k, v in before]
    changed = [
        (key, old, value)
        for (key, old), (_, value) in zip(before, after, strict=True)
        if value is not old
    ]
    for key, _, value in changed:
        new[key] = value
    if any(obj[key] is value for key, _, value in changed):
        # The copy still writes into the caller's storage (a slot, a nested store object):
        # put the caller's values back and build a fresh mapping from the moved items.
        for key, old, _ in changed:
            obj[key] = old
        new = memo[id(obj)] = _construct(obj, dict(after), False)
        return new
    _forget_cached(new)
    return new


def _move_chain_map(
    obj: collections.ChainMap[Any, Any], move: Callable[[Any, Memo], Any], memo: Memo
) -> Any:
    """Every map of a ``ChainMap`` moved, the shadowed values too: moving only what it shows
    into ``maps[0]`` would keep the old tensors alive in ``maps[1:]``."""
    new = memo[id(obj)] = copy.copy(obj)  # keeps a subclass and its attributes
    _unshare(new, obj)
    new.maps = [move(m, memo) for m in obj.maps]
    _forget_cached(new)
    return new


def _move_sequence(obj: Any, move: Callable[[Any, Memo], Any], memo: Memo) -> Any:
    if isinstance(obj, tuple):
        moved_items = [move(v, memo) for v in obj]
        unchanged = all(now is was for now, was in zip(moved_items, obj, strict=True))
        if unchanged and hasattr(type(obj), "n_sequence_fields"):
            # A struct sequence (os.stat_result, time.struct_time) rebuilt from its items
            # alone would lose the fields it keeps outside them (st_mtime_ns, tm_zone).
            return obj
        return _with_state(obj, _construct(obj, moved_items, unchanged))
    if isinstance(obj, list):
        new_list = memo[id(obj)] = copy.copy(obj)
        new_list[:] = [move(v, memo) for v in obj]
        _forget_cached(new_list)
        return new_list
    # deque, UserList and other mutable sequences: a copy keeps maxlen and attributes.
    before = list(obj)
    memo.setdefault(KEEP_ALIVE, []).append(before)
    new = memo[id(obj)] = copy.copy(obj)
    _unshare(new, obj)
    moved = [move(v, memo) for v in before]
    new.clear()
    new.extend(moved)
    if len(obj) != len(before) or any(now is not was for now, was in zip(obj, before, strict=True)):
        # The copy shares the caller's storage (a slot): restore it, build a fresh one.
        obj.clear()
        obj.extend(before)
        new = memo[id(obj)] = _construct(obj, moved, False)
    _forget_cached(new)
    return new


def _with_state(obj: Any, new: Any) -> Any:
    """Give a rebuilt tuple (or namedtuple) subclass the original's instance attributes, as
    ``copy.copy`` gives a list subclass its own."""
    state = getattr(obj, "__dict__", None)
    if state:
        vars(new).update(state)
        _forget_cached(new)
    return new


def _unshare(new: Any, old: Any) -> None:
    """Give a shallow copy its own dicts, lists and sets where it shares the original's.

    A ``MutableMapping`` that keeps its items in an attribute (``self._data = {}``) would
    otherwise write the moved values into the caller's batch too.
    """
    state = getattr(new, "__dict__", None)
    if not state:
        return
    old_state = vars(old)
    for name, value in list(state.items()):
        if isinstance(value, (dict, list, set)) and old_state.get(name) is value:
            state[name] = copy.copy(value)


@functools.lru_cache(maxsize=256)
def _cached_names(cls: type) -> tuple[str, ...]:
    names = {
        attr.attrname
        for klass in cls.__mro__
        for attr in vars(klass).values()
        if isinstance(attr, functools.cached_property) and attr.attrname
    }
    return tuple(sorted(names))


def _forget_cached(obj: Any) -> None:
    """Drop ``functools.cached_property`` values a copy took over: they were computed from
    the tensors before the move, so they sit on the old device (Lightning drops them too)."""
    cls: type = type(obj)
    names = _cached_names(cls)
    state = getattr(obj, "__dict__", None) if names else None
    if state is not None:
        for name in names:
            state.pop(name, None)


def _construct(obj: Any, contents: Any, unchanged: bool) -> Any:
    """``type(obj)`` built from ``contents``; ``obj`` itself where that type cannot be built
    so and nothing in it moved (``sys.version_info``, a read-only mapping proxy)."""
    cls = type(obj)
    try:
        return cls(contents)
    except TypeError as e:
        if unchanged:
            return obj
        raise TypeError(
            f"to_device cannot rebuild a {cls.__qualname__} from its moved contents ({e}); "
            "give the class a .to(device) method"
        ) from e
