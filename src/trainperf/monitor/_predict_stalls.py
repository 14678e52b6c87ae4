"""What saving differently is predicted to gain against periodic stalls.

Pure functions of the measured :class:`Figures` (see ``_predict``):

- **Without the stalls** (:func:`stall_fixes`): the run minus the stalls' excess over the
  median step, ``1 / (1 - stall_fraction)``; saving ten times less often keeps a tenth.
  Stalls every fewer than 5 steps, or costing over half the run, are not predicted (more
  likely the loop's own cadence, such as gradient accumulation, than a save).
"""

from __future__ import annotations

from trainperf.monitor._figures import Figures
from trainperf.monitor._predict import _ms
from trainperf.monitor._verdict import Fix

__all__ = ["LESS_OFTEN", "stall_fixes"]

LESS_OFTEN = 10  # "save less often" is predicted for saving this many times less often
MIN_SAVE_PERIOD = 5  # stalls more often than this are not predicted as saves
MAX_SAVE_SHARE = 0.5  # nor stalls that take more than this share of the run

ASYNC_SAVE_CALL = "trainperf.Checkpointer(directory).save(state, step=step, blocking=False)"


def stall_fixes(f: Figures) -> tuple[Fix, ...]:
    """A non-blocking save (the stalls' excess gone) and saving ten times less often."""
    if f.stall_period is None or f.stall_fraction <= 0 or not f.stall_steps:
        return ()
    lost = f.stall_fraction
    if f.stall_period < MIN_SAVE_PERIOD or lost > MAX_SAVE_SHARE:
        basis = (
            f"not predicted: a stall every {f.stall_period} steps costing {lost:.0%} of the "
            "run is more likely the loop's own cadence (w.step() called per micro-batch of "
            "a gradient accumulation, or an optimizer step every few batches) than a save"
        )
        return (Fix("periodic-stalls", ASYNC_SAVE_CALL, 1.0, basis),)
    each = lost * f.wall_s / len(f.stall_steps)
    figures = (
        f"{len(f.stall_steps)} stalls every {f.stall_period} steps, each {_ms(each)} over the "
        f"median step, {lost:.0%} of {f.wall_s:.2f} s"
    )
    async_saved, async_basis = _async_save_gain(f, lost, each, figures)
    if f.setup.background_saves:
        async_saved, async_basis = (
            0.0,
            (
                f"already in use: the loop started {f.setup.background_saves} background "
                f"save(s) while watched ({figures}); what stalls is what stays in the step: "
                "the snapshot (a fork, or the copy to host buffers) or a save that waits for "
                "the previous write to finish (save less often)"
            ),
        )
    less = lost * (1 - 1 / LESS_OFTEN)
    less_basis = (
        f"the run with a tenth of the stalls' excess ({figures}): saving every "
        f"{LESS_OFTEN * f.stall_period} steps instead of every {f.stall_period}"
    )
    return (
        Fix("periodic-stalls", ASYNC_SAVE_CALL, 1 / (1 - async_saved), async_basis),
        Fix(
            "periodic-stalls",
            f"trainperf.save_checkpoint(...) every {LESS_OFTEN * f.stall_period} steps",
            1 / (1 - less),
            less_basis,
        ),
    )


def _async_save_gain(f: Figures, lost: float, each: float, figures: str) -> tuple[float, str]:
    """The share of the run a non-blocking save wins back, and its basis: on the CPU,
    the save's own blocking (its fork and bookkeeping) stays in each stalled step (measured:
    ``save_block_s``);
    on a GPU, the copy of the state to pinned host memory, not measured."""
    block = f.setup.save_block_s
    if block is None:
        return lost, (
            f"the run without the stalls' excess ({figures}); a non-blocking save leaves only "
            "the copy of the state to host memory in the step, not measured here"
        )
    kept = min(1.0, block / each) if each > 0 else 1.0
    return lost * (1 - kept), (
        f"the run with {_ms(min(block, each))} of each stall's excess left ({figures}): a "
        f"non-blocking save of a CPU state blocked this process for {_ms(block)} here "
        "(measured: the fork that takes its snapshot, and its bookkeeping)"
    )
