"""The tuner's cache: chosen batch sizes in ``batch_size.json`` beside the loader's cache.

``$XDG_CACHE_HOME/trainperf/batch_size.json`` (``~/.cache/trainperf/`` when the variable is
unset or not an absolute path), written and read with the tuners' shared store
(:mod:`trainperf._utils.cache`: atomic writes, a corrupt file ignored and replaced, old
entries dropped), as the DataLoader tuner's ``loader.json`` is. Entries are keyed the same
way, by a hash of what decides the answer: the model's class, parameter count, dtype and the
shape of each parameter and buffer, the code of its own (not torch's) module classes, its
submodules in training mode, with gradient checkpointing on, and its channels_last weights,
the optimizer's class and implementation flags (``fused``, ``foreach``, ``capturable``,
``differentiable``), a MixedPrecision's
precision, a GradScaler's being enabled, the device (for CUDA its name and memory, and the
process-wide TF32 and cuDNN settings), the host, the torch version, the step function, the
modules, MixedPrecisions, GradScalers and functions it reads (a ``torch.compile`` wrapper, a
MixedPrecision not passed), the batch's shape and types
(:func:`~trainperf._utils.cache.sample_signature` of the first size's batch), the sizes
allowed, the world size, ``global_batch`` and ``headroom``.

Nothing in an entry is trusted: before a hit is used, :func:`cache_misfit` checks that its
size is one this call allows and that its peak memory still fits the memory usable now;
otherwise the call tunes again, with a note saying why.
"""

from __future__ import annotations

import socket
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainperf._utils.cache import cache_dir, make_key, sample_signature
from trainperf._utils.format import format_bytes
from trainperf._utils.qualname import qualname
from trainperf.amp import MixedPrecision
from trainperf.amp._tf32 import tf32_state
from trainperf.batchsize._holders import is_scheduler
from trainperf.batchsize._report import BatchSizeCandidate
from trainperf.batchsize._sample import referenced_values
from trainperf.batchsize._sizes import SizeSpace
from trainperf.checkpoint import unwrap_model

__all__ = ["ENTRY_KEYS", "cache_misfit", "cache_path", "entry_key", "parsed_candidates"]

# Part of every key: 2 since the optimizer step is charged once per accumulated batch
# (choices cached before, with global_batch, leaned to large micro-batches).
_VERSION = 2
_CHECKPOINTING = ("gradient_checkpointing", "grad_checkpointing")
"""The flags by which Hugging Face's and timm's modules say their forward recomputes
activations in the backward: far less memory, so a larger size fits."""
ENTRY_KEYS = (
    "batch_size",
    "accumulation_steps",
    "samples_per_s",
    "peak_memory",
    "memory_limit",
    "memory_kind",
    "candidates",
    "batch_bytes",
)
"""What an entry keeps: these report fields (``candidates`` as ``to_dict()`` writes them)."""


def cache_path() -> Path:
    """``batch_size.json`` in the tuners' cache directory, beside the loader's ``loader.json``.

    Example:
        >>> import os
        >>> os.environ["XDG_CACHE_HOME"] = "/tmp/xdg"
        >>> str(cache_path())
        '/tmp/xdg/trainperf/batch_size.json'
    """
    return cache_dir() / "batch_size.json"


_OPTIMIZER_FLAGS = ("fused", "foreach", "capturable", "differentiable")
"""Optimizer settings that change its memory or speed (not its hyper-parameters, which
schedules change as training runs)."""


def _describe(obj: Any) -> Any:
    """What of ``obj`` decides the answer: a module's class (with the class inside a
    ``torch.compile`` or DDP wrapper), size, trainable size, dtypes and the shapes of its
    parameters and buffers; an optimizer's class,
    implementation flags and the size it steps; a MixedPrecision's precision (bf16
    activations take half the memory of fp32 ones); a GradScaler's being enabled; else the
    class."""
    name = qualname(type(obj))
    if isinstance(obj, nn.Module):
        inner = unwrap_model(obj)
        if inner is not obj:
            name = f"{name}({qualname(type(inner))})"
        params = list(obj.parameters())
        dtypes = sorted({str(p.dtype) for p in params})
        trainable = sum(p.numel() for p in params if p.requires_grad)
        sizes = [sum(p.numel() for p in params), trainable]
        return [name, *sizes, dtypes, _shapes(obj), *_module_modes(obj), _module_code(obj)]
    if isinstance(obj, torch.optim.Optimizer):
        defaults = getattr(obj, "defaults", None) or {}
        flags = {k: defaults[k] for k in _OPTIMIZER_FLAGS if defaults.get(k) is not None}
        stepped = sum(p.numel() for g in obj.param_groups for p in g["params"])
        return [name, sorted(flags.items()), stepped]
    if isinstance(obj, torch.amp.GradScaler):
        return [name, obj.is_enabled()]
    if isinstance(obj, MixedPrecision):
        return [name, str(obj.dtype), obj.uses_channels_last]
    if isinstance(obj, types.FunctionType):
        return qualname(obj)  # its body: a helper the step calls, edited
    return name


