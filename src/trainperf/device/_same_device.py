""":func:`check_same_device`: a model and its inputs on one device, or an error naming them.

The inputs are walked like :func:`trainperf.device.to_device` walks a batch (the type table
of :mod:`._containers`), and objects with their own ``.to`` are looked inside too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch

from trainperf.device._containers import (
    DATACLASS,
    HAS_TO,
    LEAF,
    MAPPING,
    NAMEDTUPLE,
    NAMESPACE,
    SEQUENCE,
    SET,
    STORAGE,
    TENSOR,
    dataclass_items,
    kind_of,
)
from trainperf.errors import DeviceMismatchError


def _named_tensors(
    obj: Any, path: str, out: list[tuple[str, torch.Tensor]], seen: dict[int, Any]
) -> None:
    kind = kind_of(type(obj))
    if kind == TENSOR:
        out.append((path, obj))
        return
    if kind in (LEAF, STORAGE) or id(obj) in seen:
        return
    seen[id(obj)] = obj  # stops reference cycles; holding obj keeps its id from being reused
    if isinstance(obj, torch.nn.Module):
        out += [(f"{path}.{name}", p) for name, p in obj.named_parameters()]
        out += [(f"{path}.{name}", b) for name, b in obj.named_buffers()]
        return
    for where, value in _contents(obj, kind):
        _named_tensors(value, path + where, out, seen)


def _contents(obj: Any, kind: int) -> list[tuple[str, Any]]:
    if kind == HAS_TO:
        # to_device lets these move themselves, but checking must look inside: a Hugging Face
        # BatchEncoding is a Mapping, a batch class is often a dataclass, others keep their
        # tensors as attributes.
        return _children(obj)
    if kind == MAPPING:
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if kind == NAMEDTUPLE:
        return [(f".{name}", getattr(obj, name)) for name in obj._fields]
    if kind == DATACLASS:
        return [(f".{name}", value) for name, value in dataclass_items(obj)]
    if kind == NAMESPACE:
        return [(f".{name}", value) for name, value in vars(obj).items()]
    if kind in (SEQUENCE, SET):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    return []


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
        return [(f".{name}", value) for name, value in dataclass_items(obj)]
    try:
        return [(f".{k}", v) for k, v in vars(obj).items()]
    except TypeError:  # no __dict__ (__slots__ or a C type)
        pass
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    return []


def check_same_device(
    module: torch.nn.Module | None, /, *tensors: Any, **named_tensors: Any
) -> torch.device:
    """Check a module's parameters and buffers and the inputs share one device.

    Call it before the forward pass to get an error naming the culprits instead of
    PyTorch's "Expected all tensors to be on the same device".

    Args:
        module: the model (or None to check the inputs alone); positional only, so an
            input may be named anything, ``module=`` included.
        *tensors: inputs, possibly nested in containers (named ``arg0``, ``arg1``…).
            Objects with their own ``.to`` are looked inside too: mappings (Hugging Face's
            ``BatchEncoding``) by item, ``PackedSequence`` (whose ``batch_sizes`` stays
            on the CPU by design) and dataclasses by field, others by attribute (or,
            without a ``__dict__``, lists and tuples by position). Other namedtuples with
            their own ``.to`` are not looked inside: their ``.to`` places each field.
        **named_tensors: inputs by name, possibly nested.

    A 0-dim tensor on the CPU (a scalar such as ``torch.tensor(0.5)``) goes with tensors
    on any device, as PyTorch lets it: it is left out when others are elsewhere.

    An ``nn.DataParallel`` with devices, and a ``DistributedDataParallel`` with
    ``device_ids`` (a module on one GPU), are checked as their forward passes work: every
    parameter and buffer must be on ``device_ids[0]`` (not merely on one device), and so
    must every input tensor they do not move. They move tensors (and ``PackedSequence``)
    in tuples, lists and dicts (namedtuples and subclasses included), so those may be
    anywhere; a tensor in anything else (a dataclass, ``SimpleNamespace``, ``UserDict``
    such as Hugging Face's ``BatchEncoding``, an object with its own ``.to``) reaches the
    module as it is. A ``DistributedDataParallel`` without ``device_ids`` (a CPU or
    multi-device module) moves nothing: its inputs are checked like any module's. Both are
    recognised inside ``torch.compile(model)`` too.

    Returns:
        The one device they all live on (``device_ids[0]`` for a ``DataParallel`` or a
        ``DistributedDataParallel`` with ``device_ids``).

    Raises:
        DeviceMismatchError: more than one device, or a ``DataParallel`` or
            ``DistributedDataParallel`` whose module, or an input it does not move, is not
            on ``device_ids[0]``; the message lists, per device, a few of the parameters,
            buffers and inputs found there.
        TypeError: ``module`` is neither a module nor None (inputs passed in its place).
        ValueError: there is no tensor at all to check.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> check_same_device(model, torch.ones(3, 2), batch={"x": torch.ones(3, 2)})
        device(type='cpu')
    """
    found: list[tuple[str, torch.Tensor]] = []
    if module is not None and not callable(getattr(module, "named_parameters", None)):
        raise TypeError(
            f"module must be an nn.Module or None, got a {type(module).__qualname__}: the first "
            "argument is the model; to check inputs alone, pass None first: "
            "check_same_device(None, batch)"
        )
    # torch.compile's wrapper (an OptimizedModule) calls the module it wraps, as it is.
    wrapper = getattr(module, "_orig_mod", module)
    source = _input_mover_source(wrapper)
    if source is not None:
        model = _model_tensors(cast(torch.nn.Module, module))
        return _check_input_mover(wrapper, model, source, tensors, named_tensors)
    if module is not None:
        found += _model_tensors(module)
    has_model = bool(found)  # a model with tensors of its own to move
    inputs: list[tuple[str, torch.Tensor]] = []
    seen: dict[int, Any] = {}
    for i, value in enumerate(tensors):
        _named_tensors(value, f"arg{i}", inputs, seen)
    for name, value in named_tensors.items():
        _named_tensors(value, name, inputs, seen)
    found += [(f"input {n}", t) for n, t in inputs]
    if not found:
        raise _no_tensors()
    by_device = _by_device(found)
    if len(by_device) == 1:
        return next(iter(by_device))
    first = next(iter(by_device))
    fix = (
        f"move both to one device, e.g. model.to({str(first)!r}) and "
        if has_model
        else "move them to one device, e.g. "
    )
    raise DeviceMismatchError(
        f"tensors are on {len(by_device)} devices, but one forward pass needs them on one:\n"
        + _listing(by_device)
        + f"\nFix: {fix}batch = trainperf.to_device(batch, {str(first)!r})."
    )


def _listing(by_device: dict[torch.device, list[str]]) -> str:
    """One line per device naming a few of the tensors found there."""
    lines = []
    for dev, names in by_device.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"  {dev}: {shown}")
    return "\n".join(lines)


def _input_mover_source(module: object) -> torch.device | None:
    """Where a wrapper that moves its inputs itself wants its module: ``device_ids[0]`` of
    an ``nn.DataParallel`` with devices (without, it only calls its module) or of a
    ``DistributedDataParallel`` with ``device_ids``, whose forward moves every input there
    (without, it moves nothing). None for any other module. ``module`` comes already taken
    out of ``torch.compile``'s wrapper, if it had one."""
    if isinstance(module, torch.nn.DataParallel) and module.device_ids:
        return module.src_device_obj
    ddp = torch.nn.parallel.DistributedDataParallel
    if isinstance(module, ddp) and module.device_ids:
        # Its forward returns the inputs unmoved under these two private modes.
        if getattr(module, "_use_python_reducer", False):
            return None
        if getattr(module, "_delay_all_reduce_all_params", False):
            return None
        return torch.device(module.device_type, module.device_ids[0])
    return None


def _no_tensors() -> ValueError:
    return ValueError(
        "check_same_device found no tensors: pass a module with parameters "
        "or at least one tensor input"
    )


def _model_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s parameters and buffers, each named as the messages name it."""
    found = [(f"parameter {n}", p) for n, p in module.named_parameters()]
    return found + [(f"buffer {n}", b) for n, b in module.named_buffers()]


def _check_input_mover(
    wrapper: Any,
    found: list[tuple[str, torch.Tensor]],
    source: torch.device,
    tensors: tuple[Any, ...],
    named_tensors: dict[str, Any],
) -> torch.device:
    """What ``DataParallel``'s and ``DistributedDataParallel``'s forward demand: the module
    (``found``: the model's parameters and buffers, :func:`_model_tensors`), and every input
    tensor they do not move, on ``device_ids[0]``. ``wrapper`` is the ``DataParallel`` or
    ``DistributedDataParallel`` itself (the one inside ``torch.compile``'s wrapper, if any)."""
    moved: list[torch.Tensor] = []
    unmoved: list[tuple[str, torch.Tensor]] = []
    inputs = [(f"arg{i}", value) for i, value in enumerate(tensors)] + list(named_tensors.items())
    for path, value in inputs:
        _split_moved(value, path, moved, unmoved, {})
    if not found and not moved and not unmoved:
        raise _no_tensors()
    # A 0-dim CPU tensor goes with any device, as in check_same_device.
    found += [(f"input {n}", t) for n, t in unmoved if t.dim() > 0 or t.device.type != "cpu"]
    elsewhere: dict[torch.device, list[str]] = {}
    for name, t in found:
        if not _is_on(t.device, source):
            elsewhere.setdefault(t.device, []).append(name)
    if not elsewhere:
        return source
    raise DeviceMismatchError(
        f"{type(wrapper).__name__}(device_ids={wrapper.device_ids}) needs its module's "
        "parameters and buffers, and the input tensors it does not move (those outside "
        f"tuples, lists and dicts), on device_ids[0], {source}, but found:\n"
        + _listing(elsewhere)
        + f"\nFix: {_mover_fix(elsewhere, source)}."
    )


def _split_moved(
    obj: Any,
    path: str,
    moved: list[torch.Tensor],
    unmoved: list[tuple[str, torch.Tensor]],
    seen: dict[int, Any],
) -> None:
    """Sort the tensors in ``obj`` by whether ``DataParallel``'s ``scatter`` and
    ``DistributedDataParallel``'s ``_recursive_to`` move them: both move tensors found
    through tuples, lists and dicts (namedtuples, ``PackedSequence`` and subclasses
    included) and hand anything else to the module as it is."""
    if isinstance(obj, torch.Tensor):
        moved.append(obj)
        return
    if isinstance(obj, (tuple, list, dict)):
        if id(obj) in seen:  # a container holding itself, which they would recurse into
            return
        seen[id(obj)] = obj
        for where, value in _moved_items(obj):
            _split_moved(value, path + where, moved, unmoved, seen)
        return
    _named_tensors(obj, path, unmoved, {})


def _moved_items(obj: tuple[Any, ...] | list[Any] | dict[Any, Any]) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):  # they move the values; keys stay as they are
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    fields = getattr(obj, "_fields", None)
    if isinstance(obj, tuple) and isinstance(fields, tuple) and len(fields) == len(obj):
        return [(f".{name}", value) for name, value in zip(fields, obj, strict=True)]
    return [(f"[{i}]", value) for i, value in enumerate(obj)]


def _mover_fix(elsewhere: dict[torch.device, list[str]], source: torch.device) -> str:
    names = [name for names in elsewhere.values() for name in names]
    fixes = []
    if any(not name.startswith("input ") for name in names):
        fixes.append(
            f"move the model there before wrapping it, model.to({str(source)!r}), or put the "
            "model's own device first in device_ids"
        )
    if any(name.startswith("input ") for name in names):
        fixes.append(
            f"move the inputs there, batch = trainperf.to_device(batch, {str(source)!r}), or "
            "pass their tensors in tuples, lists or dicts, which it moves itself"
        )
    return "; ".join(fixes)


def _is_on(where: torch.device, source: torch.device) -> bool:
    """``where`` is ``source``; a tensor of a type without indices (CPU, meta) reports none."""
    return where == source or (where.type == source.type and where.index is None)


def _by_device(found: list[tuple[str, torch.Tensor]]) -> dict[torch.device, list[str]]:
    """The names found on each device; 0-dim CPU tensors count only where every tensor is on
    the CPU (PyTorch moves such scalars to the other operand's device)."""
    by_device: dict[torch.device, list[str]] = {}
    cpu_scalars: list[str] = []
    for name, t in found:
        if t.dim() == 0 and t.device.type == "cpu":
            cpu_scalars.append(name)
        else:
            by_device.setdefault(t.device, []).append(name)
    if not by_device:
        return {torch.device("cpu"): cpu_scalars}
    cpu = by_device.get(torch.device("cpu"))
    if cpu is not None:
        cpu += cpu_scalars
    return by_device
