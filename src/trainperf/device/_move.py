"""Nested batches: :func:`to_device` moves them, :func:`check_same_device` checks them.

Both walk the same containers: dicts and other mappings, lists, tuples, namedtuples, sets and
dataclasses; each type's traversal is decided once and kept in a table.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping
from typing import Any, TypeVar

import torch

from trainperf.device._resolve import resolve_device
from trainperf.errors import DeviceMismatchError

T = TypeVar("T")


# How a type is traversed; decided once per type, then looked up.
_LEAF, _TENSOR, _HAS_TO, _NAMEDTUPLE, _MAPPING, _SEQUENCE, _SET, _DATACLASS = range(8)
_ATOMS: frozenset[type] = frozenset(
    (str, bytes, int, float, bool, complex, type(None), torch.Size, torch.dtype)
)
_kinds: dict[type, int] = dict.fromkeys(_ATOMS, _LEAF)
_kinds.update({torch.Tensor: _TENSOR, torch.nn.Parameter: _TENSOR})
_FLOAT_DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point},
    key=str,
)


def _kind(cls: type) -> int:
    kind = _kinds.get(cls)
    if kind is not None:
        return kind
    if issubclass(cls, torch.Tensor):
        kind = _TENSOR
    elif issubclass(cls, (str, bytes, int, float, torch.Size)):
        kind = _LEAF
    elif callable(getattr(cls, "to", None)):
        # Before the container checks: a mapping with its own .to (Hugging Face's
        # BatchEncoding) knows best how to move itself.
        kind = _HAS_TO
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        kind = _NAMEDTUPLE
    elif issubclass(cls, Mapping):
        kind = _MAPPING
    elif issubclass(cls, (list, tuple)):
        kind = _SEQUENCE
    elif issubclass(cls, (set, frozenset)):
        kind = _SET
    elif dataclasses.is_dataclass(cls):
        kind = _DATACLASS
    else:
        kind = _LEAF
    if len(_kinds) < 4096:  # types made on the fly (namedtuple factories) must not leak
        _kinds[cls] = kind
    return kind


def _rebuild(
    obj: Any, kind: int, move: Callable[[Any], Any], device: torch.device, skip: frozenset[Any]
) -> Any:
    """Everything but exact tensors, dicts, lists and tuples (the hot path handles those)."""
    cls = type(obj)
    if kind == _HAS_TO:
        moved = obj.to(device)
        # A .to that moves in place and forgets to return self must not turn the batch into
        # None (Lightning keeps the object too).
        return obj if moved is None else moved
    if kind == _NAMEDTUPLE:
        return cls(*[move(v) for v in obj])
    if kind == _MAPPING:
        return _move_mapping(obj, move, skip)
    if kind == _SEQUENCE:
        if isinstance(obj, list):
            new_list = copy.copy(obj)
            new_list[:] = [move(v) for v in obj]
            _forget_cached(new_list)
            return new_list
        return _construct(cls, [move(v) for v in obj])
    if kind == _SET:
        return cls(move(v) for v in obj)
    if kind == _DATACLASS:
        return _move_dataclass(obj, move)
    return obj


def _move_dataclass(obj: Any, move: Callable[[Any], Any]) -> Any:
    changed = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        moved = move(value)
        if moved is not value:
            changed[field.name] = moved
    if not changed:
        return obj
    # Copy and set rather than call __init__: works for frozen classes, init=False
    # fields and InitVars alike, and does not re-run __post_init__.
    new_obj = copy.copy(obj)
    for name, value in changed.items():
        object.__setattr__(new_obj, name, value)
    _forget_cached(new_obj)
    return new_obj


def _move_mapping(obj: Mapping[Any, Any], move: Callable[[Any], Any], skip: frozenset[Any]) -> Any:
    before = list(obj.items())
    after = [(k, v if k in skip else move(v)) for k, v in before]
    if not isinstance(obj, MutableMapping):
        return _construct(type(obj), dict(after))
    # A shallow copy keeps the subclass and its state (defaultdict's factory, attributes).
    new = copy.copy(obj)
    _unshare(new, obj)
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
        return _construct(type(obj), dict(after))
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


def _construct(cls: type, contents: Any) -> Any:
    try:
        return cls(contents)
    except TypeError as e:
        raise TypeError(
            f"to_device cannot rebuild a {cls.__qualname__} from its moved contents ({e}); "
            "give the class a .to(device) method"
        ) from e


# Targets a copy never overlaps with the host for: the CPU itself (and a device-to-host copy
# read before it lands is the documented risk of non_blocking), MPS (a race, pytorch#83015,
# which is why Lightning never asks there either) and meta (no data moves).
_SYNC_TARGETS = frozenset({"cpu", "mps", "meta"})


def copies_async(source: torch.device, pinned: bool, target: torch.device) -> bool:
    """Whether :func:`to_device` asks for ``non_blocking=True`` for one tensor's copy.

    Only a pinned (page-locked) host tensor going to an accelerator (CUDA, XPU, ...): that
    is the one copy that overlaps with other work, and a device-to-host copy made
    asynchronously could be read before its data lands. The choice follows Lightning's
    ``move_data_to_device``, which never passes it for CPU or MPS targets.

    Args:
        source: the tensor's device.
        pinned: whether the tensor is in pinned memory (``tensor.is_pinned()``).
        target: where it goes.

    Returns:
        True to pass ``non_blocking=True`` (when the caller allowed it).

    Example:
        >>> cpu, cuda = torch.device("cpu"), torch.device("cuda")
        >>> copies_async(cpu, True, cuda), copies_async(cpu, False, cuda)
        (True, False)
        >>> copies_async(cuda, False, cpu), copies_async(cpu, True, cpu)
        (False, False)
    """
    return pinned and source.type == "cpu" and target.type not in _SYNC_TARGETS


_HOST = torch.device("cpu")


@functools.lru_cache(maxsize=64)
def _mover(
    dev: torch.device, nb: bool, dtype: torch.dtype | None, skip: frozenset[Any]
) -> Callable[[Any], Any]:
    # ``nb`` is True only where a pinned host tensor would copy asynchronously to ``dev``
    # (copies_async); per tensor it then takes ``is_pinned()``, which only host tensors
    # can be, so ``nb and x.is_pinned()`` is copies_async(x.device, x.is_pinned(), dev).
    # dtype None: keep every dtype; else source dtype -> new dtype, None for ints and bools.
    cast = _keep_dtype if dtype is None else dict.fromkeys(_FLOAT_DTYPES, dtype).get
    walk: list[Callable[[Any], Any]] = []

    def other(x: Any, cls: type) -> Any:
        kind = _kinds.get(cls)
        if kind is None:
            kind = _kind(cls)
        if kind == _LEAF:
            return x
        if kind == _TENSOR:
            return x.to(dev, cast(x.dtype), non_blocking=nb and x.is_pinned())
        return _rebuild(x, kind, walk[0], dev, skip)

    build = _walker if dtype is None else _casting_walker
    walk.append(build(dev, nb, cast, not skip, other))
    return walk[0]


def _keep_dtype(_: torch.dtype) -> None:
    return None


def _walker(
    dev: torch.device,
    nb: bool,
    cast: Callable[[torch.dtype], torch.dtype | None],
    plain_dicts: bool,
    other: Callable[[Any, type], Any],
) -> Callable[[Any], Any]:
    # Exact-type tests come first, so plain batches (dicts of lists of tensors) never reach
    # the kind table, and tensors inside containers move inline, without a Python call each:
    # such a call costs about as much as the rest of the traversal. Hence two walkers, this
    # one without a cast. With skip_keys, dicts take the slow path (``other``).
    tensor = torch.Tensor

    def move(x: Any) -> Any:
        cls = type(x)
        if cls is tensor:
            return x.to(dev, non_blocking=nb and x.is_pinned())
        if cls is list:
            return [
                v.to(dev, non_blocking=nb and v.is_pinned()) if type(v) is tensor else move(v)
                for v in x
            ]
        if cls is dict and plain_dicts:
            return {
                k: v.to(dev, non_blocking=nb and v.is_pinned()) if type(v) is tensor else move(v)
                for k, v in x.items()
            }
        if cls is tuple:
            return tuple(
                [
                    v.to(dev, non_blocking=nb and v.is_pinned()) if type(v) is tensor else move(v)
                    for v in x
                ]
            )
        return x if cls in _ATOMS else other(x, cls)

    return move


def _casting_walker(
    dev: torch.device,
    nb: bool,
    cast: Callable[[torch.dtype], torch.dtype | None],
    plain_dicts: bool,
    other: Callable[[Any, type], Any],
) -> Callable[[Any], Any]:
    tensor = torch.Tensor

    def move(x: Any) -> Any:
        cls = type(x)
        if cls is tensor:
            return x.to(dev, cast(x.dtype), non_blocking=nb and x.is_pinned())
        if cls is list:
            return [
                v.to(dev, cast(v.dtype), non_blocking=nb and v.is_pinned())
                if type(v) is tensor
                else move(v)
                for v in x
            ]
        if cls is dict and plain_dicts:
            return {
                k: v.to(dev, cast(v.dtype), non_blocking=nb and v.is_pinned())
                if type(v) is tensor
                else move(v)
                for k, v in x.items()
            }
        if cls is tuple:
            return tuple(
                [
                    v.to(dev, cast(v.dtype), non_blocking=nb and v.is_pinned())
                    if type(v) is tensor
                    else move(v)
                    for v in x
                ]
            )
        return x if cls in _ATOMS else other(x, cls)

    return move


def _skip_set(skip_keys: str | Iterable[Hashable] | None) -> frozenset[Any]:
    if skip_keys is None:
        return frozenset()
    if isinstance(skip_keys, str):
        return frozenset((skip_keys,))
    if isinstance(skip_keys, (bytes, bytearray)):
        raise _skip_keys_error(skip_keys, "bytes are not a list of keys")
    try:
        return frozenset(skip_keys)
    except TypeError as e:
        raise _skip_keys_error(skip_keys, str(e)) from e


def _skip_keys_error(skip_keys: object, why: str) -> TypeError:
    return TypeError(
        f"skip_keys must be a str or an iterable of hashable keys, such as ['labels'], "
        f"got {skip_keys!r} ({why})"
    )


def to_device(
    obj: T,
    device: str | int | torch.device,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
    skip_keys: str | Iterable[Hashable] | None = None,
) -> T:
    """Move every tensor inside ``obj`` to ``device``, keeping the containers as they are.

    Walks dicts (``OrderedDict``, ``defaultdict`` and other mappings keep their type),
    lists, tuples, namedtuples, sets and dataclasses (frozen ones too); calls
    ``x.to(device)`` on objects that have a ``.to`` method (modules, custom batch classes),
    keeping ``x`` itself if that ``.to`` returns None; leaves everything else (str, int,
    None, NumPy arrays…) untouched. A tensor already on ``device`` with the right dtype is
    returned as is, not copied. ``obj`` itself is never changed: containers are copied, also
    a mapping that keeps its items in an attribute, and values of ``functools.cached_property``
    are dropped from the copies (they were computed on the old device).

    ``non_blocking=True`` is passed on only where it helps and is safe: for a *pinned* CPU
    tensor (``pin_memory=True`` in the DataLoader) going to an accelerator such as CUDA.
    Copies to the CPU (device-to-host ones included) and to MPS stay synchronous, so their
    result can be read at once (as Lightning's ``move_data_to_device`` does).

    Args:
        obj: a tensor or any nesting of the containers above.
        device: ``"cuda:1"``, ``1`` (meaning ``cuda:1``) or a ``torch.device``. There is no
            default and None is refused (``TypeError``): a batch must go where its model is,
            which "the best device" need not be.
        non_blocking: allow asynchronous host-to-accelerator copies from pinned memory.
        dtype: cast floating-point tensors to this floating dtype on the way; integer and
            bool tensors (labels, indices, masks) keep theirs. Not passed to ``.to`` objects.
        skip_keys: a key, or several, whose values are left as they are in every mapping
            at any depth (Accelerate's ``send_to_device`` has the same option). Objects
            with their own ``.to`` (Hugging Face's ``BatchEncoding``) move themselves whole.

    Returns:
        A structure like ``obj`` with its tensors on ``device``.

    Raises:
        ValueError: ``device`` is not a valid device, or ``dtype`` is not floating-point.
        TypeError: ``device`` has the wrong type (None included), ``skip_keys`` is neither a
            str nor an iterable of hashable keys, or a container cannot be rebuilt.
        DeviceError: CUDA or MPS asked for but not available, or a CUDA index beyond the
            visible GPUs (see :func:`trainperf.device.resolve_device`).

    Example:
        >>> batch = {"x": torch.ones(2), "y": [torch.tensor([1]), "id-7"]}
        >>> out = to_device(batch, "meta", dtype=torch.float16)
        >>> out["x"].device, out["x"].dtype, out["y"][0].dtype, out["y"][1]
        (device(type='meta'), torch.float16, torch.int64, 'id-7')
        >>> to_device(batch, "meta", skip_keys="y")["y"] is batch["y"]
        True
    """
    dev = resolve_device(device, allowed=None, auto=False)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"dtype casts floating-point tensors only, so it must be a floating dtype such as "
            f"torch.bfloat16, got {dtype!r}"
        )
    nb = bool(non_blocking) and copies_async(_HOST, True, dev)
    move = _mover(dev, nb, dtype, _skip_set(skip_keys))
    result: T = move(obj)
    return result


# --------------------------------------------------------------------------- same-device check


def _named_tensors(
    obj: Any, path: str, out: list[tuple[str, torch.Tensor]], seen: set[int] | None = None
) -> None:
    kind = _kind(type(obj))
    if kind == _TENSOR:
        out.append((path, obj))
    elif isinstance(obj, torch.nn.Module):
        out += [(f"{path}.{name}", p) for name, p in obj.named_parameters()]
        out += [(f"{path}.{name}", b) for name, b in obj.named_buffers()]
    elif kind == _HAS_TO:
        # to_device lets these move themselves, but checking must look inside: a Hugging Face
        # BatchEncoding is a Mapping, a batch class is often a dataclass, others keep their
        # tensors as attributes. `seen` stops reference cycles between such objects.
        seen = set() if seen is None else seen
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for where, value in _children(obj):
            _named_tensors(value, path + where, out, seen)
    elif kind == _MAPPING:
        for key, value in obj.items():
            _named_tensors(value, f"{path}[{key!r}]", out, seen)
    elif kind in (_NAMEDTUPLE, _DATACLASS):
        names = obj._fields if kind == _NAMEDTUPLE else [f.name for f in dataclasses.fields(obj)]
        for name in names:
            _named_tensors(getattr(obj, name), f"{path}.{name}", out, seen)
    elif kind in (_SEQUENCE, _SET):
        for i, value in enumerate(obj):
            _named_tensors(value, f"{path}[{i}]", out, seen)


def _children(obj: Any) -> list[tuple[str, Any]]:
    """What an object with its own ``.to`` holds, each with its path suffix: a mapping by
    item, a ``PackedSequence`` by field (``batch_sizes`` left out), a dataclass by field,
    others by attribute, and a sequence or set without a ``__dict__`` by position. Other
    namedtuples are not walked: their ``.to`` decides where each field goes."""
    if isinstance(obj, Mapping):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, torch.nn.utils.rnn.PackedSequence):
        # batch_sizes stays on the CPU wherever the data is (its .to and the RNNs want it
        # there): not a mismatch. sorted_indices and unsorted_indices move with the data.
        return [(f".{name}", getattr(obj, name)) for name in obj._fields if name != "batch_sizes"]
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        # A user's NamedTuple batch whose .to keeps some fields on the CPU on purpose (the
        # lengths pack_padded_sequence wants there): its author decides placement.
        return []
    if dataclasses.is_dataclass(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    try:
        return [(f".{k}", v) for k, v in vars(obj).items()]
    except TypeError:  # no __dict__ (__slots__ or a C type)
        pass
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    return []


def check_same_device(
    module: torch.nn.Module | None, *tensors: Any, **named_tensors: Any
) -> torch.device:
    """Check a module's parameters and buffers and the inputs share one device.

    Call it before the forward pass to get an error naming the culprits instead of
    PyTorch's "Expected all tensors to be on the same device".

    Args:
        module: the model (or None to check the inputs alone).
        *tensors: inputs, possibly nested in containers (named ``arg0``, ``arg1``…).
            Objects with their own ``.to`` are looked inside too: mappings (Hugging Face's
            ``BatchEncoding``) by item, ``PackedSequence`` (whose ``batch_sizes`` stays
            on the CPU by design) and dataclasses by field, others by attribute (or,
            without a ``__dict__``, lists and tuples by position). Other namedtuples with
            their own ``.to`` are not looked inside: their ``.to`` places each field.
        **named_tensors: inputs by name, possibly nested.

    Returns:
        The one device they all live on.

    Raises:
        DeviceMismatchError: more than one device; the message lists, per device, a few of
            the parameters, buffers and inputs found there.
        ValueError: there is no tensor at all to check.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> check_same_device(model, torch.ones(3, 2), batch={"x": torch.ones(3, 2)})
        device(type='cpu')
    """
    found: list[tuple[str, torch.Tensor]] = []
    if module is not None:
        found += [(f"parameter {n}", p) for n, p in module.named_parameters()]
        found += [(f"buffer {n}", b) for n, b in module.named_buffers()]
    inputs: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(tensors):
        _named_tensors(value, f"arg{i}", inputs)
    for name, value in named_tensors.items():
        _named_tensors(value, name, inputs)
    found += [(f"input {n}", t) for n, t in inputs]
    if not found:
        raise ValueError(
            "check_same_device found no tensors: pass a module with parameters "
            "or at least one tensor input"
        )
    by_device: dict[torch.device, list[str]] = {}
    for name, t in found:
        by_device.setdefault(t.device, []).append(name)
    if len(by_device) == 1:
        return next(iter(by_device))
    lines = []
    for dev, names in by_device.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"  {dev}: {shown}")
    first = next(iter(by_device))
    raise DeviceMismatchError(
        f"tensors are on {len(by_device)} devices, but one forward pass needs them on one:\n"
        + "\n".join(lines)
        + f"\nFix: move both to one device, e.g. model.to({str(first)!r}) and "
        f"batch = trainperf.to_device(batch, {str(first)!r})."
    )
