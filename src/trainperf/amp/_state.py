"""What :meth:`trainperf.MixedPrecision.load_state_dict` checks before it changes anything:
a state dict that is not one, and a loss-scaler state that ``GradScaler.load_state_dict``
would load only half of (it sets the scale, then fails on the first missing key).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_scaler_state", "check_state"]


def check_state(state: object) -> None:
    """Refuse what is not a :meth:`MixedPrecision.state_dict`.

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
