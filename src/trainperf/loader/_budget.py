"""What ``budget_s`` guarantees, and the note when a call ran past it.

Work in worker processes is cut at the deadline: every wait for a batch is cut to the time
left and workers are killed (tens of milliseconds to stop them). Work in this process is
not: a batch loaded with ``num_workers=0`` (or the first sample the cache key reads) and a
``step_fn`` call run the caller's code here, and the only way to abandon them would be a
thread left running, which would go on using the dataset, or the model, while training
starts. So each such piece is started only when the previous one of its kind says it will
end before the deadline, and ``tune_loader`` returns within ``budget_s`` plus at most one
piece: the first batch or ``step_fn`` call (nothing is known of it before), or one slower
than the one before. When that happens the report says so (:func:`overrun_note`), with the
piece's measured time and the budget that would measure it.
"""

from __future__ import annotations

__all__ = ["OVERRUN_TOLERANCE_S", "overrun_note"]

OVERRUN_TOLERANCE_S = 0.25
"""Seconds past the budget that go without a note (stopping workers, writing the cache)."""

_BASELINE_BATCHES = 12
"""Batches a ``num_workers=0`` measurement needs: the first, two skipped, two windows of at
least four."""


def overrun_note(
    budget_s: float,
    elapsed_s: float,
    main_batch_s: float | None,
    step_call_s: float | None,
) -> str | None:
    """The note for a call that took more than ``budget_s`` (plus a small tolerance), or None.

    Args:
        budget_s: the budget.
        elapsed_s: what the call took.
        main_batch_s: the longest batch loaded in this process (``num_workers=0``), if known.
        step_call_s: the longest ``step_fn`` call with its batch, if ``step_fn`` was timed.

    Example:
        >>> print(overrun_note(3.0, 16.2, 16.0, None))  # doctest: +NORMALIZE_WHITESPACE
        tuning took 16.2 s, 13.2 s over budget_s=3: work in this process cannot be cut short,
        so the piece running at the deadline ran to its end (a batch loaded in this process,
        num_workers=0, took 16.0 s); a budget_s of at least 192 s measures num_workers=0
        (about 12 batches)
        >>> overrun_note(3.0, 3.1, 0.5, None) is None
        True
    """
    over = elapsed_s - budget_s
    if over <= OVERRUN_TOLERANCE_S:
        return None
    # The pieces long enough to explain a tenth of the overrun or more.
    pieces = []
    if main_batch_s is not None and main_batch_s >= over / 10:
        pieces.append(f"a batch loaded in this process, num_workers=0, took {main_batch_s:.1f} s")
    if step_call_s is not None and step_call_s >= over / 10:
        pieces.append(f"a step_fn call with its batch took {step_call_s:.1f} s")
    took = f"tuning took {elapsed_s:.1f} s, {over:.1f} s over budget_s={budget_s:g}: "
    if not pieces:
        return took + (
            "nothing measured in this process explains it, so most likely stopping the "
            "last workers took that long (a loaded machine, or workers slow to exit)"
        )
    note = took + (
        f"work in this process cannot be cut short, so the piece running at the deadline ran "
        f"to its end ({'; '.join(pieces)})"
    )
    if main_batch_s is not None and main_batch_s * _BASELINE_BATCHES > budget_s:
        note += (
            f"; a budget_s of at least {main_batch_s * _BASELINE_BATCHES:.0f} s measures "
            f"num_workers=0 (about {_BASELINE_BATCHES} batches)"
        )
    return note
