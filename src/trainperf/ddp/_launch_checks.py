"""What ``launch`` refuses before any rank starts: bad options (a hang timeout under 1 s),
a ``main`` whose call runs none of its body (``async def``, generators), one that spawned
workers cannot receive, ``fork`` after CUDA or with a default process group already set up,
more gloo ranks than the CPUs can run; and the warnings for a ``hang_timeout`` the
collectives' timeout comes before, and for an ``nprocs`` that a job already running
(torchrun, SLURM, an outer ``launch``) ignores.
"""

from __future__ import annotations

import inspect
import io
import multiprocessing
import os
import pickle
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainperf._utils.validate import choice, non_negative_int, positive_number
from trainperf.ddp import _capacity
from trainperf.ddp._env import DistributedEnv
from trainperf.ddp._worker_pickle import called_function
from trainperf.errors import DeviceError

__all__ = ["MAX_TIMEOUT", "MIN_HANG_TIMEOUT_S", "cuda_driver_loaded", "hang_timeout_s"]

_BACKENDS = ("nccl", "gloo")
_START_METHODS = ("spawn", "fork")


def _check_options(
    main: Callable[..., Any],
    backend: str | None,
    start_method: str,
    timeout: timedelta | float,
    max_restarts: int,
) -> tuple[timedelta, int]:
    """``timeout`` as a timedelta and ``max_restarts`` as a Python int, once both pass."""
    if not callable(main):
        raise TypeError(f"main must be callable, got {type(main).__name__}")
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None (auto), got {backend!r}")
    choice("start_method", start_method, _START_METHODS)
    span = _timeout_span(timeout)
    return span, non_negative_int("max_restarts", max_restarts)


MAX_TIMEOUT = timedelta(days=365 * 100)
"""The longest ``timeout``: torch.distributed keeps timeouts in milliseconds (and
nanoseconds) in 64 bits; far beyond this, its store and barrier overflow (a start-up that
hangs for ever, or fails at once with a negative timeout)."""
_MIN_TIMEOUT = timedelta(seconds=1)


def _timeout_span(timeout: object) -> timedelta:
    """``timeout`` as a timedelta: a timedelta, or a finite number of seconds, in
    ``[1 s, MAX_TIMEOUT]``."""
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
    if span < _MIN_TIMEOUT:
        # The rendezvous store and the first collective need this long to connect: a shorter
        # timeout failed start-up as "the client socket has timed out after 0ms".
        raise ValueError(
            f"timeout={timeout!r} is shorter than 1 s, too short for the ranks to connect "
            "(the rendezvous store would time out before they start): pass at least "
            "timeout=1 (seconds); the hang_timeout option bounds waits between steps"
        )
    if span > MAX_TIMEOUT:
        raise ValueError(
            f"timeout={timeout!r} is longer than torch.distributed can wait (at most "
            f"{MAX_TIMEOUT.days} days); pass a shorter one, and hang_timeout=None if no "
            "hang should ever be reported"
        )
    return span


MIN_HANG_TIMEOUT_S = 1.0
"""The shortest hang timeout (``launch``'s ``hang_timeout``, ``watchdog``'s ``timeout``):
progress is read every 0.1 s to 1 s (the launcher's poll, the watchdog's beat), so a
shorter one reports any wait for a slower rank between two reads as a hang."""


def hang_timeout_s(option: str, value: object) -> float:
    """``value`` as seconds if it is a finite number >= :data:`MIN_HANG_TIMEOUT_S`, else
    ``ValueError`` naming ``option``."""
    seconds = positive_number(option, value, unit="seconds (or None)")
    if seconds < MIN_HANG_TIMEOUT_S:
        raise ValueError(
            f"{option}={seconds:g} s is below {MIN_HANG_TIMEOUT_S:g} s, the shortest hang "
            "timeout: progress is read every 0.1 s to 1 s, so a shorter one reports an "
            "ordinary wait for a slower rank as a hang. Pass at least "
            f"{option}={MIN_HANG_TIMEOUT_S:g} (or None to turn hang detection off)"
        )
    return seconds


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
        # Bytes: a mapped file's path need not be UTF-8.
        return b"libcuda.so" in maps.read_bytes()
    except OSError:
        return False


def _check_spawnable(main: Callable[..., Any], start_method: str, backend: str) -> None:
    import torch
    import torch.distributed as dist

    if start_method == "fork":
        if "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError("start_method='fork' is not available on this platform; use 'spawn'")
        if dist.is_available() and dist.is_initialized():
            # Refused here: every forked rank would inherit the group and fail the same way
            # in launch's own set-up, on every restart too.
            raise RuntimeError(
                "start_method='fork' cannot be used while this process already has a default "
                "process group (dist.init_process_group ran before launch()), which every "
                "forked rank would inherit: call dist.destroy_process_group() before "
                "launch(), or use start_method='spawn'"
            )
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
        owner = getattr(target, "__self__", None)
        if inspect.ismethod(target) and not isinstance(owner, type):
            raise ValueError(
                f"start_method='spawn' pickles main for every worker, and main={name!r} is a "
                f"method of a {type(owner).__name__} object that cannot be pickled "
                f"({type(e).__name__}: {e}): make that object picklable (its class at module "
                "top level; locks, open files and the like created inside the method), pass a "
                "module-level function, or use start_method='fork' (Linux, notebooks)"
            ) from e
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


