"""What saving differently is predicted to gain against periodic stalls.

Pure functions of the measured :class:`Figures` (see ``_predict``):

- **Without the stalls** (:func:`stall_fixes`): the run minus the stalls' excess over the
  median step, ``1 / (1 - stall_fraction)``; saving ten times less often keeps a tenth.
  Stalls every fewer than 5 steps, or costing over half the run, are not predicted (more
  likely the loop's own cadence, such as gradient accumulation, than a save). Stalls once
  an epoch (or every few: :func:`epochs_per_stall`) are bounds, "at most": between epochs a
  loop validates as often as it saves, and a save's fix does not shorten a validation pass.
"""

from __future__ import annotations

from trainperf.monitor._figures import Figures
from trainperf.monitor._predict import _ms
from trainperf.monitor._verdict import Fix

__all__ = ["LESS_OFTEN", "epochs_per_stall", "stall_fixes"]

LESS_OFTEN = 10  # "save less often" is predicted for saving this many times less often
MIN_SAVE_PERIOD = 5  # stalls more often than this are not predicted as saves
MAX_SAVE_SHARE = 0.5  # nor stalls that take more than this share of the run

ASYNC_SAVE_CALL = "trainperf.Checkpointer(directory).save(state, step=step, blocking=False)"


def epochs_per_stall(f: Figures) -> int | None:
    """How many epochs apart the periodic stalls come (1: once an epoch, between one pass
    over the loader and the next), or None when their period is no whole number of epochs
    (``LoopSetup.steps_per_epoch``; unknown before a pass ended). A pass of fewer than
    ``MIN_SAVE_PERIOD`` steps (a peek at the first batch, left for the loop's own pass)
    says nothing: every period would be a whole number of such "epochs"."""
    epoch = f.setup.steps_per_epoch
    if f.stall_period is None or not epoch or epoch < MIN_SAVE_PERIOD or f.stall_period % epoch:
        return None
    return f.stall_period // epoch


def _epochs(n: int) -> str:
    """``"epoch"``, ``"2 epochs"``: what follows "every"."""
    return "epoch" if n == 1 else f"{n} epochs"


def stall_fixes(f: Figures) -> tuple[Fix, ...]:
    """A non-blocking save (the stalls' excess gone) and saving ten times less often."""
    if f.stall_period is None or f.stall_fraction <= 0 or not f.stall_steps:
        return ()
    lost = f.stall_fraction
    epochs = epochs_per_stall(f)
    # The cadence of a step that is no save (gradient accumulation) recurs every few
    # steps, not with the epoch.
    cadence = epochs is None and (f.stall_period < MIN_SAVE_PERIOD or lost > MAX_SAVE_SHARE)
    if cadence or lost >= 1:
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
    every, now = f"{LESS_OFTEN * f.stall_period} steps", str(f.stall_period)
    between = ""
    if epochs is not None:
        every, now = _epochs(LESS_OFTEN * epochs), _epochs(epochs)
        passes = "1 pass" if epochs == 1 else f"{epochs} passes"
        between = (
            f"at most: the stalls come between epochs (every {f.stall_period} steps, "
            f"{passes} over the loader), where a loop validates as often as it saves: this "
            "is their gain if all that work is a save, none if it is a validation pass; "
        )
    if not f.setup.background_saves:
        async_basis = between + async_basis
    less_basis = (
        f"{between}the run with a tenth of the stalls' excess ({figures}): saving every "
        f"{every} instead of every {now}"
    )
    return (
        Fix("periodic-stalls", ASYNC_SAVE_CALL, 1 / (1 - async_saved), async_basis),
        Fix(
            "periodic-stalls",
            f"trainperf.save_checkpoint(...) every {every}",
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
