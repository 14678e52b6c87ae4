"""The fp16 loss scaler of :class:`trainperf.MixedPrecision`, and what ``mp.backward`` does
with the ``unscale_`` records it finds there.

``torch.amp.GradScaler`` keys its record of an ``unscale_`` by ``id(optimizer)`` only;
:class:`LossScaler` also keeps the optimizer (weakly), so that a backward can tell the
``unscale_`` of gradients it adds to (dropped, with a warning: the step must unscale the new
ones) from the ``unscale_`` of another optimizer's, which it leaves alone (one loss per
optimizer, the first one unscaled to read its norm before the second backward).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch

from trainperf._utils.validate import as_real_number
from trainperf.amp._step import parameters

__all__ = [
    "BACKOFF_FACTOR_RULE",
    "GROWTH_FACTOR_RULE",
    "GROWTH_INTERVAL_RULE",
    "MAX_GROWTH_FACTOR",
    "MAX_SCALE",
    "GradRecord",
    "LossScaler",
    "as_loss_scaler",
    "backoff_factor_ok",
    "drop_unscaled",
    "growth_factor_ok",
    "growth_interval_ok",
    "unscaled_grads",
]

GradRecord = dict[int, list[tuple[torch.Tensor, torch.Tensor | None, int]] | None]
"""By optimizer id, with an ``unscale_`` recorded: each parameter, its gradient and that
gradient's version counter (None where the optimizer is unknown)."""

MAX_SCALE = torch.finfo(torch.float32).max
"""The largest loss scale: ``GradScaler`` keeps it in a float32 tensor."""

MAX_GROWTH_FACTOR = MAX_SCALE / 2.0**16
"""The largest growth factor taken, about 5.19e33: one growth of ``GradScaler``'s starting
scale, 65536.0, by a larger one passes :data:`MAX_SCALE`, and its update kernel drops a
growth past float32's range, so the scale would never grow. A cap, not a limit computed from
the scale in use: a scale that grew to the top by a factor of 2 (2**127) is fine."""

GROWTH_FACTOR_RULE = (
    f"a finite number >= 1 (1.0 turns growth off), at most {MAX_GROWTH_FACTOR:.3g} (one "
    "growth of the starting scale 65536.0 by more passes float32's largest number, and "
    "GradScaler then never grows the scale)"
)
"""What :func:`growth_factor_ok` takes, in words."""


BACKOFF_FACTOR_RULE = "a number in (0, 1] (1.0 turns backoff off)"
"""What :func:`backoff_factor_ok` takes, in words."""

GROWTH_INTERVAL_RULE = "an int from 1 to 2**63 - 1"
"""What :func:`growth_interval_ok` takes, in words (the update kernel's int64)."""


def backoff_factor_ok(factor: float) -> bool:
    """Whether ``factor`` (a number) is a backoff factor a loss scaler can use: above 1 it
    would raise the scale at every skipped step."""
    return 0 < factor <= 1


def growth_interval_ok(interval: float) -> bool:
    """Whether ``interval`` (a number) is a growth interval a loss scaler can use."""
    return isinstance(interval, int) and 1 <= interval < 2**63


def growth_factor_ok(factor: float) -> bool:
    """Whether ``factor`` (a number) is a growth factor a loss scaler can grow by.

    Example:
        >>> growth_factor_ok(2.0), growth_factor_ok(1e300), growth_factor_ok(0.5)
        (True, False, False)
    """
    return 1 <= factor <= MAX_GROWTH_FACTOR


def _check_setting(
    setter: str, value: object, rule: str, ok: Callable[[float], bool], default: str
) -> float:
    """Refuse ``value`` for ``mp.scaler.<setter>()`` unless ``ok`` takes it (torch's setters
    take anything, and ``mp.state_dict()`` would then hold a state ``load_state_dict``
    refuses). Returns it as a Python number (a NumPy one would make the state unreadable to
    a plain ``torch.load``)."""
    number = as_real_number(value)
    if number is None or not ok(number):
        raise ValueError(
            f"mp.scaler.{setter}() got {value!r}: it must be {rule}; pass a value such as "
            f"{default} (GradScaler's default)"
        )
    return number


class LossScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` that remembers, weakly, the optimizers ``unscale_`` saw.

    Example:
        >>> scaler = LossScaler("cpu", enabled=False)
        >>> isinstance(scaler, torch.amp.GradScaler), scaler.get_scale()
        (True, 1.0)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unscaled_optimizers: weakref.WeakValueDictionary[int, torch.optim.Optimizer]
        self._unscaled_optimizers = weakref.WeakValueDictionary()

    def set_growth_factor(self, new_factor: float) -> None:
        """``GradScaler.set_growth_factor``, refusing a factor ``load_state_dict`` would
        refuse in ``mp.state_dict()`` (see :data:`GROWTH_FACTOR_RULE`): torch's setter
        takes anything.

        Raises:
            ValueError: such a factor; the growth factor is left as it was.
        """
        super().set_growth_factor(
            _check_setting(
                "set_growth_factor", new_factor, GROWTH_FACTOR_RULE, growth_factor_ok, "2.0"
            )
        )

    def set_backoff_factor(self, new_factor: float) -> None:
        """``GradScaler.set_backoff_factor``, refusing a factor ``load_state_dict`` would
        refuse in ``mp.state_dict()`` (see :data:`BACKOFF_FACTOR_RULE`).

        Raises:
            ValueError: such a factor; the backoff factor is left as it was.
        """
        super().set_backoff_factor(
            _check_setting(
                "set_backoff_factor", new_factor, BACKOFF_FACTOR_RULE, backoff_factor_ok, "0.5"
            )
        )

    def set_growth_interval(self, new_interval: int) -> None:
        """``GradScaler.set_growth_interval``, refusing an interval ``load_state_dict`` would
        refuse in ``mp.state_dict()`` (see :data:`GROWTH_INTERVAL_RULE`).

        Raises:
            ValueError: such an interval; the growth interval is left as it was.
        """
        interval = _check_setting(
            "set_growth_interval", new_interval, GROWTH_INTERVAL_RULE, growth_interval_ok, "2000"
        )
        super().set_growth_interval(int(interval))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_``, remembering ``optimizer`` (if it can be weakly referenced)."""
        super().unscale_(optimizer)
        # No weak reference to it (__slots__): any backward drops its record, as before.
        with contextlib.suppress(TypeError):
            self._unscaled_optimizers[id(optimizer)] = optimizer

    def __getstate__(self) -> dict[str, Any]:
        """GradScaler's state, without the weak references (which cannot be pickled) and
        without the records of this step's ``unscale_`` (keyed by the original's optimizers,
        as a pickled MixedPrecision has no backward waiting for its step), which
        ``GradScaler`` refuses to pickle with a bare ``AssertionError``."""
        states = getattr(self, "_per_optimizer_states", None)
        if states:
            self._per_optimizer_states = copy.copy(states)
            self._per_optimizer_states.clear()  # keeps its defaultdict's factory
        try:
            state = super().__getstate__()
        finally:
            if states:
                self._per_optimizer_states = states
        state.pop("_unscaled_optimizers", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._unscaled_optimizers = weakref.WeakValueDictionary()


def as_loss_scaler(scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler | None:
    """``scaler`` as a :class:`LossScaler`, its state (scale, growth tracker, settings)
    kept: a MixedPrecision pickled by trainperf 0.1.0 holds a plain ``torch.amp.GradScaler``,
    which cannot tell one optimizer's ``unscale_`` from another's. None stays None.

    Example:
        >>> old = torch.amp.GradScaler("cpu", init_scale=128.0, enabled=False)
        >>> new = as_loss_scaler(old)
        >>> type(new).__name__, new.get_scale() == old.get_scale(), new.is_enabled()
        ('LossScaler', True, False)
    """
    if scaler is None or isinstance(scaler, LossScaler):
        return scaler
    upgraded = LossScaler.__new__(LossScaler)
    upgraded.__setstate__(dict(vars(scaler)))
    return upgraded


def unscaled_grads(scaler: torch.amp.GradScaler) -> GradRecord:
    """The gradients, now, of each optimizer whose ``unscale_`` ``scaler`` records since its
    last update (see :data:`GradRecord`). Empty for a disabled scaler, which keeps none."""
    from torch.amp.grad_scaler import OptState

    states = getattr(scaler, "_per_optimizer_states", None) or {}
    known = getattr(scaler, "_unscaled_optimizers", {})  # a plain GradScaler knows none
    record: GradRecord = {}
    for key, state in states.items():
        if state.get("stage") is OptState.UNSCALED:
            optimizer = known.get(key)
            record[key] = None if optimizer is None else _grads(optimizer)
    return record


def _grads(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
    """Each parameter of ``optimizer``, its gradient, and that gradient's version counter."""
    return [(p, p.grad, -1 if p.grad is None else p.grad._version) for p in parameters(optimizer)]


def drop_unscaled(scaler: torch.amp.GradScaler, before: GradRecord) -> bool:
    """Drop ``scaler``'s record of each ``unscale_`` in ``before`` (taken just before a
    backward) whose optimizer's gradients that backward changed (a new gradient, or one
    added to in place) or whose optimizer is unknown; returns whether one was dropped."""
    dropped = [key for key, grads in before.items() if grads is None or _changed(grads)]
    for key in dropped:  # a disabled scaler has no records, and no _per_optimizer_states
        del scaler._per_optimizer_states[key]
    return bool(dropped)


def _changed(grads: list[tuple[torch.Tensor, torch.Tensor | None, int]]) -> bool:
    """Whether a gradient of :func:`_grads`'s list is no longer as it was then."""
    return any(
        p.grad is not grad or (grad is not None and grad._version != version)
        for p, grad, version in grads
    )
