"""What runs inside each worker that ``launch`` spawns.

A worker ties its life to the parent's (:func:`~trainperf._utils.lifetime.die_with_parent`:
the parent-death signal, or a watcher thread), takes its own process group
so the parent can stop it together with its DataLoader workers, loads ``main`` (under spawn:
imports its module, inside the worker's own error handling, so an import that fails is
reported like any exception), joins the process group through the parent's store, runs
``main`` and sends its messages back: ``loaded`` once ``main`` is imported, then its result
(with the background checkpoint writes it left finished first; ``sys.exit(0)`` counts as
returning None, and is named), or the exception it died of, stamped with the time it was
raised so the parent can tell the first failure from the ranks that failed because a peer
had gone.

A spawned worker starts with its stderr on a pipe to the launcher, which keeps the tail: what
Python prints when importing the script fails before any trainperf code runs (a
bootstrapping ``RuntimeError``, an exception at import time) reaches the ``LaunchError``.
The worker puts its real stderr back as its first act.

Modules: ``_worker_pickle`` (how ``main``, its arguments and the launcher's descriptors
travel to a spawned worker), ``_worker_reimport`` (a spawned worker that imports a script
with no ``__main__`` guard), this one (the worker's spec and its life).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, NoReturn, cast

from trainperf._utils.lifetime import die_with_parent
from trainperf.ddp._rank_exit import flush_std_streams, say
from trainperf.ddp._worker_pickle import (
    _MAIN,
    InheritedFd,
    UnsendableResult,
    _class_name,
    _labelled,
    _pack,
    _unpickled,
    pickling_code_only,
)
from trainperf.ddp._worker_reimport import loading_main, relaunched

__all__ = [
    "KEEP_START_METHOD",
    "Failure",
    "WorkerSpec",
    "call_main",
    "called",
    "clean_exit_call",
    "exit_call",
    "rank_device",
    "worker_main",
]

KEEP_START_METHOD = "keep"
"""WorkerSpec.child_start_method: leave the rank's default start method as it is."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; pickled once per rank under spawn.

    ``main``, ``args`` and ``kwargs`` travel as one pickled blob (``packed``) that the
    worker loads inside its own error handling: a module the worker cannot import then
    fails as a reported exception, not as a crash of multiprocessing's bootstrap. Each of
    them is labelled in the blob (``labels``), so a failure names the one being unpickled.
    """

    main: Callable[..., Any] | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    backend: str
    world_size: int
    master_addr: str
    master_port: int
    store_prefix: str
    timeout: timedelta
    threads: int | None
    parent_pid: int
    send_result_from_all: bool
    from_main: bool = True  # the launcher's main thread starts the ranks (die_with_parent)
    # The launching process's own default start method (None: the platform's), for a
    # spawned rank's own children (its DataLoader workers), not the one that started the
    # rank; KEEP_START_METHOD: leave the rank's as it is (forked ranks).
    child_start_method: str | None = KEEP_START_METHOD
    grace_s: float | None = None
    hang: Any = None  # a _progress_slots.ProgressSpec when hang detection is on
    packed: bytes | None = None
    labels: tuple[str, ...] = ()  # main's arguments, in the order they are unpickled

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if fields["main"] is not None:
            call, labels = _labelled(fields.pop("main"), fields.pop("args"), fields.pop("kwargs"))
            # Once per rank: queues and pipes travel as descriptors handed to that one child.
            fields.update(main=None, args=(), kwargs={}, packed=_pack(call), labels=labels)
        return (_rebuild_spec, (fields,))

    def load(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """``(main, args, kwargs)``, unpickled here when they came packed."""
        if self.packed is None:
            return cast(Callable[..., Any], self.main), self.args, self.kwargs
        _unpickled.clear()
        with loading_main():
            call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] = pickle.loads(
                self.packed
            )
        return call

    def failed_argument(self) -> str | None:
        """After :meth:`load` raised: the argument being unpickled (``"args[1] (pkg.Cls)"``),
        or None when main itself failed."""
        if _MAIN not in _unpickled:
            return None
        done = len(_unpickled) - 1
        return self.labels[done] if done < len(self.labels) else "arguments"


def _rebuild_spec(fields: dict[str, Any]) -> WorkerSpec:
    return WorkerSpec(**fields)


@dataclass(frozen=True)
class Failure:
    """The exception a worker's ``main`` (or its set-up) raised, as plain strings."""

    rank: int
    pid: int
    type_name: str
    message: str
    traceback: str
    time: float
    # "load": importing main's module (unpickling main) failed; "args": unpickling one of
    # main's arguments failed (``argument`` names it); "relaunch": a module imported to
    # load them called launch(); "group": importing main's module set up a default process
    # group; "setup": launch's own set-up of the process group raised; "main": main raised;
    # "result": main's return value could not be pickled (set by the exception's type,
    # :class:`UnsendableResult`, whatever stage it was raised in).
    stage: str = "main"
    argument: str = ""


