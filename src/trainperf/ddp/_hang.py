"""Which rank caused a hang, and why: pure rules over every rank's stack and collective state.

Input: one :class:`RankView` per rank (built by the launcher or the watchdog from the slot
and the stack dump). The rules, in order (:func:`diagnose`):

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
"""

from __future__ import annotations

import itertools
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

from trainperf.ddp._progress import BUSY_CAP, Collective
from trainperf.ddp._stacks import Activity, Frame, is_user_file

__all__ = ["Ending", "HangReport", "RankView", "Verdict", "blocked", "diagnose", "is_hang"]

Status = Literal["running", "returned", "gone", "unknown"]
Kind = Literal["outside", "returned", "gone", "unreachable", "ddp", "mismatch", "behind", "stalled"]


@dataclass(frozen=True)
class RankView:
    """One rank at the moment of the hang."""

    rank: int
    status: Status
    activity: Activity
    collective: Collective | None = None  # the collective it waits in
    history: tuple[Collective, ...] = ()  # its last collectives, oldest first
    steps: int = 0  # optimizer steps
    where: Frame | None = None  # the innermost frame of the user's code, main thread
    line: str = ""  # that frame's source line
    stack: tuple[Frame, ...] = ()  # main thread, innermost first
    threads: tuple[tuple[int, Frame | None, str], ...] = ()  # other threads: id, frame, line
    answered: bool = True  # whether a stack dump came
    compiling: bool = False  # torch.compile's compiler on one of its threads
    stuck_in: str = ""  # the known slow work (busy()) it has been in past the cap
    stuck_s: float = 0.0  # for how long

    @property
    def waiting(self) -> bool:
        return self.status == "running" and self.activity in ("collective", "backward")

    @property
    def busy(self) -> bool:
        return self.status == "running" and not self.waiting

    def key(self) -> tuple[str, str, str]:
        """What it waits in, as ranks must agree on: op, shape/dtype, call site."""
        if self.activity == "collective" and self.collective is not None:
            c = self.collective
            return c.op, c.detail, c.site
        return "backward()", "", self.where.site if self.where else "?"

    def doing(self) -> str:
        """What this rank does, in words."""
        at = f" at {self.where}" if self.where else ""
        code = f" (`{self.line}`)" if self.line else ""
        if self.status == "returned":
            return "returned from main"
        if self.status == "gone":
            return "has exited"
        if self.status == "unknown":
            return "could not be asked"
        if self.activity == "collective" and self.collective is not None:
            return f"waits in {self.collective.describe()}"
        if self.stuck_in and self.activity != "backward":
            return f"is stuck in {self.stuck_in} for {self.stuck_s:.0f} s{at}{code}"
        if self.compiling and self.activity != "backward":
            return f"is stuck in torch.compile's compilation{at}{code}"
        if self.activity == "backward":
            return f"waits inside backward(){at} (DDP's gradient all-reduce runs there)"
        if self.activity == "dataloader":
            return f"waits for a batch from its DataLoader{at}{code}"
        if self.activity == "lock":
            return f"is blocked on a lock{at}{code}"
        if self.activity == "thread-wait":
            return f"waits for another of its threads (a join, an Event or a queue){at}{code}"
        if self.activity == "process-wait":
            what = "a multiprocessing queue, pipe or join, a subprocess"
            return f"waits for another process ({what}){at}{code}"
        return f"is busy outside any collective{at}{code}"


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    root: tuple[int, ...]  # the ranks that cause the hang (empty for "stalled")
    headline: str
    advice: str


def _named_as(advice: str, option: str) -> str:
    """``advice`` for a caller that names the limit ``option``: ``watchdog(timeout=...)``
    has no ``hang_timeout``.

    Example:
        >>> _named_as("raise hang_timeout (or pass hang_timeout=None).", "timeout")
        "raise the watchdog's timeout (or pass timeout=None)."
    """
    if option == "hang_timeout":
        return advice
    return advice.replace("hang_timeout=None", f"{option}=None").replace(
        "hang_timeout", f"the watchdog's {option}"
    )


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _verb(ranks: list[RankView], singular: str, plural: str) -> str:
    return singular if len(ranks) == 1 else plural


def _what_others_do(others: list[RankView]) -> str:
    """'rank 0 waits in ...' / 'ranks 0, 2 wait in ...', grouped by what they do."""
    groups: dict[str, list[int]] = defaultdict(list)
    for v in others:
        groups[v.doing()].append(v.rank)
    parts = []
    for doing, ranks in groups.items():
        if len(ranks) > 1:
            doing = doing.replace("waits ", "wait ", 1).replace("returned", "returned", 1)
            doing = doing.replace("has exited", "have exited", 1)
        parts.append(f"{_ranks(ranks)} {doing}")
    return "; ".join(parts)


def _describe_root(root: list[RankView]) -> str:
    return "; ".join(f"rank {v.rank} {v.doing()}" for v in root)


