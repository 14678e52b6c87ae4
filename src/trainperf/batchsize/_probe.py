"""One batch size run for real: warm-up, timed windows, peak memory, out-of-memory caught.

A probe of size ``n`` (:class:`Prober`):

1. hands back the previous probe's memory and resets the peak
   (:mod:`trainperf.batchsize._memory`), and sets aside the loss scalers' records of the
   caller's step (:meth:`~trainperf.batchsize._state.SavedState.set_aside`);
2. builds the batch once (``sample(n)``, checked to hold ``n`` samples) and moves it to the
   device; it is reused for every step, so loading is not timed;
3. warms up: steps, each synchronised, until two in a row agree within 25 %
   (:func:`warmed_up`, at least 2 and at most 8, or past the deadline after 2): the first
   steps at a new size grow the allocator's pools, run cuDNN's autotuner and recompile
   under ``torch.compile``;
4. times windows of a fixed number of steps (:func:`steps_per_window`: at least a quarter
   of a second each), synchronising CUDA once per window, not per step, until the last
   windows agree within 5 % (at most 5 windows), as the DataLoader tuner times its
   candidates (:class:`~trainperf._utils.windows.WindowPolicy`, median of the last three);
   with accumulation ahead, the optimizers' steps are timed and charged once per
   ``global_batch / world_size`` samples, as training runs them
   (:mod:`trainperf.batchsize._accumulation`);
5. reads the peak memory of the whole probe, warm-up included, and, until a probe has
   moved a parameter, whether its steps trained what was saved
   (:mod:`trainperf.batchsize._trained`: a probe that made no gradient and changed
   nothing, on any rank, raises ``ValueError``), then puts the training state back
   (:mod:`trainperf.batchsize._state`).

``torch.OutOfMemoryError`` (or the CPU allocator's "can't allocate memory") anywhere in the
probe, building the batch included, is caught (:func:`is_out_of_memory`): the exception and
its traceback, which hold the probe's activations, are dropped, the state is restored (the
probe's gradients and optimizer state go with it), the allocator's cache is emptied, and the
size is reported as ``oom``. Any other exception propagates; the caller restores the state
first.

Under DDP each decision (warm-up done, steps per window, window done, out of time) is
taken from figures all ranks agree on (:mod:`trainperf.batchsize._agree`). An
out-of-memory error is agreed on at the same points: every rank makes the same-shaped
all-reduce, its own "ran out of memory" flag in front, whether its step raised or not
(:meth:`Prober._agreed`), so all ranks leave the probe (or the alternation) together,
instead of one waiting in an all-reduce of another size.

:meth:`Prober.compare` measures shortlisted sizes in alternation: each batch is built
once, one at a time, and kept in host memory; each window moves it to the device and
drops it after, with the gradients (and the CUDA allocator's cache), so one size's memory
at a time is held. A size that runs out of memory there is returned as an
:class:`~trainperf.batchsize._compare.AlternationOOM`, which the search marks ``oom``.

The rules a probe applies (warm-up settled, steps per window, out-of-memory errors, status),
each a pure function, are in :mod:`trainperf.batchsize._probe_rules`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

from trainperf._utils.batches import batch_bytes
from trainperf._utils.format import format_bytes
from trainperf._utils.windows import WindowTiming, settled
from trainperf.batchsize._accumulation import OptimizerClock, accumulated_seconds
from trainperf.batchsize._agree import Agreement
from trainperf.batchsize._compare import AlternationOOM, Comparison, round_order
from trainperf.batchsize._memory import MemoryReader, Peak
from trainperf.batchsize._probe_rules import (
    DEFAULT_PROBE,
    OTHER_RANK,
    ProbePolicy,
    is_out_of_memory,
    oom_text,
    status_of,
    steps_per_window,
    warmed_up,
)
from trainperf.batchsize._report import BatchSizeCandidate
from trainperf.batchsize._sample import checked_batch
from trainperf.batchsize._state import SavedState
from trainperf.batchsize._trained import Marks, TrainingCheck, untrained_error

__all__ = ["Prober"]

_ONE_PER_CHANNEL = "Expected more than 1 value per channel when training"
"""BatchNorm's error for a training batch of one sample."""


