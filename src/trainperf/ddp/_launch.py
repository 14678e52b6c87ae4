"""``launch(main)``: one process per GPU (or N CPU ranks), or the ranks a launcher started.

Modules: ``_store`` (the rendezvous store), ``_injob`` (inside torchrun/SLURM),
``_capacity`` (how many ranks fit), ``_group`` (starting and watching one attempt) and
``_failures`` (what it says about a failed rank), ``_worker`` (inside each rank),
``_detector``/``_progress``/``_stacks``/``_hang``/``_rundir`` (hangs).

Inside a torchrun or SLURM job, ``main`` runs in this process after the process group is
initialised from the environment. Otherwise the launcher hosts a ``TCPStore`` on a port the
OS picks (no probe-then-bind race), starts ``nprocs`` workers that join through it, and
watches them: the first failure stops the rest within seconds and is raised as a
:class:`~trainperf.errors.LaunchError` carrying the failing rank's own traceback.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Literal

from trainperf._utils.lifetime import started_from_main
from trainperf._utils.validate import choice, non_negative_int, positive_int, positive_number
from trainperf.ddp import _capacity, _env
from trainperf.ddp._detector import HangDetector
from trainperf.ddp._group import Group
from trainperf.ddp._injob import resolve_backend, run_in_process
from trainperf.ddp._procs import Interrupted, SignalGuard
from trainperf.ddp._store import LOCALHOST, StoreHost, listen
from trainperf.ddp._worker import KEEP_START_METHOD as _KEEP
from trainperf.ddp._worker import (
    REIMPORT_EXIT_CODE,
    WorkerSpec,
    called_function,
    reimporting_main,
)
from trainperf.errors import DeviceError, LaunchError

__all__ = ["Backend", "StartMethod", "launch", "launch_all"]

Backend = Literal["nccl", "gloo"]
StartMethod = Literal["spawn", "fork"]
_BACKENDS = ("nccl", "gloo")
_START_METHODS = ("spawn", "fork")

logger = logging.getLogger("trainperf.ddp")


def _check_options(
    main: Callable[..., Any],
    backend: str | None,
    start_method: str,
    timeout: timedelta | float,
    max_restarts: int,
) -> timedelta:
    if not callable(main):
        raise TypeError(f"main must be callable, got {type(main).__name__}")
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None (auto), got {backend!r}")
    choice("start_method", start_method, _START_METHODS)
    span = _timeout_span(timeout)
    non_negative_int("max_restarts", max_restarts)
    return span


MAX_TIMEOUT = timedelta(days=365 * 100)
"""The longest ``timeout``: torch.distributed keeps timeouts in milliseconds (and
nanoseconds) in 64 bits; far beyond this, its store and barrier overflow (a start-up that
hangs for ever, or fails at once with a negative timeout)."""


def _timeout_span(timeout: object) -> timedelta:
    """``timeout`` as a timedelta: a timedelta, or a finite number of seconds, in
    ``(0, MAX_TIMEOUT]``."""
    if isinstance(timeout, timedelta):
        if timeout <= timedelta(0):
            raise ValueError(
                f"timeout must be a positive timedelta (or a positive number of seconds), "
                f"got {timeout!r}"
            )
        span = timeout
    else:
        seconds = positive_number("timeout", timeout, unit="seconds (or a positive timedelta)")
        try:
            span = timedelta(seconds=seconds)
        except OverflowError:
            span = timedelta.max
    if span > MAX_TIMEOUT:
        raise ValueError(
            f"timeout={timeout!r} is longer than torch.distributed can wait (at most "
            f"{MAX_TIMEOUT.days} days); pass a shorter one, and hang_timeout=None if no "
            "hang should ever be reported"
        )
    return span


def cuda_driver_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether this process has loaded CUDA's driver library (Linux; False elsewhere).

    ``torch.cuda.is_available()`` loads and initialises it without counting as "CUDA
    initialised" in torch, yet forked children can no longer use CUDA afterwards.

    Example:
        >>> import pathlib, tempfile
        >>> maps = pathlib.Path(tempfile.mkdtemp()) / "maps"
        >>> _ = maps.write_text("7f00-7f80 r-xp 00000000 08:01 42 /usr/lib/libcuda.so.1\\n")
        >>> cuda_driver_loaded(maps), cuda_driver_loaded(maps.with_name("missing"))
        (True, False)
    """
    try:
        return "libcuda.so" in maps.read_text()
    except OSError:
        return False


