"""What :class:`trainperf.MixedPrecision` remembers between ``backward``, ``step`` and
``zero_grad``, and the moves that change it.

The record (:class:`StepBook`) lives on the instance as plain attributes (a pickle of
trainperf 0.1.0 holds them so, and ``tune_batch_size`` saves and restores all of them):

- ``_backward_pending``: a backward waits for its step;
- ``_stepped``: a step used the last backward (until the next backward or
  ``mp.zero_grad()``): a second step is refused as such, even after
  ``mp.zero_grad(optimizer)`` in between;
- ``_zeroed``: ids of the optimizers ``mp.zero_grad(optimizer)`` cleared since the last
  backward (that backward is gone for them only) or since the step that used it;
- ``_already_stepped``: ids of the optimizers that a step which raised had stepped on the
  last backward: its retry must leave them out;
- ``_skip_flags``: the fp16 inf/NaN flags of those optimizers, so that the retry's
  loss-scale update and its result count an optimizer that skipped before the error;
- ``_skipped_in_a_row``: how many fp16 steps in a row were skipped on inf/NaN gradients
  (:data:`SKIPS_BEFORE_WARNING` of them warn once): each skipped step adds 1, a step that
  succeeds sets it back to 0, and nothing else changes it (a step that raises neither).

``_already_stepped`` and ``_skip_flags`` last until the next backward, ``mp.zero_grad()``,
or a step that succeeds.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from trainperf.amp._closure import check_closure
from trainperf.amp._scaler import GradRecord, drop_unscaled
from trainperf.amp._step import (
    check_optimizers,
    check_scalable_grads,
    check_step,
    forget,
    has_grads,
    plain_step,
    scaled_step,
)

__all__ = [
    "SKIPPED_STEPS",
    "SKIPS_BEFORE_WARNING",
    "UNSCALED_BACKWARD",
    "StepBook",
    "after_backward",
    "check_step_call",
    "end_backward",
    "fresh",
    "run_step",
    "unscale",
    "zero_grad",
]

UNSCALED_BACKWARD = (
    "mp.backward(loss) gave new gradients to an optimizer after "
    "mp.scaler.unscale_(optimizer) with no mp.step() or mp.zero_grad() in between: the "
    "loss scaler's record of that unscale_ is dropped, so the "
    "next step unscales the new (scaled) gradients, and gradients kept from before the "
    "unscale_ would be unscaled twice. To skip a step after unscale_, clear the gradients "
    "with mp.zero_grad(optimizer), not optimizer.zero_grad(); to accumulate gradients, "
    "call mp.scaler.unscale_(optimizer) only after the last backward"
)
"""The warning of a backward that finds the scaler's record of an ``unscale_``."""

SKIPS_BEFORE_WARNING = 20
"""fp16 steps skipped in a row before :data:`SKIPPED_STEPS` warns: the loss scale is then
2**20 times lower than when they began. Finding the scale at the start of a run skips a
few steps; this many means that no scale makes the gradients finite."""

SKIPPED_STEPS = (
    "the last {count} fp16 steps were all skipped on inf/NaN gradients, and the loss "
    "scale is down to {scale:g}: lowering it has not made the gradients finite, so the "
    "loss itself is probably inf/NaN (the model's weights or the batch hold inf/NaN, or "
    "the forward overflows). Check torch.isfinite(loss) before mp.backward(loss), and the "
    "inputs and the learning rate; skipped steps leave the weights as they are, and once "
    "the scale reaches 0 no step can succeed again"
)
"""The warning of :data:`SKIPS_BEFORE_WARNING` skipped fp16 steps in a row."""


class StepBook(Protocol):
    """The attributes of :class:`~trainperf.MixedPrecision` these functions read and set."""

    _backward_pending: bool
    _stepped: bool
    _zeroed: set[int]
    _already_stepped: set[int]
    _skip_flags: list[torch.Tensor]
    _skipped_in_a_row: int


