"""The watchdog's decisions, as pure functions of what the ranks sent: what one rank makes of
a stall (:func:`judge`), and what the collector builds from every rank's report (:func:`view`
per rank, then :func:`verdict_record`, which names the :func:`speaker`).

Used by :mod:`~trainperf.ddp._watchdog`, whose thread measures, talks to the store and exits;
nothing here does any of that.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from trainperf.ddp import _hang_report, _hang_view
from trainperf.ddp._detector import rank_view
from trainperf.ddp._progress_slots import BUSY_CAP, SlotState, State, busy_counts, read_slot
from trainperf.ddp._stacks import ThreadStack, classify, compiling_threads, parse_dump

__all__ = ["Decision", "judge", "speaker", "verdict_record", "view"]

Decision = Literal["progress", "hang", "wait"]


def judge(
    slot: SlotState,
    threads: list[ThreadStack],
    *,
    seen_progress: int,
    ended: bool,
    now: float,
    timeout: float,
    stalled_s: float = 0.0,
) -> Decision:
    """What a rank makes of a stall, from one snapshot of itself: its slot and one dump of
    all its threads.

    ``"progress"``: it moved since the stall was measured, it is inside ``torch.compile``'s
    compiler (on any thread) and the job has been stalled (``stalled_s``, since the last
    real progress) for less than ``BUSY_CAP`` times the timeout, or it is inside ``busy()``
    below the cap and not in a collective there. ``"hang"``: it waits (in a
    collective, in the ``work.wait()`` of an ``async_op=True`` one, or in DDP's
    ``backward()``), or another rank has ended. ``"wait"``: it is
    busy in its own code, so it waits for nobody: a waiting rank judges.

    Example:
        >>> from trainperf.ddp._progress_slots import SlotState, State
        >>> inside = SlotState(7, 3, 0, 0.0, 1, State.IN_COLLECTIVE, True, ())
        >>> judge(inside, [], seen_progress=7, ended=False, now=0.0, timeout=5.0)
        'hang'
        >>> judge(inside, [], seen_progress=6, ended=False, now=0.0, timeout=5.0)
        'progress'
    """
    if slot.progress != seen_progress:
        return "progress"
    if busy_counts(slot, now, timeout):
        return "progress"
    if compiling_threads(threads) and stalled_s < BUSY_CAP * timeout:
        return "progress"
    if slot.state == State.IN_COLLECTIVE or ended:
        return "hang"
    main = [t for t in threads if t.ident == slot.thread]
    # An async collective's work.wait() has no Python frame: the slot says what it waits
    # for, as the launcher's detector reads it (rank_view).
    last = slot.history[-1] if slot.history else None
    waits_async = bool(last and last.async_op and slot.state == State.RUNNING)
    if main and classify(main[0].frames, in_collective=False, waits_async=waits_async) in (
        "backward",
        "collective",
    ):
        return "hang"
    return "wait"


def speaker(report: _hang_report.HangReport, me: int) -> int:
    """The lowest rank still running that answered prints the verdict (``me`` if none)."""
    for each in report.ranks:
        if each.status == "running" and each.answered:
            return each.rank
    return me


def verdict_record(report: _hang_report.HangReport, me: int) -> dict[str, Any]:
    """What the collector posts (JSON): the message, the report's dict, who prints it, and
    how many ranks answered (they wait for each other before exiting)."""
    answering = sum(1 for v in report.ranks if v.status == "running" and v.answered)
    return {
        "message": str(report),
        "report": report.to_dict(),
        "speaker": speaker(report, me),
        "answering": answering,
    }


def view(rank: int, record: dict[str, Any]) -> _hang_view.RankView:
    """One rank's view for the rules, from the report it posted (``status``: "running",
    "returned" or "gone"; ``slot``: its progress slot in hex; ``dump``: its stacks, if any;
    ``how``: how a rank that returned or exited finished, in words). Only a running rank's
    stacks count: one that returned or exited waits in nothing."""
    slot = read_slot(bytes.fromhex(record["slot"]))
    threads = parse_dump(record["dump"]) if record.get("dump") else None
    status: _hang_view.Status = "running"
    if record["status"] == "returned":
        status = "returned"
    elif record["status"] == "gone":
        status = "gone"
    found = rank_view(rank, status, slot, threads if status == "running" else [])
    if status != "running" and record.get("how"):
        found = dataclasses.replace(found, finished=record["how"])
    return found
