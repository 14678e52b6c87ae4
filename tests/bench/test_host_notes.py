"""trainperf.bench._host_notes: the busy-host and CPU-emulation notes of the benchmarks."""

from __future__ import annotations

import importlib

import pytest

from trainperf.limits import HostLimits

host_notes_module = importlib.import_module("trainperf.bench._host_notes")


def test_a_pods_note_ignores_the_host_wide_cpu_pressure(monkeypatch: pytest.MonkeyPatch) -> None:
    # A container allowed 2 of a 64-core host's CPUs whose cgroup reports no PSI: the
    # host-wide pressure counts other tenants' threads on other cores (before: noted).
    monkeypatch.setattr(host_notes_module, "load_average", lambda: 1.0)
    monkeypatch.setattr(host_notes_module, "cgroup_cpu_pressure", lambda: (0.6, "host"))
    pod = HostLimits(64, 64, 2.0, 2, 2**36, None, 2**35, None, None)
    monkeypatch.setattr(host_notes_module, "host_limits", lambda: pod)
    assert host_notes_module.host_notes_now() == ()
    # With all the host's CPUs usable, the host's threads are this run's neighbours.
    whole = HostLimits(64, 64, None, 64, 2**36, None, 2**35, None, None)
    monkeypatch.setattr(host_notes_module, "host_limits", lambda: whole)
    (note,) = host_notes_module.host_notes_now()
    assert note.startswith("the host was busy") and "threads on this host waited" in note


@pytest.mark.parametrize(
    ("scope", "value"),
    [
        ("cgroup", "CPU pressure 62% (this cgroup's PSI some avg60)"),
        ("host", "CPU pressure 62% (host-wide PSI some avg60)"),
    ],
)
def test_the_busy_host_note_has_no_brackets_in_brackets(scope: str, value: str) -> None:
    # Before: "the host was busy while measuring (CPU pressure 62% (the host's (host-wide,
    # no cgroup figure) PSI some avg60)), so the figure may be low: ...".
    (note,) = host_notes_module.busy_host_notes(1.0, 8, 8, (0.62, scope))
    assert note.startswith(
        f"the host was busy while measuring, so the figure may be low: 1-minute load average "
        f"1.0 for 8 usable CPUs; {value}. Fix: "
    )
    assert "((" not in note and "))" not in note


def test_the_cpu_emulation_note_is_for_half_precision_the_cpu_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_notes_module, "cpu_has_bf16_kernels", lambda: True)
    assert host_notes_module.cpu_emulation_notes("bf16") == ()
    assert host_notes_module.cpu_emulation_notes("fp32") == ()
    (fp16,) = host_notes_module.cpu_emulation_notes("fp16")
    assert fp16 == (
        "this CPU has no native fp16 arithmetic: torch emulates it, so this is not a hardware "
        "rate; compare fp32 (on a GPU the benchmark measures the tensor cores)"
    )
    monkeypatch.setattr(host_notes_module, "cpu_has_bf16_kernels", lambda: False)
    assert host_notes_module.cpu_emulation_notes("bf16") == (fp16.replace("fp16", "bf16", 1),)
