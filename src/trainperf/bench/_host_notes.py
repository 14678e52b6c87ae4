"""Notes on the host a benchmark ran on, which make its figure no hardware rate: other work
crowding the CPUs while measuring (``bench_model``), and a half precision the CPU only
emulates (``bench_model`` and ``bench_matmul``).
"""

from __future__ import annotations

from trainperf.amp._precision import cpu_has_bf16_kernels
from trainperf.doctor._cpu_checks import check_load, load_average
from trainperf.limits import PressureScope, cgroup_cpu_pressure, host_limits

__all__ = ["busy_host_notes", "cpu_emulation_notes", "host_notes_now"]


def busy_host_notes(
    load: float | None,
    cpus: int,
    host_cpus: int | None = None,
    pressure: tuple[float, PressureScope] | None = None,
) -> tuple[str, ...]:
    """A note when other work crowded the host while measuring (doctor's ``load`` check:
    the host-wide load against the host's CPUs where this process may use fewer, and the
    CPU pressure of its cgroup, ``cgroup_cpu_pressure()``, where Linux reports one; a
    host-wide pressure only where this process may use all the host's CPUs).

    Example:
        >>> note = busy_host_notes(12.0, 2)[0]
        >>> note.startswith("the host was busy while measuring, so the figure may be low: 1-minute")
        True
        >>> busy_host_notes(1.0, 2), busy_host_notes(12.0, 2, host_cpus=64)
        ((), ())
        >>> len(busy_host_notes(12.0, 2, host_cpus=64, pressure=(0.5, "cgroup")))
        1
    """
    share: float | None = None
    scope: PressureScope = "cgroup"
    if pressure is not None:
        share, scope = pressure
    check = check_load(load, cpus, host_cpus=host_cpus, cpu_pressure=share, pressure_scope=scope)
    if check.verdict != "warn":
        return ()
    # Not "busy (<value>)": the value has brackets of its own.
    return (
        f"the host was busy while measuring, so the figure may be low: {check.value}. "
        f"Fix: {check.fix}",
    )


def host_notes_now() -> tuple[str, ...]:
    """:func:`busy_host_notes` from this host's load average, CPUs and CPU pressure now (read
    before a run: the 1-minute average would otherwise count the bench's own threads)."""
    limits = host_limits()
    return busy_host_notes(
        load_average(),
        limits.cpus,
        max(limits.cpus, limits.cpus_host),
        cgroup_cpu_pressure(),
    )


def cpu_emulation_notes(precision: str) -> tuple[str, ...]:
    """A note where the CPU has no native ``precision`` (``"fp16"``, or ``"bf16"`` without
    AVX512-BF16 or AMX): torch emulates it, slowly, so the figure is no hardware rate.

    Example:
        >>> cpu_emulation_notes("fp32")
        ()
        >>> print(cpu_emulation_notes("fp16")[0])  # doctest: +ELLIPSIS
        this CPU has no native fp16 arithmetic: torch emulates it, so this is not a hardware...
    """
    emulated = precision == "fp16" or (precision == "bf16" and not cpu_has_bf16_kernels())
    if not emulated:
        return ()
    return (
        f"this CPU has no native {precision} arithmetic: torch emulates it, so this is not a "
        "hardware rate; compare fp32 (on a GPU the benchmark measures the tensor cores)",
    )
