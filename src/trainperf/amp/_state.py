"""What a :class:`trainperf.MixedPrecision` saves and loads: its ``state_dict`` (the
precision and the fp16 loss scale) and its pickle (everything but the models it saw).

:func:`load_into` checks what ``load_state_dict`` is handed before it changes anything: a
state dict that is not one (its keys, its precision, a loss scale from a run that had no
scaler), a loss-scaler state that ``GradScaler.load_state_dict`` would load only half of (it
sets the scale, then fails on the first missing key), a loss scale no step can recover from
(0, negative, inf or NaN: :func:`check_scale`), and another loss scale than the one in use
loaded between ``mp.backward`` and ``mp.step``, whose step would unscale the waiting
gradients by the new scale instead of the one they were scaled by (after
``mp.zero_grad(optimizer)`` it loads, and ends that backward for every optimizer).

A pickled MixedPrecision (``torch.save(mp)``, ``copy.deepcopy``) whose loss scale
:func:`check_scale` refuses still unpickles, so that whatever was saved beside it loads;
:func:`unpickled` records the refusal, and :func:`check_usable` raises it at
``mp.backward`` and ``mp.step``, until a loss scale is loaded into it.

While :func:`restoring` is entered (``tune_batch_size`` putting back the state it saved
before its probes, after it reset each MixedPrecision's record of its backward, and before
it puts that record back), any scale loads, however low the caller's own run let it fall.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainperf._utils.validate import as_real_number
from trainperf.amp import _bookkeeping
from trainperf.amp._precision import DTYPES, NAMES
from trainperf.amp._scaler import (
    BACKOFF_FACTOR_RULE,
    GROWTH_FACTOR_RULE,
    GROWTH_INTERVAL_RULE,
    MAX_SCALE,
    as_loss_scaler,
    backoff_factor_ok,
    growth_factor_ok,
    growth_interval_ok,
)

if TYPE_CHECKING:
    from trainperf.amp._mixed import MixedPrecision

__all__ = [
    "check_float32",
    "check_scale",
    "check_scaler_settings",
    "check_scaler_state",
    "check_state",
    "check_usable",
    "checked_state",
    "load_into",
    "pickled",
    "restoring",
    "state_of",
    "unpickled",
]


def state_of(mp: MixedPrecision) -> dict[str, Any]:
    """:meth:`~trainperf.MixedPrecision.state_dict`: the precision in use and the loss
    scaler's state (None without one), as plain Python values."""
    scaler = mp.scaler
    return {
        "precision": NAMES[mp.dtype],
        "scaler": dict(scaler.state_dict()) if scaler is not None else None,
    }


_RESTORING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "trainperf_amp_restoring", default=False
)


@contextlib.contextmanager
def restoring() -> Iterator[None]:
    """While the block runs, ``load_state_dict`` loads any loss scale, 0 too: for
    ``tune_batch_size`` putting back the caller's own state, saved before its probes (a run
    whose losses stayed inf/NaN halves its scale down to 0, in about 165 skipped steps),
    through the MixedPrecision itself or an object of the caller's whose
    ``load_state_dict`` loads it (``model=(model, train_state)``).

    Example:
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> state = {"precision": "fp16", "scaler": {**scaler.state_dict(), "scale": 0.0}}
        >>> with restoring():
        ...     checked_state(state, scaler, "fp16", strict=True)["scale"]
        0.0
    """
    token = _RESTORING.set(True)
    try:
        yield
    finally:
        _RESTORING.reset(token)


_MID_STEP = (
    "MixedPrecision.load_state_dict() was called between mp.backward(loss) and "
    "mp.step(optimizer) with another loss scale: the waiting gradients are scaled by "
    "{now!r}, and the step would unscale them by the loaded {loaded!r} instead; load the "
    "state before mp.backward(loss) or after mp.step(optimizer), or drop the waiting "
    "gradients first with mp.zero_grad(optimizer) (each optimizer that backward gave "
    "gradients to)"
)
"""The refusal of another loss scale between ``mp.backward`` and ``mp.step``."""


def load_into(mp: MixedPrecision, state: Mapping[str, Any], *, strict: bool) -> None:
    """:meth:`~trainperf.MixedPrecision.load_state_dict`: :func:`checked_state`, then the
    scale is loaded, unless it differs from the one in use while a backward waits for its
    step: refused, or, once ``mp.zero_grad(optimizer)`` dropped that backward for an
    optimizer, loaded and that backward ended for all
    (:func:`~trainperf.amp._bookkeeping.end_backward`: its gradients still held were scaled
    by the old scale)."""
    scaler = mp.scaler
    checked = checked_state(state, scaler, NAMES[mp.dtype], strict=strict)
    if checked is None or scaler is None:
        return
    if mp._backward_pending and scaler.is_enabled() and _changes_scale(scaler, checked):
        if not mp._zeroed:
            raise RuntimeError(_MID_STEP.format(now=scaler.get_scale(), loaded=checked["scale"]))
        _bookkeeping.end_backward(mp, scaler)
    scaler.load_state_dict(checked)
    if scaler.is_enabled() and not _RESTORING.get():
        mp._unusable_scale = None  # checked_state checked the loaded scale