def rank_device(local_rank: int, local_world_size: int = 1) -> Any:
    """The CUDA device a rank with this local rank uses (one process per GPU).

    A job whose scheduler binds one GPU per task shows each task a single device (whether
    the tasks of a node share it is checked on the store: :mod:`._shared_gpu`); any other
    layout needs a GPU for each of the node's ``local_world_size`` ranks, refused on every
    rank otherwise (not only on those past the last GPU, which would leave the others
    waiting for them).

    Raises:
        ValueError: more ranks on this node than visible GPUs (more than one visible).
    """
    import torch

    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count or local_world_size > count:
        ranks = max(local_rank + 1, local_world_size)
        raise ValueError(
            f"{ranks} ranks run on this node (this is local rank {local_rank}) but only "
            f"{count} GPUs are visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}), and backend='nccl' needs one per "
            f"rank; start at most {count} processes per node (torchrun --nproc-per-node, srun "
            "--ntasks-per-node), or use backend='gloo'"
        )
    return torch.device("cuda", local_rank)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop this module's own frames from the top of a traceback: users want theirs."""
    start = tb
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb if tb is not None else start


def _describe(rank: int, exc: BaseException, stage: str = "main", argument: str = "") -> Failure:
    """``exc`` as plain strings; a ``SystemExit``'s message is its call (:func:`exit_call`).
    An :class:`UnsendableResult` is a ``TypeError`` of stage "result" whose message says
    all, shown without a traceback unless the pickling error came from the value's own code
    (its ``__getstate__`` or ``__reduce__``): then the traceback is that error's."""
    if isinstance(exc, UnsendableResult):
        cause = exc.__cause__
        shown = ""
        if cause is not None and not pickling_code_only(cause.__traceback__):
            tb = _user_frames(cause.__traceback__)
            shown = "".join(traceback.format_exception(type(cause), cause, tb))
        return Failure(rank, os.getpid(), "TypeError", str(exc), shown, time.time(), "result")
    cls = type(exc)
    return Failure(
        rank=rank,
        pid=os.getpid(),
        type_name=_class_name(cls),
        message=exit_call(exc.code) if isinstance(exc, SystemExit) else _text(exc),
        traceback="".join(traceback.format_exception(cls, exc, _user_frames(exc.__traceback__))),
        time=time.time(),
        stage=stage,
        argument=argument,
    )


def _text(exc: BaseException) -> str:
    """``str(exc)``, or what can be said when its ``__str__`` raises (the report must go)."""
    try:
        return str(exc)
    except Exception as e:
        return f"<{type(exc).__name__} whose str() raised {type(e).__name__}: {e!r}>"


def _refuse_a_group_already_there(spec: WorkerSpec) -> None:
    """Raise when the default process group exists before launch sets it up in a spawned
    rank: made while it imported main's module. torch would say only "initialize the default
    process group twice!". A forked rank is not checked: a group it would inherit is refused
    in the launching process, before any rank starts (``_launch_checks``)."""
    import torch.distributed as dist

    if spec.child_start_method == KEEP_START_METHOD or not dist.is_initialized():
        return
    raise RuntimeError(
        "the default process group was set up while this rank imported main's module (a "
        "dist.init_process_group call at its top level?): launch() sets it up for main; "
        'remove that call, or move it under the script\'s if __name__ == "__main__": guard'
    )


def _setup(spec: WorkerSpec, rank: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
    )
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    device = None
    if spec.backend == "nccl":
        device = rank_device(rank, spec.world_size)
        torch.cuda.set_device(device)
    client = dist.TCPStore(  # type: ignore[attr-defined]
        spec.master_addr, spec.master_port, is_master=False, timeout=spec.timeout
    )
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(spec.store_prefix, client),  # type: ignore[attr-defined]
        rank=rank,
        world_size=spec.world_size,
        timeout=spec.timeout,
        device_id=device,
    )
    # Every rank's side of the connections is up before any rank's main runs: a rank whose
    # main returns at once would otherwise tear the group down while a slower peer was still
    # connecting ("Gloo connectFullMesh failed ... Connection closed by peer").
    dist.barrier()


