"""The CPU bf16 probe (``monitor/_cpu_bf16.py``): what bf16 autocast gains a CPU step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.monitor._fakes import cpu_loop
from trainperf.monitor import _cpu_bf16
from trainperf.monitor._cpu_bf16 import measure_cpu_bf16, with_cpu_bf16
from trainperf.monitor._setup import LoopSetup


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_bf16, "_CACHE", {})


def test_the_probe_measures_a_ratio_and_leaves_the_random_state_and_threads() -> None:
    torch.manual_seed(123)
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    gain = measure_cpu_bf16()
    assert gain is not None and gain > 0
    assert torch.equal(torch.get_rng_state(), state)  # the loop's random numbers unchanged
    assert torch.get_num_threads() == threads
    assert measure_cpu_bf16(probe=False) == gain  # remembered


def test_without_probe_only_an_earlier_measurement_is_used() -> None:
    assert measure_cpu_bf16(probe=False) is None


def test_a_build_without_cpu_bf16_autocast_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> float:
        raise RuntimeError("bf16 autocast is not supported on this build")

    monkeypatch.setattr(_cpu_bf16, "_probe", fail)
    assert measure_cpu_bf16() is None


def test_a_compute_bound_cpu_loop_on_a_native_bf16_cpu_gets_the_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def fake(*, probe: bool = True) -> float:
        calls.append(probe)
        return 1.456789

    monkeypatch.setattr(_cpu_bf16, "measure_cpu_bf16", fake)
    f = cpu_loop(wait_fraction=0.1, setup=LoopSetup(cpu_native_bf16=True, torch_threads=2))
    setup = with_cpu_bf16(f, probe=False)
    assert calls == [False] and setup is not None
    assert setup.cpu_bf16_speedup == 1.4568 and setup.torch_threads == 2


@pytest.mark.parametrize(
    "changes",
    [
        {"cuda_used": True},
        {"precision": ("fp32", "auto")},  # MixedPrecision in use already
        {"setup": LoopSetup(cpu_native_bf16=False)},
        {"setup": LoopSetup()},  # not known
        {"wait_fraction": 0.5},  # waiting for data: the step's speed is not the limit
    ],
)
def test_no_probe_where_bf16_cannot_help(
    monkeypatch: pytest.MonkeyPatch, changes: dict[str, object]
) -> None:
    monkeypatch.setattr(_cpu_bf16, "measure_cpu_bf16", pytest.fail)
    f = cpu_loop(wait_fraction=0.1, setup=LoopSetup(cpu_native_bf16=True))
    assert with_cpu_bf16(dataclasses.replace(f, **changes)) is None  # type: ignore[arg-type]


def test_no_probe_for_a_report_with_too_few_steps_for_a_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: a second of probing for a report that is "inconclusive" and predicts nothing.
    from trainperf.monitor import _watch_inputs
    from trainperf.monitor._rules import MIN_STEPS

    for name in ("with_crowding", "with_cpu_bf16", "with_save_cost"):
        monkeypatch.setattr(_watch_inputs, name, pytest.fail)
    f = cpu_loop(wait_fraction=0.1, setup=LoopSetup(cpu_native_bf16=True))
    few = dataclasses.replace(f, measured_steps=MIN_STEPS - 1)
    assert _watch_inputs.probed(few, probe=True) is None
