"""Whether ``step`` trains what the tuner was given: gradients made, parameters moved.

``step`` is a training step: forward, ``backward()``, optimizer step. One that returns a
loss without calling ``backward()`` (or never steps the optimizer) runs in a fraction of
training's memory and time, and the size chosen from it would be too large, silently. So,
until a probe has seen a parameter move, :class:`TrainingCheck` watches each probe:

- during its warm-up steps (untimed), a hook on every parameter that requires a gradient
  says whether ``backward()`` computed one (a step that zeroes the gradients at its end
  leaves none to see after it), and a step post-hook on every optimizer of the saved state
  whether one stepped (at a learning rate of 0, a warm-up schedule's first value, a fused
  optimizer's step changes no value and bumps no counter); the hooks are removed before
  the timed windows;
- around all its steps (:class:`Marks`, read once before and once after), each parameter's
  ``_version`` counter, which every in-place write bumps (an optimizer's update); its
  gradient, made or written to since (held by weak reference: the mark keeps no memory
  alive); and a few evenly spaced values of a few parameters (a fused optimizer's update,
  or one replayed from a CUDA graph, bumps no counter).

What it concludes:

- a whole probe that ran without running out of memory, and every probe before it, made no
  gradient and moved no parameter: ``step`` trains nothing it was given, and the tuner
  stops (:func:`untrained_error`). A step that accumulates gradients (its optimizer stepped
  once per few calls) or whose loss scaler skipped the optimizer step (inf gradients at the
  first, large scales) still makes gradients, and a frozen backbone still leaves its
  head's: none of them is refused;
- gradients, but not one parameter moved nor one optimizer stepped over the whole search:
  the optimizer never stepped (:func:`unstepped_note`). A warning and a note, not an error:
  a step that accumulates over more calls than tuning ran, or whose loss scaler skipped
  every step, would be refused wrongly.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["Marks", "TrainingCheck", "untrained_error", "unstepped_note"]

_SAMPLED_PARAMETERS = 8
"""Parameters whose values are sampled (evenly spaced over the parameter list)."""

_SAMPLED_VALUES = 64
"""Elements sampled from each of them (evenly spaced over the parameter)."""


def _grad_mark(p: torch.Tensor) -> tuple[Any, int]:
    g = p.grad
    return (None, -1) if g is None else (weakref.ref(g), g._version)


def _grad_changed(p: torch.Tensor, mark: tuple[Any, int]) -> bool:
    """``p`` holds a gradient made (or written to) since ``mark``: a gradient set to None
    (``zero_grad()``) is no sign of ``backward()``."""
    ref, version = mark
    g = p.grad
    return g is not None and (ref is None or ref() is not g or g._version != version)


def _sampled(p: torch.Tensor) -> torch.Tensor | None:
    """A host copy of up to :data:`_SAMPLED_VALUES` evenly spaced elements of ``p``; None
    where that could cost more than the copy (a sharded ``DTensor``, a non-contiguous or
    sparse tensor, no data)."""
    t = p.detach()
    if (
        type(t) is not torch.Tensor
        or t.layout != torch.strided
        or t.device.type == "meta"
        or t.numel() == 0
        or not t.is_contiguous()
    ):
        return None
    flat = t.view(-1)
    return flat[:: max(1, flat.numel() // _SAMPLED_VALUES)][:_SAMPLED_VALUES].to("cpu", copy=True)


def _values_changed(p: torch.Tensor, before: torch.Tensor) -> bool:
    """Compared bit for bit: NaN equals itself, and any dtype compares."""
    now = _sampled(p)
    return now is not None and not torch.equal(now.view(torch.uint8), before.view(torch.uint8))


@dataclass
class Marks:
    """What one probe's steps are compared with: the parameters before them.

    Attributes:
        versions: each parameter's ``_version``.
        grads: each parameter's gradient (a weak reference, None without one) and its
            ``_version``.
        values: a few parameters, each with a host copy of a few of its values.
        hooked: a hook saw ``backward()`` compute a gradient.
        stepped: a hook saw an optimizer's ``step`` end.
    """

    versions: list[int]
    grads: list[tuple[Any, int]]
    values: list[tuple[torch.Tensor, torch.Tensor]]
    hooked: bool = False
    stepped: bool = False


@dataclass
class TrainingCheck:
    """What the probes' steps did to ``params`` (see the module docstring).

    Attributes:
        params: every parameter of the saved state.
        optimizers: every optimizer of the saved state.
        backward_seen: a probe's steps made a gradient (or moved a parameter).
        moved_seen: a probe's steps moved a parameter: nothing is watched any more.
        stepped_seen: a probe's steps stepped an optimizer (with gradients seen too,
            nothing is watched any more).
        steps: the steps of the probes watched.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> check = TrainingCheck([w])
        >>> marks = check.mark()
        >>> _ = (w * 2).sum()                      # forward only
        >>> check.record(marks, steps=1), check.backward_seen
        (False, False)
        >>> marks = check.mark()
        >>> with check.hooked(marks):               # a gradient, zeroed: no optimizer step
        ...     (w * 2).sum().backward()
        ...     w.grad = None
        >>> check.record(marks, steps=1), check.moved_seen
        (True, False)
    """

    params: Sequence[torch.Tensor]
    optimizers: Sequence[torch.optim.Optimizer] = ()
    backward_seen: bool = False
    moved_seen: bool = False
    stepped_seen: bool = False
    steps: int = 0
    _values_of: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        trainable = [p for p in self.params if p.requires_grad] or list(self.params)
        stride = max(1, -(-len(trainable) // _SAMPLED_PARAMETERS))
        self._values_of = trainable[::stride][:_SAMPLED_PARAMETERS]

    @property
    def settled(self) -> bool:
        """Nothing more to learn: no parameter to watch, or one moved already, or an
        optimizer stepped and a gradient was made."""
        return not self.params or self.moved_seen or (self.stepped_seen and self.backward_seen)

    def mark(self) -> Marks | None:
        """The marks before a probe; None once :attr:`settled`."""
        if self.settled:
            return None
        return Marks(
            versions=[p._version for p in self.params],
            grads=[_grad_mark(p) for p in self.params],
            values=[(p, v) for p in self._values_of if (v := _sampled(p)) is not None],
        )

    @contextlib.contextmanager
    def hooked(self, marks: Marks | None) -> Iterator[None]:
        """While the block runs, a gradient computed for any parameter that requires one
        sets ``marks.hooked``, and a step of any of :attr:`optimizers` ``marks.stepped``;
        nothing is hooked once ``marks`` is None (settled)."""
        handles: list[RemovableHandle] = []
        try:
            if marks is not None and not marks.hooked:
                seen = functools.partial(_set_hooked, marks)
                for p in self.params:
                    if p.requires_grad:
                        with contextlib.suppress(RuntimeError):  # unhookable: other signs
                            handles.append(p.register_hook(seen))  # type: ignore[no-untyped-call]
            if marks is not None:
                stepped = functools.partial(_set_stepped, marks)
                for o in self.optimizers:  # a wrapper that skipped Optimizer.__init__
                    with contextlib.suppress(AttributeError, RuntimeError):  # (timm's
                        handles.append(o.register_step_post_hook(stepped))  # Lookahead)
            yield
        finally:
            for handle in handles:
                handle.remove()

    def record(self, marks: Marks | None, steps: int) -> bool:
        """Compare with ``marks`` after a probe's ``steps`` (all run, none out of memory);
        True when they made a gradient or moved a parameter."""
        if marks is None:
            return True
        moved = any(p._version != v for p, v in zip(self.params, marks.versions, strict=True))
        moved = moved or any(_values_changed(p, v) for p, v in marks.values)
        trained = (
            moved
            or marks.hooked
            or any(_grad_changed(p, m) for p, m in zip(self.params, marks.grads, strict=True))
        )
        self.steps += steps
        self.backward_seen = self.backward_seen or trained
        self.moved_seen = self.moved_seen or moved
        self.stepped_seen = self.stepped_seen or marks.stepped
        return trained


def _set_hooked(marks: Marks, grad: torch.Tensor) -> None:
    """A parameter's gradient hook: it leaves the gradient as it is."""
    marks.hooked = True