@contextlib.contextmanager
def _uncounted(tracker: Any) -> Iterator[None]:
    """The launcher's own collectives (the group's start-up barriers) are not counted as
    main's: the first collective a hang report names is main's first."""
    if tracker is None:
        yield
        return
    tracker.depth += 1
    try:
        yield
    finally:
        tracker.depth -= 1


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_call(code: object) -> str:
    """The ``sys.exit`` call that raises ``SystemExit(code)``, as every ddp message names it
    (the code's ``repr``: ``sys.exit(3)`` and ``sys.exit('3')`` differ).

    Example:
        >>> exit_call(None), exit_call(3), exit_call("no data")
        ('sys.exit()', 'sys.exit(3)', "sys.exit('no data')")
    """
    if code is None:
        return "sys.exit()"
    try:
        shown = repr(code)
    except Exception:  # the message must still go out
        shown = f"<{type(code).__name__}>"
    return f"sys.exit({shown})"


def called(exc: BaseException) -> str | None:
    """``"called sys.exit(1)"`` when ``exc`` is a ``SystemExit`` (its :func:`exit_call`);
    None for any other exception.

    Example:
        >>> called(SystemExit(1)), called(ValueError("bad")) is None
        ('called sys.exit(1)', True)
    """
    return f"called {exit_call(exc.code)}" if isinstance(exc, SystemExit) else None


def clean_exit_call(exc: BaseException) -> str | None:
    """``"sys.exit(0)"`` (or ``"sys.exit()"``) when ``exc`` is the ``SystemExit`` of a call
    that ends a rank cleanly, as returning None does; None for any other exception. The one
    place every ddp path (launch's workers, a launch inside a job, the watchdog) decides it.

    Clean is a code of None or an int equal to 0 (``False`` too), as Python has it: any
    other object, ``0.0`` or ``"0"`` included, is printed and exits 1. (``sys.exit(256)``
    also leaves a status of 0, the low 8 bits, but no one means it as success: a failure.)

    Example:
        >>> clean_exit_call(SystemExit(0)), clean_exit_call(SystemExit())
        ('sys.exit(0)', 'sys.exit()')
        >>> clean_exit_call(SystemExit(3)) is None, clean_exit_call(ValueError()) is None
        (True, True)
        >>> clean_exit_call(SystemExit(0.0)) is None, clean_exit_call(SystemExit(False))
        (True, 'sys.exit(False)')
    """
    if not isinstance(exc, SystemExit):
        return None
    code = exc.code
    if code is not None and not (isinstance(code, int) and code == 0):
        return None
    return exit_call(code)


def call_main(
    main: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, str | None]:
    """What ``main`` returned, and the ``sys.exit(0)`` call that ended it instead (it counts
    as returning None), if any; any other exception, ``sys.exit(n)`` included, propagates."""
    try:
        return main(*args, **kwargs), None
    except SystemExit as exc:
        call = clean_exit_call(exc)
        if call is None:
            raise
        return None, call


def _send_result(conn: Connection, rank: int, payload: Any, call: str | None) -> None:
    """``("ok", rank, payload)``, or ``("exit", rank, call)`` after ``sys.exit(0)``."""
    if call is not None:
        _send(conn, ("exit", rank, call))
        return
    try:
        message = _pickled(("ok", rank, payload))
    except Exception as e:  # whatever the value's pickling raises (its __reduce__, its depth)
        raise UnsendableResult(payload, e) from e
    conn.send_bytes(message)  # an OSError here is a dead pipe, no fault of the value


def _send(conn: Connection, message: tuple[str, int, Any]) -> None:
    conn.send_bytes(_pickled(message))


def _pickled(message: tuple[str, int, Any]) -> bytes:
    # Plain pickle copies tensors into the message; multiprocessing's own pickler would
    # share their storage through a file descriptor that dies with this process.
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _report_failure(conn: Connection, failure: Failure) -> None:
    # OSError: the parent is gone or stopped listening; the exit code still tells it.
    with contextlib.suppress(OSError):
        _send(conn, ("error", failure.rank, failure))


def _restore_stderr(stderr: InheritedFd | None) -> None:
    """Point fd 2 back at the launcher's stderr (it was a pipe while Python started)."""
    if stderr is None:
        return
    with contextlib.suppress(OSError):
        os.dup2(stderr.fd, 2)
    with contextlib.suppress(OSError):
        os.close(stderr.fd)


def _load(spec: WorkerSpec, rank: int, conn: Connection) -> Any:
    """``(main, args, kwargs)``, then tell the launcher (it may be measuring this rank)."""
    try:
        call = spec.load()
    except BaseException as exc:
        argument = spec.failed_argument()
        if relaunched():
            _report_failure(conn, _describe(rank, exc, stage="relaunch"))
        elif argument is None:
            _report_failure(conn, _describe(rank, exc, stage="load"))
        else:
            _report_failure(conn, _describe(rank, exc, stage="args", argument=argument))
        _exit_now(1)
    import torch  # noqa: F401  (what a rank costs is measured with torch imported)

    with contextlib.suppress(OSError):
        _send(conn, ("loaded", rank, None))
    return call


