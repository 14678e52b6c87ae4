"""Nested batches: :func:`to_device` moves them, :func:`check_same_device` checks them.

Both walk the same containers: dicts and other mappings, lists, tuples, namedtuples, sets and
dataclasses; each type's traversal is decided once and kept in a table.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping, MutableMapping
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


def _rebuild(obj: Any, kind: int, move: Callable[[Any], Any], device: torch.device) -> Any:
    """Everything but exact tensors, dicts, lists and tuples (the hot path handles those)."""
    cls = type(obj)
    if kind == _HAS_TO:
        return obj.to(device)
    if kind == _NAMEDTUPLE:
        return cls(*[move(v) for v in obj])
    if kind == _MAPPING:
        if isinstance(obj, MutableMapping):
            # A shallow copy keeps the subclass and its state (defaultdict's factory).
            new = copy.copy(obj)
            for key, value in obj.items():
                new[key] = move(value)
            return new
        return _construct(cls, {k: move(v) for k, v in obj.items()})
    if kind == _SEQUENCE:
        if isinstance(obj, list):
            new_list = copy.copy(obj)
            new_list[:] = [move(v) for v in obj]
            return new_list
        return _construct(cls, [move(v) for v in obj])
    if kind == _SET:
        return cls(move(v) for v in obj)
    if kind == _DATACLASS:
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
        return new_obj
    return obj


def _construct(cls: type, contents: Any) -> Any:
    try:
        return cls(contents)
    except TypeError as e:
        raise TypeError(
            f"to_device cannot rebuild a {cls.__qualname__} from its moved contents ({e}); "
            "give the class a .to(device) method"
        ) from e


@functools.lru_cache(maxsize=64)
def _mover(dev: torch.device, nb: bool, dtype: torch.dtype | None) -> Callable[[Any], Any]:
    # Exact-type tests come first, so plain batches (dicts of lists of tensors) never reach
    # the kind table, and tensors inside containers move inline, without a Python call each:
    # such a call costs about as much as the rest of the traversal. Hence two variants.
    tensor = torch.Tensor
    kinds = _kinds

    def other(x: Any, cls: type) -> Any:
        kind = kinds.get(cls)
        if kind is None:
            kind = _kind(cls)
        if kind == _LEAF:
            return x
        if kind == _TENSOR:
            return x.to(dev, target(x.dtype), non_blocking=nb)
        return _rebuild(x, kind, move, dev)

    if dtype is None:
        target: Callable[[torch.dtype], torch.dtype | None] = lambda _: None  # noqa: E731

        def move(x: Any) -> Any:
            cls = type(x)
            if cls is tensor:
                return x.to(dev, non_blocking=nb)
            if cls is list:
                return [v.to(dev, non_blocking=nb) if type(v) is tensor else move(v) for v in x]
            if cls is dict:
                return {
                    k: v.to(dev, non_blocking=nb) if type(v) is tensor else move(v)
                    for k, v in x.items()
                }
            if cls is tuple:
                return tuple(
                    [v.to(dev, non_blocking=nb) if type(v) is tensor else move(v) for v in x]
                )
            return x if cls in _ATOMS else other(x, cls)

        return move

    # source dtype -> new dtype; None (keep it) for ints, bools, complex
    target = dict.fromkeys(_FLOAT_DTYPES, dtype).get

    def move_cast(x: Any) -> Any:
        cls = type(x)
        if cls is tensor:
            return x.to(dev, target(x.dtype), non_blocking=nb)
        if cls is list:
            return [
                v.to(dev, target(v.dtype), non_blocking=nb) if type(v) is tensor else move(v)
                for v in x
            ]
        if cls is dict:
            return {
                k: v.to(dev, target(v.dtype), non_blocking=nb) if type(v) is tensor else move(v)
                for k, v in x.items()
            }
        if cls is tuple:
            return tuple(
                [
                    v.to(dev, target(v.dtype), non_blocking=nb) if type(v) is tensor else move(v)
                    for v in x
                ]
            )
        return x if cls in _ATOMS else other(x, cls)

    move = move_cast
    return move


def to_device(
    obj: T,
    device: str | int | torch.device,
    *,
    non_blocking: bool = True,
    dtype: torch.dtype | None = None,
) -> T:
    """Move every tensor inside ``obj`` to ``device``, keeping the containers as they are.

    Walks dicts (``OrderedDict``, ``defaultdict`` and other mappings keep their type),
    lists, tuples, namedtuples, sets and dataclasses (frozen ones too); calls
    ``x.to(device)`` on objects that have a ``.to`` method (modules, custom batch classes);
    leaves everything else (str, int, None, NumPy arrays…) untouched. A tensor already on
    ``device`` with the right dtype is returned as is, not copied.

    ``non_blocking=True`` only overlaps the copy with other work for a *pinned* CPU tensor
    going to CUDA (``pin_memory=True`` in the DataLoader); every other copy is synchronous
    anyway. A CUDA-to-CPU non-blocking copy returns before the data is there: call
    ``torch.cuda.synchronize()`` before reading it.

    Args:
        obj: a tensor or any nesting of the containers above.
        device: ``"cuda:1"``, ``1`` (meaning ``cuda:1``) or a ``torch.device``. There is no
            default and None is refused (``TypeError``): a batch must go where its model is,
            which "the best device" need not be.
        non_blocking: allow asynchronous host-to-device copies (see above).
        dtype: cast floating-point tensors to this floating dtype on the way; integer and
            bool tensors (labels, indices, masks) keep theirs. Not passed to ``.to`` objects.

    Returns:
        A structure like ``obj`` with its tensors on ``device``.

    Raises:
        ValueError: ``device`` is not a valid device, or ``dtype`` is not floating-point.
        TypeError: ``device`` has the wrong type (None included), or a container cannot be
            rebuilt.
        DeviceError: CUDA or MPS asked for but not available, or a CUDA index beyond the
            visible GPUs (see :func:`trainperf.device.resolve_device`).

    Example:
        >>> batch = {"x": torch.ones(2), "y": [torch.tensor([1]), "id-7"]}
        >>> out = to_device(batch, "meta", dtype=torch.float16)
        >>> out["x"].device, out["x"].dtype, out["y"][0].dtype, out["y"][1]
        (device(type='meta'), torch.float16, torch.int64, 'id-7')
    """
    dev = resolve_device(device, allowed=None, auto=False)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"dtype casts floating-point tensors only, so it must be a floating dtype such as "
            f"torch.bfloat16, got {dtype!r}"
        )
    move = _mover(dev, non_blocking, dtype)
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
        if isinstance(obj, Mapping):
            items = list(obj.items())
        elif dataclasses.is_dataclass(obj):
            items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        else:
            try:
                items = list(vars(obj).items())
            except TypeError:  # no __dict__ (__slots__ or a C type): nothing to walk
                return
        for key, value in items:
            where = f"{path}[{key!r}]" if isinstance(obj, Mapping) else f"{path}.{key}"
            _named_tensors(value, where, out, seen)
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
            ``BatchEncoding``) by item, dataclasses by field, others by attribute.
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
