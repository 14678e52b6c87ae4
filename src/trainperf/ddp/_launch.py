"""``launch(main)``: one process per GPU (or N CPU ranks), or the ranks a launcher started.

Modules: ``_launch_checks`` (what is refused before any rank starts), ``_launch_spawn``
(starting the ranks and restarting failed groups), ``_store`` (the rendezvous store),
``_injob`` (inside torchrun/SLURM; ``_shared_gpu``: its NCCL ranks on one card),
``_capacity`` (how many ranks fit), ``_group`` (starting and watching one attempt),
``_group_exits`` (what each report or exit it sees means), ``_failures`` (what it says
about a failed rank) and ``_group_report`` (the error's message), ``_worker`` (inside each
rank) and ``_rank_exit`` (how a rank leaves after a fault),
``_detector``/``_progress``/``_stacks``/``_hang``/``_rundir`` (hangs).

Inside a torchrun or SLURM job, ``main`` runs in this process after the process group is
initialised from the environment. Otherwise the launcher hosts a ``TCPStore`` on a port the
OS picks (no probe-then-bind race), starts ``nprocs`` workers that join through it, and
watches them: the first failure stops the rest within seconds and is raised as a
:class:`~trainperf.errors.LaunchError` carrying the failing rank's own traceback.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from trainperf._utils.validate import positive_int, positive_number
from trainperf.ddp import _env
from trainperf.ddp._injob import resolve_backend, run_in_process
from trainperf.ddp._launch_checks import (
    _check_call,
    _check_capacity,
    _check_options,
    _check_spawnable,
    _warn_if_nprocs_ignored,
    _warn_if_unreachable,
    hang_timeout_s,
)
from trainperf.ddp._launch_spawn import _spawn
from trainperf.ddp._worker_reimport import (
    REIMPORT_EXIT_CODE,
    refuse_launch_while_loading,
    reimporting_main,
)

__all__ = ["Backend", "StartMethod", "launch", "launch_all"]

Backend = Literal["nccl", "gloo"]
StartMethod = Literal["spawn", "fork"]


def _warn_off_the_main_thread() -> None:
    """Warn where launch() spawns ranks from a thread Ctrl-C and SIGTERM never reach."""
    if threading.current_thread() is not threading.main_thread():
        warnings.warn(
            "launch() called outside the main thread: Python delivers Ctrl-C and SIGTERM to "
            "the main thread only, so they will not stop the ranks (nor give them grace_s "
            "to save); call launch() from the main thread",
            UserWarning,
            stacklevel=4,
        )


def _launch(
    main: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    nprocs: int | None,
    backend: str | None,
    start_method: str,
    timeout: timedelta | float,
    max_restarts: int,
    all_ranks: bool,
    grace_s: float,
    hang_timeout: float | None,
) -> Any:
    if reimporting_main():
        # A spawned worker importing a script with no __main__ guard: Python would refuse to
        # start processes from here with a long traceback. Leave quietly instead; the
        # launcher knows this exit status and says what to change.
        raise SystemExit(REIMPORT_EXIT_CODE)
    refuse_launch_while_loading()
    import torch

    span, max_restarts = _check_options(main, backend, start_method, timeout, max_restarts)
    _check_call(main, args, kwargs)
    if nprocs is not None:
        # Checked here, before a running job decides to ignore it: nprocs=0 or "2" is a
        # mistake wherever launch() runs.
        nprocs = positive_int(
            "nprocs",
            nprocs,
            fix="pass the number of worker processes as an int, e.g. nprocs=2, or leave nprocs "
            "out for one per visible GPU (1 without GPUs)",
        )
    grace = positive_number("grace_s", grace_s, unit="seconds")
    hang = None
    if hang_timeout is not None:
        hang = hang_timeout_s("hang_timeout", hang_timeout)
        _warn_if_unreachable(hang, span)
    env = _env.detect()
    if env is None:
        _warn_off_the_main_thread()
    if env is not None:
        _warn_if_nprocs_ignored(nprocs, env)
        return run_in_process(
            env,
            main,
            args,
            kwargs,
            backend=backend,
            timeout=span,
            all_ranks=all_ranks,
            hang_timeout=hang,
        )
    gpu_count = torch.cuda.device_count()  # through NVML: does not initialise CUDA
    resolved = resolve_backend(backend, gpu_count)
    if nprocs is None:
        nprocs = max(gpu_count, 1)
    if resolved == "nccl" and nprocs > gpu_count:
        raise ValueError(
            f"nprocs={nprocs} with backend='nccl' needs {nprocs} GPUs, but {gpu_count} "
            f"{'is' if gpu_count == 1 else 'are'} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use "
            f"nprocs<={gpu_count}, or backend='gloo' for CPU ranks"
        )
    _check_capacity(nprocs, resolved)
    _check_spawnable(main, start_method, resolved)
    results = _spawn(
        main,
        args,
        kwargs,
        nprocs=nprocs,
        backend=resolved,
        start_method=start_method,
        timeout=span,
        max_restarts=max_restarts,
        all_ranks=all_ranks,
        grace_s=grace,
        hang_timeout=hang,
    )
    return [results[r] for r in range(nprocs)] if all_ranks else results[0]


def launch(
    main: Callable[..., Any],
    /,
    *args: Any,
    nprocs: int | None = None,
    backend: Backend | None = None,
    start_method: StartMethod = "spawn",
    timeout: timedelta | float = timedelta(minutes=30),
    max_restarts: int = 0,
    grace_s: float = 25.0,
    hang_timeout: float | None = 300.0,
    **kwargs: Any,
) -> Any:
    """Run ``main(*args, **kwargs)`` on every rank of a process group; return rank 0's value.

    Outside a launcher, starts ``nprocs`` workers on this machine (default: one per visible
    GPU, 1 without GPUs; ask for more CPU ranks explicitly). Under torchrun or in a SLURM
    step (``RANK``/``WORLD_SIZE``/... or ``SLURM_PROCID``/``SLURM_NTASKS``/... set) starts
    nothing: initialises the process group from the environment and runs ``main`` here,
    returning this process's own value; ``nprocs``, ``start_method`` and ``max_restarts``
    are then ignored (the launcher owns them), and an explicit ``nprocs`` other than the
    processes running on this node is warned about (once, on rank 0). The same goes for a
    ``launch`` called inside a rank that ``launch`` started. The process group is always
    destroyed.

    Each worker gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, ``torch.cuda.set_device(local_rank)`` under NCCL, and a share of the
    CPUs as ``torch.set_num_threads`` (unless ``OMP_NUM_THREADS`` is set). For every rank's
    value use :func:`launch_all`. Keyword arguments named like the options above go to
    ``launch``, not ``main``: wrap ``main`` in ``functools.partial`` for those (``main``
    itself is positional only, so ``main=`` is one of ``main``'s keywords).

    Args:
        main: the training function; a module-level function under ``"spawn"``.
        *args: positional arguments for ``main``.
        nprocs: number of workers on this machine: an int >= 1, or None (the default above);
            checked inside a running job too, where it is then ignored.
        backend: ``"nccl"`` or ``"gloo"``; None picks NCCL with GPUs, gloo without.
        start_method: ``"spawn"`` (scripts, with an ``if __name__ == "__main__":`` guard)
            or ``"fork"`` (notebooks and REPLs, Linux, before CUDA is initialised).
        timeout: how long a collective (and the rendezvous) may wait for a peer: a
            ``timedelta`` > 0, or a finite number of seconds > 0 (NaN, infinity, 0 and
            negatives are refused with ``ValueError`` before any rank starts).
        max_restarts: how many times a failed group is restarted from scratch.
        grace_s: after SIGTERM reaches the launcher, how long the ranks get to exit on
            their own (SIGTERM is passed on to each rank, not to its DataLoader workers)
            before SIGKILL; below torchrun's and SLURM's 30 s. Each rank sees it as
            ``TRAINPERF_GRACE_S``.
        hang_timeout: seconds without progress on any rank (a collective returning, an
            optimizer step, a rank returning from main) after which the launcher collects
            every rank's stacks, names the rank(s) that caused the hang and stops them all
            (``HangError``); at least 1 s, or None to turn detection off. Under torchrun
            or SLURM the ranks watch each other through :func:`watchdog` instead.
        **kwargs: keyword arguments for ``main``.

    Returns:
        What ``main`` returned on rank 0 (pickled back to the launcher).

    Raises:
        HangError: no rank made progress for ``hang_timeout`` seconds (a ``LaunchError``).
        LaunchError: a worker raised, exited with a non-zero code or died by a signal (the
            first failing rank, its exception type and traceback, or the signal; ranks in
            different collectives are named), the explicit ``MASTER_PORT`` cannot be
            bound, or, under spawn, a worker could not start: the script calls ``launch``
            outside an ``if __name__ == "__main__":`` guard, its top level fails when a
            worker imports it again (the worker's own traceback is in the message), or
            ``main``'s module cannot be imported in a new interpreter. None of these is
            restarted: it would fail the same way.
        ValueError: bad option, inconsistent launcher environment (names the variable),
            too many ranks for the GPUs under NCCL, more gloo ranks than 4 per usable CPU
            (``TRAINPERF_OVERSUBSCRIBE=1`` allows it), ranks whose projected memory does
            not fit (measured on rank 0 first when it could matter), or ``main``
            unpicklable under spawn.
        DeviceError: ``start_method="fork"`` after CUDA was initialised.
        KeyboardInterrupt: SIGINT reached the launcher (after stopping every worker).
        SystemExit: SIGTERM reached the launcher; exit status 143, once every rank exited
            (within ``grace_s``) or was killed.
        TypeError: ``main`` is not callable, is an ``async def`` or generator function
            (calling it would run none of its body), or cannot take ``*args`` and
            ``**kwargs`` (as its signature says; ``args=(...)`` in the style of
            ``torch.multiprocessing.spawn`` is named), before any rank starts.

    Example:
        >>> import operator, torch
        >>> how = "spawn" if torch.cuda.device_count() else "fork"  # fork: quick, no GPUs
        >>> launch(operator.add, 2, 3, nprocs=2, backend="gloo", start_method=how)
        5
    """
    return _launch(
        main,
        args,
        kwargs,
        nprocs=nprocs,
        backend=backend,
        start_method=start_method,
        timeout=timeout,
        max_restarts=max_restarts,
        all_ranks=False,
        grace_s=grace_s,
        hang_timeout=hang_timeout,
    )


def launch_all(
    main: Callable[..., Any],
    /,
    *args: Any,
    nprocs: int | None = None,
    backend: Backend | None = None,
    start_method: StartMethod = "spawn",
    timeout: timedelta | float = timedelta(minutes=30),
    max_restarts: int = 0,
    grace_s: float = 25.0,
    hang_timeout: float | None = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Like :func:`launch`, but return every rank's value, indexed by rank.

    Under torchrun or SLURM the values are gathered with ``all_gather_object`` before the
    process group is destroyed, so every process gets the whole list. If ``main`` destroyed
    the group, on every rank or on some, the ranks agree on the store to gather in a new
    group instead, each waiting at most ``timeout`` for the others to return from ``main``.

    Args:
        main: as for :func:`launch`.
        *args: as for :func:`launch`.
        nprocs: as for :func:`launch`.
        backend: as for :func:`launch`.
        start_method: as for :func:`launch`.
        timeout: as for :func:`launch`.
        max_restarts: as for :func:`launch`.
        grace_s: as for :func:`launch`.
        hang_timeout: as for :func:`launch`.
        **kwargs: as for :func:`launch`.

    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Raises:
        HangError: as for :func:`launch`.
        LaunchError: as for :func:`launch`; under torchrun or SLURM also when ``main``
            failed on another rank (at once: the message names the rank and its
            exception), another rank does not return from ``main`` within ``timeout`` of
            this one (the message names it), or the store that gathers the values becomes
            unreachable.
        TypeError: under torchrun or SLURM, ``main`` returned a value that cannot be
            pickled to gather it (the other ranks are told, as for a failure).
        ValueError: as for :func:`launch`.
        DeviceError: as for :func:`launch`.

    Example:
        >>> import operator, torch
        >>> how = "spawn" if torch.cuda.device_count() else "fork"  # fork: quick, no GPUs
        >>> launch_all(operator.add, 2, 3, nprocs=2, backend="gloo", start_method=how)
        [5, 5]
    """
    result: list[Any] = _launch(
        main,
        args,
        kwargs,
        nprocs=nprocs,
        backend=backend,
        start_method=start_method,
        timeout=timeout,
        max_restarts=max_restarts,
        all_ranks=True,
        grace_s=grace_s,
        hang_timeout=hang_timeout,
    )
    return result