def _set_stepped(marks: Marks, optimizer: Any, args: Any, kwargs: Any) -> None:
    """An optimizer's step post-hook."""
    marks.stepped = True


def untrained_error(size: int, steps: int) -> ValueError:
    """The error for a probe whose ``steps`` at ``size`` trained nothing it was given.

    Example:
        >>> str(untrained_error(8, 5))[:60]
        'tune_batch_size: step(batch) ran 5 times at batch size 8 but'
    """
    return ValueError(
        f"tune_batch_size: step(batch) ran {steps} times at batch size {size} but trained "
        f"nothing it was given: no parameter of model or optimizer (or of the modules and "
        f"optimizers found with them) got a gradient or changed. A step "
        f"without loss.backward() and optimizer.step() takes far less memory and time than "
        f"training, so the size chosen would be too large. Make step train (forward, "
        f"loss.backward(), optimizer.step()) the model and optimizer passed; to tune a step "
        f"that trains nothing on purpose (inference), pass model=() and no optimizer"
    )


def unstepped_note(check: TrainingCheck) -> str | None:
    """What the report says when the probes made gradients but never moved a parameter
    nor stepped an optimizer; None otherwise.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> check = TrainingCheck([w], backward_seen=True, steps=40)
        >>> unstepped_note(check)[:44]
        'step made gradients but changed no parameter'
    """
    if check.settled or not check.backward_seen:
        return None
    return (
        f"step made gradients but changed no parameter and stepped no optimizer in the "
        f"{check.steps} steps tuning ran: "
        f"if it never calls optimizer.step(), the size chosen is too large (training also "
        f"holds the optimizer's state and runs its step); a step that accumulates gradients "
        f"over more calls, or whose loss scaler skipped every step, can ignore this"
    )
