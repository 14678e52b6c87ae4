"""What :meth:`trainperf.MixedPrecision.load_state_dict` checks before it changes anything:
a state dict that is not one (its keys, its precision, a loss scale from a run that had no
scaler), and a loss-scaler state that ``GradScaler.load_state_dict`` would load only half of
(it sets the scale, then fails on the first missing key).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainperf.amp._precision import DTYPES

__all__ = ["check_scaler_state", "check_state", "load_state"]


def load_state(
    state: Mapping[str, Any],
    scaler: torch.amp.GradScaler | None,
    in_use: str,
    *,
    strict: bool,
) -> None:
    """Load ``state``'s loss scale into ``scaler`` (None: the precision ``in_use`` has
    none), after the checks of :func:`check_state` and :func:`check_scaler_state`; see
    :meth:`trainperf.MixedPrecision.load_state_dict`."""
    check_state(state)
    saved = state["scaler"]
    if saved is None:
        return  # nothing to restore; an fp16 run resumed from bf16 starts a fresh scale
    if scaler is None:
        if strict:
            raise ValueError(
                f"the state holds a loss scale from a {state['precision']} run, but this "
                f"MixedPrecision uses {in_use}, which has no scaler; pass strict=False to "
                "drop it, or precision='fp16' to keep using it"
            )
        return
    scaler.load_state_dict(check_scaler_state(saved, scaler))


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
