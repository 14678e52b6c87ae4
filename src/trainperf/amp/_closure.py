"""Closures in :meth:`trainperf.MixedPrecision.step`: an optimizer that re-evaluates the loss
inside its ``step`` (``torch.optim.LBFGS``) takes ``mp.step(optimizer, closure=closure)`` with
bf16 and fp32, and is refused, with the reason, under fp16 loss scaling, which
``torch.amp.GradScaler`` cannot run with a closure.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["check_closure", "needs_closure"]

_FP16 = (
    "fp16 loss scaling cannot step with a closure: torch.amp.GradScaler does not support "
    "closures (it unscales the gradients once, before the step, and a closure makes new "
    "ones); use MixedPrecision(precision='bf16') or precision='fp32' with this optimizer, "
    "or an optimizer without a closure"
)


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` cannot be called without an argument (a closure).

    Read from the class where it has a ``step`` method: an LR scheduler replaces
    ``optimizer.step`` on the instance with a wrapper whose signature is the unbound
    method's, ``self`` included. A ``step`` that only the instance has (a wrapper that sets
    ``self.step = optimizer.step``) is read as it is, bound.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> needs_closure(torch.optim.LBFGS([w])), needs_closure(torch.optim.SGD([w], lr=1.0))
        (True, False)
    """
    method = getattr(type(optimizer), "step", None)
    if method is not None:
        return _method_needs_argument(method)
    return _needs_argument(optimizer.step, after=0)  # not cached: it holds the instance


@functools.cache
def _method_needs_argument(method: Callable[..., Any]) -> bool:
    """:func:`_needs_argument` of a method read from its class, past ``self``."""
    return _needs_argument(method, after=1)


def _needs_argument(step: Callable[..., Any], *, after: int) -> bool:
    """Whether ``step`` has a required positional parameter past its first ``after`` ones."""
    try:
        signature = inspect.signature(step)
    except (TypeError, ValueError):  # no signature to read (a builtin): assume none needed
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = list(signature.parameters.values())[after:]
    return any(p.kind in positional and p.default is inspect.Parameter.empty for p in rest)


def check_closure(
    optimizers: tuple[torch.optim.Optimizer, ...],
    closure: Callable[[], Any] | None,
    max_grad_norm: object,
    *,
    scaling: bool,
) -> None:
    """Refuse a closure where it cannot work, and an optimizer that needs one without it.

    Args:
        optimizers: what ``mp.step`` got (checked to be optimizers already).
        closure: its ``closure=``, or None.
        max_grad_norm: its clip value.
        scaling: fp16 with an enabled loss scaler.

    Raises:
        TypeError: ``closure`` is not callable, or an optimizer needs a closure and got none.
        ValueError: a closure (or an optimizer that needs one) with fp16 loss scaling, or
            a closure with ``max_grad_norm``.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> try:
        ...     check_closure((torch.optim.LBFGS([w]),), None, None, scaling=False)
        ... except TypeError as e:
        ...     print(str(e).split(";")[0])
        MixedPrecision.step() got optimizer 1 of 1 (LBFGS), whose step() needs a closure
    """
    if closure is None:
        _check_needs_none(optimizers, scaling=scaling)
        return
    if not callable(closure):
        raise TypeError(
            "MixedPrecision.step(closure=...) takes a function that runs the forward, calls "
            f"mp.backward(loss) and returns the loss, got {closure!r}"
        )
    if scaling:
        raise ValueError(f"MixedPrecision.step() got closure={closure!r}, but {_FP16}")
    if max_grad_norm is not None:
        raise ValueError(
            f"MixedPrecision.step() got max_grad_norm={max_grad_norm!r} with a closure, "
            "whose gradients are made inside optimizer.step(), after any clipping here; "
            "clip inside the closure instead: torch.nn.utils.clip_grad_norm_(params, "
            "max_norm) after mp.backward(loss)"
        )


def _check_needs_none(optimizers: tuple[torch.optim.Optimizer, ...], *, scaling: bool) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS) when none was given:
    torch's own error is a bare "missing 1 required positional argument: 'closure'"."""
    for i, o in enumerate(optimizers, 1):
        if not needs_closure(o):
            continue
        which = (
            f"optimizer {i} of {len(optimizers)} ({type(o).__name__}), whose step() needs a closure"
        )
        if scaling:
            raise ValueError(f"MixedPrecision.step() got {which}, but {_FP16}")
        raise TypeError(
            f"MixedPrecision.step() got {which}; pass it: mp.step(optimizer, "
            "closure=closure), where closure() runs the forward under mp.autocast(), calls "
            "mp.backward(loss) and returns the loss (optimizer.zero_grad() first, as torch's "
            "LBFGS example does)"
        )
