"""Which rank caused a hang, and why: pure rules over every rank's stack and collective state.

Input: one :class:`~trainperf.ddp._hang_view.RankView` per rank (built by the launcher or the
watchdog from the slot and the stack dump). The rules, in order (:func:`diagnose`):

0. **unreachable**: the store that connects the ranks failed, so the watchdog knows only
   its own rank: no rank is blamed, and the store's host is named as the place to look.
1. **outside**: some ranks wait (in a collective, or inside ``backward()``, where DDP's
   gradient all-reduce runs) while others run user code outside any collective: those
   are the cause; their stack says whether they wait for a DataLoader batch, are blocked
   on a lock or on another of their threads, or are simply busy (a loop, a sleep, work
   only they do).
2. **returned**: some ranks returned from ``main`` and the others are still busy outside
   any collective: the busy ones are the cause. **gone**: some ranks exited without
   returning (an exception, a crash) and the others wait: the ones that exited are; when
   all that finished returned and the others wait, those call a collective the finished
   ranks never will (**mismatch**).
3. **ddp**: some ranks wait inside ``backward()`` while others wait in a collective and have
   made more optimizer steps: those got past the gradient all-reduce without starting it
   (their forward did not use every parameter), so they are the cause.
4. **mismatch**: every running rank waits, but not in the same collective (name, tensor
   shape and dtype, call site): the ranks outside the largest group are the cause; with
   no largest group (two ranks), the rank whose last move (previous call site -> this one)
   no rank ever made before (it skipped a collective) is; else all are named.
5. **behind**: all wait in the same call, but their collective counts differ: the ranks
   with fewer calls skipped one earlier.
6. **stalled**: all wait in the same collective and none is missing: the cause is below
   Python (network, a kernel, a peer outside the job); no rank is blamed.

Before any rule, :func:`is_hang` says whether the stall is a hang at all: not while a rank
compiles (``torch.compile``'s compiler frames on any of its threads) for up to ``BUSY_CAP``
times the timeout (past that it is named as stuck in compilation), nor while no rank waits
for another (every rank busy in its own code).

Modules: ``_hang_view`` (one rank's view, and what ranks do, in words), ``_hang_advice`` (the
fix each verdict gives), ``_hang_report`` (:class:`~trainperf.ddp._hang_report.HangReport`,
the message users read), this one (the rules).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from trainperf.ddp._hang_advice import _advice, _reason
from trainperf.ddp._hang_view import RankView, _describe_root, _ranks, _verb, _what_others_do
from trainperf.ddp._progress_slots import BUSY_CAP, Collective

__all__ = ["Verdict", "blocked", "diagnose", "is_hang"]

Kind = Literal["outside", "returned", "gone", "unreachable", "ddp", "mismatch", "behind", "stalled"]


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    root: tuple[int, ...]  # the ranks that cause the hang (empty for "stalled")
    headline: str
    advice: str


def _outside(running: list[RankView], done: list[RankView]) -> Verdict | None:
    waiting = [v for v in running if v.waiting]
    busy = [v for v in running if v.busy]
    if not busy or not (waiting or done):
        return None
    others = waiting + done
    kind: Kind = "outside" if waiting else "returned"
    tail = "while" if waiting else "after"
    headline = f"{_describe_root(busy)}, {tail} {_what_others_do(others)}"
    advice = _advice("returned" if kind == "returned" else _reason(busy[0]), busy)
    return Verdict(kind, tuple(v.rank for v in busy), headline, advice)


def _ddp(waiting: list[RankView]) -> Verdict | None:
    behind = [v for v in waiting if v.activity == "backward"]
    ahead = [v for v in waiting if v.activity == "collective"]
    if not behind or not ahead or min(v.steps for v in ahead) <= max(v.steps for v in behind):
        return None
    steps = ", ".join(f"rank {v.rank}: {v.steps}" for v in sorted(waiting, key=lambda v: v.rank))
    headline = (
        f"{_ranks([v.rank for v in ahead])} got past the backward() that "
        f"{_ranks([v.rank for v in behind])} {_verb(behind, 'waits', 'wait')} in (optimizer "
        f"steps {steps}) without starting DDP's gradient all-reduce: "
        f"{_verb(ahead, 'its', 'their')} forward did not use every parameter. Now "
        f"{_describe_root(ahead)}; {_what_others_do(behind)}"
    )
    return Verdict("ddp", tuple(v.rank for v in ahead), headline, _advice("ddp", ahead))


def _transitions(history: tuple[Collective, ...]) -> list[tuple[tuple[str, str], ...]]:
    """Consecutive (previous call, next call) pairs, by op and call site."""
    return [
        ((a.op, a.site), (b.op, b.site))
        for a, b in itertools.pairwise(history)
        if b.seq == a.seq + 1
    ]


def _deviating(waiting: list[RankView]) -> list[RankView]:
    """Ranks whose last move (previous call site -> current one) no rank made before."""
    known: set[tuple[tuple[str, str], ...]] = set()
    last: dict[int, tuple[tuple[str, str], ...]] = {}
    for v in waiting:
        moves = _transitions(v.history) if v.activity == "collective" else []
        if moves:
            last[v.rank] = moves[-1]
            known.update(moves[:-1])
    return [v for v in waiting if v.rank in last and last[v.rank] not in known]


def _excluding(views: list[RankView], left_out: list[RankView]) -> list[RankView]:
    """``views`` without ``left_out``, by rank (linear: thousands of ranks under watchdog)."""
    ranks = {v.rank for v in left_out}
    return [v for v in views if v.rank not in ranks]


def _mismatch(waiting: list[RankView]) -> Verdict | None:
    groups: dict[tuple[str, str, str], list[RankView]] = defaultdict(list)
    for v in waiting:
        groups[v.key()].append(v)
    if len(groups) < 2:
        return None
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    if sizes[0] > sizes[1]:
        majority = max(groups.values(), key=len)
        in_majority = {v.rank for v in majority}
        root = [v for v in waiting if v.rank not in in_majority]
    else:
        root = _deviating(waiting)
        if not 0 < len(root) < len(waiting):
            root = list(waiting)
    others = _excluding(waiting, root)
    headline = "the ranks wait in different collectives: " + _describe_root(root)
    if others:
        headline += f", while {_what_others_do(others)}"
    return Verdict("mismatch", tuple(v.rank for v in root), headline, _advice("mismatch", root))


def _same_call(waiting: list[RankView]) -> Verdict:
    seqs = {v.rank: v.collective.seq for v in waiting if v.collective is not None}
    if len(set(seqs.values())) > 1:
        least = min(seqs.values())
        root = [v for v in waiting if seqs.get(v.rank) == least]
        others = _excluding(waiting, root)
        headline = (
            f"every rank waits at the same call, but {_describe_root(root)} while "
            f"{_what_others_do(others)}: {_verb(root, 'it has', 'they have')} made fewer "
            "collective calls, so one was skipped earlier"
        )
        return Verdict("behind", tuple(v.rank for v in root), headline, _advice("mismatch", root))
    ops = {v.collective.op for v in waiting if v.collective is not None}
    if len(ops) == 1 and ops <= {"send", "recv"} and all(v.collective for v in waiting):
        # Each waits for a peer that is itself waiting in the same blocking call.
        (op,) = ops
        headline = (
            f"every rank {waiting[0].doing()}: a blocking {op} returns only once its peer "
            f"has {'sent' if op == 'recv' else 'received'}, and every peer is in a {op} too "
            "(a send/recv ordering deadlock)"
        )
        return Verdict(
            "mismatch", tuple(v.rank for v in waiting), headline, _advice("p2p", waiting)
        )
    doing = waiting[0].doing() if waiting else "nothing"
    headline = f"every rank {doing}, and none is missing from it"
    return Verdict("stalled", (), headline, _advice("stalled", []))


def blocked(views: list[RankView]) -> bool:
    """Whether the ranks are stuck on each other: one waits (in a collective or in DDP's
    ``backward()``) or is gone. Ranks all busy in their own code (each preprocessing its
    shard, an evaluation without a DataLoader) wait for nobody, so that is not a hang.

    Example:
        >>> busy = RankView(0, "running", "running")
        >>> blocked([busy, RankView(1, "running", "running")])
        False
        >>> blocked([busy, RankView(1, "running", "collective")])
        True
        >>> blocked([busy, RankView(1, "returned", "running")])
        True
    """
    return any(v.waiting or v.status != "running" for v in views)


def is_hang(views: list[RankView], *, stalled_s: float = 0.0, timeout: float = math.inf) -> bool:
    """Whether a stall seen on these views (one snapshot) is a hang: some rank waits for
    another (:func:`blocked`) and no running rank is inside ``torch.compile``'s compiler, on
    any of its threads (a first compilation can take minutes on every rank at once), unless
    the job has made no progress for ``stalled_s`` >= ``BUSY_CAP`` x ``timeout``: then the
    compiling rank is stuck in compilation.

    Example:
        >>> waits = RankView(0, "running", "collective")
        >>> is_hang([waits, RankView(1, "running", "running")])
        True
        >>> compiles = RankView(1, "running", "running", compiling=True)
        >>> is_hang([waits, compiles], stalled_s=20.0, timeout=3.0)
        False
        >>> is_hang([waits, compiles], stalled_s=31.0, timeout=3.0)
        True
    """
    compile_counts = stalled_s < BUSY_CAP * timeout
    if compile_counts and any(v.status == "running" and v.compiling for v in views):
        return False
    return blocked(views)


def diagnose(views: list[RankView]) -> Verdict:
    """Name the rank(s) that caused a hang (see the module docstring for the rules).

    Example:
        >>> from trainperf.ddp._progress_slots import Collective
        >>> from trainperf.ddp._stacks import Frame
        >>> c = Collective(3, "all_reduce", "float32[4]", "train.py", 24, "main")
        >>> v0 = RankView(0, "running", "collective", collective=c)
        >>> v1 = RankView(1, "running", "running", where=Frame("train.py", 21, "main"))
        >>> diagnose([v0, v1]).root
        (1,)
    """
    unknown = [v for v in views if v.status == "unknown"]
    if unknown:
        return _unreachable(_excluding(views, unknown), unknown)
    running = [v for v in views if v.status == "running"]
    done = [v for v in views if v.status != "running"]
    found = _outside(running, done)
    if found is not None:
        return found
    waiting = [v for v in running if v.waiting]
    busy = [v for v in running if v.busy]
    if busy:  # nobody waits and nobody finished: all of them are stuck outside collectives
        headline = _describe_root(busy)
        return Verdict(
            "outside", tuple(v.rank for v in busy), headline, _advice(_reason(busy[0]), busy)
        )
    gone = [v for v in done if v.status == "gone"]
    if gone and waiting:
        return _waiting_for_gone(waiting, gone, _excluding(done, gone))
    if done and waiting:
        return _left_waiting(waiting, done)
    for rule in (_ddp, _mismatch):
        found = rule(waiting)
        if found is not None:
            return found
    return _same_call(waiting)


def _unreachable(known: list[RankView], unknown: list[RankView]) -> Verdict:
    """The store that connects the ranks failed: only the ranks still reachable (this one)
    could say what they do, so no rank is blamed."""
    headline = (
        f"{_describe_root(known)}; {_ranks([v.rank for v in unknown])} could not be asked: the "
        "store that connects the ranks failed"
    )
    return Verdict("unreachable", (), headline, _advice("unreachable", unknown))


def _waiting_for_gone(
    waiting: list[RankView], gone: list[RankView], returned: list[RankView]
) -> Verdict:
    """Some ranks exited without returning from main (an exception, a crash) and the others
    wait in a collective: the ones that exited are the cause."""
    if all(v.finished for v in gone):  # the watchdog's ranks said how they ended
        headline = f"{_describe_root(gone)}, while {_what_others_do(waiting)}"
    else:
        who = _ranks([v.rank for v in gone])
        verb = "have" if len(gone) > 1 else "has"
        headline = f"{who} {verb} exited without returning from main (an error or a crash), "
        headline += f"while {_what_others_do(waiting)}"
    if returned:
        headline += f"; {_what_others_do(returned)}"
    return Verdict("gone", tuple(v.rank for v in gone), headline, _advice("gone", gone))


def _left_waiting(waiting: list[RankView], done: list[RankView]) -> Verdict:
    """Some ranks finished main (or exited) and every other waits in a collective: those
    call one the finished ranks never will."""
    headline = (
        f"{_describe_root(waiting)}, after {_what_others_do(done)}: "
        f"{_verb(waiting, 'it calls', 'they call')} a collective that "
        f"{_ranks([v.rank for v in done])} never will"
    )
    return Verdict(
        "mismatch", tuple(v.rank for v in waiting), headline, _advice("mismatch", waiting)
    )
