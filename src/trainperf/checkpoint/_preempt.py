"""Preemption: a signal asks the loop to stop, every rank agrees on the step, the loop saves.

The signal handler only records that a signal came and when (no I/O, no allocation worth
the name), so a signal can arrive at any instant, a second one during the final save
included, without harm. ``requested`` is read once per training step; under a process
group, every ``check_every``-th read is a small ``all_reduce`` (MAX) of every rank's flag
and of how long ago its first signal came, so every rank sees ``True`` at the same read,
i.e. at the same step. The cost of that ``all_reduce`` is measured on entry; the first read
compares, and ``check_every`` is chosen there, and again after each check, from what the
previous check cost and how long the steps took on the slowest rank (sent along in the
same ``all_reduce``, so every rank picks the same interval): 50 us a step on average (half
of 1 % of a 10 ms step), and at least one check a second. Or it is given.
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any

import torch

from trainperf._utils.validate import positive_int, positive_number
from trainperf.checkpoint._rank_gpu import rank_gpu

__all__ = ["Preemption", "active_signals", "agreement_interval", "signal_numbers"]

# How many active Preemptions wait for each signal number: DataLoader workers started with
# trainperf.DieWithParent ignore those (torchrun and SLURM signal every process, and a
# torch worker dies of SIGTERM, which fails the rank's next batch before its final save).
_ACTIVE: dict[int, int] = {}
# The Preemptions entered and not exited yet, in entry order: a block exited before one
# entered after it (not nested: enter A, enter B, exit A) takes its handler out of the chain
# through the later one's saved handler (:meth:`Preemption._unlink`).
_ENTERED: list[Preemption] = []


def active_signals() -> tuple[int, ...]:
    """The signal numbers an active :class:`Preemption` in this process waits for."""
    return tuple(sorted(sig for sig, n in _ACTIVE.items() if n > 0))


# A check may cost 50 us a step on average: 0.5 % of a 10 ms step, half the 1 % target,
# because a check can cost twice what the one before it did on a busy machine.
_BUDGET_S = 5e-5
# However cheap the steps, a stop is agreed within about this long of the signal (a check
# at least this often).
_MAX_DELAY_S = 1.0
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def agreement_interval(cost_s: float, step_s: float = 0.010) -> int:
    """How many steps apart the ranks compare flags, for a comparison costing ``cost_s``
    and steps of ``step_s``.

    The comparison may cost 50 us a step on average (0.5 % of a 10 ms step, less of a
    longer one); but the interval never spans more than a second of steps, so a stop is
    agreed within about a second of the signal even when the comparison is slow.

    Example:
        >>> agreement_interval(0.00005), agreement_interval(0.0004), agreement_interval(1.0)
        (1, 8, 100)
        >>> agreement_interval(0.002, step_s=2.0)  # long steps: every step
        1
    """
    wanted = math.ceil(cost_s / _BUDGET_S - 1e-9)
    longest = max(1, math.floor(_MAX_DELAY_S / max(step_s, 1e-6) + 1e-9))
    return max(1, min(wanted, longest))


def signal_numbers(signals: Iterable[str | int] | str | int) -> tuple[signal.Signals, ...]:
    """``("SIGTERM", "USR1", 15)`` -> the signals, checked.

    Raises:
        ValueError: an unknown name or number, none at all, or SIGKILL/SIGSTOP (which no
            process can catch).
        TypeError: a value that is not a name or a number.

    Example:
        >>> [s.name for s in signal_numbers(("SIGTERM", "USR1"))]
        ['SIGTERM', 'SIGUSR1']
    """
    items = [signals] if isinstance(signals, (str, int)) else list(signals)
    if not items:
        raise ValueError("signals must name at least one signal, such as ('SIGTERM', 'SIGUSR1')")
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise TypeError(f"signals must be names such as 'SIGTERM' or numbers, got {item!r}")
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"unknown signal {item!r}; use a name such as 'SIGTERM', 'SIGUSR1' or 'SIGINT'"
            ) from e
        if sig.name in _UNCATCHABLE:
            raise ValueError(
                f"{sig.name} cannot be caught by any process, so it cannot ask for a save; "
                "use SIGTERM or SIGUSR1 (SLURM: #SBATCH --signal=USR1@90)"
            )
        out.append(sig)
    return tuple(dict.fromkeys(out))


def _group() -> tuple[int, torch.device] | None:
    """``(world size, device for collectives)`` under a process group of 2 or more: under
    NCCL this rank's GPU (:func:`~._rank_gpu.rank_gpu`), else the CPU."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_world_size(), rank_gpu() or torch.device("cpu")