# Keeps the stack file open for faulthandler for the life of the worker.
_stack_files: list[Any] = []


def _track(spec: WorkerSpec, rank: int) -> Any:
    """Hang detection on: write progress into this rank's slot, dump stacks on request.

    Installed before main's module is imported, so its ``dist.*`` calls are seen.
    """
    if spec.hang is None:
        return None
    import faulthandler

    from trainperf.ddp import _progress, _progress_slots, _progress_tracker
    from trainperf.ddp._stacks import DUMP_SIGNAL

    if DUMP_SIGNAL is None:
        raise OSError("this platform has no signal to ask a rank for its stacks")
    tracker = _progress_tracker.Tracker(_progress_slots.attach(spec.hang.path), rank)
    _progress.install(tracker)
    _progress._launched.append(True)
    stacks = open(os.path.join(spec.hang.stacks_dir, f"rank{rank}.stacks"), "w")  # noqa: SIM115
    _stack_files.append(stacks)
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    return tracker


def _finish_background_saves() -> None:
    """Finish the background checkpoint writes ``main`` left running before this rank
    reports its result: after that the launcher gives a rank only a few seconds to exit,
    and stopping it would kill the writer and lose the checkpoint. Nothing when
    trainperf.checkpoint was never imported."""
    module = sys.modules.get("trainperf.checkpoint._checkpointer")
    if module is not None:
        module._wait_at_exit()


def worker_main(
    spec: WorkerSpec, rank: int, conn: Connection, stderr: InheritedFd | None = None
) -> None:
    """Entry point of a spawned worker (``multiprocessing.Process`` target)."""
    # A forked worker inherits the launcher's handlers, which would raise in the wrong process.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _restore_stderr(stderr)
    die_with_parent(spec.parent_pid, spec.from_main)
    # A spawned process makes spawn its default too: its DataLoader workers would start a
    # fresh interpreter each (a dataset class defined in main cannot be pickled there, and
    # each epoch's workers import torch again), unlike the same script under torchrun.
    if spec.child_start_method != KEEP_START_METHOD:
        multiprocessing.set_start_method(spec.child_start_method, force=True)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if spec.grace_s is not None:
        # What the launcher gives a rank between SIGTERM and SIGKILL (preemption handlers).
        os.environ["TRAINPERF_GRACE_S"] = f"{spec.grace_s:g}"
    try:
        tracker = _track(spec, rank)
    except Exception as e:
        # Hang detection is a help, not a condition to run: without it this rank's slot
        # never says "ready", so the launcher's hang clock does not start. say(): a forked
        # rank may have inherited a closed sys.stderr, and a notice must not stop main.
        say(f"trainperf.ddp: rank {rank}: hang detection is off ({e!r})")
        tracker = None
    main, args, kwargs = _load(spec, rank, conn)

    stage = "group"  # made by importing main's module: a restart would make it again
    try:
        _refuse_a_group_already_there(spec)
        stage = "setup"  # launch's own set-up (a port clash may pass): no hint for main's code
        with _uncounted(tracker):
            _setup(spec, rank)
        stage = "main"
        if tracker is not None:
            tracker.ready(armed=True)
        result, call = call_main(main, args, kwargs)
        _finish_background_saves()
        if tracker is not None:
            tracker.returned()
        payload = result if (rank == 0 or spec.send_result_from_all) else None
        # The result goes out before the group is torn down: a peer still inside a
        # collective fails as soon as this rank disconnects, and the launcher must by then
        # know that this rank had returned (or called sys.exit(0), which it names as such).
        _send_result(conn, rank, payload, call)
    except BaseException as exc:
        # A DataLoader's SIGCHLD handler raises when one of its workers exits, as they do
        # now: it would cut the report short. The rank leaves through _exit_now whatever.
        if hasattr(signal, "SIGCHLD"):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            # Report before tearing the group down: destroying it can block after a fault,
            # and the time stamp must precede the errors this exit causes in the peers.
            _report_failure(conn, _describe(rank, exc, stage))
        finally:
            _exit_now(1)
    conn.close()
    try:
        _destroy()
    except Exception:
        # main succeeded and its result is already with the launcher: a failed clean-up
        # is worth a warning, not the run (say() never raises, even where main closed
        # sys.stderr).
        say(
            f"trainperf.ddp: rank {rank}: destroy_process_group failed after main returned:\n"
            + traceback.format_exc().rstrip("\n")
        )


def _exit_now(code: int) -> NoReturn:
    """Leave without interpreter shutdown: after a fault it can block (threads, NCCL).
    Nothing on the way raises (``main`` may have closed ``sys.stderr``): the exit happens."""
    try:
        with contextlib.suppress(Exception):
            _destroy()
        flush_std_streams()
    finally:
        os._exit(code)