def _module_modes(module: nn.Module) -> list[int]:
    """What changes a module's memory and speed but not its shapes: how many submodules
    are in training mode (dropout masks, BatchNorm statistics kept for the backward), have
    gradient checkpointing on, and how many 4-D weights are channels_last."""
    modules = list(module.modules())
    training = sum(m.training for m in modules)
    checkpointing = sum(any(getattr(m, f, False) is True for f in _CHECKPOINTING) for m in modules)
    channels_last = sum(
        t.dim() == 4
        and not t.is_contiguous()
        and t.is_contiguous(memory_format=torch.channels_last)
        for t in (*module.parameters(), *module.buffers())
    )
    return [training, checkpointing, channels_last]


def _module_code(module: nn.Module) -> str:
    """A digest of the methods of ``module``'s own classes and its submodules' (each class
    and base class not from torch, whose code the torch version in the key stands for):
    an edited ``forward`` (another attention, an upsampling, an extra head) changes the
    memory and speed of every size, with the same parameters.

    Example:
        >>> class Net(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x).relu()
        >>> _module_code(Net(2, 2)) == _module_code(Net(3, 3)) != _module_code(nn.Linear(2, 2))
        True
    """
    classes = {type(m) for m in module.modules()}
    own = {k for cls in classes for k in cls.__mro__ if not _from_torch(k)}
    methods = [
        qualname(f)
        for k in sorted(own, key=qualname)
        for f in vars(k).values()
        if isinstance(f, types.FunctionType)
    ]
    return make_key({"code": methods})


def _from_torch(cls: type) -> bool:
    """Whether ``cls`` is torch's (or Python's own): its code comes with the version."""
    where = getattr(cls, "__module__", None) or ""
    return where == "builtins" or where == "torch" or where.startswith("torch.")


def _shapes(module: nn.Module) -> str:
    """A digest of the name and shape of each parameter and buffer: two models of one class
    and parameter count (an MLP 8-64-4-1 and 8-1-277-1) differ in activations and speed."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return make_key({"shapes": [[n, list(t.shape)] for n, t in named]})


def _model_fields(objects: Sequence[Any]) -> list[Any]:
    """What of ``objects`` decides the answer; not their LR schedulers, which cost a step
    nothing (and are found whether passed or not)."""
    return [_describe(obj) for obj in objects if not is_scheduler(obj)]


def _step_fields(step: Any) -> list[Any]:
    """What of the objects ``step`` reads decides the answer: the modules (a
    ``torch.compile`` or DDP wrapper of the model passed), MixedPrecisions and GradScalers
    among its closure cells, the globals it names, the instance it is bound to (or it is)
    and those objects' attributes, and the bodies of the functions among them, one level
    down (``step`` calling ``train_one(batch)``)."""
    values = _read_by(step)
    values += [v for f in values if type(f) is types.FunctionType for v in _read_by(f)]
    found: list[Any] = []
    for value in values:
        if issubclass(type(value), _DESCRIBED) and all(value is not f for f in found):
            found.append(value)
    return [_described(v) for v in found]


def _described(obj: Any) -> Any:
    """:func:`_describe`, or the class where that fails (a lazy module not yet run, which
    the tuner does not save, has no size to read)."""
    try:
        return _describe(obj)
    except Exception:
        return qualname(type(obj))


_DESCRIBED = (nn.Module, MixedPrecision, torch.amp.GradScaler, types.FunctionType)
"""What of the values a step reads counts in the key."""


def _read_by(fn: Any) -> list[Any]:
    """The values ``fn`` reads (:func:`~trainperf.batchsize._sample.referenced_values`) and
    the attributes of those that are plain objects (a trainer ``step`` is a method of)."""
    values = referenced_values(fn)  # a callable object: itself, whose attributes are read
    # type(), not isinstance(): isinstance reads __class__, which some proxies answer with
    # a warning or an import.
    owners = [v for v in values if not issubclass(type(v), _NOT_OWNERS)]
    return [*values, *(a for o in owners for a in _attributes(o))]


def _attributes(obj: Any) -> list[Any]:
    """The values of ``obj``'s instance attributes; none where it has no ``__dict__``."""
    try:
        return list(vars(obj).values())
    except Exception:  # no __dict__ (slots, builtins), or a proxy that refuses
        return []


