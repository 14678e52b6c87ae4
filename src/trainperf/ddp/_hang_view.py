"""One rank at the moment of a hang (:class:`RankView`), and what ranks do, in words.

The launcher (:func:`~trainperf.ddp._detector.rank_view`) or the watchdog builds one view per
rank from its slot and its stack dump; :mod:`~trainperf.ddp._hang`'s rules judge them and
:mod:`~trainperf.ddp._hang_report` prints them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from trainperf.ddp._group_exits import finished as finished_main
from trainperf.ddp._progress_slots import Collective
from trainperf.ddp._stacks import Activity, Frame, loads_in_process

__all__ = ["RankView", "Status"]

Status = Literal["running", "returned", "gone", "unknown"]


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
    exit_call: str = ""  # returned: the call that ended main instead ("sys.exit(0)"), if any
    # returned or gone: how it finished, in words, where the rank said so itself (under
    # watchdog(): "left the watchdog() block", "raised ValueError in the watchdog() block")
    finished: str = ""

    @property
    def waiting(self) -> bool:
        return self.status == "running" and self.activity in ("collective", "backward", "joining")

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
        if self.finished and self.status in ("returned", "gone"):
            return self.finished
        if self.status == "returned":
            return finished_main(self.exit_call or None, in_main=True)
        if self.status == "gone":
            return "has exited"
        if self.status == "unknown":
            return "could not be asked"
        if self.activity == "collective" and self.collective is not None:
            return f"waits in {self.collective.describe()}"
        if self.activity == "joining":
            return "waits for every rank to join the process group (before main)"
        if self.activity == "starting":
            return _starting(self, at, code)
        if not self.answered and self.activity == "running":
            return (
                "did not answer: its stacks could not be read (C code that holds the GIL "
                "runs, or the process is stopped)"
            )
        if self.stuck_in and self.activity != "backward":
            return f"is stuck in {self.stuck_in} for {self.stuck_s:.0f} s{at}{code}"
        if self.compiling and self.activity != "backward":
            return f"is stuck in torch.compile's compilation{at}{code}"
        if self.activity == "backward":
            return f"waits inside backward(){at} (DDP's gradient all-reduce runs there)"
        if self.activity == "dataloader" and loads_in_process(self.stack):
            return f"loads a batch in the rank itself (num_workers=0), in its dataset{at}{code}"
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


def _starting(view: RankView, at: str, code: str) -> str:
    """What a rank that never reached main is doing, in words."""
    if view.answered and view.where is not None:
        return (
            "has not joined the process group: it is still importing main's module or "
            f"unpickling its arguments{at}{code}"
        )
    return (
        "has not joined the process group: it is still starting (a spawned rank imports your "
        "script again, so its module-level code runs there too; its stack could not be read "
        "before trainperf's worker code ran)"
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