def _changes_scale(scaler: torch.amp.GradScaler, checked: Mapping[str, Any]) -> bool:
    """Loading ``checked`` would give ``scaler`` another loss scale than its own now."""
    number = as_real_number(checked["scale"])
    # Compared, not converted: an int past a float's range (10**400) stays comparable.
    return number is None or number != scaler.get_scale()


def checked_state(
    state: Mapping[str, Any],
    scaler: torch.amp.GradScaler | None,
    in_use: str,
    *,
    strict: bool,
) -> dict[str, Any] | None:
    """The loss-scaler state in ``state`` to load into ``scaler`` (None: the precision
    ``in_use`` has none), after :func:`check_state`, :func:`check_scaler_state` and (unless
    :func:`restoring`) :func:`check_scale` and :func:`check_scaler_settings`; None when
    there is nothing to load."""
    check_state(state)
    saved = state["scaler"]
    if saved is None:
        return None  # nothing to restore; an fp16 run resumed from bf16 starts a fresh scale
    if scaler is None:
        if strict:
            raise ValueError(
                f"the state holds a loss scale from a {state['precision']} run, but this "
                f"MixedPrecision uses {in_use}, which has no scaler; pass strict=False to "
                "drop it, or precision='fp16' to keep using it"
            )
        return None
    checked = check_scaler_state(saved, scaler)
    if scaler.is_enabled() and not _RESTORING.get():
        check_scale(checked["scale"])
        check_scaler_settings(checked)
    elif scaler.is_enabled():
        check_float32(checked["scale"])
    return checked


def pickled(attributes: dict[str, Any]) -> dict[str, Any]:
    """What pickling a :class:`~trainperf.MixedPrecision` keeps (``torch.save(mp)``,
    ``copy.deepcopy``, a spawned process's argument), from its ``__dict__``.

    Everything but the models ``prepare`` saw, which are held weakly (a weak reference
    cannot be pickled; a strong one would pickle the model), and but the record of a
    backward waiting for its step (:func:`~trainperf.amp._bookkeeping.fresh` instead): a
    copy made between ``mp.backward(loss)`` and ``mp.step`` has no backward of its own
    (those gradients are in the original's models, and the loss scale they were scaled by
    is not pickled, as ``GradScaler`` pickles none), so its ``step`` without a backward is
    refused, as a new instance's would be.
    """
    kept = dict(attributes)
    del kept["_models"]
    kept.update(_bookkeeping.fresh())
    return kept


def unpickled(attributes: dict[str, Any], state: dict[str, Any]) -> None:
    """Fill in ``attributes`` (a new instance's ``__dict__``) from ``state``: it knows no
    prepared model (a fresh ``WeakSet``). A loss scale :func:`check_scale` refuses (one
    saved after the losses stayed inf/NaN until it fell to 0) is not refused here: raising
    would make everything pickled beside it unreachable (``torch.load`` of a whole
    checkpoint). The refusal is kept in ``_unusable_scale`` instead, and raised by
    :func:`check_usable` at the first ``backward`` or ``step``, which would otherwise skip
    every fp16 step (0, inf, NaN) or fail with a bare ``TypeError`` (not a number).

    The record of a failed step is absent from older pickles (trainperf 0.1.0), and their
    loss scaler is a plain ``GradScaler``, which cannot tell one optimizer's ``unscale_``
    from another's: it becomes a :class:`~trainperf.amp._scaler.LossScaler` with the same
    scale.
    """
    scaler = as_loss_scaler(state.get("_scaler"))
    unusable = None
    if scaler is not None and scaler.is_enabled():
        try:
            check_scale(
                scaler.get_scale(),  # the pickled number: GradScaler pickles no scale tensor
                what="the pickled MixedPrecision's loss scale",
                fix=(
                    "make a new one instead, which starts at 65536.0: MixedPrecision("
                    f"{str(state.get('device'))!r}, precision={state.get('precision')!r}), or "
                    "load a good scale into this one with mp.load_state_dict(state); "
                    "checkpoint mp.state_dict() rather than the object"
                ),
            )
        except ValueError as e:
            unusable = str(e)
    attributes.update({**_bookkeeping.fresh(), **state})
    attributes["_scaler"] = scaler
    attributes["_unusable_scale"] = unusable  # a pickled one is the original's: recomputed
    attributes["_models"] = weakref.WeakSet()


