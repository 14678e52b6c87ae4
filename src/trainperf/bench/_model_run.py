"""``bench_model``'s run: its settings, the warm-up, the timed iterations, and the limit on
how long they may take.

The limit is checked from batches the run times anyway, never from a probe: the second
warm-up batch, timed on its own (the first holds one-off setup such as cuDNN autotuning or
the allocator's growth); the first timed iteration where there is a single warm-up batch;
the first batch where that alone took longer than the limit. Only the first two warm-up
batches get a synchronisation of their own; a timed iteration is synchronised once, after
its last batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainperf._utils.format import plural
from trainperf.amp._tf32 import tf32 as tf32_mode
from trainperf.amp._tf32 import tf32_state
from trainperf.bench._common import (
    RunTimeLimitExceeded,
    fewer_iterations,
    format_duration,
    limit_passed,
    power_of_two_at_most,
    run_time_fix,
    seconds_to_fit,
    synchronize,
)

__all__ = ["MIN_COMPARABLE_BATCH", "RunTimeLimit", "Settings", "Timing", "measure"]

# Below this batch a GPU is under-fed and a "slow card" warning would be misleading (and a
# batch's time no longer shrinks in proportion to its images).
MIN_COMPARABLE_BATCH = 64

# The clock every batch is timed with (a name of this module's, for the tests to fake).
_clock = time.perf_counter


@dataclass(frozen=True)
class Settings:
    """The counts a run uses, defaults filled in for the device and checked."""

    batch_size: int
    image_size: int
    iterations: int
    batches_per_iteration: int
    warmup_batches: int


def _run_time_fix(
    settings: Settings,
    seconds_per_batch: float,
    max_seconds: float | None,
    *,
    train: bool,
    cuda: bool = False,
) -> tuple[float, str | None]:
    """The decision rule (:func:`~trainperf.bench._common.limit_passed`) for a run of
    ``settings`` at ``seconds_per_batch``: its estimated seconds, and None where they fit,
    else the fix (:func:`~trainperf.bench._common.run_time_fix`): a smaller batch (a batch's
    time taken as in proportion to its images), a smaller image size, fewer iterations, or a
    larger limit. On a GPU (``cuda``) a batch's time is not in proportion to its images (a
    small batch under-feeds it), so fewer iterations and a larger limit come first, and a
    smaller batch is never below :data:`MIN_COMPARABLE_BATCH`."""
    per_iteration = settings.batches_per_iteration * seconds_per_batch
    warmup = settings.warmup_batches * seconds_per_batch
    estimate = warmup + settings.iterations * per_iteration
    limit = limit_passed(estimate, max_seconds)
    if limit is None:
        return estimate, None
    # batch_size=<n>, image_size and iterations=<n> are what trainperf.cli rewrites as its
    # options.
    smaller = []
    fitting = power_of_two_at_most(int(settings.batch_size * seconds_to_fit(limit) / estimate))
    if cuda:
        fitting = max(fitting, MIN_COMPARABLE_BATCH)
    if (2 if train else 1) <= fitting < settings.batch_size:
        smaller.append(f"a smaller batch_size (e.g. batch_size={fitting})")
    smaller.append("a smaller image_size")
    iterations = fewer_iterations(limit, warmup, per_iteration)
    if cuda:
        return estimate, run_time_fix(estimate, iterations, after=smaller)
    return estimate, run_time_fix(estimate, smaller + iterations)


def _call(settings: Settings, iterations_at_fault: bool) -> str:
    """The call a refusal names: the batch and image size (a batch's cost), and the
    iterations where fewer are a fix, as they ran.

    Example:
        >>> _call(Settings(2, 64, 1000, 1, 2), True)
        'bench_model(batch_size=2, image_size=64, iterations=1000)'
    """
    # Each is what trainperf.cli rewrites as its option (--batch-size <n>, ...).
    s = settings
    iterations = f", iterations={s.iterations}" if iterations_at_fault else ""
    return f"bench_model(batch_size={s.batch_size}, image_size={s.image_size}{iterations})"


@dataclass(frozen=True)
class RunTimeLimit:
    """The limit on one run's length, and what its refusal names."""

    label: str  # e.g. "resnet50 fp32"
    settings: Settings
    device: torch.device
    max_seconds: float | None
    train: bool

    def check(self, seconds_per_batch: float, measured_on: str) -> None:
        """Refuse a run that, at ``seconds_per_batch`` (measured on ``measured_on``), would
        take longer than ``max_seconds``, before the rest of it runs (a batch underway does
        not stop at Ctrl-C).

        Raises:
            RunTimeLimitExceeded: it would (a ValueError); the message names the estimate, the
                rate and the fix.
        """
        settings, max_seconds = self.settings, self.max_seconds
        cuda = self.device.type == "cuda"
        estimate, fix = _run_time_fix(
            settings, seconds_per_batch, max_seconds, train=self.train, cuda=cuda
        )
        if fix is None or max_seconds is None:
            return
        fewer = fewer_iterations(
            max_seconds,
            settings.warmup_batches * seconds_per_batch,
            settings.batches_per_iteration * seconds_per_batch,
        )
        timed = settings.iterations * settings.batches_per_iteration
        batches = settings.warmup_batches + timed
        iterations = plural(settings.iterations, "iteration")
        mode = "training" if self.train else "inference"
        raise RunTimeLimitExceeded(
            f"{_call(settings, bool(fewer))}: {batches} {self.label} {mode} batches "
            f"({settings.warmup_batches} warm-up, {timed} timed in {iterations}) would take "
            f"about {format_duration(estimate)} on {self.device} "
            f"({settings.batch_size / seconds_per_batch:.1f} images/s, "
            f"{format_duration(seconds_per_batch)} per batch, measured on {measured_on}), "
            f"more than max_seconds={max_seconds:g}: {fix}"
        )

    def passed_by(self, seconds: float) -> bool:
        """Whether ``seconds`` alone are past the limit: the run is, whatever they held."""
        return self.max_seconds is not None and seconds > self.max_seconds


def _seconds_of_batch(run_batch: Callable[[], None], device: torch.device) -> float:
    """One batch's wall time, CUDA synchronised after it (warm-up only: a timed iteration
    is synchronised once, after all its batches)."""
    start = _clock()
    run_batch()
    synchronize(device)
    return _clock() - start


def _warm_up(run_batch: Callable[[], None], what: str, limit: RunTimeLimit) -> None:
    """Run the untimed batches; a kernel this PyTorch build lacks is a NotImplementedError.
    The run's length is checked from the second batch, timed on its own: the first holds
    one-off setup (cuDNN autotuning, the allocator's growth), so it is used only where it
    alone took longer than the limit."""
    try:
        for i in range(limit.settings.warmup_batches):
            if i >= 2:
                run_batch()
                continue
            seconds = _seconds_of_batch(run_batch, limit.device)
            if i == 1:
                limit.check(seconds, "the second warm-up batch")
            elif limit.passed_by(seconds):
                limit.check(seconds, "the first warm-up batch, one-off setup included")
    except (NotImplementedError, RuntimeError) as e:
        # PyTorch reports a missing kernel as NotImplementedError, or (older builds)
        # a RuntimeError "... not implemented for 'Half'"; anything else is a bug.
        if not isinstance(e, NotImplementedError) and "not implemented" not in str(e):
            raise
        raise NotImplementedError(f"bench_model: {what} by this PyTorch build ({e})") from e


@dataclass(frozen=True)
class Timing:
    """What the timed iterations measured, and the TF32 settings they ran with."""

    seconds: tuple[float, ...]
    rates: tuple[float, ...]
    tf32_matmul: bool
    tf32_cudnn: bool


def _time_iterations(
    run_batch: Callable[[], None],
    limit: RunTimeLimit,
    on_iteration: Callable[[int, float, float], None] | None,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(seconds, images_per_s)`` of each timed iteration, CUDA synchronised around each.
    After a single warm-up batch (all setup) the first iteration checks the run's length,
    from the time it measures anyway."""
    settings, device = limit.settings, limit.device
    seconds: list[float] = []
    rates: list[float] = []
    synchronize(device)
    for i in range(settings.iterations):
        start = _clock()
        for _ in range(settings.batches_per_iteration):
            run_batch()
        synchronize(device)
        elapsed = _clock() - start
        rate = settings.batch_size * settings.batches_per_iteration / elapsed
        seconds.append(elapsed)
        rates.append(rate)
        if on_iteration is not None:
            on_iteration(i, rate, elapsed)
        if i == 0 and settings.warmup_batches == 1 and settings.iterations > 1:
            per_batch = elapsed / settings.batches_per_iteration
            limit.check(per_batch, "the first timed iteration")
    return tuple(seconds), tuple(rates)


def measure(
    run_batch: Callable[[], None],
    limit: RunTimeLimit,
    *,
    what: str,
    tf32: bool | None,
    on_iteration: Callable[[int, float, float], None] | None,
) -> Timing:
    """Warm up, then time the iterations, under the TF32 setting asked for; a run that
    would take past ``limit`` is refused as soon as a batch's time says so."""
    # tf32=None keeps the current settings; either way they are read without the RuntimeError
    # torch raises once its new fp32_precision API was used, and restored afterwards.
    mode = contextlib.nullcontext(tf32_state()) if tf32 is None else tf32_mode(tf32)
    with mode as state, torch.inference_mode(not limit.train):
        _warm_up(run_batch, what, limit)
        seconds, rates = _time_iterations(run_batch, limit, on_iteration)
    return Timing(seconds, rates, tf32_matmul=state.matmul, tf32_cudnn=state.cudnn)
