"""tests/ddp/_distributed.py: the spawn() helper every multi-process test uses."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tests.ddp import _distributed
from trainperf.ddp._launch_checks import _warn_if_unreachable


def _launch_all_seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace launch_all with one that records its keyword arguments and starts nothing."""
    seen: dict[str, Any] = {}

    def fake(fn: Any, *args: Any, **kwargs: Any) -> list[str]:
        seen.update(kwargs)
        return ["rank 0", "rank 1"]

    monkeypatch.setattr(_distributed, "launch_all", fake)
    return seen


@pytest.mark.parametrize("timeout_s", [3.0, 60.0])
def test_spawn_passes_a_hang_timeout_launch_does_not_warn_about(
    monkeypatch: pytest.MonkeyPatch, timeout_s: float
) -> None:
    # spawn() left hang_timeout at launch's 300 s, not below its short timeouts: every
    # spawning test warned "hang_timeout=300 s is not below timeout".
    seen = _launch_all_seen(monkeypatch)
    assert _distributed.spawn(print, timeout_s=timeout_s) == {0: "rank 0", 1: "rank 1"}
    assert "hang_timeout" in seen
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if seen["hang_timeout"] is not None:
            _warn_if_unreachable(seen["hang_timeout"], seen["timeout"])


def test_spawn_passes_a_chosen_hang_timeout_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # A test of hang detection itself asks for it, below its timeout.
    seen = _launch_all_seen(monkeypatch)
    _distributed.spawn(print, timeout_s=10.0, hang_timeout_s=5.0)
    assert seen["hang_timeout"] == 5.0
