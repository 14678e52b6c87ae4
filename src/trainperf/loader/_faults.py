"""Worker faults: what a DataLoader exception means, and when a wait counts as a hang.

A DataLoader's failures arrive as exceptions in the main process: ``RuntimeError``s for a
worker that died ("exited unexpectedly", "killed by signal"), for a hang ("timed out
after"), re-raised dataset errors ("Caught ValueError in DataLoader worker process 0"),
pickling errors under ``spawn``. :func:`classify_fault` turns each into a
:data:`~trainperf.loader.FaultKind` and a sentence with the fix;
:func:`hang_timeout` says how long a wait for a batch may last before it counts as a hang.
The worker processes themselves (found, measured, stopped) are :mod:`._workers`.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

from trainperf.loader._picklable import FD_FIX, UNSENDABLE
from trainperf.loader._report import FaultKind, format_bytes
from trainperf.loader._step import cores_for_workers

__all__ = [
    "budget_cut",
    "budget_cut_reason",
    "classify_fault",
    "hang_timeout",
    "oom_figures",
    "start_method",
]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


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


_SHM_MARKERS = (
    "bus error",
    "no space left on device",
    "unable to write to file </torch_",
    "shared memory",
    "unable to allocate shared memory",
)


def _cause(msg: str) -> str:
    """The error's own words: its last line, without the fix a worker's send failure
    (:mod:`._picklable`) already added, or torch's "Original " prefix."""
    cause = _last_line(msg).split("; fix: ")[0]
    return cause.removeprefix("Original ")


def _shm_reason(msg: str, shm_free: int | None, inflight_bytes: int | None) -> str:
    """What a ``shm`` fault says: /dev/shm too small, with its free space and the bytes in
    flight where known, and the fix."""
    where = "" if shm_free is None else f" ({format_bytes(shm_free)} free"
    if where and inflight_bytes is not None:
        where += f", about {format_bytes(inflight_bytes)} of batches in flight"
    where += ")" if where else ""
    return (
        f"/dev/shm is too small for the batches in flight{where}: {_cause(msg)}; fix: "
        f"give the container more shared memory (docker run --shm-size=16g, or a "
        f"memory-backed emptyDir on Kubernetes), or use fewer workers or a smaller "
        f"prefetch_factor"
    )


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
    if "too many open files" in low:  # before /dev/shm: torch's words say "shared memory"
        # Each tensor in flight between processes holds a file descriptor (torch's default
        # sharing strategy): the limit ran out, not /dev/shm.
        return "error", f"a process ran out of file descriptors ({_cause(msg)}); {FD_FIX}"
    if any(m in low for m in _SHM_MARKERS):
        return "shm", _shm_reason(msg, shm_free, inflight_bytes)
    if caught and UNSENDABLE in msg:  # a batch the worker could not pickle (_picklable)
        return "pickle", _last_line(msg).split(": ", 1)[-1]
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
