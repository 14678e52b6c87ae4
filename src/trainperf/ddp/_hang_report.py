"""A hang, its verdict and every rank's state (:class:`HangReport`): the message users read,
and its JSON.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from trainperf.ddp._hang import Verdict
from trainperf.ddp._hang_advice import _named_as
from trainperf.ddp._hang_view import RankView, _ranks
from trainperf.ddp._stacks import Frame, is_user_file

__all__ = ["Ending", "HangReport"]


def _from_user_code(stack: tuple[Frame, ...]) -> list[Frame]:
    """Outermost first, from the start of the innermost run of the user's frames: the
    launcher's and multiprocessing's frames above it say nothing (under fork the launching
    script's own frames are further out still)."""
    frames = list(reversed(stack))
    user = [i for i, f in enumerate(frames) if is_user_file(f.file)]
    if not user:
        return frames
    first = user[-1]
    while first > 0 and is_user_file(frames[first - 1].file):
        first -= 1
    return frames[first:]


def _stack_lines(view: RankView, limit: int = 12) -> list[str]:
    if not view.answered and view.activity == "starting":
        return []  # its line says why there is no stack
    if not view.answered:
        return [f"rank {view.rank} sent no stack (it may be stopped, or gone)"]
    lines = [f"Stack of rank {view.rank}, main thread (most recent call last):"]
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    # trainperf's own frames (the collective's wrapper) are left out: they say nothing.
    shown = [f for f in _from_user_code(view.stack) if not f.file.startswith(own)]
    for f in shown[-limit:]:
        lines.append(f'  File "{f.file}", line {f.line}, in {f.function}')
        if f == view.where and view.line:
            lines.append(f"    {view.line}")
    for ident, frame, code in view.threads:
        text = f"  other thread 0x{ident:x}: {frame if frame else '(no Python frame)'}"
        lines.append(text + (f" (`{code}`)" if code else ""))
    return lines


@dataclass(frozen=True)
class Ending:
    """How one rank's process ended once the hang was declared and the ranks were stopped."""

    rank: int
    exitcode: int | None  # as multiprocessing gives it: -N for signal N; None if unknown
    text: str  # "stopped by the launcher's SIGTERM", "died from signal SIGSEGV (...)", ...
    expected: bool  # the ending the stop itself causes (SIGTERM, or SIGKILL after the grace)


@dataclass(frozen=True)
class HangReport:
    """A hang, its verdict and every rank's state. ``str()`` is the message users read."""

    hang_timeout: float
    stalled_s: float
    world_size: int
    verdict: Verdict
    ranks: tuple[RankView, ...]
    option: str = "hang_timeout"  # how the caller named the timeout (watchdog: "timeout")
    endings: tuple[Ending, ...] = ()  # how each rank ended when stopped (the launcher's)
    attempt: str = ""  # " (attempt 2 of 3)" when the launcher restarts failed groups

    def __str__(self) -> str:
        v = self.verdict
        cause = (
            f"{_ranks(v.root)} {'is' if len(v.root) == 1 else 'are'} the cause"
            if v.root
            else "no rank is blamed"
        )
        lines = [
            f"no progress on any of {self.world_size} ranks{self.attempt} for "
            f"{self.stalled_s:.0f} s "
            f"({self.option}={self.hang_timeout:g}): {cause}.",
            v.headline,
            "",
            _named_as(v.advice, self.option),
            "",
            "Each rank:",
        ]
        for view in self.ranks:
            steps = f" ({view.steps} optimizer steps)" if view.steps else ""
            lines.append(f"  rank {view.rank} {view.doing()}{steps}")
        root = set(v.root)
        for view in self.ranks:
            if view.rank in root:
                lines += ["", *_stack_lines(view)]
        lines += _ending_lines(self.endings)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the verdict, and per rank its state, call site and stack."""
        return {
            "hang_timeout": self.hang_timeout,
            "stalled_s": None if math.isinf(self.stalled_s) else round(self.stalled_s, 1),
            "world_size": self.world_size,
            "kind": self.verdict.kind,
            "root_ranks": list(self.verdict.root),
            "headline": self.verdict.headline,
            "advice": _named_as(self.verdict.advice, self.option),
            "ranks": [_view_dict(view) for view in self.ranks],
            "endings": [
                {"rank": e.rank, "exitcode": e.exitcode, "how": e.text, "expected": e.expected}
                for e in self.endings
            ],
        }


def _ending_lines(endings: tuple[Ending, ...]) -> list[str]:
    """The ranks whose exit was not the one the stop causes, named first: a rank that
    crashed or exited with an error code while being stopped says something about the hang."""
    if not endings:
        return []
    odd = [e for e in endings if not e.expected]
    lines = [""]
    if odd:
        lines.append("While the ranks were stopped:")
        lines += [f"  rank {e.rank} {e.text}" for e in odd]
    usual = [e for e in endings if e.expected]
    if usual:
        lines.append(f"{_ranks([e.rank for e in usual]).capitalize()}: {'; '.join(_usual(usual))}.")
    return lines


def _usual(endings: list[Ending]) -> list[str]:
    groups: dict[str, list[int]] = defaultdict(list)
    for e in endings:
        groups[e.text].append(e.rank)
    if len(groups) == 1:
        return list(groups)
    return [f"{text} ({_ranks(ranks)})" for text, ranks in groups.items()]


def _frame_dict(frame: Frame | None) -> dict[str, Any] | None:
    if frame is None:
        return None
    return {"file": frame.file, "line": frame.line, "function": frame.function}


def _view_dict(view: RankView) -> dict[str, Any]:
    c = view.collective
    return {
        "rank": view.rank,
        "status": view.status,
        "activity": view.activity,
        "doing": view.doing(),
        "where": _frame_dict(view.where),
        "source": view.line,
        "collective": None
        if c is None
        else {"op": c.op, "detail": c.detail, "seq": c.seq, "site": c.site, "function": c.function},
        "optimizer_steps": view.steps,
        "stack": [_frame_dict(f) for f in reversed(view.stack)],
        "answered": view.answered,
    }
