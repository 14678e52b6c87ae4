"""The argument checks of :func:`trainperf.tune_batch_size`, done once on entry, and the
sizes they allow (:func:`size_space`)."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from trainperf._utils.validate import (
    as_real_number,
    choice,
    positive_int,
    positive_number,
    worker_numbers,
)
from trainperf.batchsize._sizes import SizeSpace

__all__ = ["CheckedArgs", "check_args", "check_state", "size_space"]

_NO_STATE = (
    "tune_batch_size got neither model= nor optimizer=: its probes run thousands of training "
    "steps, which would leave the model trained and the optimizer stepped; pass "
    "model=model, optimizer=optimizer (what step trains) so tuning can put them back, or "
    "model=() if step changes no state"
)


@dataclass(frozen=True)
class CheckedArgs:
    """The numeric arguments as :func:`check_args` accepted them, as Python ints and floats
    (a NumPy scalar passed in is converted: the report must stay JSON-safe)."""

    min_size: int
    max_size: int | None
    global_batch: int | None
    budget_s: float
    headroom: float
    num_workers: int
    prefetch_factor: int | None


def check_args(
    step: Any,
    sample: Any,
    *,
    min_size: object,
    max_size: object,
    global_batch: object,
    budget_s: object,
    headroom: object,
    num_workers: object,
    prefetch_factor: object,
    progress: object = True,
    cache: object = True,
) -> CheckedArgs:
    """The numeric arguments as Python numbers, or ``ValueError`` for the first argument
    ``tune_batch_size`` cannot take. NumPy integers and floats are taken where Python's are.

    Returns:
        :class:`CheckedArgs`: the sizes, budget, headroom and worker settings as ``int`` and
        ``float``.

    Raises:
        ValueError: ``step`` or ``sample`` is not callable; ``min_size``, ``max_size`` or
            ``global_batch`` is not a whole number >= 1 (``max_size`` and ``global_batch``
            may be None) or ``max_size < min_size``; ``budget_s`` is not a finite number of
            seconds > 0; ``headroom`` is not in ``[0, 1)``; ``num_workers`` or
            ``prefetch_factor`` is out of range, or ``prefetch_factor`` comes without workers;
            ``progress`` or ``cache`` is not True or False.

    Example:
        >>> import numpy as np
        >>> check_args(print, print, min_size=1, max_size=None, global_batch=256,
        ...            budget_s=60.0, headroom=np.float32(0.25), num_workers=4,
        ...            prefetch_factor=2).headroom
        0.25
        >>> check_args(print, print, min_size=1, max_size=None, global_batch=None,
        ...            budget_s=60.0, headroom=1.0, num_workers=0, prefetch_factor=None)
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: headroom must be a fraction of the memory in [0, 1) (0.1 keeps ...), got 1.0
    """
    for name, fn, what in (("step", step, "one batch"), ("sample", sample, "a batch size n")):
        if not callable(fn):
            hint = _hint(fn) if name == "sample" else ""
            raise ValueError(
                f"{name} must be callable (it gets {what}), got {_short_repr(fn)}{hint}"
            )
    low = positive_int("min_size", min_size)
    high = positive_int("max_size", max_size, none_ok=True)
    if high is not None and high < low:
        raise ValueError(
            f"max_size={high} is below min_size={low}: pass max_size >= min_size, or None"
        )
    keep = positive_int("global_batch", global_batch, none_ok=True)
    budget = positive_number("budget_s", budget_s, unit="seconds")
    fraction = as_real_number(headroom)
    if fraction is None or not 0.0 <= fraction < 1.0:  # NaN fails too
        raise ValueError(
            f"headroom must be a fraction of the memory in [0, 1) (0.1 keeps 10 % free), "
            f"got {headroom!r}"
        )
    choice("progress", progress, (True, False))
    choice("cache", cache, (True, False))
    pool = worker_numbers({"num_workers": num_workers, "prefetch_factor": prefetch_factor})
    return CheckedArgs(
        low, high, keep, budget, float(fraction), pool["num_workers"], pool["prefetch_factor"]
    )


def check_state(model: object, optimizer: object) -> None:
    """Raise ``ValueError`` when ``tune_batch_size`` could not put the training state back.

    Raises:
        ValueError: neither ``model`` nor ``optimizer`` is given (``model=()`` says that
            ``step`` changes no state), or a module or optimizer among them holds a lazy
            module's uninitialized parameters (``nn.LazyLinear`` before its first forward
            pass) or parameters on the meta device, which have no values to save.

    Example:
        >>> check_state(nn.Linear(2, 2), None)
        >>> check_state(nn.Sequential(nn.LazyLinear(2)), None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: model's submodule '0' (LazyLinear) has uninitialized parameters (...
    """
    if model is None and optimizer is None:
        raise ValueError(_NO_STATE)
    for name, group in (("model", model), ("optimizer", optimizer)):
        for obj in group if isinstance(group, (tuple, list)) else (group,):
            found = _part_where(obj)
            if found is None:
                continue
            lazy, where = found
            if lazy:
                raise ValueError(
                    f"{name}'s {where} has uninitialized parameters (a lazy module: their "
                    f"shape comes from its first forward pass), which tune_batch_size cannot "
                    f"save and put back; run one forward pass before tuning (e.g. "
                    f"model(sample(1))), then call tune_batch_size"
                )
            raise ValueError(
                f"{name}'s {where} is on the meta device: its parameters have a shape "
                f"but no values, so no step can train them and tune_batch_size cannot "
                f"save and put them back; materialize it first: "
                f"model.to_empty(device='cpu'), then initialize its weights (or load a "
                f"checkpoint), then call tune_batch_size"
            )


def _part_where(obj: object) -> tuple[bool, str] | None:
    """Where ``obj`` (a module or an optimizer) holds a lazy module's uninitialized
    parameter or buffer, as ``(True, where)``; else where it holds one on the meta device,
    as ``(False, where)``; else None. For an optimizer, ``where`` says what it was "built
    over"."""
    if isinstance(obj, nn.Module):
        return _first_lazy_or_meta(
            (
                f"submodule {name!r} ({type(m).__name__})" if name else type(m).__name__,
                [*m.parameters(recurse=False), *m.buffers(recurse=False)],
            )
            for name, m in obj.named_modules()
        )
    if isinstance(obj, torch.optim.Optimizer):
        found = _first_lazy_or_meta([(type(obj).__name__, _stepped(obj))])
        if found is not None:
            lazy, name = found
            kind = "a lazy module" if lazy else "a module on the meta device"
            return lazy, f"{name} (built over {kind})"
    return None


def _first_lazy_or_meta(
    parts: Iterable[tuple[str, Iterable[torch.Tensor]]],
) -> tuple[bool, str] | None:
    """The first of ``(where, tensors)`` with a lazy module's uninitialized tensor, as
    ``(True, where)``; else the first with a tensor on the meta device, as ``(False,
    where)``; else None. One walk, in which a lazy one anywhere wins (a lazy module's
    parameters may be on the meta device too): the first meta one is only remembered."""
    meta: str | None = None
    for where, tensors in parts:
        for t in tensors:
            if is_lazy(t):
                return True, where
            if meta is None and t.is_meta:
                meta = where
    return None if meta is None else (False, meta)


def _stepped(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def size_space(
    min_size: int, max_size: int | None, global_batch: int | None, world_size: int
) -> SizeSpace:
    """The sizes a call may try: ``[min_size, max_size]``, or with ``global_batch`` the
    divisors of ``global_batch / world_size`` there.

    Raises:
        ValueError: ``global_batch`` is not divisible by ``world_size``, or no size in range
            divides ``global_batch / world_size``.

    Example:
        >>> size_space(1, None, 256, 2).per_rank
        128
        >>> size_space(1, None, 255, 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: global_batch=255 is not divisible by world_size=2 (...): pass ... e.g. 256
    """
    if global_batch is None:
        return SizeSpace(min_size, max_size)
    if global_batch % world_size:
        up = -(-global_batch // world_size) * world_size
        raise ValueError(
            f"global_batch={global_batch} is not divisible by world_size={world_size} (the "
            f"ranks of torch.distributed): pass a global_batch that is a multiple of "
            f"{world_size}, e.g. {up}"
        )
    space = SizeSpace(min_size, max_size, global_batch // world_size)
    if space.first() is None:
        raise ValueError(
            f"no batch size in [min_size={min_size}, max_size={max_size}] divides "
            f"global_batch / world_size = {global_batch} / {world_size} = {space.per_rank}: "
            f"{_divisor_fix(min_size, max_size, global_batch // world_size)}, or pass a "
            f"global_batch with a divisor in range"
        )
    return space


def _divisor_fix(min_size: int, max_size: int | None, per_rank: int) -> str:
    """The range bounds that would take in the divisors of ``per_rank`` nearest
    ``[min_size, max_size]``, which holds none of them.

    Example:
        >>> _divisor_fix(2, 12, 13), _divisor_fix(4, None, 2)
        ('pass min_size=1 or max_size=13', 'pass min_size=2')
    """
    small = [d for d in range(1, math.isqrt(per_rank) + 1) if per_rank % d == 0]
    divisors = sorted({*small, *(per_rank // d for d in small)})
    below = max(d for d in divisors if d < min_size)  # 1 divides it: min_size > 1 here
    above = [d for d in divisors if max_size is not None and d > max_size]
    return f"pass min_size={below}" + (f" or max_size={above[0]}" if above else "")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 2, 2, 2
_REPR.maxstring, _REPR.maxother = 60, 100


def _short_repr(value: object) -> str:
    """``repr(value)`` cut to a line or two: a whole dataset passed by mistake would print
    every sample (a list of 10,000 tensors: a 200,000-character message).

    Example:
        >>> _short_repr(list(range(10_000)))
        '[0, 1, ...]'
    """
    return _REPR.repr(value)


def _hint(value: object) -> str:
    """The fix for a dataset or DataLoader passed where ``sample(n)`` goes."""
    from torch.utils.data import DataLoader, Dataset

    if isinstance(value, DataLoader):
        return (
            "; for a DataLoader, pass sample=trainperf.batches_from(loader.dataset, "
            "collate_fn=loader.collate_fn)"
        )
    if isinstance(value, Dataset) or hasattr(value, "__getitem__"):
        return "; for a dataset, pass sample=trainperf.batches_from(dataset)"
    return ""
