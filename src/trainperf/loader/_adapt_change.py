"""The record of one change an :class:`~trainperf.loader.AdaptiveDataLoader` made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainperf.loader._adapt_rules import EpochFigures, Reason, rates

__all__ = ["TuningChange"]


@dataclass(frozen=True)
class TuningChange:
    """One change an :class:`AdaptiveDataLoader` made, at an epoch boundary or mid-epoch.

    Attributes:
        epoch: the epoch (counted from 0) that runs with the new setting (from its start,
            or from batch ``epoch_batch`` on).
        time: when it was made (seconds since the epoch, ``time.time()``): where a timeline
            puts its marker.
        old: ``(num_workers, prefetch_factor)`` before.
        new: ``(num_workers, prefetch_factor)`` after.
        reason: which rule made it (see :mod:`trainperf.loader._adapt_rules`).
        why: one sentence with the figures behind it.
        figures: what was measured since the previous check (the previous epoch, or the
            seconds before a mid-epoch change).
        batch: batches the loader had yielded, over all epochs, when it was made (the
            first batch with the new setting is number ``batch``, from 0).
        epoch_batch: batches of ``epoch`` yielded before it (0: at the epoch's start).
    """

    epoch: int
    time: float
    old: tuple[int, int | None]
    new: tuple[int, int | None]
    reason: Reason
    why: str
    figures: EpochFigures
    batch: int = 0
    epoch_batch: int = 0

    def __str__(self) -> str:
        """One line: old → new settings, why, the measured rates.

        Example:
            >>> from trainperf.loader._adapt_rules import figures
            >>> print(TuningChange(1, 0.0, (0, None), (3, 2), "input-bound", "waited",
            ...                    figures(samples=400, startup_s=0.0)))
            ... # doctest: +NORMALIZE_WHITESPACE
            epoch 1: workers=0 prefetch=- → workers=3 prefetch=2 (input-bound: waited;
            200 samples/s, waited for data 50 % of the time, 4 usable CPUs 20 % busy)
        """
        at = f"epoch {self.epoch}" + (f", batch {self.epoch_batch}" if self.epoch_batch else "")
        return (
            f"{at}: {_label(self.old)} → {_label(self.new)} "
            f"({self.reason}: {self.why}; {rates(self.figures)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-safe (the figures as a dict)."""
        return dataclasses.asdict(self)


def _label(setting: tuple[int, int | None]) -> str:
    n, pf = setting
    return f"workers={n} prefetch={'-' if pf is None or n == 0 else pf}"
