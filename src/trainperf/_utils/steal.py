"""CPU time the hypervisor withheld from this machine ("steal"), and demand corrected for it.

On a virtual machine whose physical CPUs are shared with other tenants, a runnable thread
can be kept off the CPU by the hypervisor. Linux counts that time as *steal*: it is in
neither the thread's run time nor its wait for a CPU (``schedstat``), so a loop that
computes looks as if it demanded only part of a core. Measured demand divided by the
share the hypervisor left is what the loop asked for.

Example:
    >>> steal_share((10.0, 1000.0), (60.0, 1100.0))  # 50 of 100 ticks stolen
    0.5
    >>> undo_steal(0.5, 0.5)  # half a core measured while half the time was stolen
    1.0
    >>> undo_steal(0.5, None)
    0.5
"""

from __future__ import annotations

import contextlib

import psutil

__all__ = [
    "MAX_STEAL", "STEAL_NOTICE", "StealMeter", "boot_steal_share", "cpu_ticks", "steal_share",
    "steal_words", "undo_steal",
]  # fmt: skip

MAX_STEAL = 0.9  # above this a correction would divide by almost nothing
STEAL_NOTICE = 5.0  # percent of stolen CPU time a report mentions


def _host_times() -> tuple[float, float, float] | None:
    """``(steal, total, idle)`` seconds of the whole host's CPU time since boot (idle
    counting iowait), None where the platform does not report steal (only Linux does)."""
    with contextlib.suppress(Exception):  # psutil raises platform-specific errors
        t = psutil.cpu_times()
        steal = getattr(t, "steal", None)
        if steal is None:
            return None
        # Guest time is already in user and nice: counting it twice would dilute steal.
        guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        idle = float(t.idle) + getattr(t, "iowait", 0.0)
        return float(steal), float(sum(t)) - guest, idle
    return None


def cpu_ticks() -> tuple[float, float] | None:
    """``(steal, total)`` seconds of the whole host's CPU time since boot, None where the
    platform does not report steal (only Linux does)."""
    times = _host_times()
    return None if times is None else (times[0], times[1])


def boot_steal_share() -> float | None:
    """Since boot, the share of the CPU time this machine's CPUs wanted (busy or stolen)
    that the hypervisor withheld; None where the platform does not report steal or the CPUs
    never ran. Idle time is left out of the share: a VM that mostly idles would otherwise
    hide a heavy steal whenever it computes.

    Example:
        >>> share = boot_steal_share()
        >>> share is None or 0.0 <= share <= 1.0
        True
    """
    times = _host_times()
    if times is None:
        return None
    steal, total, idle = times
    wanted = total - idle
    return min(1.0, max(0.0, steal / wanted)) if wanted > 0 else None


def steal_share(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """The share of the host's CPU time stolen between two :func:`cpu_ticks` readings, None
    when either is missing or no time passed."""
    if before is None or after is None:
        return None
    total = after[1] - before[1]
    if total <= 0:
        return None
    return min(1.0, max(0.0, (after[0] - before[0]) / total))


def undo_steal(demand: float, share: float | None) -> float:
    """``demand`` measured while ``share`` of the CPU time was stolen, as it would be without
    the steal (``share`` is capped at ``MAX_STEAL``)."""
    if not share:
        return demand
    return demand / (1.0 - min(share, MAX_STEAL))


def steal_words(steal: float | None) -> str:
    """``", the hypervisor withheld N% ..."`` when ``steal`` (percent) is at least
    ``STEAL_NOTICE``, else "".

    Example:
        >>> steal_words(2.0)
        ''
        >>> steal_words(30.0)[:40]
        ', the hypervisor withheld 30% of the CPU'
    """
    if steal is None or steal < STEAL_NOTICE:
        return ""
    return (
        f", the hypervisor withheld {steal:.0f}% of the CPU time (steal: other tenants "
        "share this VM's physical CPUs)"
    )


class StealMeter:
    """The steal share since the previous reading (or since it was made).

    Example:
        >>> meter = StealMeter()
        >>> share = meter.share()
        >>> share is None or 0.0 <= share <= 1.0
        True
    """

    def __init__(self) -> None:
        self._last = cpu_ticks()

    def share(self) -> float | None:
        now = cpu_ticks()
        share = steal_share(self._last, now)
        if now is not None and share is not None:
            self._last = now
        return share
