"""What the single-node spawner says when a group of workers fails: the first failure with
its traceback, then each other rank once (a later failure, returned from main, or stopped by
the launcher and how it ended), and the line for ranks that ended the same way after a
passed-on SIGTERM. Pure functions of what :class:`~trainperf.ddp._group.Group` recorded.

A rank the stop reached is placed by when it failed: one that reported a failure before the
stop began (and was still exiting) is a later failure; one that reported while being stopped
is listed as stopped, with what it reported as how it ended.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from trainperf.ddp._failures import Problem

__all__ = [
    "Ending",
    "Outcome",
    "drain_ending",
    "failure_message",
    "first_failure",
    "lost_peer",
    "maybe_lost_peer",
    "maybe_peer_gone",
    "peer_gone",
]

# (rank, exit code, how it ended, whether that is the ending the stop itself causes)
Ending = tuple[int, int | None, str, bool]


@dataclass(frozen=True)
class Outcome:
    """What a failed group left behind, for its ``LaunchError``.

    Attributes:
        n: ranks in the group.
        attempt: the attempt's suffix for the first line (``" (attempt 2 of 3)"``), or "".
        problems: every failure reported or seen, in the order they arrived.
        returned: the ranks that returned from main.
        stopped: the ranks still running when the launcher began stopping them.
        endings: how each stopped rank ended (see ``Group.endings``).
        stop_began: ``time.time()`` when the launcher began stopping the ranks.
        exit_calls: ``(rank, "sys.exit(0)")`` for each rank among ``returned`` whose main
            called ``sys.exit(0)`` (or ``sys.exit()``) instead of returning.
    """

    n: int
    attempt: str
    problems: tuple[Problem, ...]
    returned: frozenset[int]
    stopped: tuple[int, ...]
    endings: tuple[Ending, ...] = ()
    stop_began: float = float("inf")
    exit_calls: tuple[tuple[int, str], ...] = ()

    def failed_while_stopped(self, problem: Problem) -> bool:
        """Whether ``problem`` came from a rank the stop reached, once it had begun."""
        return problem.rank in self.stopped and problem.time >= self.stop_began


def failure_message(outcome: Outcome, mismatch_note: Callable[[str], list[str]] | None) -> str:
    """The ``LaunchError``'s message: the earliest failure first, with its traceback.

    Args:
        outcome: what the group recorded; it has at least one problem.
        mismatch_note: the hang detector's note on a collective mismatch, given the first
            failure's summary and traceback; None when hang detection is off.

    Example:
        >>> bad = Problem(1, 100.0, "raised ValueError: bad batch", "Traceback ...")
        >>> print(failure_message(Outcome(2, "", (bad,), frozenset(), (0,)), None))
        rank 1 of 2 raised ValueError: bad batch
        <BLANKLINE>
        Traceback from rank 1:
        Traceback ...
        <BLANKLINE>
        Stopped by the launcher: rank 0
    """
    first = first_failure(outcome.problems)
    lines = [f"rank {first.rank} of {outcome.n}{outcome.attempt} {first.summary}"]
    if first.detail:
        lines += ["", f"Traceback from rank {first.rank}:", first.detail.rstrip()]
    if first.advice:
        lines += ["", first.advice]
    lines += _later(outcome, first)
    lines += _returned(outcome, first)
    if mismatch_note is not None:
        lines += mismatch_note(f"{first.summary}\n{first.detail}")
    lines += _stopped(outcome, first)
    return "\n".join(lines)


def first_failure(problems: tuple[Problem, ...]) -> Problem:
    """The failure to blame: the earliest. A death seen without a report is dated up to its
    ``slack`` before it was seen, ahead of the lost-peer errors ("Connection closed by
    peer") it causes. A rank that exited through its own exit path (``os._exit(0)``,
    ``sys.exit``) may have caught another rank's error and left, so an error of a rank's own
    (a report that does not read like a lost peer) raised before that exit was seen, and
    before any lost-peer error, comes first. A rank killed by a signal (the OOM killer's
    SIGKILL, a crash) caught nothing: it stays dated back, ahead of any error in its slack.
    A failure that may be a lost peer's (:func:`maybe_lost_peer`: NCCL < 2.13's "unhandled
    system error", a death by SIGABRT) is blamed only when no death or error of a rank's own
    may have come before it. Failures dated alike (deaths seen in the same wake-up) blame a
    death by a signal over an exit, then the lower rank; so does a death by a signal seen
    within its slack after that exit (a wake-up later), unless SIGABRT ended it.

    Example:
        >>> own = Problem(1, 100.0, "raised ValueError: bad batch")
        >>> lost = Problem(2, 100.1, "raised RuntimeError: Connection closed by peer")
        >>> gone = Problem(0, 100.5, "exited with code 0", slack=1.0)
        >>> killed = Problem(0, 100.5, "died from signal SIGKILL", slack=1.0, by_signal=True)
        >>> aborted = Problem(3, 100.4, "died from signal SIGABRT", slack=1.0, aborted=True)
        >>> cases = [(own, lost, gone), (lost, gone), (own, killed), (aborted, own)]
        >>> [first_failure(p).rank for p in cases]
        [1, 0, 0, 1]
    """
    return _earliest_cause(tuple(p for p in problems if not _explained(p, problems)))


def _explained(problem: Problem, problems: tuple[Problem, ...]) -> bool:
    """Whether ``problem`` may be a lost peer's, and a death or an error of a rank's own
    (neither a lost peer nor a maybe) may have come before it, to cause it."""
    if not maybe_lost_peer(problem):
        return False
    return any(
        _dated(q) <= problem.time and not lost_peer(q) and not maybe_lost_peer(q) for q in problems
    )


def _earliest_cause(problems: tuple[Problem, ...]) -> Problem:
    earliest = min(problems, key=_order)
    if not earliest.slack or earliest.by_signal:
        return earliest
    lost = [p.time for p in problems if not p.slack and lost_peer(p)]
    bound = min([earliest.time, *lost])
    own = [p for p in problems if not p.slack and not lost_peer(p) and p.time < bound]
    if not own:
        # A rank killed by a signal (not SIGABRT, which may be NCCL's watchdog ending it
        # for the exit) that may have died before that exit was seen is blamed over it, as
        # in one wake-up: seen a wake-up later, it is dated later, yet caught nothing. Not
        # one that died after a rank had lost its peer: that peer had gone before it.
        killed = [p for p in problems if p.by_signal and not p.aborted and _dated(p) <= bound]
        return min(killed, key=_order) if killed else earliest
    # A rank killed before that own error was raised is still blamed over it.
    return min(own + [p for p in problems if p.by_signal], key=_order)


def _dated(problem: Problem) -> float:
    return problem.time - problem.slack


def _order(problem: Problem) -> tuple[float, bool, int]:
    """Earliest first; between failures dated alike (deaths seen in one wake-up get the same
    time, in whatever order ``wait()`` listed them) a death by a signal, which caught nothing,
    before an exit a rank made itself (it may have caught the other's fault and left), then
    the lower rank, so the blame does not depend on that order."""
    return _dated(problem), not problem.by_signal, problem.rank


def _later(outcome: Outcome, first: Problem) -> list[str]:
    later = sorted(
        (p for p in outcome.problems if p is not first and not outcome.failed_while_stopped(p)),
        key=_order,
    )
    if not later:
        return []
    lines = ["", "Later failures (often a consequence of the first):"]
    return lines + [f"  rank {p.rank} {p.summary}" for p in later]


def _returned(outcome: Outcome, first: Problem) -> list[str]:
    """The ranks that finished main, grouped by how: returned, or called ``sys.exit(0)``."""
    returned = sorted(r for r in outcome.returned if r != first.rank)
    if not returned or first.rank in outcome.returned:
        return []
    calls = dict(outcome.exit_calls)
    groups: dict[str, list[int]] = {}
    for r in returned:
        head = f"Called {calls[r]} in main" if r in calls else "Already returned from main"
        groups.setdefault(head, []).append(r)
    lines = [
        f"{head}: rank{'s' if len(ranks) > 1 else ''} " + ", ".join(map(str, ranks))
        for head, ranks in groups.items()
    ]
    if lost_peer(first) or maybe_lost_peer(first):
        lines[-1] += " (a collective that not every rank calls fails like this)"
    return ["", *lines]


def _stopped(outcome: Outcome, first: Problem) -> list[str]:
    # Ranks that failed before the stop began are among the later failures already.
    failed = {p.rank for p in outcome.problems if not outcome.failed_while_stopped(p)}
    stopped = [
        r
        for r in outcome.stopped
        if r != first.rank and r not in outcome.returned and r not in failed
    ]
    lines = []
    if stopped:
        lines += [
            "",
            f"Stopped by the launcher: rank{'s' if len(stopped) > 1 else ''} "
            + ", ".join(map(str, stopped)),
        ]
    odd = [
        (r, text) for r, _, text, expected in outcome.endings if not expected and r not in failed
    ]
    return lines + [f"  rank {rank} {text} while being stopped" for rank, text in odd]


# What a rank raises when another rank went away (or the link to it broke), as the sources
# word it; matched lowercased. A message NCCL or PyTorch also gives for a rank's own
# mistake ("invalid usage", "unhandled cuda error", "unhandled system error", "CUDA out of
# memory") is not here: that rank is to blame.
_PEER_GONE = (
    # gloo's tcp transport (third_party/gloo/gloo/transport/tcp/pair.cc): "Connection closed
    # by peer", and a read error's strerror(ECONNRESET) "Connection reset by peer"; the
    # same strerror texts (and EPIPE's "Broken pipe") come from PyTorch's TCPStore sockets
    # (torch/csrc/distributed/c10d/Utils.hpp, SYSCHECK).
    "closed by peer",
    "reset by peer",
    "connection closed",
    "broken pipe",
    # NCCL's ncclGetErrorString(ncclRemoteError) (src/init.cc, NCCL >= 2.13), which
    # PyTorch's C10D_NCCL_CHECK and watchdog put in "NCCL error in: <file>:<line>, remote
    # process exited or there was a network error, NCCL version ..." and "NCCL error:
    # remote process exited ...", followed by "ncclRemoteError: A call failed possibly due
    # to a network error or a remote process exiting prematurely."
    "remote process exited or there was a network error",
    # ProcessGroupNCCL's WorkNCCL::checkTimeout (torch/csrc/distributed/c10d/
    # ProcessGroupNCCL.cpp): "[Rank 1] Watchdog caught collective operation timeout:
    # WorkNCCL(SeqNum=1, OpType=ALLREDUCE, ...) ran for 600017 milliseconds before timing
    # out." NCCL does not notice a peer that has gone; the survivors wait until this.
    "watchdog caught collective operation timeout",
    # NCCLComm::getNcclComm (torch/csrc/distributed/c10d/NCCLUtils.cpp): "NCCL communicator
    # was aborted on rank 1. Original reason for failure was: ..." (see _ABORT_REASON).
    "nccl communicator was aborted",
    # TCPStore's tcputil::recvBytes / sendBytes (torch/csrc/distributed/c10d/Utils.hpp):
    # "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server
    # shutdown or crash?" (older releases: "failed to recv, got 0 bytes"), and SYSCHECK's
    # DistNetworkError "Socket Timeout", alone or in ProcessGroupNCCL's "... but
    # store->get('0') got error: Socket Timeout"; a bare "socket timeout" may be anyone's.
    "failed to recv, got 0 bytes",
    "failed to send, sent 0 bytes",
    "distnetworkerror: socket timeout",
    "got error: socket timeout",
)
# What a rank raises when another rank went away, and also for faults of its own; matched
# lowercased. Such an error is blamed unless a death or an error of a rank's own came first.
_MAYBE_PEER_GONE = (
    # ncclGetErrorString(ncclSystemError): before NCCL 2.13 (no ncclRemoteError) the error a
    # rank gets when its peer's process exits, "NCCL error in: <file>:<line>, unhandled
    # system error, NCCL version 2.10.3\nncclSystemError: System call (e.g. socket, malloc)
    # or external library call failed or device error. It can be also caused by unexpected
    # exit of a remote peer, ..."; the "Connection closed by remote peer" that says so is
    # only in the NCCL WARN lines (stdout, with NCCL_DEBUG set), which the launcher never sees.
    "unhandled system error",
    # ECONNREFUSED: a TCPStore (or gloo) client connecting once the rank that listened for
    # it is gone; also a service of the user's own that is down.
    "connection refused",
)
# An aborted NCCL communicator may say why it was aborted: that reason, not the abort,
# tells whose error it was (a timeout waiting for a peer, or this rank's own CUDA error).
_ABORT_REASON = "original reason for failure was:"


def peer_gone(text: str) -> bool:
    """Whether a failure reads like a collective whose peer had gone, not a rank's own
    error: gloo's "Connection closed by peer", NCCL's "remote process exited or there was a
    network error", ProcessGroupNCCL's watchdog timeout or aborted communicator, or a
    TCPStore connection that closed.

    Example:
        >>> peer_gone("raised RuntimeError: [gloo] Connection closed by peer"), peer_gone("x")
        (True, False)
        >>> peer_gone("NCCL error in: pg.cpp:1, invalid usage (run with NCCL_DEBUG=WARN)")
        False
        >>> aborted = "NCCL communicator was aborted on rank 1.  Original reason for failure was: "
        >>> peer_gone(aborted + "CUDA error: an illegal memory access was encountered")
        False
    """
    low = text.lower()
    head, marked, reason = low.partition(_ABORT_REASON)
    if marked and "nccl communicator was aborted" in head:
        return peer_gone(reason)
    return any(s in low for s in _PEER_GONE)


def maybe_peer_gone(text: str) -> bool:
    """Whether a failure may be a lost peer's but may as well be a rank's own: NCCL < 2.13's
    "unhandled system error", or "Connection refused"; one that reads like a lost peer
    (:func:`peer_gone`) is not a maybe.

    Example:
        >>> maybe_peer_gone("NCCL error in: pg.cpp:1, unhandled system error, NCCL version 2.10.3")
        True
        >>> maybe_peer_gone("unhandled system error, Last error: Connection closed by peer")
        False
    """
    low = text.lower()
    return any(s in low for s in _MAYBE_PEER_GONE) and not peer_gone(text)


def maybe_lost_peer(problem: Problem) -> bool:
    """Whether ``problem`` may be a consequence of another rank's failure as much as its own
    fault: a death by SIGABRT (how NCCL's watchdog ends the ranks whose peer went away, as
    well as a crash), or an error :func:`maybe_peer_gone` says so of.

    Example:
        >>> abort = Problem(0, 1.0, "died from signal SIGABRT", slack=1.0, aborted=True)
        >>> maybe_lost_peer(abort)
        True
        >>> maybe_lost_peer(Problem(0, 1.0, "raised ValueError: bad batch"))
        False
    """
    if problem.slack:
        return problem.aborted
    return maybe_peer_gone(f"{problem.summary}\n{problem.detail}")


def lost_peer(problem: Problem) -> bool:
    """Whether ``problem``'s summary or traceback reads like a lost peer (:func:`peer_gone`).

    Example:
        >>> lost_peer(Problem(0, 1.0, "raised RuntimeError: Connection closed by peer"))
        True
    """
    return peer_gone(f"{problem.summary}\n{problem.detail}")


def drain_ending(ranks: list[int], text: str, code: int | None) -> str:
    """One line for the ranks that ended the same way after the passed-on SIGTERM; for ranks
    the signal itself ended, the line says how to let a rank save first.

    Example:
        >>> drain_ending([0, 1], "stopped by SIGTERM", -15)[:63]
        'ranks 0, 1 were ended by the passed-on SIGTERM (exit code -15: '
        >>> drain_ending([1], "exited with code 3", 3)
        'rank 1 exited with code 3 (exit code 3)'
    """
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if code == -signal.SIGTERM:
        return (
            f"{who} {'were' if len(ranks) > 1 else 'was'} ended by the passed-on SIGTERM "
            f"(exit code {code}: the signal's default action, with no handler or one that "
            "re-raised it); to finish the step and save first, use "
            "trainperf.Checkpointer.preemption() (or a handler of your own) and return"
        )
    return f"{who} {text} (exit code {code})"