_NOT_OWNERS = (types.ModuleType, type, *_DESCRIBED)
"""Values whose attributes are not read: a module's names are thousands, a class's are
its methods, and the others are described whole."""


def _device_fields(device: torch.device) -> list[Any]:
    if device.type != "cuda":
        return [device.type]
    props = torch.cuda.get_device_properties(device)
    tf32 = tf32_state()
    cudnn = [torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic]
    return [device.type, props.name, int(props.total_memory), tf32.matmul, tf32.cudnn, *cudnn]


def entry_key(
    *,
    step: Any,
    objects: Sequence[Any],
    device: torch.device,
    first_batch: Any,
    space: SizeSpace,
    world_size: int,
    global_batch: int | None,
    headroom: float,
) -> str:
    """The key of a call's entry: a hash of what decides the answer (the module docstring).

    Example:
        >>> k = entry_key(step=print, objects=[nn.Linear(2, 2)], device=torch.device("cpu"),
        ...               first_batch=torch.zeros(1, 2), space=SizeSpace(1, 64),
        ...               world_size=1, global_batch=None, headroom=0.1)
        >>> len(k)
        32
    """
    fields = {
        "v": _VERSION,
        "objects": _model_fields(objects),
        "device": _device_fields(device),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "step": qualname(step),
        "step_reads": _step_fields(step),
        "sample": sample_signature(first_batch),
        "sizes": [space.min_size, space.max_size, space.per_rank],
        "world_size": world_size,
        "global_batch": global_batch,
        "headroom": headroom,
    }
    return make_key(fields)


def parsed_candidates(entry: Mapping[str, Any]) -> tuple[BatchSizeCandidate, ...] | None:
    """The candidates an entry holds, or None when they do not parse."""
    try:
        return tuple(BatchSizeCandidate(**c) for c in entry["candidates"])
    except (KeyError, TypeError, ValueError):
        return None


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def cache_misfit(entry: Mapping[str, Any], space: SizeSpace, usable: float | None) -> str | None:
    """Why a stored entry cannot be used by this call, or None when it can.

    Args:
        entry: what the tuner stored (or a hand-edited version of it).
        space: the sizes this call allows.
        usable: the memory a size may peak at now (None when not measured).

    Example:
        >>> entry = {"batch_size": 48, "accumulation_steps": 1, "peak_memory": 2**30,
        ...          "candidates": []}
        >>> cache_misfit(entry, SizeSpace(1, None, 64), None)
        'batch_size=48 is not a size this call allows'
        >>> cache_misfit(entry, SizeSpace(1, 64), 2**29)
        'it peaked at 1.0 GiB, 512 MiB is usable now'
    """
    size, accum, peak = (
        entry.get("batch_size"),
        entry.get("accumulation_steps"),
        entry.get("peak_memory"),
    )
    if not _is_int(size, 1) or not space.allowed(size):  # type: ignore[arg-type]
        return f"batch_size={size!r} is not a size this call allows"
    expected = space.accumulation(size)  # type: ignore[arg-type]
    if accum != expected:
        return f"accumulation_steps={accum!r} does not make up the global batch ({expected})"
    if peak is not None and not _is_int(peak, 0):
        return f"peak_memory={peak!r} is not None or an int >= 0"
    if peak is not None and usable is not None and peak > usable:
        return f"it peaked at {format_bytes(peak)}, {format_bytes(usable)} is usable now"
    if parsed_candidates(entry) is None:
        return "the entry is malformed: its candidates do not parse"
    return _malformed_field(entry)


def _malformed_field(entry: Mapping[str, Any]) -> str | None:
    """The first of the report's other fields an edited entry spoils, or None."""
    rate = entry.get("samples_per_s")
    if rate is not None and (not isinstance(rate, (int, float)) or isinstance(rate, bool)):
        return f"samples_per_s={rate!r} is not None or a number"
    for name in ("memory_limit", "batch_bytes"):
        value = entry.get(name)
        if value is not None and not _is_int(value, 0):
            return f"{name}={value!r} is not None or an int >= 0"
    if not isinstance(entry.get("memory_kind", "unmeasured"), str):
        return f"memory_kind={entry.get('memory_kind')!r} is not a string"
    return None
