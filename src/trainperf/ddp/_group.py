"""The single-node spawner's watch over one group of workers: start, collect, stop, report.

Each worker sends ``loaded`` once ``main`` is imported, then one final message (its result,
the ``sys.exit(0)`` that ended main instead, or its exception stamped with the time it was
raised). The group waits on those pipes, on the process sentinels and on the spawned
workers' start-up stderr together; the first failure ends the watch, every worker's
process tree is stopped (SIGTERM, then SIGKILL), and the earliest failure is reported with
its traceback (:mod:`~trainperf.ddp._group_exits` reads each report and exit,
:mod:`~trainperf.ddp._group_report` words the error).

Signals: SIGINT/SIGTERM raise :class:`~trainperf.ddp._procs.Interrupted` only while the
group waits. Starting a worker and handling what it sent run with signals held back: an
exception raised by the handler inside ``os.fork()``'s at-fork hooks would be swallowed
(the launch would go on as if nothing had happened), and one raised between starting a
process and recording it would leave a child that nobody reaps. After SIGTERM the ranks get
``grace_s`` seconds to exit on their own before SIGKILL.

Every rank's exit status while it is being stopped is kept: a rank that crashes or exits
with an error code during a grace period (after SIGTERM is passed on, or once a hang was
declared) is named, in the ``HangError``'s report or in the launcher's warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from trainperf.ddp import _capacity, _group_exits
from trainperf.ddp._failures import DEATH_SLACK_S as _DEATH_SLACK_S
from trainperf.ddp._failures import Problem as _Problem
from trainperf.ddp._group_report import Outcome, drain_ending, failure_message
from trainperf.ddp._group_report import lost_peer as _lost_peer
from trainperf.ddp._group_report import maybe_lost_peer as _maybe_lost_peer
from trainperf.ddp._procs import Interrupted, SignalGuard, signal_tree, stop_ending
from trainperf.ddp._stderr import StartupStderr, redirected_stderr, unredirected_stderr
from trainperf.ddp._worker import WorkerSpec, worker_main
from trainperf.ddp._worker_pickle import InheritedFd, UnpicklableArgument
from trainperf.ddp._worker_reimport import WORKER_NAME_PREFIX
from trainperf.errors import LaunchError

__all__ = ["EXIT_GRACE_S", "TERM_GRACE_S", "Group"]

logger = logging.getLogger("trainperf.ddp")

# SIGTERM, then this long before SIGKILL.
TERM_GRACE_S = 3.0
# After every rank has reported its result, how long the processes get to exit on their own.
EXIT_GRACE_S = 10.0


def _unpicklable(e: BaseException) -> str:
    """The error for main or an argument that spawn cannot pickle: which one, and its type."""
    if not isinstance(e, UnpicklableArgument):
        return (
            "start_method='spawn' pickles main's args and kwargs for every worker, "
            f"and they cannot be pickled: {e}; pass picklable values (build "
            "unpicklable objects inside main), or use start_method='fork'"
        )
    cause = e.__cause__
    return (
        "start_method='spawn' pickles main and its args and kwargs for every worker, and "
        f"{e.label} cannot be pickled ({type(cause).__name__}: {cause}): pass a picklable "
        "value (build unpicklable objects such as locks, open files and sockets inside main), "
        "or use start_method='fork'"
    )


class Group:
    """One attempt: ``nprocs`` workers started, watched, and stopped."""

    def __init__(
        self,
        ctx: BaseContext,
        spec: WorkerSpec,
        attempt: str,
        guard: SignalGuard,
        on_started: Callable[[], None] | None = None,
        *,
        measure_first: bool = False,
        detector: Any = None,
    ) -> None:
        self.ctx = ctx
        self.on_started = on_started
        self.spec = spec
        self.n = spec.world_size
        self.attempt = attempt
        self.guard = guard
        # Start rank 0 alone and check that nprocs ranks of its size fit in memory.
        self.measure_first = measure_first
        # A _detector.HangDetector, or None when hang detection is off.
        self.detector = detector
        self.procs: list[BaseProcess] = []
        self.readers: dict[int, Connection] = {}
        self.stderr: dict[int, StartupStderr] = {}
        self.running: dict[int, BaseProcess] = {}
        self.loaded: set[int] = set()
        self.results: dict[int, Any] = {}
        # The ranks whose main called sys.exit(0) (or sys.exit()): the call, for the report.
        self.exit_calls: dict[int, str] = {}
        self.problems: list[_Problem] = []
        self.stopped: list[int] = []
        # Exit codes of the ranks reaped while being stopped, and those SIGKILL reached.
        self.stop_codes: dict[int, int | None] = {}
        self.killed: set[int] = set()
        self._stop_began = float("inf")  # time.time() when stopping began (first SIGTERM)
        self.hang: Any = None  # the detector's report, once a hang was found
        # False once a failure is certain to repeat (no __main__ guard): no restart then.
        self.restartable = True

    def run(self) -> dict[int, Any]:
        signum: int | None = None
        try:
            self.guard.raise_pending()  # a signal that came while the guard was set up
            self._start()
            if self.on_started is not None:
                self.on_started()
            self._watch()
        except Interrupted as e:
            signum = e.signum
            raise
        finally:
            with self.guard.deferred():
                graceful = signum == signal.SIGTERM and self.spec.grace_s is not None
                if graceful:
                    self._drain(float(self.spec.grace_s or 0.0))
                    graceful = self.guard.pending != signal.SIGINT
                self._stop(0.0 if graceful else TERM_GRACE_S)
            self.guard.raise_pending()
        if self.hang is not None:
            raise self.detector.error(self.hang, self.endings(), self.attempt) from None
        if self.problems:
            raise LaunchError(self._message())
        return self.results

    def _start(self) -> None:
        available = _capacity.available_memory() if self.measure_first else 0
        if self.ctx.get_start_method() != "fork":
            # Started lazily by the first worker's start, while fd 2 is that worker's
            # start-up pipe, multiprocessing's resource tracker would keep a copy of it.
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        for rank in range(self.n):
            with self.guard.deferred():
                self._start_one(rank)
            self.guard.raise_pending()
            if rank == 0 and self.measure_first:
                self._check_memory(available)
            if self.problems:
                return  # the watch reports it; starting more ranks would not help

    def _start_one(self, rank: int) -> None:
        reader, writer = self.ctx.Pipe(duplex=False)
        redirect = (
            redirected_stderr() if self.ctx.get_start_method() == "spawn" else unredirected_stderr()
        )
        try:
            with redirect as captured:
                stderr = None if captured is None else InheritedFd(captured[1])
                proc = self.ctx.Process(  # type: ignore[attr-defined]
                    target=worker_main,
                    args=(self.spec, rank, writer, stderr),
                    name=f"{WORKER_NAME_PREFIX}{rank}",
                    daemon=False,  # daemonic processes may not start DataLoader workers
                )
                proc.start()
        except BaseException as e:
            # Whatever went wrong (unpicklable args, fork/spawn failing with OSError),
            # neither end of this rank's pipe may outlive the launch.
            reader.close()
            writer.close()
            if not isinstance(e, (pickle.PicklingError, AttributeError, TypeError)):
                raise
            raise ValueError(_unpicklable(e)) from e
        # Closing our copy now keeps later forked workers from inheriting it.
        writer.close()
        with contextlib.suppress(OSError):  # the worker does it too; the first one wins
            os.setpgid(proc.pid, proc.pid)
        self.procs.append(proc)
        self.readers[rank] = reader
        self.running[rank] = proc
        if captured is not None:
            self.stderr[rank] = captured[0]
        if self.detector is not None:
            self.detector.started(rank, proc.pid)

    def _check_memory(self, available: int) -> None:
        """Wait until rank 0 has imported torch and main, then project nprocs of it."""
        deadline = time.monotonic() + self.spec.timeout.total_seconds()
        while 0 not in self.loaded and 0 in self.running and not self.problems:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wait_once(min(remaining, 1.0))
        if 0 not in self.loaded or self.problems:
            return
        pid = self.running[0].pid if 0 in self.running else None
        per_rank = 0 if pid is None else _capacity.rank_memory(pid)
        refusal = _capacity.memory_refusal(self.n, per_rank, available)
        if refusal is not None:
            raise ValueError(refusal)

    def _receive(self, rank: int) -> None:
        conn = self.readers[rank]
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            self.readers.pop(rank).close()
            return
        try:
            kind, _, payload = pickle.loads(data)
        except Exception as e:
            self.readers.pop(rank).close()
            self.problems.append(
                _Problem(rank, time.time(), f"sent a result the launcher cannot unpickle: {e!r}")
            )
            return
        if kind == "loaded":
            self.loaded.add(rank)
            return
        self.readers.pop(rank).close()
        if kind in ("ok", "exit"):
            # "exit": main called sys.exit(0) (or sys.exit()), which counts as returning None.
            self.results[rank] = payload if kind == "ok" else None
            if kind == "exit":
                self.exit_calls[rank] = payload
            if self.detector is not None:
                self.detector.returned(rank, self.exit_calls.get(rank))
            return
        problem, repeats = _group_exits.reported(payload, self.spec.main)
        self.restartable = self.restartable and not repeats
        self.problems.append(problem)

    def _receive_sent(self, rank: int) -> None:
        """Read every message ``rank`` has sent so far."""
        while rank in self.readers and self.readers[rank].poll(0):
            self._receive(rank)

    def _collect(self, rank: int) -> None:
        """Read whatever an exited worker still has in its pipes."""
        self._receive_sent(rank)
        if rank in self.readers:
            self.readers.pop(rank).close()
        if rank in self.stderr:
            self.stderr[rank].drain(1.0)

    def _exited(self, rank: int, seen_at: float) -> None:
        proc = self.running[rank]
        proc.join()
        del self.running[rank]
        self._collect(rank)
        code = proc.exitcode if proc.exitcode is not None else -signal.SIGKILL
        reported = any(p.rank == rank for p in self.problems)
        if reported or (rank in self.results and code == 0):
            return
        if rank in self.results:
            # The result is complete; losing it to a crash at interpreter exit (some native
            # libraries do that) would help no one, but it must not pass silently either.
            logger.warning(_group_exits.returned_then_died(rank, self.exit_calls.get(rank), code))
            return
        self.problems.append(self._no_report(rank, code, seen_at))

    def _no_report(self, rank: int, code: int, seen_at: float) -> _Problem:
        """What to blame for a worker that exited with ``code`` and sent nothing."""
        startup = None
        if rank in self.stderr and rank not in self.loaded:
            startup = self.stderr[rank].text()
        problem, repeats = _group_exits.unreported(
            rank, code, seen_at, reimport=self._reimported(rank, code), startup_text=startup
        )
        self.restartable = self.restartable and not repeats
        return problem

    def _reimported(self, rank: int, code: int) -> bool:
        """See :func:`~trainperf.ddp._group_exits.reimported`."""
        return _group_exits.reimported(code, self.ctx, rank in self.loaded)

    def _reap(self, rank: int) -> None:
        """Join a worker the launcher is stopping; keep its exit code and a report it
        managed to send."""
        proc = self.running.pop(rank)
        proc.join()
        self.stop_codes[rank] = proc.exitcode
        self._collect(rank)

    def _ending(self, rank: int) -> tuple[str, bool]:
        """How a rank that was being stopped ended (see :func:`_procs.stop_ending`)."""
        late = [p for p in self.problems if p.rank == rank and p.time >= self._stop_began]
        code = self.stop_codes.get(rank)
        if code is not None and self._reimported(rank, code) and not late:
            # The missing main guard again (its own import of the script): already the cause.
            return "exited: it too imported a script with no main guard", True
        return stop_ending(
            code,
            killed=rank in self.killed,
            reported=late[0].summary if late else "",
            term_grace_s=TERM_GRACE_S,
        )

    def endings(self) -> list[tuple[int, int | None, str, bool]]:
        """``(rank, exit code, how it ended, expected)`` for each rank the stop reached."""
        return [(r, self.stop_codes.get(r), *self._ending(r)) for r in self.stopped]

    def _handle(self, ready: list[Any], *, stopping: bool = False) -> None:
        seen_at = time.time()
        rank_of_reader = {c: r for r, c in self.readers.items()}
        rank_of_sentinel = {p.sentinel: r for r, p in self.running.items()}
        for obj in ready:
            if isinstance(obj, StartupStderr):
                obj.read()
        for obj in ready:
            rank = rank_of_reader.get(obj)
            if rank is not None and rank in self.readers:
                self._receive(rank)
        for obj in ready:
            rank = rank_of_sentinel.get(obj)
            if rank is not None and rank in self.running:
                self._reap(rank) if stopping else self._exited(rank, seen_at)

    def _wait_once(self, timeout: float | None, *, stopping: bool = False) -> bool:
        """Wait for the next message, exit or stderr output; False if nothing is left."""
        waitables: list[Any] = [*self.readers.values()]
        waitables += [p.sentinel for p in self.running.values()]
        waitables += [s for s in self.stderr.values() if s.fd is not None]
        if not waitables:
            return False
        ready = wait(waitables, timeout)  # the one place a signal may interrupt the watch
        if stopping:  # already deferred by the caller
            self._handle(ready, stopping=True)
            return True
        with self.guard.deferred():
            self._handle(ready)
        self.guard.raise_pending()
        return True

    def _watch(self) -> None:
        exit_deadline: float | None = None
        poll = 1.0 if self.detector is None else self.detector.poll_s
        while not self.problems:
            timeout: float | None = poll
            if len(self.results) == self.n:
                if not self.running:
                    return
                if exit_deadline is None:
                    exit_deadline = time.monotonic() + EXIT_GRACE_S
                timeout = exit_deadline - time.monotonic()
                if timeout <= 0:
                    ranks = list(self.running)
                    logger.warning(
                        "%s", _group_exits.not_exited(ranks, self.exit_calls, EXIT_GRACE_S)
                    )
                    return
            if not self._wait_once(timeout):
                return
            if self.detector is not None and len(self.results) < self.n:
                with self.guard.deferred():
                    self.hang = self.detector.check(self.running, self.results, self.loaded)
                self.guard.raise_pending()
                if self.hang is not None:
                    return
        self._await_lost_peer()

    def _await_lost_peer(self) -> None:
        """The failures so far read like a lost peer ("Connection closed by peer"), or may be
        one (see :func:`~trainperf.ddp._group_report.maybe_lost_peer`): give the
        rank that left up to ``DEATH_SLACK_S`` to be seen gone, so that it is blamed, not
        the ranks it left behind. Its exit status comes first: its end of the pipes can
        close later than its sockets (a slow teardown, a child that holds them), and the
        stop would then read its exit as the stop's own doing. What the running ranks sent
        meanwhile is read too: a result (the rank that left had returned from main, and is
        still exiting) or an error of a rank's own explains the failures, and ends the wait.
        So too after an exit a rank made itself, with no report: it may have caught the
        broken collective of a rank killed by a signal, to be seen gone a wake-up later."""
        deadline = time.monotonic() + _DEATH_SLACK_S
        while self.running and self._only_lost_peers():
            with self.guard.deferred():
                for rank in list(self.running):
                    self._receive_sent(rank)
                seen_at = time.time()
                for rank in [r for r, p in self.running.items() if p.exitcode is not None]:
                    self._exited(rank, seen_at)
            self.guard.raise_pending()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _only_lost_peers(self) -> bool:
        """Every failure so far reads like a lost peer, or may be one (NCCL < 2.13's
        "unhandled system error", a death by SIGABRT, an exit a rank that had loaded main
        made itself), and no rank returned to explain it."""
        return (
            bool(self.problems)
            and not self.results
            and all(
                _lost_peer(p) or _maybe_lost_peer(p) or self._left_itself(p) for p in self.problems
            )
        )

    def _left_itself(self, problem: _Problem) -> bool:
        """Whether ``problem`` is an exit without a report that a rank made through its own
        exit path (``os._exit(n)``, not a signal) after loading main: it may have caught a
        collective that a peer's death broke. One before loading main joined no group."""
        return bool(problem.slack) and not problem.by_signal and problem.rank in self.loaded

    def _drain(self, grace_s: float) -> None:
        """SIGTERM reached the launcher: pass it on to each rank and wait up to ``grace_s``.

        Only the rank itself is signalled: its DataLoader workers must keep serving it while
        it finishes a step and saves (they are stopped with the rest afterwards). Ranks that
        exit within the grace period are not failures; the launcher exits with 143. A rank
        that crashed or exited with an error code meanwhile is named in a warning.
        """
        self._stop_began = min(self._stop_began, time.time())
        draining = sorted(self.running)
        for proc in self.running.values():
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.running and (remaining := deadline - time.monotonic()) > 0:
            if self.guard.pending == signal.SIGINT:
                return  # Ctrl-C during the grace period: stop now, as Ctrl-C always does
            # In short waits: a signal only sets ``pending`` meanwhile, it cuts no wait short.
            self._wait_once(min(remaining, 0.25), stopping=True)
        if self.running:
            logger.warning(
                "SIGTERM: ranks %s did not exit within grace_s=%g s; killing them",
                sorted(self.running),
                grace_s,
            )
        for p in self.problems:
            logger.warning("after SIGTERM, rank %d %s\n%s", p.rank, p.summary, p.detail)
        reported = {p.rank for p in self.problems}
        endings: dict[tuple[str, int | None], list[int]] = {}
        for rank in draining:
            code = self.stop_codes.get(rank)
            if rank in self.stop_codes and rank not in reported and code != 0:
                endings.setdefault((stop_ending(code, killed=False)[0], code), []).append(rank)
        for (text, code), ranks in endings.items():
            logger.warning("after SIGTERM, %s", drain_ending(ranks, text, code))

    def _stop(self, term_grace_s: float = TERM_GRACE_S) -> None:
        """Stop every worker and everything below it; collect reports that still arrive."""
        self._stop_began = min(self._stop_began, time.time())
        self.stopped = sorted(self.running)
        for rank, proc in enumerate(self.procs):
            if proc.pid is not None:
                signal_tree(proc.pid, signal.SIGTERM, alive=rank in self.running)
        deadline = time.monotonic() + term_grace_s
        while self.running and (remaining := deadline - time.monotonic()) > 0:
            self._wait_once(remaining, stopping=True)
        self.killed = set(self.running)
        for rank, proc in enumerate(self.procs):
            if proc.pid is not None:
                signal_tree(proc.pid, signal.SIGKILL, alive=rank in self.running)
        # Every child is joined, whatever path led here: none is left as a zombie.
        for proc in self.procs:
            if proc.exitcode is None:
                proc.join(timeout=10)
        for rank in self.running:
            self.stop_codes[rank] = self.running[rank].exitcode
        self.running.clear()
        for conn in self.readers.values():
            conn.close()
        self.readers.clear()
        for captured in self.stderr.values():
            captured.close()

    def _message(self) -> str:
        outcome = Outcome(
            self.n,
            self.attempt,
            tuple(self.problems),
            frozenset(self.results),
            tuple(self.stopped),
            tuple(self.endings()),
            self._stop_began,
            tuple(sorted(self.exit_calls.items())),
        )
        note = None if self.detector is None else self.detector.mismatch_note
        return failure_message(outcome, note)