def _one_sample_error(e: Exception) -> str:
    """The refusal of BatchNorm's error ``e`` (its text holds :data:`_ONE_PER_CHANNEL`), with
    the fix. Eager torch raises it as a ``ValueError``; under ``torch.compile`` it comes
    inside another error (dynamo's ``TorchRuntimeError``, a screenful of tracing context)
    whose text is not repeated here: it is chained.

    Example:
        >>> print(_one_sample_error(RuntimeError("... got ValueError('Expected more than 1 "
        ...     "value per channel when training, ...')")).split(": ")[0])
        Expected more than 1 value per channel when training (inside a RuntimeError)
    """
    what = (
        str(e) if isinstance(e, ValueError) else f"{_ONE_PER_CHANNEL} (inside a {type(e).__name__})"
    )
    return (
        f"{what}: BatchNorm cannot train on a batch of one sample, and "
        "tune_batch_size starts at min_size (1 unless given); pass min_size=2"
    )


class _AgreedOOM(Exception):
    """Every rank leaves the probe or the alternation: one ran out of memory."""

    def __init__(self, reason: str, size: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.size = size


@dataclass
class _Timed:
    """What the steps of one probe measured."""

    warmup: int = 0
    timing: WindowTiming | None = None
    budget_cut: bool = False
    batch_bytes: int = 0


def _steps(timed: _Timed) -> int:
    """The steps a probe ran, warm-up included."""
    return timed.warmup + (0 if timed.timing is None else timed.timing.batches)


@dataclass
class Prober:
    """The search's ``probe``: one batch size run and measured (see the module docstring).

    Attributes:
        step: the caller's training step.
        sample: the caller's batch builder.
        device: where the batch is moved and the work synchronised.
        memory: the device's memory reader.
        state: the caller's saved state, set aside before each probe, restored after it.
        agree: how ranks agree (no-op with one).
        deadline: ``time.perf_counter()`` value at which the budget ends.
        usable: the most a size may peak at (``(1 - headroom) * limit``), None unknown.
        per_rank: ``global_batch / world_size`` (for ``accumulation_steps``), or None.
        policy: the measurement's shape.
        on_update: progress text sink.
        batch_bytes: host bytes of the batch of each size run.
        optimizers: the optimizers ``step`` steps, timed when ``per_rank`` is set.
        optimizer_charged: a window charged the optimizers' time as accumulation will.
        batch_dim: the dimension of the batch's first tensor that holds the samples.
        check: what the steps did to the saved parameters, marked around each probe until
            one moved a parameter (:mod:`trainperf.batchsize._trained`); the default,
            watching nothing, checks nothing.
    """

    step: Callable[[Any], object]
    sample: Callable[[int], Any]
    device: torch.device
    memory: MemoryReader
    state: SavedState
    agree: Agreement
    deadline: float
    usable: Callable[[], float | None]
    per_rank: int | None = None
    policy: ProbePolicy = DEFAULT_PROBE
    on_update: Callable[[str], None] = lambda text: None
    batch_bytes: dict[int, int] = field(default_factory=dict)
    optimizers: Sequence[Optimizer] = ()
    optimizer_charged: bool = False
    batch_dim: int = 0
    check: TrainingCheck = field(default_factory=lambda: TrainingCheck(()))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _batch(self, size: int) -> tuple[Any, int]:
        from trainperf.device import to_device

        host = checked_batch(self.sample, size, self.batch_dim)
        return to_device(host, self.device), batch_bytes(host)

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
        """``fn(*args)`` and None, or None and the message of the out-of-memory error it
        raised (anything else propagates). Only the text is kept: the exception's traceback
        holds the tensors of the step that raised."""
        try:
            return fn(*args), None
        except Exception as e:
            if not is_out_of_memory(e):
                if _ONE_PER_CHANNEL in str(e):
                    raise ValueError(_one_sample_error(e)) from e
                raise
            return None, oom_text(e)

    def _agreed(
        self, failed: str | None, maxima: Sequence[float] = (), minima: Sequence[float] = ()
    ) -> tuple[list[float], list[float]]:
        """:meth:`Agreement.combine` with this rank's out-of-memory flag in front: every
        rank makes the same-shaped call whether its step raised or not, and all raise
        :class:`_AgreedOOM` together when any did."""
        (oom_any, *mx), mn = self.agree.combine(
            maxima=[float(failed is not None), *maxima], minima=minima
        )
        if oom_any:
            raise _AgreedOOM(failed or OTHER_RANK)
        return mx, mn

    def _timed_step(self, batch: Any) -> float:
        t0 = time.perf_counter()
        self.step(batch)
        self._sync()
        self.memory.after_step()
        return time.perf_counter() - t0

    def _warm_up(self, batch: Any, timed: _Timed) -> float:
        """Warm-up steps until they settle on every rank; the last step's seconds."""
        times: list[float] = []
        while True:
            step_s, failed = self._guarded(self._timed_step, batch)
            if failed is None:
                times.append(step_s)
            timed.warmup = len(times)
            done = failed is not None or warmed_up(times, self.policy)
            if len(times) >= self.policy.min_warmup and time.perf_counter() >= self.deadline:
                done = True  # out of time: the windows say how settled it was
            (more,), _ = self._agreed(failed, maxima=[float(not done)])
            if not more:
                return times[-1]

    def _window(self, batch: Any, size: int, k: int) -> float:
        """Samples per second over ``k`` steps, synchronised once; with accumulation ahead,
        the optimizers' steps counted once per ``per_rank`` samples, not once per step."""
        per_rank = self.per_rank if self.per_rank is not None and self.per_rank > size else None
        with OptimizerClock(self.optimizers if per_rank else (), self.device) as clock:
            t0 = time.perf_counter()
            for _ in range(k):
                self.step(batch)
                self.memory.after_step()
            self._sync()
            seconds = time.perf_counter() - t0
        if per_rank is not None and clock.steps:
            seconds = accumulated_seconds(seconds, clock.seconds(), size, per_rank)
            self.optimizer_charged = True
        return size * k / max(seconds, 1e-9)

    def _run(self, size: int, timed: _Timed, marks: Marks | None) -> None:
        built, failed = self._guarded(self._batch, size)
        self._agreed(failed)
        batch, timed.batch_bytes = built
        self.on_update(f"batch {size}: warming up")
        with self.check.hooked(marks):
            step_s = self._warm_up(batch, timed)
        (k_agreed,), _ = self.agree.combine(maxima=[steps_per_window(step_s, self.policy)])
        k = int(k_agreed)
        rates: list[float] = []
        while True:
            rate, failed = self._guarded(self._window, batch, size, k)
            late = time.perf_counter() >= self.deadline
            (late_any,), (slowest,) = self._agreed(
                failed, maxima=[float(late)], minima=[math.inf if rate is None else rate]
            )
            rates.append(slowest)
            timed.timing = WindowTiming(tuple(rates), k * len(rates), 0, bool(late_any))
            self.on_update(f"batch {size}: {timed.timing.samples_per_s:,.0f}/s")
            if settled(timed.timing, self.policy.windows):
                return
            if len(rates) >= self.policy.windows.max_windows:
                return
            if late_any:
                timed.budget_cut = True
                return

    def _measure(self, size: int, marks: Marks | None) -> tuple[_Timed, str | None]:
        """Run the steps; an out-of-memory error (on any rank) is returned as its message,
        anything else raised."""
        timed = _Timed()
        try:
            self._run(size, timed, marks)
        except _AgreedOOM as e:
            return timed, e.reason
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            return timed, oom_text(e)
        return timed, None

    def __call__(self, size: int) -> BatchSizeCandidate:
        started = time.perf_counter()
        self.memory.start_probe()
        oom_message = None
        try:
            self.state.set_aside()
            marks = self.check.mark()
            timed, oom_message = self._measure(size, marks)
            peak = self.memory.peak()
            idle = oom_message is None and self._untrained(marks, timed)
        finally:
            # The probe's gradients, optimizer state and BatchNorm statistics go; the
            # caller's come back. Then the memory they held is handed back.
            self.state.restore()
            self.memory.free(collect=oom_message is not None)
        (oom_any, peak_max, idle_any), _ = self.agree.combine(
            maxima=[float(oom_message is not None), float(peak.memory or 0), float(idle)]
        )
        if idle_any and not oom_any:
            raise untrained_error(size, _steps(timed))
        agreed = Peak(None if peak.memory is None else int(peak_max), peak.allocated)
        return self._candidate(size, timed, agreed, bool(oom_any), oom_message, started)

    def _untrained(self, marks: Marks | None, timed: _Timed) -> bool:
        """No step of this probe, nor of any before it, trained what was saved
        (:func:`~trainperf.batchsize._trained.untrained_error`)."""
        self.check.record(marks, _steps(timed))
        return not (self.check.settled or self.check.backward_seen)

    def compare(
        self, sizes: Sequence[BatchSizeCandidate], rounds: int
    ) -> Comparison | AlternationOOM | None:
        """Measure ``sizes`` (measured before, each with its figure) against each other in
        alternating windows (:mod:`trainperf.batchsize._compare`): one untimed step of each
        first (not on the CPU), then ``rounds`` rounds of one window per size, the order
        reversed every other round. Each size's batch is built once, one at a time, and
        kept in host memory; it is moved to the device before each of its windows
        (untimed) and dropped after it, with the gradients, so one size's memory at a time
        is held. The state is put back after.

        Every rank agrees after each step or window whether one ran out of memory, so all
        stop at the same size together.

        Returns:
            The rounds completed (the deadline ends them early), the size that ran out of
            memory (on any rank), or None when not one round completed.
        """
        order = [c.batch_size for c in sizes]
        k = {
            c.batch_size: steps_per_window(c.batch_size / (c.samples_per_s or 1.0), self.policy)
            for c in sizes
        }
        done: list[tuple[float, ...]] = []
        oom: AlternationOOM | None = None
        try:
            self.state.set_aside()
            done = self._alternate(order, k, rounds)
        except _AgreedOOM as e:
            oom = AlternationOOM(e.size, e.reason)
        finally:
            self.state.restore()
            self.memory.free(collect=oom is not None)
        if oom is not None:
            return oom
        return Comparison(tuple(order), tuple(done)) if done else None

    def _alternate(
        self, order: list[int], k: dict[int, int], rounds: int
    ) -> list[tuple[float, ...]]:
        hosts: dict[int, Any] = {}
        for n in order:
            hosts[n], failed = self._guarded(self._host_batch, n)
            self._agreed_at(n, failed)
        for n in order if self.device.type != "cpu" else ():
            # The caching allocator's pools, emptied after the probe, grow back (no such
            # pools on the CPU, where the step would only cost time).
            _, failed = self._guarded(self._untimed_step, hosts[n])
            self._agreed_at(n, failed)
        done: list[tuple[float, ...]] = []
        for r in range(rounds):
            row: dict[int, float] = {}
            for n in round_order(order, r):
                self.on_update(f"batch {n}: against {len(order) - 1} other(s), round {r + 1}")
                row[n], failed = self._guarded(self._moved_window, hosts[n], n, k[n])
                self._agreed_at(n, failed)
            late = time.perf_counter() >= self.deadline
            (late_any,), slowest = self.agree.combine(
                maxima=[float(late)], minima=[row[n] for n in order]
            )
            done.append(tuple(slowest))
            if late_any:
                break
        return done

    def _agreed_at(self, size: int, failed: str | None) -> None:
        try:
            self._agreed(failed)
        except _AgreedOOM as e:
            raise _AgreedOOM(e.reason, size) from None

    def _host_batch(self, size: int) -> Any:
        """``sample(size)`` checked, kept in host memory (a batch ``sample`` builds on the
        device is copied out, so the shortlist's batches are not all there at once)."""
        from trainperf.device import to_device

        return to_device(checked_batch(self.sample, size, self.batch_dim), "cpu")

    def _untimed_step(self, host: Any) -> None:
        try:
            self.step(self._moved(host))
            self._sync()
        finally:
            self._release()

    def _moved_window(self, host: Any, size: int, k: int) -> float:
        try:
            return self._window(self._moved(host), size, k)
        finally:
            self._release()

    def _release(self) -> None:
        """Between two sizes: the gradients go, and the CUDA allocator's cache with them."""
        self.state.drop_gradients()
        if self.device.type == "cuda":
            self.memory.free()

    def _moved(self, host: Any) -> Any:
        from trainperf.device import to_device

        batch = to_device(host, self.device)
        self._sync()
        return batch

    def _candidate(
        self,
        size: int,
        timed: _Timed,
        peak: Peak,
        oom: bool,
        oom_message: str | None,
        started: float,
    ) -> BatchSizeCandidate:
        self.batch_bytes[size] = timed.batch_bytes
        usable = self.usable()
        status = status_of(oom, peak.memory, usable)
        timing = timed.timing
        reason = None
        if status == "oom":
            reason = oom_message or OTHER_RANK
        elif status == "over-headroom":
            reason = f"peak past the {format_bytes(usable)} usable"
        elif timed.budget_cut:
            reason = "the budget cut the timing short"
        return BatchSizeCandidate(
            batch_size=size,
            status=status,
            samples_per_s=None if oom or timing is None else timing.samples_per_s,
            spread=None if oom or timing is None else timing.spread,
            peak_memory=peak.memory,
            peak_allocated=peak.allocated,
            warmup_steps=timed.warmup,
            steps=0 if timing is None else timing.batches,
            windows=0 if timing is None else len(timing.rates),
            accumulation_steps=1 if self.per_rank is None else self.per_rank // size,
            elapsed_s=time.perf_counter() - started,
            reason=reason,
        )