_ADVICE = {
    "running": (
        "Fix: every rank must reach the same collectives. Look at what {who} does at {site}: "
        "an endless loop, a sleep, or work only some ranks do. If that work is slow on "
        "purpose, raise hang_timeout (or pass hang_timeout=None)."
    ),
    "dataloader": (
        "Fix: {who}'s DataLoader delivers no batch: a worker is stuck in __getitem__ (I/O, "
        "a lock, a deadlock after fork) or died. DataLoader(..., timeout=60) makes the wait "
        "raise; num_workers=0 runs __getitem__ in the rank, so the next report shows its line."
    ),
    "busy": (
        "Fix: {who} spent more than {cap:g} x the timeout in that work, which counts as "
        "progress only that long. A checkpoint write that slow points at the storage (a full, "
        "slow or network filesystem: check the path's free space and write speed); if it is "
        "slow on purpose, raise hang_timeout."
    ),
    "compiling": (
        "Fix: {who} spent more than {cap:g} x the timeout in torch.compile's compiler, which "
        "counts as progress only that long. Either the compilation is stuck (a compile "
        "worker died or deadlocked: its stacks are below) or it recompiles again and again "
        "(TORCH_LOGS=recompiles names the guard that fails; mark changing sizes dynamic). If "
        "one compilation is that slow on purpose, raise hang_timeout."
    ),
    "lock": (
        "Fix: {who} waits for a lock that nothing releases: another of its threads holds it "
        "(its threads are listed below). Release it on every path (`with lock:`), and do not "
        "hold it across blocking calls."
    ),
    "thread-wait": (
        "Fix: {who} waits for one of its own threads to finish or to signal (Thread.join, an "
        "Event or Condition, a queue) and it never does: that thread died, is stuck itself, "
        "or was never started (its threads are listed below). Signal on every path "
        "(try/finally), and give the wait a timeout."
    ),
    "process-wait": (
        "Fix: {who} waits for another process (a multiprocessing Queue or Pipe, "
        "Process.join, a subprocess) that never answers: it died, is stuck "
        "itself, or was never started; its own output says which. Give the wait a timeout "
        "(get(timeout=...), join(timeout), subprocess's timeout=) and check the other side's "
        "exit code."
    ),
    "unreachable": (
        "Fix: the rendezvous store that connects the ranks failed, so {who} could not say "
        "what they do: the process that hosts it (rank 0, or torchrun's agent) exited or lost "
        "the network. Look at that process's output first; the hang may be its crash."
    ),
    "gone": (
        "Fix: {who} exited while the others wait for it in a collective: its own output "
        "(stderr, or its log under torchrun) says why. A rank that fails must end the job "
        "(with watchdog(), an exception leaving the block counts as exiting); a rank that "
        "leaves early on purpose must still make every collective the others make."
    ),
    "returned": (
        "Fix: the other ranks finished main while {who} still runs code at {site} that they "
        "do not. If that is intended (work only {who} does at the end), raise hang_timeout; "
        "otherwise make it return."
    ),
    "ddp": (
        "Fix: make every rank's forward use the same parameters (no branch on the rank or the "
        "data around a layer), or wrap the model with find_unused_parameters=True."
    ),
    "mismatch": (
        "Fix: every rank must call the same collectives in the same order, with the same "
        "shapes and dtypes: look for an `if` that depends on the rank or the data around "
        "{site}. TORCH_DISTRIBUTED_DEBUG=DETAIL checks every call as it is made."
    ),
    "p2p": (
        "Fix: order the point-to-point calls so that one side of each pair sends while the "
        "other receives (even ranks send first, odd ranks receive first), or start both "
        "without blocking (dist.isend / dist.irecv, or dist.batch_isend_irecv) and wait on "
        "them; see {site}."
    ),
    "stalled": (
        "Fix: no rank is missing from the collective, so the stall is below Python: the "
        "interconnect (run `trainperf doctor --dist`; NCCL_DEBUG=INFO names the transport), "
        "a GPU kernel that never finishes, or a peer outside this job on the same port."
    ),
}


def _advice(kind: str, root: list[RankView]) -> str:
    first = root[0] if root else None
    site = first.where.site if first and first.where else "the call site"
    if first and first.collective and kind in ("mismatch", "behind", "p2p"):
        site = first.collective.site
    who = _ranks([v.rank for v in root]) if root else "every rank"
    return _ADVICE[kind].format(who=who, site=site, cap=BUSY_CAP)


def _reason(view: RankView) -> str:
    """Which advice fits a rank stuck outside any collective."""
    if view.stuck_in:
        return "busy"
    return "compiling" if view.compiling else view.activity


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
        >>> from trainperf.ddp._progress import Collective
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
    who = _ranks([v.rank for v in gone])
    verb = "have" if len(gone) > 1 else "has"
    headline = f"{who} {verb} exited without returning from main (an error or a crash), while "
    headline += _what_others_do(waiting)
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
