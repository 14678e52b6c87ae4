"""The single-node spawner's watch over one group of workers: start, collect, stop, report.

Each worker sends one message (its result, or its exception stamped with the time it was
raised). The group waits on those pipes and on the process sentinels together; the first
failure ends the watch, every worker's process tree is stopped (SIGTERM, then SIGKILL), and
the earliest failure is reported with its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from trainperf.ddp._procs import SignalGuard, death_summary, signal_tree
from trainperf.ddp._worker import (
    REIMPORT_EXIT_CODE,
    WORKER_NAME_PREFIX,
    Failure,
    WorkerSpec,
    worker_main,
)
from trainperf.errors import LaunchError

__all__ = ["EXIT_GRACE_S", "TERM_GRACE_S", "Group"]

logger = logging.getLogger("trainperf.ddp")

# SIGTERM, then this long before SIGKILL.
TERM_GRACE_S = 3.0
# After every rank has reported its result, how long the processes get to exit on their own.
EXIT_GRACE_S = 10.0
# A death without a report is only seen when the parent wakes up, about when the peers'
# "connection closed" errors are stamped; dating it this much earlier blames the dead rank,
# not the ranks that failed because it was gone.
_DEATH_SLACK_S = 1.0


@dataclass(frozen=True)
class _Problem:
    rank: int
    time: float
    summary: str
    detail: str = ""  # the rank's traceback
    advice: str = ""  # what to do, when the cause is known without a traceback


def _summary(failure: Failure) -> str:
    if failure.type_name == "SystemExit":
        return f"called sys.exit({failure.message})"
    first_line = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
    if len(first_line) > 300:
        first_line = first_line[:300] + "..."
    return f"raised {failure.type_name}" + (f": {first_line}" if first_line else "")


def _unguarded_main() -> tuple[str, str]:
    """Summary and advice for workers that exited because the script has no main guard."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    summary = (
        f"could not start: each spawned worker imports {script} again, and that import "
        "called launch() once more, because the call is not under an "
        'if __name__ == "__main__": guard'
    )
    advice = (
        "Fix: start the workers only when the script is run, not when it is imported:\n\n"
        '    if __name__ == "__main__":\n'
        "        trainperf.ddp.launch(main)\n\n"
        'In a notebook or REPL there is no script to import: use start_method="fork" (Linux).'
    )
    return summary, advice