def fresh() -> dict[str, Any]:
    """The record of an instance with no backward yet (a new one, or a pickled copy).

    Example:
        >>> sorted(fresh())[:2]
        ['_already_stepped', '_backward_pending']
    """
    return {
        "_backward_pending": False,
        "_stepped": False,
        "_zeroed": set(),
        "_already_stepped": set(),
        "_skip_flags": [],
        "_skipped_in_a_row": 0,
    }


def after_backward(
    book: StepBook, scaler: torch.amp.GradScaler | None, unscaled: GradRecord
) -> None:
    """Record a backward: it waits for its step. With fp16, drop the scaler's record of an
    ``unscale_`` made since the last step of an optimizer whose gradients this backward
    changed (``unscaled``: taken before it, by :func:`~trainperf.amp._scaler.unscaled_grads`),
    with a warning (:data:`UNSCALED_BACKWARD`): its new gradients are scaled, and a step
    would apply them as they are. Another optimizer's ``unscale_`` is kept."""
    if scaler is not None and drop_unscaled(scaler, unscaled):
        # stacklevel: the caller of mp.backward, so the default filter warns once per line.
        warnings.warn(UNSCALED_BACKWARD, UserWarning, stacklevel=3)
    book._backward_pending = True
    book._stepped = False
    book._zeroed.clear()
    book._already_stepped.clear()
    book._skip_flags = []


def check_step_call(
    book: StepBook,
    optimizers: tuple[torch.optim.Optimizer, ...],
    max_grad_norm: object,
    closure: Callable[[], Any] | None,
    *,
    scaling: bool,
) -> None:
    """``mp.step``'s refusals, before anything steps (:func:`~trainperf.amp._step.check_step`)."""
    if closure is not None:
        check_optimizers(optimizers)  # the closure makes the gradients: no backward needed
    else:
        check_step(
            optimizers,
            max_grad_norm,
            pending=book._backward_pending,
            stepped=book._stepped,
            zeroed=book._zeroed,
            already_stepped=book._already_stepped,
        )
    check_closure(optimizers, closure, max_grad_norm, scaling=scaling)
    if scaling:
        check_scalable_grads(optimizers)


def run_step(
    book: StepBook,
    scaler: torch.amp.GradScaler | None,
    optimizers: tuple[torch.optim.Optimizer, ...],
    max_grad_norm: float | torch.Tensor | None,
    closure: Callable[[], Any] | None,
) -> bool:
    """Step ``optimizers`` (through ``scaler``, an enabled fp16 one, if not None) and record
    it. A step that raises leaves every field of the record as it was before it (a
    closure's ``mp.backward`` included), plus the optimizers that stepped and their inf/NaN
    flags, for a retry or a skip."""
    before = _copy(book)
    stepped: list[torch.optim.Optimizer] = []
    flags = list(book._skip_flags)
    try:
        if scaler is None:
            result = plain_step(optimizers, max_grad_norm, stepped, closure)
        else:
            result = _scaled_step(scaler, optimizers, max_grad_norm, stepped, flags)
    except BaseException:
        vars(book).update(before)
        book._already_stepped.update(id(o) for o in stepped)
        book._skip_flags = flags
        raise
    book._backward_pending = False
    book._stepped = True
    book._zeroed.clear()
    book._already_stepped.clear()
    book._skip_flags = []
    if scaler is not None:
        _count_skips(book, scaler, stepped=result)
    return result


def _count_skips(book: StepBook, scaler: torch.amp.GradScaler, *, stepped: bool) -> None:
    """Count an fp16 step skipped on inf/NaN (a step that succeeds ends the run), and warn
    once when :data:`SKIPS_BEFORE_WARNING` were skipped in a row: ``GradScaler`` halves the
    scale at each and says nothing, down to 0, from where nothing can step again."""
    book._skipped_in_a_row = 0 if stepped else book._skipped_in_a_row + 1
    if book._skipped_in_a_row == SKIPS_BEFORE_WARNING:
        message = SKIPPED_STEPS.format(count=SKIPS_BEFORE_WARNING, scale=scaler.get_scale())
        # stacklevel: the caller of mp.step (through run_step).
        warnings.warn(message, UserWarning, stacklevel=4)