def _check_spawnable(main: Callable[..., Any], start_method: str, backend: str) -> None:
    import torch

    if start_method == "fork":
        if "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError("start_method='fork' is not available on this platform; use 'spawn'")
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            raise DeviceError(
                "start_method='fork' cannot be used once CUDA is initialised in this process: "
                "forked workers cannot use CUDA then. Restart the kernel/interpreter and call "
                "launch() before anything touches the GPU, or run a script with "
                "start_method='spawn'"
            )
        if backend == "nccl" and cuda_driver_loaded():
            raise DeviceError(
                "start_method='fork' with backend='nccl': CUDA's driver is already loaded in "
                "this process (torch.cuda.is_available() or another CUDA call ran), so forked "
                "workers cannot use the GPU. Restart the kernel/interpreter and call launch() "
                "before any CUDA call (export PYTORCH_NVML_BASED_CUDA_CHECK=1 keeps "
                "torch.cuda.is_available() from loading it), or use start_method='spawn'"
            )
        return
    _check_picklable(main)
    target = called_function(main)
    name = getattr(target, "__qualname__", repr(target))
    if getattr(target, "__module__", None) == "__main__" and not _main_is_a_file():
        raise ValueError(
            f"{name!r} is defined in an interactive session (notebook or REPL, or a script "
            "piped on stdin), which spawned workers cannot import: use start_method='fork', "
            "or move main into a .py module"
        )


class _Probe(pickle.Pickler):
    """Pickles what starting a spawned worker pickles, but leaves out multiprocessing's own
    objects (queues, locks, pipes): they refuse to be pickled except while a process
    starts, and then they travel to it (by inheritance) as arguments of main do."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj).__module__.startswith("multiprocessing."):
            return (type(None), ())
        return NotImplemented


def _pickles(obj: object) -> None:
    _Probe(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(obj)


def _check_picklable(main: Callable[..., Any]) -> None:
    """Under spawn: main's function by name, then what a ``functools.partial`` binds."""
    target = called_function(main)
    name = getattr(target, "__qualname__", repr(target))
    try:
        _pickles(target)
    except Exception as e:
        raise ValueError(
            f"start_method='spawn' sends main to each worker by name, and {name!r} cannot be "
            f"pickled ({e}): define main at module top level (not a lambda or nested "
            "function), or use start_method='fork' (Linux, notebooks)"
        ) from e
    if target is main:
        return
    try:
        _pickles(main)
    except Exception as e:
        raise ValueError(
            f"start_method='spawn' pickles main for every worker, and main=functools.partial("
            f"{name}, ...) binds arguments that cannot be pickled ({type(e).__name__}: {e}): "
            "pass picklable values (build unpicklable objects inside main), or use "
            "start_method='fork' (Linux, notebooks)"
        ) from e


def _warn_if_unreachable(hang_timeout: float, timeout: timedelta) -> None:
    """A collective times out after ``timeout``: a hang_timeout as long never fires, and
    the timeout's error names the rank that waited, not the one it waited for."""
    if hang_timeout >= timeout.total_seconds():
        warnings.warn(
            f"hang_timeout={hang_timeout:g} s is not below timeout={timeout.total_seconds():g} "
            "s, after which a waiting collective fails on its own: hang detection cannot name "
            "the rank that causes a hang first. Pass a hang_timeout below timeout (or a "
            "longer timeout)",
            UserWarning,
            stacklevel=4,
        )