def _check_runs_when_called(main: Callable[..., Any]) -> None:
    """Refuse a ``main`` whose call runs none of its body: each rank would get a coroutine
    or generator back, fail to pickle it to the launcher ("cannot pickle 'coroutine'
    object") and warn that the coroutine was never awaited; in a torchrun job ``launch()``
    would return it unrun."""
    target = called_function(main)
    call = target
    if not (inspect.isroutine(target) or isinstance(target, type)):
        call = type(target).__call__  # a callable object: its __call__ is what runs
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    if inspect.isasyncgenfunction(call):
        kind, made, fix = (
            "an async generator function",
            "an async generator",
            "make main a plain function that returns a value instead of yielding, and run "
            "the async code inside it: def main(...): return asyncio.run(amain(...))",
        )
    elif inspect.iscoroutinefunction(call):
        kind, made, fix = (
            "an async def function",
            "a coroutine",
            "wrap it in a plain function that runs it: def main(...): asyncio.run(amain(...)) "
            "(return its result to get it back)",
        )
    elif inspect.isgeneratorfunction(call):
        kind, made, fix = (
            "a generator function",
            "a generator",
            "return a value instead of yielding (the last value, or a list of them)",
        )
    else:
        return
    raise TypeError(
        f"main={name!r} is {kind}: calling it only creates {made} and runs none of its "
        f"body, and launch() calls main in each rank as a plain function; {fix}"
    )


def _check_call(main: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse arguments ``main`` cannot take before any rank starts: each rank would start,
    join the group, and only then fail with the same ``TypeError``. A callable with no
    signature to read (some builtins) is left to the ranks. A decorated ``main`` is read as
    its wrapper (not what ``functools.wraps`` says it wraps), which may supply arguments."""
    _check_runs_when_called(main)
    try:
        signature = inspect.signature(main, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"launch() cannot call {_call_shape(main, signature)} with these arguments ({e}): "
            + _call_advice(signature, kwargs)
        ) from e


def _call_shape(main: Callable[..., Any], signature: inspect.Signature) -> str:
    """``name(a, b, *, scale=1)``: main's parameters without their annotations."""
    name = getattr(main, "__qualname__", None) or getattr(
        called_function(main), "__qualname__", "main"
    )
    plain = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return f"{name}{signature.replace(parameters=plain, return_annotation=signature.empty)}"


def _call_advice(signature: inspect.Signature, kwargs: dict[str, Any]) -> str:
    spawn_style = [k for k in ("args", "kwargs") if k in kwargs and k not in signature.parameters]
    if spawn_style:
        return (
            "launch() passes main's arguments as they are, as main(*args, **kwargs) takes "
            "them: launch(main, cfg, nprocs=2), not args=(cfg,) as "
            "torch.multiprocessing.spawn takes them; nor does main get its rank as its first "
            "argument (call trainperf.ddp.rank() inside main)"
        )
    return (
        "pass main's arguments after it, as main takes them: launch(main, arg, key=value, nprocs=2)"
    )


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


# Whether this process has warned about an ignored nprocs: once is enough (a loop of
# launches, or one per epoch, would repeat it).
_warned_ignored_nprocs = [False]

_STARTED_BY = {
    "torchrun": "RANK and WORLD_SIZE set by torchrun or an outer launch()",
    "slurm": "SLURM_PROCID and SLURM_NTASKS set by srun",
}


def _warn_if_nprocs_ignored(nprocs: int | None, env: DistributedEnv) -> None:
    """Inside a running job ``main`` runs in this process and ``nprocs`` is ignored: say so
    when the caller asked for another number of processes on this node than are running
    (rank 0 only, once per process)."""
    if nprocs is None or nprocs == env.local_world_size or env.rank != 0:
        return
    if _warned_ignored_nprocs[0]:
        return
    _warned_ignored_nprocs[0] = True
    running = env.local_world_size
    warnings.warn(
        f"launch() ignores nprocs={nprocs}: this process is rank {env.rank} of a job "
        f"already running {running} process{'es' if running != 1 else ''} on this node "
        f"({_STARTED_BY[env.source]}), so main runs here, in this process, as under "
        f"torchrun. Leave nprocs out (or pass {running}) where launch() runs inside a "
        "launched rank, or start the job with the number of processes you want",
        UserWarning,
        stacklevel=4,
    )


def _main_is_a_file() -> bool:
    """Whether ``__main__`` was run from a file spawned workers can import again (not a
    notebook, a REPL, ``python - < train.py`` or ``python -c``: ``<stdin>``, ``<string>``)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(path) and not str(path).startswith("<") and os.path.exists(str(path))


def _check_capacity(nprocs: int, backend: str) -> None:
    """Refuse more gloo ranks than the CPUs can run (see ``_capacity``)."""
    from trainperf.limits import host_limits

    if backend != "gloo" or nprocs == 1 or _capacity.oversubscription_allowed():
        return
    refusal = _capacity.cpu_refusal(nprocs, host_limits().cpus)
    if refusal is not None:
        raise ValueError(refusal)
