"""Fixtures of the batch-size tuner's tests: a private cache directory, quick probes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The first optimizer step imports torch._dynamo (about 2 s here); importing it while
# collecting keeps that one-time cost out of whichever test happens to run first.
import torch._dynamo

from tests.batchsize._fakes import QUICK
from trainperf.batchsize import _tune


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: with two on a host whose cores other processes keep busy, a
    tiny step's time swings tenfold (threads spinning for a core), and the tests are about
    what the tuner decides, not how fast it is."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes with 20 ms windows instead of 250 ms: the same rules, a tenth of the time."""
    monkeypatch.setattr(_tune, "DEFAULT_PROBE", QUICK)