def check_usable(mp: MixedPrecision, call: str) -> None:
    """Raise the refusal :func:`unpickled` recorded for ``mp``'s loss scale, if any, at
    ``call`` (``"mp.backward(loss)"``, ``"mp.step(optimizer)"``): a ``ValueError`` naming
    the scale and the fix.

    Example:
        >>> from trainperf.amp import MixedPrecision
        >>> check_usable(MixedPrecision("cpu", precision="fp32"), "mp.backward(loss)")
    """
    unusable = mp._unusable_scale
    if unusable is not None:
        raise ValueError(f"{call} refused: {unusable}")


def check_state(state: object) -> None:
    """Refuse what is not a :meth:`MixedPrecision.state_dict`: other keys, a precision that
    is not one ``state_dict`` writes ("bf16", "fp16" or "fp32", the one in use: never
    "auto"), or a loss scale saved with a precision that has no scaler.

    Example:
        >>> check_state({"precision": "fp32", "scaler": None})
        >>> try:
        ...     check_state({"scale": 1024.0})
        ... except ValueError as e:
        ...     print(str(e).split(":")[0])
        not a MixedPrecision state dict
    """
    if not isinstance(state, Mapping) or set(state) != {"precision", "scaler"}:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            "not a MixedPrecision state dict: expected the keys ['precision', 'scaler'] "
            f"from mp.state_dict(), got {got!r}"
        )
    precision = state["precision"]
    if not isinstance(precision, str) or precision not in DTYPES:
        raise ValueError(
            f"not a MixedPrecision state dict: state['precision'] must be one of "
            f"{sorted(DTYPES)} (the precision mp.state_dict() saw in use), got {precision!r}; "
            "pass the state mp.state_dict() returned"
        )
    if state["scaler"] is not None and precision != "fp16":
        raise ValueError(
            f"not a MixedPrecision state dict: it holds a loss scale (state['scaler']) but its "
            f"precision is {precision!r}, and only fp16 has a loss scaler; pass the state "
            "mp.state_dict() returned"
        )


def check_scaler_state(saved: object, scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """The loss-scaler state to load into ``scaler``, as a dict, once it has every key that
    ``scaler.state_dict()`` has.

    Raises:
        ValueError: ``saved`` is not a mapping, or lacks one of those keys.
    """
    expected = set(scaler.state_dict()) if scaler.is_enabled() else set()
    if isinstance(saved, Mapping) and expected.issubset(saved):
        return dict(saved)
    got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
    missing = sorted(expected - set(saved)) if isinstance(saved, Mapping) else sorted(expected)
    raise ValueError(
        f"the state's loss scale (state['scaler']) lacks {missing}: expected the keys "
        f"{sorted(expected)} of mp.state_dict()['scaler'], got {got!r}; pass the state "
        "mp.state_dict() returned"
    )


_SETTINGS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "growth_factor": (GROWTH_FACTOR_RULE, growth_factor_ok),
    "backoff_factor": (BACKOFF_FACTOR_RULE, backoff_factor_ok),
    "growth_interval": (GROWTH_INTERVAL_RULE, growth_interval_ok),
    "_growth_tracker": (
        "an int from 0 to 2**31 - 1",
        lambda n: isinstance(n, int) and 0 <= n < 2**31,
    ),
}
"""The rules for the loss scaler's settings, as wide as what ``GradScaler``'s setters and
update kernel take: ``set_growth_factor(1.0)`` and ``set_backoff_factor(1.0)`` turn growth
and backoff off (its constructor refuses both, its setters and kernel do not); the kernel
takes the interval as an int64 and keeps the tracker in an int32 tensor. The growth factor
alone is capped below what they take (:data:`~trainperf.amp._scaler.MAX_GROWTH_FACTOR`): a
larger one never grows the scale. Each rule is
applied to the setting as :func:`~trainperf._utils.validate.as_real_number` reads it (an int
stays an int); a setting it reads as no number (a bool, a string, a ``timedelta64``) is
refused whatever the rule."""


