"""Worker faults: which process is a worker, what an exception means, and a clean stop.

A DataLoader's failures arrive as exceptions in the main process: ``RuntimeError``s for a
worker that died ("exited unexpectedly", "killed by signal"), for a hang ("timed out
after"), re-raised dataset errors ("Caught ValueError in DataLoader worker process 0"),
pickling errors under ``spawn``. :func:`classify_fault` turns each into a
:data:`~trainperf.loader.FaultKind` and a sentence with the fix; :func:`close_iterator`
stops the workers without the multi-second joins a hung worker would otherwise cost;
:func:`hang_timeout` says how long a wait for a batch may last before it counts as a hang.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import psutil

from trainperf.loader._report import FaultKind, format_bytes
from trainperf.loader._step import cores_for_workers

__all__ = [
    "WorkerProcesses",
    "budget_cut",
    "budget_cut_reason",
    "child_signals_held",
    "classify_fault",
    "close_iterator",
    "hang_timeout",
    "iterator_worker_pids",
    "main_private_bytes",
    "oom_figures",
    "sigkilled_workers",
    "start_method",
    "thread_busy_seconds",
]

_HELPER_MARKERS = ("resource_tracker", "forkserver", "semaphore_tracker")
USS_READ_LIMIT = 8
"""Workers whose private memory is read: reading one costs a walk of its page tables
(milliseconds for a process holding torch), and the workers of one pool are alike."""


class WorkerProcesses:
    """The worker processes of the DataLoader iterators it is shown (:meth:`scan`):
    multiprocessing helpers excluded, and never another process this program starts
    meanwhile (a subprocess a thread launches while a pool is measured is not killed)."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._before = {p.pid for p in self._me.children()}
        self._procs: dict[int, psutil.Process] = {}
        self._helpers: set[int] = set()
        self.peak_rss = 0

    def scan(self, it: Any = None) -> list[psutil.Process]:
        """Track the workers of the DataLoader iterator ``it`` (from its own list of worker
        processes); without one that lists them, this process's children started since
        construction, less multiprocessing's helpers."""
        pids = iterator_worker_pids(it)
        if pids is not None:
            for pid in pids:
                if pid not in self._procs:
                    with contextlib.suppress(psutil.Error):
                        self._procs[pid] = psutil.Process(pid)
            return list(self._procs.values())
        for p in self._me.children():
            if p.pid in self._before or p.pid in self._procs or p.pid in self._helpers:
                continue
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if any(m in cmd for m in _HELPER_MARKERS):
                self._helpers.add(p.pid)
            else:
                self._procs[p.pid] = p
        return list(self._procs.values())

    def alive(self) -> list[psutil.Process]:
        out = []
        for p in self._procs.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def busy_seconds(self) -> float:
        """CPU demand of all workers' threads so far (see :func:`thread_busy_seconds`)."""
        total = 0.0
        for p in self._procs.values():
            busy = _schedstat_seconds(f"/proc/{p.pid}/task")
            if busy is None:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    busy = t.user + t.system
            total += busy or 0.0
        return total

    def sample_rss(self) -> None:
        total = 0
        for p in self._procs.values():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        self.peak_rss = max(self.peak_rss, total)

    def uss_by_pid(self, limit: int = USS_READ_LIMIT) -> dict[int, int]:
        """Private (unshared) memory of up to ``limit`` workers, in bytes, by pid."""
        out: dict[int, int] = {}
        for p in list(self._procs.values())[:limit]:
            with contextlib.suppress(psutil.Error, AttributeError):
                out[p.pid] = int(p.memory_full_info().uss)
        return out

    def kill(self) -> None:
        for p in self.alive():
            with contextlib.suppress(psutil.Error):
                p.kill()

    def wait_exited(self, timeout: float) -> list[psutil.Process]:
        """Wait (without reaping: multiprocessing does that) until the workers have exited."""
        end = time.monotonic() + timeout
        alive = self.alive()
        while alive and time.monotonic() < end:
            time.sleep(0.02)
            alive = self.alive()
        return alive


def _read_schedstat(path: str) -> float | None:
    try:
        with open(path) as f:
            run_ns, wait_ns, _ = f.read().split()
        return (int(run_ns) + int(wait_ns)) / 1e9
    except (OSError, ValueError):
        return None


def _schedstat_seconds(task_dir: str) -> float | None:
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    found = [_read_schedstat(f"{task_dir}/{tid}/schedstat") for tid in tids]
    values = [v for v in found if v is not None]
    return sum(values) if values else None


