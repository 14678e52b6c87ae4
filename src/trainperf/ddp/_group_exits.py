"""How the single-node spawner reads what a rank sent or how it exited: the
:class:`~trainperf.ddp._failures.Problem` a failure report or an exit without one records,
whether a restarted group would fail the same way, and how a rank that finished main is
named. Pure functions of what :class:`~trainperf.ddp._group.Group` saw; the group waits,
receives and stops, nothing here does.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from trainperf.ddp._failures import (
    DEATH_SLACK_S,
    RELAUNCH_ADVICE,
    Problem,
    summarize,
    unguarded_main,
)
from trainperf.ddp._failures import arguments_advice as _arguments_advice
from trainperf.ddp._failures import load_advice as _load_advice
from trainperf.ddp._failures import startup_problem as _startup_problem
from trainperf.ddp._procs import death_summary
from trainperf.ddp._worker import Failure
from trainperf.ddp._worker_reimport import REIMPORT_EXIT_CODE

__all__ = ["finished", "not_exited", "reimported", "reported", "returned_then_died", "unreported"]


def reported(failure: Failure, main: Callable[..., Any] | None) -> tuple[Problem, bool]:
    """The problem a rank's failure report records, and whether a restarted group would
    fail the same way: main or one of its arguments could not be loaded (the same bytes fail
    the same way in the next attempt), importing main's module set up a process group (the
    next import sets it up again), or main's return value could not be pickled (main would
    run again only to return the same kind of value).

    Example:
        >>> f = Failure(1, 10, "ValueError", "bad batch", "tb", time=100.0)
        >>> problem, repeats = reported(f, None)
        >>> problem.summary, repeats
        ('raised ValueError: bad batch', False)
    """
    advice = ""
    if failure.stage == "load":
        advice = _load_advice(main)
    elif failure.stage == "args":
        advice = _arguments_advice(failure.argument)
    elif failure.stage == "relaunch":
        advice = RELAUNCH_ADVICE
    problem = Problem(
        failure.rank, failure.time, summarize(failure), failure.traceback, advice=advice
    )
    return problem, failure.stage in ("load", "args", "relaunch", "group", "result")


def reimported(code: int, ctx: BaseContext, loaded: bool) -> bool:
    """Whether a rank exited because its import of the script called launch() again (no
    main guard): a rank ``ctx`` spawned that never loaded main, with that exit status.
    After loading main, the same status is main's own (``os._exit(117)``).

    Example:
        >>> import multiprocessing
        >>> spawn = multiprocessing.get_context("spawn")
        >>> reimported(REIMPORT_EXIT_CODE, spawn, loaded=False)
        True
        >>> reimported(REIMPORT_EXIT_CODE, spawn, loaded=True), reimported(1, spawn, False)
        (False, False)
    """
    return code == REIMPORT_EXIT_CODE and ctx.get_start_method() == "spawn" and not loaded


# For a rank that ended its process itself (os._exit(0), or a library calling exit(0)).
_EXITED_ADVICE = (
    "Fix: return from main (or call sys.exit(0)) instead of ending the process (os._exit(0), "
    "or a library that calls exit()): only then does the launcher get the rank's result, "
    "and the rank's background checkpoint saves finish before it exits."
)


def unreported(
    rank: int, code: int, seen_at: float, *, reimport: bool, startup_text: str | None
) -> tuple[Problem, bool]:
    """What to blame for a rank that exited with ``code`` and sent nothing, seen gone at
    ``seen_at``, and whether a restarted group would fail the same way.

    Args:
        rank: the rank.
        code: its exit code (negative: the signal that ended it).
        seen_at: ``time.time()`` when the launcher saw it gone.
        reimport: it exited because its import of the script launched again
            (:func:`reimported`).
        startup_text: what a spawned rank printed before it loaded main, or None when it
            had loaded main (or was forked).

    Example:
        >>> problem, repeats = unreported(1, -9, 100.0, reimport=False, startup_text=None)
        >>> problem.summary.startswith("died from signal SIGKILL"), problem.by_signal, repeats
        (True, True, False)
    """
    if code == 0:
        summary = "exited with code 0 without returning from main (os._exit?)"
        return Problem(rank, seen_at, summary, advice=_EXITED_ADVICE, slack=DEATH_SLACK_S), False
    if reimport:
        summary, advice = unguarded_main()
        return Problem(rank, seen_at, summary, advice=advice), True
    if startup_text is not None:
        startup = _startup_problem(rank, seen_at, startup_text, code)
        if startup is not None:
            return startup, True
    problem = Problem(
        rank,
        seen_at,
        death_summary(code),
        slack=DEATH_SLACK_S,
        by_signal=code < 0,
        aborted=code == -signal.SIGABRT,
    )
    return problem, False


def finished(call: str | None, *, in_main: bool = False) -> str:
    """How a rank that finished main did so: returned, or ``call`` (``"sys.exit(0)"``),
    said to be ``in main`` where ``in_main``.

    Example:
        >>> finished(None), finished("sys.exit(0)"), finished("sys.exit(0)", in_main=True)
        ('returned from main', 'called sys.exit(0)', 'called sys.exit(0) in main')
    """
    if call is None:
        return "returned from main"
    return f"called {call} in main" if in_main else f"called {call}"


def returned_then_died(rank: int, call: str | None, code: int) -> str:
    """The warning for a rank whose result is in, that then exited with ``code`` != 0: its
    result stands (some native libraries crash at interpreter exit), said, not hidden.

    Example:
        >>> returned_then_died(1, "sys.exit(0)", 3)[:65]
        'rank 1 called sys.exit(0), then exited with code 3 while shutting'
    """
    how = death_summary(code).replace(" without reporting an error", " while shutting down")
    return f"rank {rank} {finished(call)}, then {how}"


def not_exited(ranks: list[int], exit_calls: dict[int, str], grace_s: float) -> str:
    """The warning for ranks that finished main but had not exited ``grace_s`` later, named
    by how they finished it (``exit_calls``: rank -> ``"sys.exit(0)"``), as the
    ``LaunchError`` names them.

    Example:
        >>> not_exited([0, 1, 2], {1: "sys.exit(0)"}, 10.0)[:75]
        'ranks 0, 2 returned from main and rank 1 called sys.exit(0) in main, but di'
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        how = finished(exit_calls.get(rank), in_main=True)
        groups.setdefault(how, []).append(rank)
    who = " and ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {how}"
        for how, rs in groups.items()
    )
    return (
        f"{who}, but did not exit within {grace_s:.0f} s (a non-daemon thread?); stopping "
        f"{'it' if len(ranks) == 1 else 'them'}"
    )