def check_scaler_settings(saved: Mapping[str, Any]) -> None:
    """Refuse a loss-scaler state whose settings no ``GradScaler`` can use: a
    ``backoff_factor`` > 1 raises the scale on every skipped step (NaN skips every step for
    good) and one <= 0 zeroes or flips it, a ``growth_factor`` < 1 lowers it after good
    ones and one past :data:`~trainperf.amp._scaler.MAX_GROWTH_FACTOR` never grows it (the
    update kernel drops a growth past float32's range), a ``growth_interval`` of 0 never grows
    it, and a growth interval or tracker that is
    not an int, or past the int64 (interval) or int32 (tracker) the update kernel keeps it
    in, fails at the first step with a bare ``TypeError``, ``ValueError`` or
    ``RuntimeError``. A factor of exactly 1 (growth or backoff off) is taken.

    Example:
        >>> check_scaler_settings(torch.amp.GradScaler("cpu").state_dict())
        >>> try:
        ...     check_scaler_settings({"backoff_factor": 2.0})
        ... except ValueError as e:
        ...     print(str(e).split(", ")[0])
        the state's loss-scaler setting state['scaler']['backoff_factor'] is 2.0
    """
    for key, (rule, ok) in _SETTINGS.items():
        if key not in saved:
            continue
        number = as_real_number(saved[key])
        if number is None or not ok(number):
            raise ValueError(
                f"the state's loss-scaler setting state['scaler'][{key!r}] is {saved[key]!r}, "
                f"a setting GradScaler cannot use: it must be {rule}; {_LOAD_FIX}"
            )


_LOAD_FIX = (
    "load the state without it, keeping this MixedPrecision's own scale (a new one starts at "
    "65536.0): mp.load_state_dict({**state, 'scaler': None})"
)
"""What :func:`check_scale` advises ``load_state_dict``'s caller."""


_MAX_SCALE = MAX_SCALE
"""The largest loss scale: ``GradScaler`` keeps it in a float32 tensor, and a larger one
fails the first ``mp.backward`` with a bare "value cannot be converted ... without overflow"."""


def check_float32(scale: object) -> None:
    """Refuse, while :func:`restoring`, a loss scale that ``GradScaler`` cannot hold: not a
    number, or a finite one past float32's range (:data:`_MAX_SCALE`). Any other loads then,
    0 included; loading this one would fail half-way with a bare ``OverflowError``.

    Example:
        >>> check_float32(0.0)
        >>> try:
        ...     check_float32(1e39)
        ... except ValueError as e:
        ...     print(str(e).split(":")[0])
        the state's loss scale (state['scaler']['scale']) is 1e+39
    """
    number = as_real_number(scale)
    if number is not None and not _past_float32(number):
        return
    raise ValueError(
        f"the state's loss scale (state['scaler']['scale']) is {scale!r}: GradScaler keeps "
        f"the scale in a float32, which holds a number up to {_MAX_SCALE:.2g}; {_LOAD_FIX}"
    )


def _past_float32(number: float) -> bool:
    """Whether ``number`` is finite and past what a float32 holds (inf and NaN fill one);
    an int is compared, not converted (``float(10**400)`` overflows)."""
    return abs(number) > _MAX_SCALE and (isinstance(number, int) or math.isfinite(number))


def check_scale(
    scale: object,
    *,
    what: str = "the state's loss scale (state['scaler']['scale'])",
    fix: str = _LOAD_FIX,
) -> None:
    """Refuse a loss scale that is not a finite number > 0 that a float32 holds (at most
    :data:`_MAX_SCALE`, about 3.4e38). At 0, inf or NaN every fp16 step is skipped (the
    gradients are NaN or inf), and halving or doubling the scale keeps it there; a negative
    one is never written by ``GradScaler``, whose factors are positive; a larger one fails
    the first backward (``GradScaler`` keeps the scale in a float32 tensor).
    Such a scale comes from a corrupt checkpoint, or one saved after the losses stayed
    inf/NaN long enough to halve the scale down to 0 (about 165 skipped steps from 65536).
    The error names ``what`` held the scale and ``fix``, the way out (by default those of
    ``load_state_dict``).

    Example:
        >>> check_scale(65536.0)
        >>> try:
        ...     check_scale(0.0)
        ... except ValueError as e:
        ...     print(str(e).split(":")[0])
        the state's loss scale (state['scaler']['scale']) is 0.0
    """
    number = as_real_number(scale)
    # Compared, not converted: an int past a float's range (10**400) stays comparable.
    if number is not None and 0 < number <= _MAX_SCALE:
        return
    raise ValueError(
        f"{what} is {scale!r}: it must be a finite number > 0, at most {_MAX_SCALE:.2g} "
        "(at 0, inf or NaN every fp16 step would be skipped, and GradScaler keeps the scale "
        "in a float32, which holds no more; it comes from a corrupt checkpoint, or one saved "
        f"after the losses stayed inf/NaN); {fix}, and find why the losses were inf/NaN"
    )
