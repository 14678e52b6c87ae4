"""The table a person reads of a DataLoader tuning (``str(TuningReport)``), and how it words
the cores kept for the main process (shared with the tuner's CPU skips)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainperf._utils.format import format_bytes, plural

if TYPE_CHECKING:
    from trainperf.loader._report import TuningReport

__all__ = ["main_process_share", "report_table", "shares_main_core"]


def _num(x: float | None, fmt: str) -> str:
    """Format ``x`` with ``fmt`` plus an optional unit after a space or %: ``".1f%"``."""
    if x is None:
        return "-"
    spec, _, unit = fmt.partition(" ")
    if spec.endswith("%"):
        return format(x, spec[:-1]) + "%"
    return format(x, spec) + unit


def main_process_share(main_cores: float, measured: bool = False, shared: bool = False) -> str:
    """How the report words the cores kept for the main process (``measured``: from
    ``step_fn``, else the one core kept when the step is unknown; ``shared``: none is left
    over for it, the workers share its core: :func:`shares_main_core`).

    Example:
        >>> main_process_share(1.0), main_process_share(0.04, measured=True)
        ('one kept for the main process', '0.04 kept for the main process, as step_fn measured')
        >>> main_process_share(1.0, shared=True)
        'shared with the main process'
    """
    if shared:
        if not measured:
            return "shared with the main process"
        return f"shared with the main process, which step_fn measured at {main_cores:.2f} cores"
    if not measured:
        return "one kept for the main process"
    return f"{main_cores:.2f} kept for the main process, as step_fn measured"


def shares_main_core(cpus: int, worker_cpus: int, main_cores: float) -> bool:
    """Whether the workers' whole cores (at least 1) leave the main process less than its
    share of ``cpus``: on one CPU, say, none is kept for it.

    Example:
        >>> shares_main_core(1, 1, 1.0), shares_main_core(4, 3, 1.0), shares_main_core(2, 1, 1.8)
        (True, False, True)
    """
    return worker_cpus + main_cores > cpus + 0.5


def _source(report: TuningReport) -> str:
    """Where the settings came from, for the first line of the table."""
    if report.shared_from is not None:
        return f"tuned on local rank 0 (rank {report.shared_from}) and shared"
    if report.from_cache:
        return "from cache"
    return f"{report.elapsed_s:.1f} s of {report.budget_s:g} s"


def _main_share(report: TuningReport) -> str:
    """The main process's share of the CPUs, for the limits line."""
    return main_process_share(
        report.main_cores,
        report.step_samples_per_s is not None,
        shares_main_core(report.cpus, report.worker_cpus, report.main_cores),
    )


def report_table(report: TuningReport) -> str:
    """:class:`~trainperf.loader.TuningReport` as ``str`` prints it: the source and limits, one
    row per candidate, the choice, the verdict on the caller's setting, and the notes."""
    lim = report.limits
    shm = "no /dev/shm" if lim.shm_free is None else f"/dev/shm {format_bytes(lim.shm_free)} free"
    lines = [
        f"DataLoader tuning: batch_size={report.batch_size}, device {report.device}, "
        f"{_source(report)}",
        f"limits: {plural(report.cpus, 'usable CPU')} ({report.worker_cpus} for workers, "
        f"{_main_share(report)}), "
        f"{format_bytes(lim.memory_available)} memory available, {shm}",
    ]
    header = (
        f"{'workers':>7} {'prefetch':>8} {'pin':>3} {'samples/s':>10} {'spread':>6} "
        f"{'start-up':>8} {'workers RSS':>11} {'cores':>5}  status"
    )
    if report.candidates:  # a cached report holds only the choice, not the table
        lines.append(header)
    for c in report.candidates:
        cores = c.main_cpu if c.num_workers == 0 else c.worker_cpu
        status = c.status if c.reason is None else f"{c.status} ({c.fault}): {c.reason}"
        lines.append(
            f"{c.num_workers:>7} {_num(c.prefetch_factor, 'd'):>8} "
            f"{'yes' if c.pin_memory else 'no':>3} {_num(c.samples_per_s, ',.1f'):>10} "
            f"{_num(None if c.spread is None else 100 * c.spread, '.1f%'):>6} "
            f"{_num(c.startup_s, '.2f s'):>8} {format_bytes(c.worker_peak_rss):>11} "
            f"{_num(cores, '.2f'):>5}  {status}"
        )
    chosen = ", ".join(
        f"{k}={report.best_kwargs[k]!r}"
        for k in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
        if k in report.best_kwargs
    )
    speed = (
        "not measured" if report.samples_per_s is None else f"{report.samples_per_s:,.1f} samples/s"
    )
    if report.speedup is not None:
        speed += f" ({report.speedup:.2f}x num_workers=0)"
    lines.append(f"chosen: {chosen}: {speed}")
    if report.user_setting is not None:
        lines.append(str(report.user_setting))
    if report.step_samples_per_s is not None:
        lines.append(f"step_fn alone: {report.step_samples_per_s:,.1f} samples/s")
    lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)
