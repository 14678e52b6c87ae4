"""Fixtures of the loader tuner's tests: a private cache directory, one shared tuning run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loader._fakes import Waits, collate_ids, quick
from trainperf.loader import TuningReport, tune_loader


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def report() -> TuningReport:
    """One real tuning run (about 4 s), shared by the tests of its arguments and its report."""
    return tune_loader(Waits(), 4, **quick(max_workers=2, collate_fn=collate_ids, drop_last=True))
