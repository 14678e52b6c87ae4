"""Spies on the loader tuner's internals, shared by its test files."""

from __future__ import annotations

from typing import Any

import pytest

from trainperf.loader import _measure as measure_mod


def record_closes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record ``kill_first`` of every worker-pool shutdown ``measure`` makes (and still shut
    the pools down): True means the workers were killed before the join."""
    closes: list[bool] = []
    real_close = measure_mod.close_iterator

    def close_iterator(it: Any, workers: Any, *, kill_first: bool) -> None:
        closes.append(kill_first)
        real_close(it, workers, kill_first=kill_first)

    monkeypatch.setattr(measure_mod, "close_iterator", close_iterator)
    return closes
