"""The save probe (``monitor/_save_cost.py``): what a non-blocking save of a CPU state
still costs its step, measured on this process."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import pytest

from tests.monitor._fakes import figures
from trainperf.monitor import _save_cost
from trainperf.monitor._save_cost import measure_save_block_s, with_save_cost

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="saves fork on Linux")


@linux
def test_a_save_is_measured_once_per_memory_size_and_leaves_no_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_save_cost, "_CACHE", {})
    assert measure_save_block_s(probe=False) is None  # nothing measured yet, nothing probed
    before = set(Path(tempfile.gettempdir()).glob("trainperf-save-probe-*"))
    spent = measure_save_block_s()
    assert spent is not None and 0 < spent < 5
    assert set(Path(tempfile.gettempdir()).glob("trainperf-save-probe-*")) == before
    calls: list[int] = []
    monkeypatch.setattr(_save_cost, "_probe", lambda: calls.append(1) or 1.0)
    assert measure_save_block_s() == spent and measure_save_block_s(probe=False) == spent
    assert not calls


@linux
def test_a_failed_probe_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_save_cost, "_CACHE", {})

    def no_disk() -> float:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_save_cost, "_probe", no_disk)
    assert measure_save_block_s() is None


def test_only_a_cpu_loop_with_periodic_stalls_gets_the_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_save_cost, "measure_save_block_s", lambda probe=True: 0.0125)
    stalled = figures(stall_period=10, stall_steps=(9, 19), stall_fraction=0.2, cuda_used=False)
    setup = with_save_cost(stalled)
    assert setup is not None and setup.save_block_s == 0.0125
    assert with_save_cost(figures(cuda_used=False)) is None  # no stalls
    gpu = dataclasses.replace(stalled, cuda_used=True)
    assert with_save_cost(gpu) is None  # a GPU state is staged to pinned memory, not forked
