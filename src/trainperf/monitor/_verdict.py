"""The findings of a ``trainperf.watch()`` report: :class:`Verdict` (what limits the loop),
the :class:`Fix` es that address it with their predicted gains, and the :class:`WhatIf`
table that ranks them.

The verdict rules (``_rules``) build them; import them from :mod:`trainperf.monitor`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from trainperf.monitor._records import _fields_dict

__all__ = [
    "NOT_PREDICTED",
    "Fix",
    "Verdict",
    "VerdictKind",
    "WhatIf",
    "rank_fixes",
    "with_fixes",
]

VerdictKind = Literal[
    "input-bound", "compute-bound", "host-bound", "gpu-unused", "periodic-stalls", "inconclusive"
]


NOT_PREDICTED = "not predicted"
"""How a ``basis`` begins when the figures say nothing about the gain (the speed-up is 1.0)."""


@dataclass(frozen=True)
class Fix:
    """One fix for a finding, and the gain predicted for it from the measured figures.

    Attributes:
        finding: the verdict kind it addresses.
        call: the trainperf call (or setting) that applies it.
        predicted_speedup: samples per second after the fix over samples per second now
            (1.8: 80 % more; 1.0: no gain predicted, or none can be, see ``basis``).
        basis: one sentence: how the prediction was computed, from which measured figures.
    """

    finding: VerdictKind
    call: str
    predicted_speedup: float
    basis: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict.

        Example:
            >>> Fix("input-bound", "trainperf.autotune_loader(dataset, 32)", 2.5, "...").to_dict()
            ... # doctest: +NORMALIZE_WHITESPACE
            {'finding': 'input-bound', 'call': 'trainperf.autotune_loader(dataset, 32)',
             'predicted_speedup': 2.5, 'basis': '...'}
        """
        return _fields_dict(self)


@dataclass(frozen=True)
class Verdict:
    """What limits the loop, why, what fixes it, and how much the fix is predicted to gain.

    Attributes:
        kind: ``"input-bound"``, ``"compute-bound"``, ``"host-bound"``, ``"gpu-unused"``,
            ``"periodic-stalls"`` or ``"inconclusive"``.
        summary: one sentence.
        reasons: the numbers behind it.
        fix: what to do, naming the trainperf tool that does it.
        predicted_speedup: the best of ``fixes``' predicted speed-ups (1.0 without fixes).
        basis: how that prediction was computed (the best fix's ``basis``).
        fixes: the fixes with a predicted gain, best first.
    """

    kind: VerdictKind
    summary: str
    reasons: tuple[str, ...]
    fix: str
    predicted_speedup: float = 1.0
    basis: str = f"{NOT_PREDICTED}: no fix was predicted"
    fixes: tuple[Fix, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"kind", "summary", "reasons" (a list), "fix",
        "predicted_speedup", "basis", "fixes" (a list of dicts)}``.

        Example:
            >>> Verdict("input-bound", "waits", ("30% waiting",), "tune").to_dict()["reasons"]
            ['30% waiting']
        """
        return {
            "kind": self.kind,
            "summary": self.summary,
            "reasons": list(self.reasons),
            "fix": self.fix,
            "predicted_speedup": self.predicted_speedup,
            "basis": self.basis,
            "fixes": [f.to_dict() for f in self.fixes],
        }


def with_fixes(verdict: Verdict, fixes: tuple[Fix, ...] | list[Fix]) -> Verdict:
    """``verdict`` carrying ``fixes``, ranked best first, and the best one's prediction.

    Example:
        >>> fixes = [Fix("input-bound", "a()", 1.5, "x"), Fix("input-bound", "b()", 3.0, "y")]
        >>> v = with_fixes(Verdict("input-bound", "waits", (), "tune"), fixes)
        >>> v.predicted_speedup, v.basis, [f.call for f in v.fixes]
        (3.0, 'y', ['b()', 'a()'])
    """
    ranked = tuple(sorted(fixes, key=lambda f: -f.predicted_speedup))
    if not ranked:
        return dataclasses.replace(verdict, fixes=())
    best = ranked[0]
    return dataclasses.replace(
        verdict, predicted_speedup=best.predicted_speedup, basis=best.basis, fixes=ranked
    )


@dataclass(frozen=True)
class WhatIf:
    """The fixes of a :class:`WatchReport`, ranked by predicted gain (``report.what_if()``).

    Attributes:
        fixes: every fix of the verdict and the "also" findings, best first; a call named
            by two findings is listed once, with the larger prediction.
        samples_per_s: the measured samples per second (None when batch sizes are
            unknown) of the steps the predictions judge, what each speed-up multiplies:
            the whole run's, or the steps' since the step time changed (the report's
            ``regime_start``).
        steps_per_s: their steps per second.
    """

    fixes: tuple[Fix, ...]
    samples_per_s: float | None
    steps_per_s: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"fixes": [Fix.to_dict(), ...], "samples_per_s",
        "steps_per_s"}``."""
        return {
            "fixes": [f.to_dict() for f in self.fixes],
            "samples_per_s": self.samples_per_s,
            "steps_per_s": self.steps_per_s,
        }

    def __str__(self) -> str:
        if not self.fixes:
            return "what if: no fix to predict"
        rate = (
            f"{self.samples_per_s:,.1f} samples/s"
            if self.samples_per_s
            else f"{self.steps_per_s:.2f} steps/s"
        )
        lines = [f"what if (ranked by predicted gain; now {rate}):"]
        for i, f in enumerate(self.fixes, start=1):
            lines.append(f"  {i}. {f.predicted_speedup:5.2f}x  {f.call}  [{f.finding}]")
            lines.append(f"            {f.basis}")
        return "\n".join(lines)


def rank_fixes(verdicts: tuple[Verdict, ...] | list[Verdict]) -> tuple[Fix, ...]:
    """Every fix of ``verdicts``, one per call (the larger prediction), best first."""
    best: dict[str, Fix] = {}
    for v in verdicts:
        for f in v.fixes:
            if f.call not in best or f.predicted_speedup > best[f.call].predicted_speedup:
                best[f.call] = f
    return tuple(sorted(best.values(), key=lambda f: -f.predicted_speedup))