class Group:
    """One attempt: ``nprocs`` workers started, watched, and stopped."""

    def __init__(
        self,
        ctx: BaseContext,
        spec: WorkerSpec,
        attempt: str,
        guard: SignalGuard,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.on_started = on_started
        self.spec = spec
        self.n = spec.world_size
        self.attempt = attempt
        self.guard = guard
        self.procs: list[BaseProcess] = []
        self.readers: dict[int, Connection] = {}
        self.running: dict[int, BaseProcess] = {}
        self.results: dict[int, Any] = {}
        self.problems: list[_Problem] = []
        self.stopped: list[int] = []
        # False once a failure is certain to repeat (no __main__ guard): no restart then.
        self.restartable = True

    def run(self) -> dict[int, Any]:
        try:
            self._start()
            if self.on_started is not None:
                self.on_started()
            self._watch()
        finally:
            with self.guard.deferred():
                self._stop()
            self.guard.raise_pending()
        if self.problems:
            raise LaunchError(self._message())
        return self.results

    def _start(self) -> None:
        for rank in range(self.n):
            reader, writer = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(  # type: ignore[attr-defined]
                target=worker_main,
                args=(self.spec, rank, writer),
                name=f"{WORKER_NAME_PREFIX}{rank}",
                daemon=False,  # daemonic processes may not start DataLoader workers
            )
            try:
                proc.start()
            except BaseException as e:
                # Whatever went wrong (unpicklable args, fork/spawn failing with OSError,
                # an interrupt), neither end of this rank's pipe may outlive the launch.
                reader.close()
                writer.close()
                if not isinstance(e, (pickle.PicklingError, AttributeError, TypeError)):
                    raise
                raise ValueError(
                    "start_method='spawn' pickles main's args and kwargs for every worker, "
                    f"and they cannot be pickled: {e}; pass picklable values (build "
                    "unpicklable objects inside main), or use start_method='fork'"
                ) from e
            # Closing our copy now keeps later forked workers from inheriting it.
            writer.close()
            with contextlib.suppress(OSError):  # the worker does it too; the first one wins
                os.setpgid(proc.pid, proc.pid)
            self.procs.append(proc)
            self.readers[rank] = reader
            self.running[rank] = proc

    def _receive(self, rank: int) -> None:
        conn = self.readers.pop(rank)
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        finally:
            conn.close()
        try:
            kind, _, payload = pickle.loads(data)
        except Exception as e:
            self.problems.append(
                _Problem(rank, time.time(), f"sent a result the launcher cannot unpickle: {e!r}")
            )
            return
        if kind == "ok":
            self.results[rank] = payload
        else:
            f: Failure = payload
            self.problems.append(_Problem(rank, f.time, _summary(f), f.traceback))

    def _exited(self, rank: int, seen_at: float) -> None:
        proc = self.running.pop(rank)
        proc.join()
        if rank in self.readers and self.readers[rank].poll(0):
            self._receive(rank)
        elif rank in self.readers:
            self.readers.pop(rank).close()
        code = proc.exitcode if proc.exitcode is not None else -signal.SIGKILL
        reported = any(p.rank == rank for p in self.problems)
        if reported or (rank in self.results and code == 0):
            return
        if rank in self.results:
            # The result is complete; losing it to a crash at interpreter exit (some native
            # libraries do that) would help no one, but it must not pass silently either.
            logger.warning(
                "rank %d returned from main, then %s",
                rank,
                death_summary(code).replace(" without reporting an error", " while shutting down"),
            )
        elif code == 0:
            self.problems.append(
                _Problem(
                    rank, seen_at, "exited with code 0 without returning from main (os._exit?)"
                )
            )
        elif code == REIMPORT_EXIT_CODE and self.ctx.get_start_method() == "spawn":
            summary, advice = _unguarded_main()
            self.problems.append(_Problem(rank, seen_at, summary, advice=advice))
            self.restartable = False
        else:
            self.problems.append(_Problem(rank, seen_at - _DEATH_SLACK_S, death_summary(code)))

    def _reap(self, rank: int) -> None:
        """Join a worker the launcher is stopping; keep a report it managed to send."""
        self.running.pop(rank).join()
        if rank in self.readers and self.readers[rank].poll(0):
            self._receive(rank)

    def _handle(self, ready: list[Any], *, stopping: bool = False) -> None:
        seen_at = time.time()
        rank_of_reader = {c: r for r, c in self.readers.items()}
        rank_of_sentinel = {p.sentinel: r for r, p in self.running.items()}
        for obj in ready:
            rank = rank_of_reader.get(obj)
            if rank is not None and rank in self.readers:
                self._receive(rank)
        for obj in ready:
            rank = rank_of_sentinel.get(obj)
            if rank is not None:
                self._reap(rank) if stopping else self._exited(rank, seen_at)

    def _watch(self) -> None:
        exit_deadline: float | None = None
        while not self.problems:
            timeout: float | None = 1.0
            if len(self.results) == self.n:
                if not self.running:
                    return
                if exit_deadline is None:
                    exit_deadline = time.monotonic() + EXIT_GRACE_S
                timeout = exit_deadline - time.monotonic()
                if timeout <= 0:
                    logger.warning(
                        "ranks %s returned from main but did not exit within %.0f s "
                        "(a non-daemon thread?); stopping them",
                        sorted(self.running),
                        EXIT_GRACE_S,
                    )
                    return
            waitables: list[Any] = [*self.readers.values()]
            waitables += [p.sentinel for p in self.running.values()]
            if not waitables:
                return
            self._handle(wait(waitables, timeout))

    def _stop(self) -> None:
        """Stop every worker and everything below it; collect reports that still arrive."""
        self.stopped = sorted(self.running)
        for rank, proc in enumerate(self.procs):
            if proc.pid is not None:
                signal_tree(proc.pid, signal.SIGTERM, alive=rank in self.running)
        deadline = time.monotonic() + TERM_GRACE_S
        while self.running and (remaining := deadline - time.monotonic()) > 0:
            waitables: list[Any] = [*self.readers.values()]
            waitables += [p.sentinel for p in self.running.values()]
            self._handle(wait(waitables, remaining), stopping=True)
        for rank, proc in enumerate(self.procs):
            if proc.pid is not None:
                signal_tree(proc.pid, signal.SIGKILL, alive=rank in self.running)
        for proc in self.running.values():
            proc.join(timeout=10)
        self.running.clear()
        for conn in self.readers.values():
            conn.close()
        self.readers.clear()

    def _message(self) -> str:
        first = min(self.problems, key=lambda p: p.time)
        lines = [f"rank {first.rank} of {self.n}{self.attempt} {first.summary}"]
        if first.detail:
            lines += ["", f"Traceback from rank {first.rank}:", first.detail.rstrip()]
        if first.advice:
            lines += ["", first.advice]
        later = sorted((p for p in self.problems if p is not first), key=lambda p: p.time)
        if later:
            lines += ["", "Later failures (often a consequence of the first):"]
            lines += [f"  rank {p.rank} {p.summary}" for p in later]
        returned = sorted(r for r in self.results if r != first.rank)
        if returned and first.rank not in self.results:
            lines += [
                "",
                f"Already returned from main: rank{'s' if len(returned) > 1 else ''} "
                + ", ".join(map(str, returned))
                + " (a collective that not every rank calls fails like this)",
            ]
        stopped = [r for r in self.stopped if r != first.rank and r not in self.results]
        if stopped:
            lines += [
                "",
                f"Stopped by the launcher: rank{'s' if len(stopped) > 1 else ''} "
                + ", ".join(map(str, stopped)),
            ]
        return "\n".join(lines)