def thread_busy_seconds() -> float:
    """CPU demand of the calling thread so far: seconds running plus seconds runnable but
    waiting for a CPU (Linux ``schedstat``; CPU time elsewhere).

    Counting the wait keeps the estimate honest on a busy host: a compute-bound loop that
    other processes crowd off the CPU still demands a whole core, while a loop that sleeps
    on I/O does not.

    Example:
        >>> thread_busy_seconds() >= 0
        True
    """
    busy = _read_schedstat(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    return time.thread_time() if busy is None else busy


def main_private_bytes() -> int:
    """Private anonymous memory of this process, in bytes: the most a forked worker can
    copy from it (``RssAnon`` on Linux, else the unique set size, else the RSS).

    Example:
        >>> main_private_bytes() > 0
        True
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    me = psutil.Process()
    try:
        return int(me.memory_full_info().uss)
    except (psutil.Error, AttributeError):
        return int(me.memory_info().rss)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


_DEATH_SYMPTOMS = (ConnectionError, EOFError)
"""What the main process may see first when a worker dies while sending a batch (the
socket that passes the batch's shared memory closes), before the worker can be waited
for."""


def sigkilled_workers(it: Any, error: BaseException | None = None) -> list[int]:
    """Pids of the DataLoader iterator's workers that ended with SIGKILL (exit code -9).

    When ``error`` is what a worker's death looks like from the main process (a
    connection reset, an end of file: see :data:`_DEATH_SYMPTOMS`), the worker may still
    be dying, so this waits for its exit code for up to a second. Reading ``exitcode``
    reaps a dead worker, which torch's shutdown handles.
    """
    workers = list(getattr(it, "_workers", None) or ())
    end = time.monotonic() + (1.0 if isinstance(error, _DEATH_SYMPTOMS) else 0.0)
    while True:
        out, running = [], 0
        for w in workers:
            with contextlib.suppress(Exception):
                code = w.exitcode
                running += code is None
                if code == -signal.SIGKILL:
                    out.append(int(w.pid))
        if out or not running or time.monotonic() >= end:
            return out
        time.sleep(0.02)


def oom_figures(
    num_workers: int,
    *,
    workers_rss: int | None,
    worker_uss: int | None,
    memory_available: int | None,
) -> str:
    """The memory figures quoted when a worker was SIGKILLed: what the workers had reached
    (as last read, every ~0.2 s) against what was available when the tuning started.

    Example:
        >>> GiB = 2**30
        >>> print(oom_figures(4, workers_rss=3 * GiB, worker_uss=GiB // 2,
        ...                   memory_available=2 * GiB))  # doctest: +NORMALIZE_WHITESPACE
        4 workers had reached 3.0 GiB resident together (512 MiB private each at the first
        reading), with 2.0 GiB available when tuning started
        >>> oom_figures(2, workers_rss=None, worker_uss=None, memory_available=None)
        '2 workers were running (their memory was not read before the kill)'
    """
    workers = f"{num_workers} worker{'' if num_workers == 1 else 's'}"
    if not workers_rss:
        verb = "was" if num_workers == 1 else "were"
        text = f"{workers} {verb} running (their memory was not read before the kill)"
    else:
        text = f"{workers} had reached {format_bytes(workers_rss)} resident together"
        if worker_uss:
            text += f" ({format_bytes(worker_uss)} private each at the first reading)"
    if memory_available is not None:
        text += f", with {format_bytes(memory_available)} available when tuning started"
    return text


def classify_fault(
    error: BaseException,
    *,
    start_method: str,
    timeout_s: float,
    inflight_bytes: int | None = None,
    shm_free: int | None = None,
    sigkilled: bool = False,
    memory_figures: str | None = None,
) -> tuple[FaultKind, str]:
    """Name the fault behind a DataLoader exception and say how to fix it.

    A worker killed by SIGKILL (``sigkilled``, or torch's "killed by signal: Killed") is
    reported as ``memory``: the out-of-memory killer is by far the commonest sender, and
    ``memory_figures`` (:func:`oom_figures`) says how close to the limit the workers were.

    Example:
        >>> classify_fault(RuntimeError("DataLoader worker (pid(s) 12) exited unexpectedly"),
        ...                start_method="fork", timeout_s=10)[0]
        'crash'
        >>> classify_fault(RuntimeError("DataLoader timed out after 2 seconds"),
        ...                start_method="fork", timeout_s=2)[0]
        'hang'
        >>> classify_fault(RuntimeError("DataLoader worker (pid(s) 12) exited unexpectedly"),
        ...                start_method="fork", timeout_s=10, sigkilled=True)[0]
        'memory'
        >>> classify_fault(TimeoutError("Caught TimeoutError in DataLoader worker process 0."
        ...                "\\nOriginal Traceback...\\nTimeoutError: read timed out after 5 s"),
        ...                start_method="fork", timeout_s=10)
        ('error', 'the dataset raised in a worker: TimeoutError: read timed out after 5 s')
    """
    msg = str(error)
    low = msg.lower()
    # The dataset's own exception, raised in a worker and re-raised here by torch: its
    # message is the dataset's ("timed out after", "pickle"), not a fault of the pool's.
    caught = low.startswith("caught ") and " in dataloader worker process" in _first_line(low)
    if sigkilled or "killed by signal: killed" in low:
        figures = f": {memory_figures}" if memory_figures else ""
        return "memory", (
            f"a worker was killed by SIGKILL (exit code -9), most likely by the out-of-memory "
            f"killer{figures}; fix: fewer workers or a smaller prefetch_factor, a dataset "
            f"whose workers hold less (open files lazily, keep big arrays in shared tensors), "
            f"or more memory for the job"
        )
    if (
        start_method != "fork"
        and not caught
        and (isinstance(error, pickle.PicklingError) or "pickle" in low or "local object" in low)
    ):
        return "pickle", (
            f"the dataset, collate_fn or worker_init_fn cannot be pickled, which the "
            f"{start_method!r} start method needs ({_first_line(msg)}); fix: use module-level "
            f"functions instead of lambdas or local functions and no open files, locks or "
            f"generators as attributes, or pass multiprocessing_context='fork' (Linux)"
        )
    shm_markers = (
        "bus error",
        "no space left on device",
        "unable to write to file </torch_",
        "shared memory",
        "unable to allocate shared memory",
    )
    if any(m in low for m in shm_markers):
        where = "" if shm_free is None else f" ({format_bytes(shm_free)} free"
        if where and inflight_bytes is not None:
            where += f", about {format_bytes(inflight_bytes)} of batches in flight"
        where += ")" if where else ""
        return "shm", (
            f"/dev/shm is too small for the batches in flight{where}: {_last_line(msg)}; fix: "
            f"give the container more shared memory (docker run --shm-size=16g, or a "
            f"memory-backed emptyDir on Kubernetes), or use fewer workers or a smaller "
            f"prefetch_factor"
        )
    if caught:
        return "error", f"the dataset raised in a worker: {_last_line(msg)}"
    if "timed out after" in low:
        return "hang", (
            f"no batch arrived within {timeout_s:.1f} s: a worker hangs (a deadlock, blocking "
            f"I/O, a lock or thread pool inherited across fork); fix the dataset, or pass a "
            f"larger timeout= if batches really take that long"
        )
    if "exited unexpectedly" in low or "killed by signal" in low:
        hint = "run with num_workers=0 to see the dataset's own error"
        if start_method != "fork":
            hint += (
                f"; under {start_method!r}, the script must guard its entry point with "
                f"if __name__ == '__main__':"
            )
        return "crash", f"a worker died ({_first_line(msg)}); {hint}"
    return "error", f"the dataset raised in a worker: {_last_line(msg)}"


_BUDGET_CUT = " left of the time budget: a worker may hang, or the budget is too short"


def budget_cut(fault: str | None, reason: str | None) -> bool:
    """Whether a candidate's ``hang`` is one the budget cut short (:func:`budget_cut_reason`):
    a pool that may only have been slow to start (``spawn`` workers import torch again), not
    a dataset seen to hang. The reason is matched as text since reports come back from the
    cache and from other ranks as text.

    Example:
        >>> budget_cut("hang", budget_cut_reason(0.5)), budget_cut("hang", "no batch arrived")
        (True, False)
    """
    return fault == "hang" and reason is not None and _BUDGET_CUT in reason


def budget_cut_reason(seconds_left: float) -> str:
    """Why a candidate whose hang timeout the budget cut short delivered no batch.

    The tuner cannot tell a hang from a pool too slow to start within what was left, so it
    says both, and how to tell them apart.

    Example:
        >>> budget_cut_reason(2.5).split(":")[0]
        'no batch within the 2.5 s left of the time budget'
    """
    return (
        f"no batch within the {seconds_left:.1f} s{_BUDGET_CUT} for the workers to start and "
        f"deliver one batch; fix: a larger budget_s, or a DataLoader timeout= shorter than the "
        f"budget so that a hang is reported as one"
    )


def start_method(loader_kwargs: Mapping[str, Any]) -> str:
    """The start method DataLoader workers will use: ``"fork"``, ``"spawn"`` or ``"forkserver"``.

    From ``loader_kwargs["multiprocessing_context"]`` (a name or a context object) when
    given, else the process's default, read without fixing it (a later
    ``set_start_method`` still works).

    Args:
        loader_kwargs: the caller's DataLoader keyword arguments.

    Returns:
        The start method's name.

    Example:
        >>> import multiprocessing
        >>> start_method({"multiprocessing_context": "spawn"})
        'spawn'
        >>> start_method({"multiprocessing_context": multiprocessing.get_context("fork")})
        'fork'
        >>> start_method({}) in multiprocessing.get_all_start_methods()
        True
    """
    import multiprocessing

    ctx = loader_kwargs.get("multiprocessing_context")
    if isinstance(ctx, str):
        return ctx
    if ctx is not None and hasattr(ctx, "get_start_method"):
        return str(ctx.get_start_method())
    # allow_none=True reads the default without fixing it for the rest of the program.
    method = multiprocessing.get_start_method(allow_none=True)
    return method or multiprocessing.get_all_start_methods()[0]


@contextlib.contextmanager
def child_signals_held() -> Iterator[None]:
    """Keep torch's SIGCHLD handler quiet while a failed pool is looked at and stopped.

    That handler raises ``RuntimeError`` in the main thread, at any line, for every worker
    that dies with a failure; after the first (already caught) more follow: the
    out-of-memory killer takes workers one by one, and stopping the pool kills the rest.
    Blocking the signal would not do (another thread of this process takes it, and the
    handler still runs in the main thread), so a handler that does nothing stands in until
    the iterator is shut down; torch's, put back, then finds no worker registered and
    raises nothing. Only the main thread has signal handlers; elsewhere this does nothing.
    """
    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, _ignore_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL if previous is None else previous)


def _ignore_signal(signum: int, frame: Any) -> None:
    """A Python-level handler that does nothing (not SIG_IGN: that would reap children)."""


def iterator_worker_pids(it: Any) -> list[int] | None:
    """The pids of a multi-process DataLoader iterator's workers (torch keeps them in
    ``_workers``), or None where ``it`` does not list them.

    Example:
        >>> iterator_worker_pids(iter([1, 2])) is None
        True
    """
    procs = getattr(it, "_workers", None)
    if not isinstance(procs, list):
        return None
    pids = [getattr(p, "pid", None) for p in procs]
    return [pid for pid in pids if isinstance(pid, int)]


def close_iterator(it: Any, workers: WorkerProcesses, *, kill_first: bool) -> None:
    """Shut the iterator's workers down; kill hung ones first so the join does not wait."""
    workers.scan(it)
    for _ in range(3):
        try:
            if kill_first:
                workers.kill()
                workers.wait_exited(2.0)
                # torch's SIGCHLD handler raises RuntimeError for the killed workers; let it
                # fire here, inside the try, rather than later in the caller's code.
                time.sleep(0.02)
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            break
        except RuntimeError:
            continue
    # Workers normally exit within milliseconds of the shutdown; anything left is killed
    # (its pids are no longer watched by torch, so this raises nothing).
    if workers.wait_exited(3.0):
        workers.kill()
        workers.wait_exited(2.0)