def unscale(
    book: StepBook, scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer
) -> None:
    """``mp.unscale_(optimizer)``: ``scaler.unscale_(optimizer)`` (``scaler``: an enabled
    fp16 one, or None, which leaves the gradients as they are), once the gradients are
    known to come from the backward that waits for its step."""
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"MixedPrecision.unscale_() takes one optimizer, got {optimizer!r}")
    if not book._backward_pending or id(optimizer) in book._zeroed:
        raise RuntimeError(
            "MixedPrecision.unscale_() found no gradients from mp.backward(loss) since the "
            "last step or zero_grad; call it between mp.backward(loss) and mp.step(optimizer)"
        )
    if scaler is not None:
        check_scalable_grads((optimizer,), caller="unscale_")
        scaler.unscale_(optimizer)


def _copy(book: StepBook) -> dict[str, Any]:
    """Every field of ``book``'s record (those of :func:`fresh`), its sets and lists copied:
    a closure's ``mp.backward`` clears them in place."""
    return {name: copy.copy(getattr(book, name)) for name in fresh()}


def _scaled_step(
    scaler: torch.amp.GradScaler,
    optimizers: tuple[torch.optim.Optimizer, ...],
    max_grad_norm: float | torch.Tensor | None,
    stepped: list[torch.optim.Optimizer],
    flags: list[torch.Tensor],
) -> bool:
    """The fp16 step: optimizers with gradients through ``scaler``, the others plainly."""
    # An optimizer none of whose parameters got a gradient (a frozen backbone) has
    # nothing to unscale nor to find inf in: GradScaler would assert on it, half-way
    # through the others. It is stepped plainly (its hooks and schedulers see a step).
    scaled = tuple(o for o in optimizers if has_grads(o))
    for opt in optimizers:
        if opt not in scaled:
            forget(scaler, opt)
            opt.step()
            stepped.append(opt)
    return scaled_step(scaler, scaled, max_grad_norm, stepped, flags)


def zero_grad(
    book: StepBook,
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer | None,
    models: Iterable[nn.Module],
    *,
    set_to_none: bool,
) -> None:
    """``mp.zero_grad``: clear ``optimizer``'s gradients (None: every model's in ``models``),
    drop the scaler's record of them, and record it."""
    if optimizer is not None and not callable(getattr(optimizer, "zero_grad", None)):
        raise TypeError(
            f"MixedPrecision.zero_grad() takes one optimizer or none, got {optimizer!r}; "
            "set_to_none is keyword-only (mp.zero_grad(set_to_none=False)), and several "
            "optimizers take one call each"
        )
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=set_to_none)
        if scaler is not None:  # its unscale_ was of the gradients just cleared
            forget(scaler, optimizer)
        if book._backward_pending or book._stepped:
            # Pending: that backward is dropped for this optimizer only. Stepped: a later
            # step of another optimizer is still a second step on one backward.
            book._zeroed.add(id(optimizer))
        return
    models = list(models)
    if not models:
        raise RuntimeError(
            "zero_grad() without an optimizer clears the models passed to "
            "mp.prepare(), but there are none; call mp.zero_grad(optimizer)"
        )
    for model in models:
        model.zero_grad(set_to_none=set_to_none)
    end_backward(book, scaler)


def end_backward(book: StepBook, scaler: torch.amp.GradScaler | None) -> None:
    """Drop the backward for every optimizer, as ``mp.zero_grad()`` does once it cleared the
    gradients: no step may use it, and the scaler forgets every ``unscale_`` since it. Also
    what loading another loss scale after ``mp.zero_grad(optimizer)`` does
    (:func:`~trainperf.amp._state.load_into`): the gradients still held were scaled by the
    old scale."""
    if scaler is not None:
        forget(scaler)
    book._backward_pending = False
    book._stepped = False
    book._zeroed.clear()
    book._already_stepped.clear()
    book._skip_flags = []
