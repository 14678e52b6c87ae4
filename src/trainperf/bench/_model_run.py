"""``bench_model``'s run: its settings, the warm-up, the timed iterations, and the limit on
how long they may take.

The limit is checked from batches the run times anyway, never from a probe: the second
warm-up batch, timed on its own (the first holds one-off setup such as cuDNN autotuning or
the allocator's growth); where there is a single warm-up batch, the first timed iteration's
average, and before it the first timed batch, timed on its own only where the warm-up batch,
setup included, leaves the run's fit in doubt and a batch is still to come (that batch may
still be settling, so it only stops an iteration that alone would take longer than the
limit); the first batch where that alone took longer than the limit. Only the first two
warm-up batches, and that first timed batch, get a synchronisation of their own; a timed
iteration is otherwise synchronised once, after its last batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from trainperf._utils.format import plural
from trainperf.amp._tf32 import tf32 as tf32_mode
from trainperf.amp._tf32 import tf32_state
from trainperf.bench._common import (
    RunTimeLimitExceeded,
    fewer_iterations,
    format_duration,
    iterations_within,
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


def _fewer_batches(settings: Settings, seconds_per_batch: float, limit: float) -> dict[str, str]:
    """The counts that, made smaller, fit the run in ``limit``, by name: fewer iterations,
    fewer batches per iteration, fewer warm-up batches; each only where one fits.

    Example:
        >>> _fewer_batches(Settings(2, 64, 1, 10**9, 1000), 1.0, 300.0)
        {}
        >>> list(_fewer_batches(Settings(2, 64, 2, 1, 1000), 1.0, 300.0))
        ['warmup_batches']
    """
    s = settings
    warmup = s.warmup_batches * seconds_per_batch
    timed = s.iterations * s.batches_per_iteration * seconds_per_batch
    fixes = {}
    for fix in fewer_iterations(limit, warmup, s.batches_per_iteration * seconds_per_batch):
        fixes["iterations"] = fix
    per_iteration = iterations_within(limit, warmup, s.iterations * seconds_per_batch)
    if 1 <= per_iteration < s.batches_per_iteration:
        fixes["batches_per_iteration"] = (
            f"fewer batches_per_iteration (e.g. batches_per_iteration={per_iteration})"
        )
    warmup_batches = iterations_within(limit, timed, seconds_per_batch)
    if 1 <= warmup_batches < s.warmup_batches:
        fixes["warmup_batches"] = f"fewer warmup_batches (e.g. warmup_batches={warmup_batches})"
    return fixes


def _smaller_batch(
    settings: Settings, estimate: float, limit: float, *, train: bool, cuda: bool
) -> list[str]:
    """A smaller batch that fits (a batch's time taken as in proportion to its images; on a
    GPU never below :data:`MIN_COMPARABLE_BATCH`), where there is one."""
    fitting = power_of_two_at_most(int(settings.batch_size * seconds_to_fit(limit) / estimate))
    if cuda:
        fitting = max(fitting, MIN_COMPARABLE_BATCH)
    if (2 if train else 1) <= fitting < settings.batch_size:
        return [f"a smaller batch_size (e.g. batch_size={fitting})"]
    return []


def _run_time_fix(
    settings: Settings,
    seconds_per_batch: float,
    max_seconds: float | None,
    *,
    train: bool,
    cuda: bool = False,
    min_image_size: int = 1,
) -> tuple[float, str | None]:
    """The decision rule (:func:`~trainperf.bench._common.limit_passed`) for a run of
    ``settings`` at ``seconds_per_batch``: its estimated seconds, and None where they fit,
    else the fix (:func:`~trainperf.bench._common.run_time_fix`): a smaller batch, a smaller
    image size (only above the model's ``min_image_size``), fewer iterations, batches per
    iteration or warm-up batches (:func:`_fewer_batches`), or a larger limit. On a GPU
    (``cuda``) a batch's time is not in proportion to its images (a small batch under-feeds
    it), so fewer batches and a larger limit come first."""
    batches = settings.warmup_batches + settings.iterations * settings.batches_per_iteration
    estimate = batches * seconds_per_batch
    limit = limit_passed(estimate, max_seconds)
    if limit is None:
        return estimate, None
    # batch_size=<n>, image_size and the counts are what trainperf.cli rewrites as its
    # options.
    smaller = _smaller_batch(settings, estimate, limit, train=train, cuda=cuda)
    if settings.image_size > min_image_size:
        smaller.append("a smaller image_size")
    fewer = list(_fewer_batches(settings, seconds_per_batch, limit).values())
    if cuda:
        return estimate, run_time_fix(estimate, fewer, after=smaller)
    return estimate, run_time_fix(estimate, smaller + fewer)


def _call(settings: Settings, at_fault: Collection[str]) -> str:
    """The call a refusal names: the batch and image size (a batch's cost), and the counts
    ``at_fault`` (those a fix makes fewer), as they ran.

    Example:
        >>> _call(Settings(2, 64, 1000, 1, 2), ["iterations"])
        'bench_model(batch_size=2, image_size=64, iterations=1000)'
    """
    # Each is what trainperf.cli rewrites as its option (--batch-size <n>, ...).
    s = settings
    counts = {
        "iterations": s.iterations,
        "batches_per_iteration": s.batches_per_iteration,
        "warmup_batches": s.warmup_batches,
    }
    named = "".join(f", {name}={value}" for name, value in counts.items() if name in at_fault)
    return f"bench_model(batch_size={s.batch_size}, image_size={s.image_size}{named})"


@dataclass(frozen=True)
class RunTimeLimit:
    """The limit on one run's length, and what its refusal names."""

    label: str  # e.g. "resnet50 fp32"
    settings: Settings
    device: torch.device
    max_seconds: float | None
    train: bool
    min_image_size: int = 1  # the model's smallest: no smaller one is suggested

    def estimate_passes(self, seconds_per_batch: float) -> bool:
        """Whether the run, at ``seconds_per_batch``, would take longer than ``max_seconds``."""
        _, fix = _run_time_fix(self.settings, seconds_per_batch, self.max_seconds, train=False)
        return fix is not None

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
            settings,
            seconds_per_batch,
            max_seconds,
            train=self.train,
            cuda=cuda,
            min_image_size=self.min_image_size,
        )
        if fix is None or max_seconds is None:
            return
        fewer = _fewer_batches(settings, seconds_per_batch, max_seconds)
        timed = settings.iterations * settings.batches_per_iteration
        batches = settings.warmup_batches + timed
        iterations = plural(settings.iterations, "iteration")
        mode = "training" if self.train else "inference"
        raise RunTimeLimitExceeded(
            f"{_call(settings, fewer)}: {batches} {self.label} {mode} batches "
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


def _warm_up(run_batch: Callable[[], None], what: str, limit: RunTimeLimit) -> float:
    """Run the untimed batches, and return the first one's seconds; a kernel this PyTorch
    build lacks is a NotImplementedError. The run's length is checked from the second batch,
    timed on its own: the first holds one-off setup (cuDNN autotuning, the allocator's
    growth), so it is used only where it alone took longer than the limit."""
    first = 0.0
    try:
        for i in range(limit.settings.warmup_batches):
            if i >= 2:
                run_batch()
                continue
            seconds = _seconds_of_batch(run_batch, limit.device)
            first = seconds if i == 0 else first
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
    return first


@dataclass(frozen=True)
class Timing:
    """What the timed iterations measured, and the TF32 settings they ran with."""

    seconds: tuple[float, ...]
    rates: tuple[float, ...]
    tf32_matmul: bool
    tf32_cudnn: bool


def _check_first_batch(limit: RunTimeLimit, seconds: float) -> None:
    """Refuse the run where an iteration of batches like the first timed one (``seconds``)
    alone would take longer than the limit. That batch may still be settling, so it sets
    no estimate otherwise: the first iteration's average does."""
    if limit.passed_by(limit.settings.batches_per_iteration * seconds):
        limit.check(seconds, "the first timed batch")


def _time_iterations(
    run_batch: Callable[[], None],
    limit: RunTimeLimit,
    on_iteration: Callable[[int, float, float], None] | None,
    *,
    check_first_batch: bool,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(seconds, images_per_s)`` of each timed iteration, CUDA synchronised around each.
    After a single warm-up batch (all setup) the first iteration checks the run's length,
    from the time it measures anyway, and, with ``check_first_batch``, its first batch
    before that (synchronised on its own), so that an iteration that alone is past the limit
    is not run whole."""
    settings, device = limit.settings, limit.device
    # Only where a batch is still to come: a check after the last one would throw the run away.
    check_first_batch = (
        check_first_batch and settings.iterations * settings.batches_per_iteration > 1
    )
    seconds: list[float] = []
    rates: list[float] = []
    synchronize(device)
    for i in range(settings.iterations):
        start = _clock()
        for j in range(settings.batches_per_iteration):
            run_batch()
            if check_first_batch and i == j == 0:
                synchronize(device)
                _check_first_batch(limit, _clock() - start)
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
        first = _warm_up(run_batch, what, limit)
        # A single warm-up batch holds the one-off setup, so it overestimates the run: where
        # even so the run fits, the timed batches need no synchronisation of their own.
        doubt = limit.settings.warmup_batches == 1 and limit.estimate_passes(first)
        seconds, rates = _time_iterations(run_batch, limit, on_iteration, check_first_batch=doubt)
    return Timing(seconds, rates, tf32_matmul=state.matmul, tf32_cudnn=state.cudnn)