def hang_timeout(
    num_workers: int,
    *,
    user_timeout: float,
    start_method: str,
    batch_s: float,
    cpus: int,
    main_cores: float,
) -> float:
    """Seconds without a batch that count as a hang for a pool of ``num_workers`` workers:
    the one rule of the one-off tuner's measurements and of the pools the adaptive loader
    starts.

    The caller's ``timeout`` when given; else twenty times the main process's time per
    batch, times how far the workers outnumber the cores left to them beside the main
    process (:func:`~trainperf.loader._step.cores_for_workers` of ``cpus`` and
    ``main_cores``), at least 10 s; plus 20 s for workers that import torch again as they
    start (``spawn``, ``forkserver``).

    Args:
        num_workers: the pool's workers.
        user_timeout: the caller's DataLoader ``timeout`` (0: none).
        start_method: the workers' start method.
        batch_s: seconds one batch takes in a single process.
        cpus: usable CPUs (:func:`~trainperf.limits.usable_cpus`).
        main_cores: cores the main process keeps (its training step's).

    Example:
        >>> hang_timeout(4, user_timeout=0.0, start_method="fork", batch_s=0.01, cpus=3,
        ...              main_cores=1.0)
        10.0
        >>> hang_timeout(4, user_timeout=0.0, start_method="spawn", batch_s=1.0, cpus=3,
        ...              main_cores=1.0)
        60.0
        >>> hang_timeout(4, user_timeout=3.0, start_method="spawn", batch_s=1.0, cpus=3,
        ...              main_cores=1.0)
        3.0
    """
    if user_timeout > 0:
        return user_timeout
    worker_cpus = cores_for_workers(cpus, main_cores)
    spawn_extra = 0.0 if start_method == "fork" else 20.0
    return max(10.0, 20.0 * batch_s * max(1.0, num_workers / worker_cpus)) + spawn_extra