def _main_is_a_file() -> bool:
    """Whether ``__main__`` was run from a file spawned workers can import again (not a
    notebook, a REPL, ``python - < train.py`` or ``python -c``: ``<stdin>``, ``<string>``)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(path) and not str(path).startswith("<") and os.path.exists(str(path))


def _spawn(
    main: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    nprocs: int,
    backend: str,
    start_method: str,
    timeout: timedelta,
    max_restarts: int,
    all_ranks: bool,
    grace_s: float,
    hang_timeout: float | None,
) -> dict[int, Any]:
    from trainperf.limits import usable_cpus

    ctx = multiprocessing.get_context(start_method)
    detector = None if hang_timeout is None else HangDetector(nprocs, hang_timeout)
    try:
        # The guard comes first: an interrupt from here on stops whatever was started.
        with SignalGuard() as guard, StoreHost(listen(), timeout) as host:
            threads = None if "OMP_NUM_THREADS" in os.environ else usable_cpus(nprocs)
            base = WorkerSpec(
                main=main,
                args=args,
                kwargs=kwargs,
                backend=backend,
                world_size=nprocs,
                master_addr=LOCALHOST,
                master_port=host.sock.getsockname()[1],
                store_prefix="",
                timeout=timeout,
                threads=threads,
                parent_pid=os.getpid(),
                send_result_from_all=all_ranks,
                from_main=started_from_main(),
                # Spawned ranks only: forked ones keep fork, as their parent's children would.
                child_start_method=(
                    multiprocessing.get_start_method(allow_none=True)
                    if start_method == "spawn"
                    else _KEEP
                ),
                grace_s=grace_s,
                hang=None if detector is None else detector.spec,
            )
            measure = nprocs > 1 and _capacity.needs_measuring(
                nprocs, _own_memory(), _capacity.available_memory()
            )
            return _attempts(ctx, base, guard, max_restarts, host.start, measure, detector)
    except Interrupted as e:
        if e.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise SystemExit(128 + e.signum) from None
    finally:
        if detector is not None:
            detector.close()


def _own_memory() -> int:
    """This process's resident memory: what a rank with torch imported costs, roughly."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _attempts(
    ctx: BaseContext,
    base: WorkerSpec,
    guard: SignalGuard,
    max_restarts: int,
    on_started: Callable[[], None] | None = None,
    measure_first: bool = False,
    detector: HangDetector | None = None,
) -> dict[int, Any]:
    """Run the group; after a failure, run it again from scratch, up to ``max_restarts``."""
    attempt = 0
    while True:
        # Each attempt rendezvouses under its own key prefix in the one store.
        spec = dataclasses.replace(base, store_prefix=f"trainperf/attempt{attempt}/")
        label = f" (attempt {attempt + 1} of {max_restarts + 1})" if max_restarts else ""
        if detector is not None:
            detector.reset()
        group = Group(
            ctx, spec, label, guard, on_started, measure_first=measure_first, detector=detector
        )
        try:
            return group.run()
        except LaunchError as e:
            if attempt == max_restarts or not group.restartable:
                raise
            logger.warning("%s\nrestarting all %d ranks", e, base.world_size)
        attempt += 1
        measure_first = False  # measured once; the host has not changed since


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
    import torch

    span = _check_options(main, backend, start_method, timeout, max_restarts)
    grace = positive_number("grace_s", grace_s, unit="seconds")
    hang = None
    if hang_timeout is not None:
        hang = positive_number("hang_timeout", hang_timeout, unit="seconds (or None)")
        _warn_if_unreachable(hang, span)
    env = _env.detect()
    if env is None and threading.current_thread() is not threading.main_thread():
        warnings.warn(
            "launch() called outside the main thread: Python delivers Ctrl-C and SIGTERM to "
            "the main thread only, so they will not stop the ranks (nor give them grace_s "
            "to save); call launch() from the main thread",
            UserWarning,
            stacklevel=3,
        )
    if env is not None:
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
    positive_int("nprocs", nprocs)
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


def _check_capacity(nprocs: int, backend: str) -> None:
    """Refuse more gloo ranks than the CPUs can run (see ``_capacity``)."""
    from trainperf.limits import host_limits

    if backend != "gloo" or nprocs == 1 or _capacity.oversubscription_allowed():
        return
    refusal = _capacity.cpu_refusal(nprocs, host_limits().cpus)
    if refusal is not None:
        raise ValueError(refusal)


def launch(
    main: Callable[..., Any],
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
    are then ignored (the launcher owns them). The process group is always destroyed.

    Each worker gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, ``torch.cuda.set_device(local_rank)`` under NCCL, and a share of the
    CPUs as ``torch.set_num_threads`` (unless ``OMP_NUM_THREADS`` is set). For every rank's
    value use :func:`launch_all`. Keyword arguments named like the options above go to
    ``launch``, not ``main``: wrap ``main`` in ``functools.partial`` for those.

    Args:
        main: the training function; a module-level function under ``"spawn"``.
        *args: positional arguments for ``main``.
        nprocs: number of workers on this machine.
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
            (``HangError``); None turns detection off. Under torchrun or SLURM the ranks
            watch each other through :func:`watchdog` instead.
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
        LaunchError: as for :func:`launch`; under torchrun or SLURM also when another rank
            does not return from ``main`` within ``timeout`` of this one (the message names
            it), or the store that gathers the values becomes unreachable.
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