class Preemption:
    """The stop flag that :meth:`Checkpointer.preemption` hands the training loop.

    Use it as a context manager: the handlers are installed on entry (in the main thread)
    and the previous ones put back on exit; blocks need not exit in the order they were
    entered (each exit leaves the other active blocks' handlers in place). Read
    :attr:`requested` once per step, on every rank.

    Attributes:
        signals: the signals that ask for a stop.
        grace_s: seconds from the first signal to the hard kill the loop expects.
        check_every: under a process group, how many reads of :attr:`requested` apart the
            ranks compare flags (1 without one).
        agree_cost_s: the measured cost of one comparison (None without a process group).
    """

    def __init__(
        self,
        signals: Iterable[str | int] | str | int = ("SIGTERM", "SIGUSR1"),
        grace_s: float = 25.0,
        check_every: int | None = None,
    ) -> None:
        self.signals = signal_numbers(signals)
        self.grace_s = positive_number("grace_s", grace_s, unit="s")
        self._given_every: int | None = (
            None if check_every is None else positive_int("check_every", check_every)
        )
        self.check_every = self._given_every or 1
        self.agree_cost_s: float | None = None
        self._group: tuple[int, torch.device] | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._signum: int | None = None
        self._at: float | None = None
        self._count = 0
        self._reads = 0
        self._last_cost = 0.0
        self._checked = 0.0
        self._agreed_at: float | None = None
        self._agreed_elapsed = 0.0
        self._agreed_signal: int | None = None
        self._active = False
        # Called once, when the stop is agreed: the Checkpointer that made this object
        # records it there rather than keep every Preemption it made (a loop may make one
        # per epoch).
        self._on_stop: Callable[[], None] | None = None

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.signals)
        asked = self._agreed_at is not None
        return f"Preemption(signals=({names}), grace_s={self.grace_s:g}, requested={asked})"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only assignments: safe whatever the main thread was doing when the signal came.
        if self._at is None:
            self._at, self._signum = time.monotonic(), signum
        self._count += 1
        # A Preemption entered outside this one (another Checkpointer's, an EMA's) is told
        # too; any other handler is put back on exit, not called, so nothing can interrupt
        # the final save.
        previous = self._previous.get(signal.Signals(signum))
        if previous is not None and isinstance(getattr(previous, "__self__", None), Preemption):
            previous(signum, frame)

    def __enter__(self) -> Preemption:
        if self._active:
            raise RuntimeError("this Preemption is already active; enter it once")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Checkpointer.preemption() must be entered in the main thread: Python "
                "delivers signals there only"
            )
        self._group = _group()
        if self._group is not None:
            self._calibrate()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
            _ACTIVE[int(sig)] = _ACTIVE.get(int(sig), 0) + 1
        self._active = True
        _ENTERED.append(self)
        self._checked = time.monotonic()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            self._unlink(sig, previous)
            _ACTIVE[int(sig)] = max(0, _ACTIVE.get(int(sig), 0) - 1)
        self._previous.clear()
        self._active = False
        if self in _ENTERED:
            _ENTERED.remove(self)

    def _unlink(self, sig: signal.Signals, previous: Any) -> None:
        """Take this block's handler of ``sig`` out of the chain, in whatever order the
        blocks exit: installed, it gives way to ``previous``; under a later block's handler
        (entered after this one, still active), that block's saved handler becomes
        ``previous``, so neither a live block loses the signal nor a stale handler comes
        back when it exits. Under a handler that is no Preemption's, that handler stays."""
        if signal.getsignal(sig) == self._handle:  # bound methods: equal, not identical
            signal.signal(sig, previous)
            return
        for later in _ENTERED:
            if later is not self and later._previous.get(sig) == self._handle:
                later._previous[sig] = previous
                return

    def _reduce(self, values: list[float]) -> list[float]:
        device = torch.device("cpu") if self._group is None else self._group[1]
        t = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [float(v) for v in t.cpu().tolist()]

    def _calibrate(self) -> None:
        """Time the comparison (every rank takes the slowest rank's figure, so all choose
        the same interval)."""
        times = []
        for _ in range(6):
            start = time.perf_counter()
            self._reduce([0.0, 0.0, 0.0, 0.0, 0.0])
            times.append(time.perf_counter() - start)
        cost = self._reduce([statistics.median(times[1:])])[0]
        self.agree_cost_s = self._last_cost = cost
        if self._given_every is None:
            # The step time is not known yet: the first read compares, and the interval is
            # chosen there from this cost and that first step's time (an interval from a
            # guessed 10 ms step spanned up to 100 steps: 50 s of 0.5 s steps before any
            # rank could learn of a signal, past the grace period).
            self.check_every = 1

    @property
    def signal(self) -> str | None:
        """The name of the first signal received here (None before any)."""
        sig = self._agreed_signal or self._signum
        return None if sig is None else signal.Signals(sig).name

    @property
    def requested(self) -> bool:
        """True from the step at which every rank has seen that a stop was asked for.

        Without a process group it is True as soon as a signal came. Under one, read it
        exactly once per step on every rank (each ``check_every``-th read is a collective).
        """
        if self._agreed_at is not None:
            return True
        now = time.monotonic()
        if self._group is None:
            if self._at is None:
                return False
            self._agreed_at, self._agreed_elapsed = now, now - self._at
            self._stopped()
            return True
        self._reads += 1
        if self._reads < self.check_every:
            return False
        step_s = (now - self._checked) / self._reads if self._checked else 0.0
        self._reads = 0
        elapsed = -1.0 if self._at is None else now - self._at
        mine = [float(self._at is not None), elapsed, float(self._signum or 0)]
        start = time.perf_counter()
        got, ago, sig, cost, slowest = self._reduce([*mine, self._last_cost, step_s])
        self._last_cost = time.perf_counter() - start
        self._checked = time.monotonic()
        if self._given_every is None and cost > 0 and slowest > 0:
            # Every rank got the same figures (the slowest rank's cost of the previous check
            # and its step time), so every rank picks the same next interval.
            self.agree_cost_s = cost
            self.check_every = agreement_interval(cost, slowest)
        if got > 0:
            self._agreed_at, self._agreed_elapsed = time.monotonic(), max(0.0, ago)
            self._agreed_signal = int(sig) or None
            self._stopped()
            return True
        return False

    def _stopped(self) -> None:
        """Tell whoever asked (:attr:`_on_stop`) that the stop was agreed."""
        if self._on_stop is not None:
            self._on_stop()

    @property
    def deadline_s(self) -> float | None:
        """Seconds left of the grace period (counted from the earliest rank's signal), or
        None while no stop is requested."""
        if self._agreed_at is None:
            return None
        spent = self._agreed_elapsed + (time.monotonic() - self._agreed_at)
        return max(0.0, self.grace_s - spent)

    @property
    def signals_received(self) -> int:
        """How many of the signals arrived here (a second one does not cut the save short)."""
        return self._count
